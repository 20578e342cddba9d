"""CPU per raw message of the worker's own stages, without Kafka or Redis.

The pipeline benchmark's traffic (`benchmarks.pipeline_workload`: the same
requests, interleaved 16 at a time) is put through what `BatchLoop` does with
each batch, minus its I/O, in batches of `--batch` messages:

- ``decode``: `RequestProcessor.examine_batch` (each value decoded and checked);
- ``admit``: `admit_batch`, and the requests the batch would ask Redis about
  (`requests_of`, `unknown`; nothing is asked: every request is new);
- ``apply``: `apply_batch` (sequencing, folding, chunks encoded, closes billed);
- ``gate``: the commit gate holding the batch and releasing what is done.

The figure is process CPU time per raw message (`time.process_time`), per
stage, over the whole traffic, with the worker's collector settings; the median
and the best of `--runs` runs (each with its own traffic, so the requests are
new).  It moves far less from run to run than `streamtally bench pipeline`,
whose figures include the broker, Redis and the producer sharing the machine:
use it to compare two builds of the hot path, alternating them.

    python -m benchmarks.worker_stages [--messages N] [--batch B] [--runs R] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Final

from aiokafka import TopicPartition

from benchmarks.pipeline_workload import RequestBuilder, interleave, scratch_names
from streamtally._gc import GC_YOUNG_THRESHOLD
from streamtally._native import status
from streamtally.billing.pricing import PriceTable
from streamtally.processors.commits import CommitGate
from streamtally.processors.outputs import Outputs
from streamtally.processors.requests import RequestProcessor
from streamtally.processors.source import RawMessage
from streamtally.settings import project_root

__all__ = ["STAGES", "StageFigures", "main", "measure"]

#: The stages timed, in a batch's order.
STAGES: Final = ("decode", "admit", "apply", "gate")
#: Requests in flight at a time, as in the pipeline benchmark.
_WIDTH: Final = 16


@dataclass(frozen=True, slots=True)
class StageFigures:
    """One run: raw messages put through, requests closed, CPU µs per message by stage."""

    messages: int
    requests: int
    closed: int
    microseconds: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.microseconds.values())


def _messages(run: str, events: int) -> tuple[list[RawMessage], int]:
    root = project_root()
    if root is None:
        raise SystemExit("run from a clone: the benchmark replays samples/")
    names = scratch_names("stages")
    requests = RequestBuilder(run, root / "samples", names).requests(events)
    now = time.time()
    messages = [
        RawMessage(topic, 0, offset, now, key, value)
        for offset, (topic, key, value, _) in enumerate(interleave(requests, _WIDTH))
    ]
    return messages, len(requests)


def measure(run: str, events: int, batch: int) -> StageFigures:
    """One run over fresh traffic of at least `events` raw events."""
    messages, requests = _messages(run, events)
    sse_topic = scratch_names("stages").topics.raw_sse.name
    processor = RequestProcessor(PriceTable.load_or_default(None), timeout=86_400)
    gate = CommitGate()
    partitions: dict[tuple[str, int], TopicPartition] = {}
    spent = dict.fromkeys(STAGES, 0.0)
    closed = 0
    clock = time.process_time
    gc.collect()
    for start in range(0, len(messages), batch):
        part = messages[start : start + batch]
        t0 = clock()
        examined = processor.examine_batch(part, sse_topic)
        t1 = clock()
        out = Outputs()
        raws = processor.admit_batch(part, examined, out)
        processor.unknown(processor.requests_of(raws))
        t2 = clock()
        holds = processor.apply_batch(out, part, raws, partitions, TopicPartition)
        t3 = clock()
        gate.hold_all(holds)
        gate.finished(
            [done.ref for done in out.completed],
            {done.ref: done.closed.offset for done in out.completed},
        )
        gate.release()
        t4 = clock()
        for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[stage] += seconds
        closed += len(out.completed)
    per = {stage: round(seconds / len(messages) * 1e6, 3) for stage, seconds in spent.items()}
    return StageFigures(len(messages), requests, closed, per)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.worker_stages", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--messages", type=int, default=100_000, help="raw events per run, at least (100000)"
    )
    parser.add_argument("--batch", type=int, default=700, help="messages per batch (700)")
    parser.add_argument("--runs", type=int, default=5, help="runs, each on fresh traffic (5)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.messages < 1 or args.batch < 1 or args.runs < 1:
        parser.error("--messages, --batch and --runs must be at least 1")
    # The engine samples name no model: each such request is priced at 0 with a warning.
    logging.disable(logging.WARNING)
    # As the worker runs: what is allocated at start out of the collector's sight.
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
    hot_path = status()
    runs = []
    for n in range(args.runs):
        figures = measure(f"stages{n}", args.messages, args.batch)
        if figures.closed != figures.requests:
            raise SystemExit(f"run {n}: {figures.closed} of {figures.requests} requests closed")
        runs.append(figures)
        if not args.json:
            stages = ", ".join(f"{k} {v:.2f}" for k, v in figures.microseconds.items())
            print(
                f"run {n + 1}: {figures.total:.2f} µs CPU per message ({stages}); "
                f"{figures.messages:,} messages, {figures.requests:,} requests"
            )
    totals = sorted(f.total for f in runs)
    median = {s: round(statistics.median(f.microseconds[s] for f in runs), 3) for s in STAGES}
    if args.json:
        print(
            json.dumps(
                {
                    "hot_path": hot_path.describe(),
                    "batch": args.batch,
                    "runs": [asdict(f) for f in runs],
                    "median_total_us": round(statistics.median(totals), 3),
                    "best_total_us": round(totals[0], 3),
                    "median_us": median,
                }
            )
        )
    else:
        print(
            f"median {statistics.median(totals):.2f} µs CPU per message, best {totals[0]:.2f} "
            f"(batches of {args.batch}, hot path: {hot_path.describe()}); by stage, medians: "
            + ", ".join(f"{k} {v:.2f}" for k, v in median.items())
        )


if __name__ == "__main__":
    main()
