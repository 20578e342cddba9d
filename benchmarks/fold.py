"""Fold throughput: raw bytes → SSE events → chunks → Tokens, per source, on one core.

Streams are our own: the long sample transcripts of each SSE source, and
engine streams generated here (a realistic shape: one token per line, usage
on the last line).  Each stream is folded whole, repeatedly, the way the
`fold` command and the processors run it; the figure is normalised chunks per
second of wall time in this single thread.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream, read_events
from streamtally.settings import project_root

__all__ = ["FoldResult", "engine_stream", "run"]

_SSE_SAMPLES = {
    Source.OPENAI: "openai/long_text_bench.sse",
    Source.OPENAI_RESPONSES: "openai-responses/long_text_bench.sse",
    Source.ANTHROPIC: "anthropic/long_text_bench.sse",
    Source.GEMINI: "gemini/long_text_bench.sse",
}


@dataclass(frozen=True, slots=True)
class FoldResult:
    source: Source
    stream_bytes: int
    chunks_per_stream: int
    repeats: int
    seconds: float

    @property
    def chunks_per_second(self) -> float:
        return self.chunks_per_stream * self.repeats / self.seconds

    @property
    def mib_per_second(self) -> float:
        return self.stream_bytes * self.repeats / self.seconds / (1 << 20)


def engine_stream(source: Source, tokens: int = 400) -> bytes:
    """A generated engine stream of `tokens` one-token steps, then a finish."""
    words = [f" w{i % 97}" for i in range(tokens)]
    lines: list[dict[str, object]] = []
    if source is Source.DYNAMO:
        lines = [
            {"token_ids": [1000 + i], "text": w, "finish_reason": None} for i, w in enumerate(words)
        ]
        lines.append(
            {
                "token_ids": [],
                "finish_reason": "eos",
                "completion_usage": {
                    "prompt_tokens": 50,
                    "completion_tokens": tokens,
                    "total_tokens": 50 + tokens,
                },
            }
        )
    elif source is Source.VLLM:
        lines = [
            {
                "request_id": "bench-vllm",
                "prompt_token_ids": list(range(50)),
                "output_kind": "DELTA",
                "outputs": [
                    {"index": 0, "text": w, "token_ids": [1000 + i], "finish_reason": None}
                ],
                "finished": False,
                "num_cached_tokens": 16,
            }
            for i, w in enumerate(words)
        ]
        lines[-1]["outputs"][0]["finish_reason"] = "stop"  # type: ignore[index]
        lines[-1]["finished"] = True
    else:
        lines = [
            {
                "request_id": "bench-atomr",
                "text_delta": w,
                "usage": {"input_tokens": 50 if i == 0 else 0, "output_tokens": 1},
                "finish_reason": None,
            }
            for i, w in enumerate(words)
        ]
        lines[-1]["finish_reason"] = "stop"
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _streams(samples: Path) -> dict[Source, bytes]:
    streams = {source: (samples / name).read_bytes() for source, name in _SSE_SAMPLES.items()}
    for source in (Source.DYNAMO, Source.VLLM, Source.ATOMR):
        streams[source] = engine_stream(source)
    return streams


def _measure(source: Source, data: bytes, seconds: float) -> FoldResult:
    def once() -> int:
        return fold_stream(source, read_events(source, io.BytesIO(data)), "bench").chunks

    chunks = once()  # warm up
    repeats = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        once()
        repeats += 1
        now = time.perf_counter()
        if now >= deadline:
            return FoldResult(source, len(data), chunks, repeats, now - start)


def run(seconds: float = 2.0, progress: Callable[[str], None] = print) -> list[FoldResult]:
    results = []
    root = project_root()
    if root is None:
        raise RuntimeError("the fold benchmark runs from a clone (it reads samples/)")
    for source, data in _streams(root / "samples").items():
        progress(f"folding {source.value} for {seconds:g}s …")
        results.append(_measure(source, data, seconds))
    return results
