"""`streamtally fold`: one request's raw transcript → its Tokens JSON."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import IO

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
    parser.add_argument("file", metavar="FILE", help="transcript file, or - for standard input")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    del settings  # the fold reads no setting: it needs neither Kafka nor Redis
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
    )
    for warning in skipped:
        print(f"streamtally fold: skipped {warning}", file=sys.stderr)
    json.dump(tokens.to_json_dict(), sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


def _read(name: str) -> bytes:
    if name == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {name}: {exc.strerror}") from exc
