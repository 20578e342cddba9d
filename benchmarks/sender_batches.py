"""Records to a real broker the way the tap's sender hands them over: records/s, CPU each.

The spool's sender (`streamtally.producers.spool_sender`) takes records as the
spool gives them, a few each turn of its event loop, and keeps up to
`--in-flight` unacknowledged.  This benchmark does the same with records of
`--size` random bytes, `--per-turn` queued per loop turn over 64 request keys,
to the raw SSE topic of a scratch namespace (``streamtally-bench-batches``, one
day's retention), through one of two paths of the same idempotent producer:

* ``batches``: `streamtally.producers.batches.Batches`, the tap's path;
* ``send``: aiokafka's ``send``, one call per record.

It reports records/s from the first record queued to the last acknowledged, the
CPU of this process per record, and the batches made (``batches`` only).
The broker must be up (`streamtally stack up`).

    python -m benchmarks.sender_batches [--records 100000] [--in-flight 10000]
                                        [--per-turn 20] [--size 300] [--runs 3]
                                        [--mode batches|send|both] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Final

from benchmarks.pipeline_workload import scratch_names
from streamtally.producers.batches import Batches
from streamtally.settings import Settings
from streamtally.wire.kafka import MAX_REQUEST_BYTES, ensure_topics, idempotent_producer

__all__ = ["SenderRun", "main", "measure"]

NAMESPACE: Final = "streamtally-bench-batches"
MODES: Final = ("batches", "send")
_KEYS: Final = 64


@dataclass(frozen=True, slots=True)
class SenderRun:
    mode: str
    records: int
    seconds: float
    cpu_seconds: float
    #: Batches submitted and records in them (``batches`` only; 0 for ``send``).
    batches: int

    @property
    def records_per_second(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_record(self) -> float:
        return 1e6 * self.cpu_seconds / self.records if self.records else 0.0


async def measure(
    mode: str,
    *,
    records: int,
    in_flight: int,
    per_turn: int,
    size: int,
    servers: Any,
    topic: str | None = None,
) -> SenderRun:
    """One run of `records` records through `mode` to `topic` (default: the scratch
    namespace's raw SSE topic), which must exist."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    if min(records, in_flight, per_turn, size) < 1:
        raise ValueError("records, in_flight, per_turn and size must be positive")
    topic = topic or scratch_names(NAMESPACE).topics.raw_sse.name
    value = os.urandom(size)
    keys = [b"sender-batches-%d" % n for n in range(_KEYS)]
    producer = idempotent_producer(servers, linger_ms=5)
    await producer.start()
    batches = Batches(producer, max_request_bytes=MAX_REQUEST_BYTES)
    waiting: deque[asyncio.Future[Any]] = deque()
    try:
        queued = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        while queued < records or waiting:
            while waiting and waiting[0].done():
                waiting.popleft().result()  # a failed record fails the run
            turn = 0
            while queued < records and len(waiting) < in_flight and turn < per_turn:
                key = keys[queued % _KEYS]
                if mode == "batches":
                    waiting.append(batches.queue(topic, key, value))
                else:
                    waiting.append(await producer.send(topic, value, key=key))
                queued += 1
                turn += 1
            if waiting and (queued == records or len(waiting) >= in_flight):
                await asyncio.wait([waiting[0]])  # room comes with the oldest's ack
            else:
                await asyncio.sleep(0)
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    finally:
        await producer.stop()
    return SenderRun(mode, records, seconds, cpu, batches.batches)


async def _run(args: argparse.Namespace) -> list[SenderRun]:
    settings = Settings()
    servers = settings.kafka
    await ensure_topics(servers, (scratch_names(NAMESPACE).topics.raw_sse,))
    modes = MODES if args.mode == "both" else (args.mode,)
    runs: list[SenderRun] = []
    for n in range(args.runs):
        for mode in modes:  # alternated, so that a drift of the machine hits both
            run = await measure(
                mode,
                records=args.records,
                in_flight=args.in_flight,
                per_turn=args.per_turn,
                size=args.size,
                servers=servers,
            )
            runs.append(run)
            if not args.json:
                per_batch = f", {run.records / run.batches:.1f} per batch" if run.batches else ""
                print(
                    f"run {n + 1} {mode}: {run.records_per_second:,.0f} records/s, "
                    f"{run.cpu_us_per_record:.1f} µs CPU per record{per_batch}",
                    flush=True,
                )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000, help="records per run (100000)")
    parser.add_argument(
        "--in-flight", type=int, default=10_000, help="unacknowledged at most (10000)"
    )
    parser.add_argument("--per-turn", type=int, default=20, help="queued per loop turn (20)")
    parser.add_argument("--size", type=int, default=300, help="value bytes each (300)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode (3)")
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both")
    parser.add_argument("--json", action="store_true", help="print the runs as JSON")
    args = parser.parse_args()
    runs = asyncio.run(_run(args))
    if args.json:
        print(json.dumps([asdict(r) | {"records_per_second": r.records_per_second} for r in runs]))
        return
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        if mine:
            print(
                f"{mode}: median {statistics.median(r.records_per_second for r in mine):,.0f} "
                f"records/s, {statistics.median(r.cpu_us_per_record for r in mine):.1f} µs "
                "CPU per record"
            )


if __name__ == "__main__":
    main()
