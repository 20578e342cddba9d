"""The tap's spool on this machine: appends per second, MB/s, append latency, recovery.

Three measures, each on a fresh spool in a temporary directory under `--dir`
(default: the state directory, on disk; a tmpfs would make fsync free):

* append: `--records` records of `--size` value bytes appended as the tap
  appends them (one ``write()`` each), yielding to the event loop every
  `--yield-every` appends so that the group commit (an fsync every
  `--sync-ms` in a thread) runs alongside; appends/s, MB/s of framed bytes,
  and the latency of one append (p50, p99, max).  Nothing reads them.
* through: the same with the spool's sender draining it concurrently to a
  fake Kafka that acknowledges at once (take, send, acknowledge, cursor
  writes and segment deletion included): records/s in and out.
* recovery: a spool left with all those records unsent is opened again
  (every CRC checked): seconds and MB/s.

    python -m benchmarks.spool [--records N] [--size BYTES] [--sync-ms MS] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamtally.core.models import Source
from streamtally.producers.spool import Spool
from streamtally.producers.spool_sender import SpoolSender
from streamtally.settings import Settings

__all__ = ["SpoolFigures", "main", "measure"]


@dataclass(frozen=True, slots=True)
class SpoolFigures:
    records: int
    value_bytes: int
    framed_bytes: int
    sync_ms: float
    append_per_s: float
    append_mb_per_s: float
    append_p50_us: float
    append_p99_us: float
    append_max_us: float
    fsyncs: int
    through_per_s: float
    through_mb_per_s: float
    recovery_s: float
    recovery_mb_per_s: float


class _InstantKafka:
    """A sender whose every record is acknowledged at once."""

    def __init__(self) -> None:
        self.count = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        del source, request_id, value, auth  # a fake: what it is given does not matter
        self.count += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def _append(
    directory: Path, records: int, value: bytes, sync_s: float, yield_every: int
) -> tuple[float, list[float], int, int]:
    """Seconds, the append latencies, the framed bytes and the group commits seen."""
    spool = await Spool(directory, sync_interval_s=sync_s).start()
    fsyncs, synced = 0, 0
    latencies: list[float] = []
    clock = time.perf_counter
    started = clock()
    for n in range(records):
        t0 = clock()
        spool.append(Source.OPENAI, f"call-{n // 20:012d}", value, None)
        latencies.append(clock() - t0)
        if n % yield_every == 0:
            await asyncio.sleep(0)
            if spool.synced != synced:  # a group commit ended since the last look
                fsyncs, synced = fsyncs + 1, spool.synced
    elapsed = clock() - started
    framed = spool.end
    await spool.close()
    return elapsed, latencies, framed, fsyncs


async def _through(directory: Path, records: int, value: bytes, sync_s: float) -> float:
    """Seconds to append `records` with the sender draining them to an instant Kafka."""
    spool = await Spool(directory, sync_interval_s=sync_s).start()
    kafka = _InstantKafka()
    sender = await SpoolSender(spool, kafka).start()
    started = time.perf_counter()
    for n in range(records):
        spool.append(Source.OPENAI, f"call-{n // 20:012d}", value, None)
        if n % 64 == 0:
            await asyncio.sleep(0)
    if not await spool.wait_sent(600):
        raise SystemExit("the sender did not drain the spool within 600 s")
    elapsed = time.perf_counter() - started
    await sender.stop()
    await spool.close()
    assert kafka.count == records
    return elapsed


async def _run(
    root: Path, records: int, size: int, sync_ms: float, yield_every: int
) -> SpoolFigures:
    value = bytes(range(256)) * (size // 256) + bytes(size % 256)
    sync_s = sync_ms / 1000
    elapsed, latencies, framed, fsyncs = await _append(
        root / "append", records, value, sync_s, yield_every
    )
    started = time.perf_counter()
    reopened = Spool(root / "append")
    recovery = time.perf_counter() - started
    assert reopened.unsent_records == records
    await reopened.close()
    through = await _through(root / "through", records, value, sync_s)
    us = 1e6
    return SpoolFigures(
        records=records,
        value_bytes=size,
        framed_bytes=framed // records,
        sync_ms=sync_ms,
        append_per_s=round(records / elapsed),
        append_mb_per_s=round(framed / elapsed / 1e6, 1),
        append_p50_us=round(statistics.median(latencies) * us, 1),
        append_p99_us=round(_percentile(latencies, 0.99) * us, 1),
        append_max_us=round(max(latencies) * us, 1),
        fsyncs=fsyncs,
        through_per_s=round(records / through),
        through_mb_per_s=round(framed / through / 1e6, 1),
        recovery_s=round(recovery, 3),
        recovery_mb_per_s=round(framed / recovery / 1e6, 1),
    )


def measure(
    records: int = 200_000,
    size: int = 300,
    sync_ms: float = 20.0,
    yield_every: int = 16,
    directory: Path | None = None,
) -> SpoolFigures:
    """The figures of one run (see the module docstring)."""
    base = directory or Settings().state_dir
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-spool-", dir=base))
    try:
        return asyncio.run(_run(root, records, size, sync_ms, yield_every))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000, help="records (200000)")
    parser.add_argument("--size", type=int, default=300, help="value bytes each (300)")
    parser.add_argument("--sync-ms", type=float, default=20.0, help="group commit (20)")
    parser.add_argument(
        "--yield-every", type=int, default=16, help="appends between two yields (16)"
    )
    parser.add_argument("--dir", type=Path, help="where (default: the state directory)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    r = measure(args.records, args.size, args.sync_ms, args.yield_every, args.dir)
    if args.json:
        print(json.dumps(asdict(r)))
        return
    print(
        f"spool, {r.records:,} records of {r.value_bytes} value bytes ({r.framed_bytes} "
        f"framed), group commit every {r.sync_ms:g} ms:\n"
        f"  append:   {r.append_per_s:,.0f} appends/s, {r.append_mb_per_s} MB/s; one append "
        f"p50 {r.append_p50_us} us, p99 {r.append_p99_us} us, max {r.append_max_us} us; "
        f"{r.fsyncs} fsyncs\n"
        f"  through:  {r.through_per_s:,.0f} records/s appended and sent to an instant "
        f"Kafka ({r.through_mb_per_s} MB/s)\n"
        f"  recovery: {r.recovery_s} s to reopen them all unsent ({r.recovery_mb_per_s} MB/s)"
    )


if __name__ == "__main__":
    main()
