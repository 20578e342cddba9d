"""The tap's own CPU per event: `TapRequest.feed` into a spool, no Kafka, no HTTP.

What the proxy's tap does per upstream chunk on the client's path, alone: the
SSE decoding, the records' encoding, their framing and the spool's one
``write()`` per chunk, as in the proxy, whose spool a sender process reads
(`Spool.read_elsewhere`: records counted, not kept in memory).  No sender
runs here, so the figure is the tap's alone, not shared with a Kafka client
or a broker on the same cores.

`--requests` requests of `--events` OpenAI chat-completion chunks each (ids of
their own), one event per chunk as a token-by-token upstream writes them,
fed in a temporary spool; `--rounds` rounds, the best reported (CPU of this
process per event, the chunks' bytes made before the clock starts).

    python -m benchmarks.tap_feed [--requests 200] [--events 195] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from streamtally.core.models import Source
from streamtally.producers.spool import Spool
from streamtally.producers.tap import Tap

__all__ = ["TapFeedFigures", "main", "measure"]

CHUNK: Final = (
    'data: {"id":"chatcmpl-b%d","object":"chat.completion.chunk","created":1764300000,'
    '"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":" token%d"},'
    '"finish_reason":null}]}\n\n'
)


@dataclass(frozen=True, slots=True)
class TapFeedFigures:
    events: int
    #: CPU of this process per event (µs), in each round and the best of them.
    rounds_us: list[float]
    best_us: float
    records: int


class _NoSender:
    """The tap's sender, never started to send: the spool is read by no one here."""

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> Any:
        size = len(value) + len(auth or b"")
        raise AssertionError(f"tap_feed sends nothing ({source.value} {request_id}, {size} B)")


async def _measure(requests: int, events: int, rounds: int, directory: Path) -> TapFeedFigures:
    tap = Tap(sender=_NoSender(), keepalive_s=None)
    spool = Spool(directory / "spool", max_bytes=1 << 40)
    spool.read_elsewhere()  # as the proxy's spool, which its sender process reads
    tap._spool = spool  # the tap without its sender task: nothing else on the CPU
    figures: list[float] = []
    try:
        for number in range(rounds):
            bodies = [
                [(CHUNK % (number * requests + r, i)).encode() for i in range(events)]
                for r in range(requests)
            ]
            start = time.process_time()
            for chunks in bodies:
                async with tap.request(Source.OPENAI, tenant="bench") as request:
                    for chunk in chunks:
                        await request.feed(chunk)
            figures.append(round((time.process_time() - start) / (requests * events) * 1e6, 2))
    finally:
        await spool.close()
    return TapFeedFigures(requests * events, figures, min(figures), spool.appended)


def measure(requests: int = 200, events: int = 195, rounds: int = 5) -> TapFeedFigures:
    with tempfile.TemporaryDirectory(prefix="st-tap-feed-") as tmp:
        return asyncio.run(_measure(requests, events, rounds, Path(tmp)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests a round (200)")
    parser.add_argument("--events", type=int, default=195, help="events a request (195)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the best reported (5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = measure(args.requests, args.events, args.rounds)
    if args.json:
        print(json.dumps(asdict(figures)))
        return
    print(
        f"tap feed: {figures.best_us:.2f} µs of CPU per event, best of {len(figures.rounds_us)}"
        f" rounds of {figures.events:,} events ({', '.join(map(str, figures.rounds_us))});"
        f" {figures.records:,} records spooled"
    )


if __name__ == "__main__":
    main()
