"""`streamtally fold`: one request's raw transcript → its Tokens JSON."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import IO

from streamtally.cli._args import file_or_stdin
from streamtally.cli._output import json_text, say, write_stdout
from streamtally.core.adapters.base import AdapterOptions
from streamtally.core.models import Source
from streamtally.core.normalize import fallback_request_id, fold_stream, read_events
from streamtally.errors import InputError
from streamtally.settings import Settings

__all__ = ["add_parser"]

_EPILOG = """\
sources:
  openai            Chat Completions SSE, and every OpenAI-compatible server
  openai-responses  Responses API SSE
  anthropic         Messages API SSE
  gemini            streamGenerateContent?alt=sse (Gemini API, Vertex AI)
  dynamo            JSON lines, one LLMEngineOutput per line
  vllm              JSON lines, one RequestOutput per line
  atomr             JSON lines, one TokenChunk per line

Events that are not valid for SOURCE are skipped with a warning on stderr, as
the stream processors dead-letter them, so both give the same Tokens.

exit status: 0 printed, 2 the input is not a stream of SOURCE (message on stderr)
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "fold",
        help="fold one request's raw transcript into its Tokens JSON",
        description="Read one request's raw transcript and print its Tokens as one JSON object.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--source",
        required=True,
        type=Source,
        metavar="SOURCE",
        choices=list(Source),
        help="wire format of the transcript (see below)",
    )
    parser.add_argument(
        "--request-id",
        metavar="ID",
        help="request id to report (default: the provider's own id)",
    )
    parser.add_argument(
        "--model",
        help="model to report when the stream names none (engine outputs never do)",
    )
    parser.add_argument(
        "--vllm-output-kind",
        choices=("DELTA", "CUMULATIVE"),
        default="DELTA",
        help="vLLM RequestOutputKind for lines that do not say (default: DELTA)",
    )
    parser.add_argument(
        "file", metavar="FILE", type=file_or_stdin, help="transcript file, or - for standard input"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    data = _read(args.file)
    options = AdapterOptions(vllm_output_kind=args.vllm_output_kind)
    stream: IO[bytes] = io.BytesIO(data)
    skipped: list[str] = []
    tokens = fold_stream(
        args.source,
        read_events(args.source, stream),
        request_id=args.request_id,
        options=options,
        fallback_request_id=fallback_request_id(data),
        on_invalid=lambda number, exc: skipped.append(f"event {number}: {exc}"),
        model=args.model,
        max_text_bytes=settings.max_text_bytes,  # the processors' limit: the same Tokens
    )
    for warning in skipped:
        say(f"streamtally fold: skipped {warning}")
    write_stdout(json_text(tokens.to_json_dict()) + "\n")
    return 0


def _read(name: str) -> bytes:
    try:
        if name == "-":
            return sys.stdin.buffer.read()
        return Path(name).read_bytes()
    except OSError as exc:
        what = "standard input" if name == "-" else name
        raise InputError(f"cannot read {what}: {exc.strerror or exc}") from exc
