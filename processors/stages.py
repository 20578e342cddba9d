"""Where a request's close latency goes inside the worker: per-stage histograms.

A request is billed when the batch that carries its END marker (the record that
closes it) has been fetched, decoded, applied and written.  Each batch carries
`BatchTimes`, monotonic timestamps taken as it passes from one step to the next
(a handful per batch, none per record), and once its Redis write is done every
request it closed adds the batch's spans to `Stages`:

============  ==============================================================================
stage         from → to
============  ==============================================================================
fetch         the END record's Kafka timestamp (its producer's clock) → ``getmany`` returned it
              (producer linger, broker, the fetch the broker holds for more records
              (`STREAMTALLY_FETCH_MIN_BYTES`, `STREAMTALLY_FETCH_WAIT`), the consumer's buffer)
decode        fetched → decoded and checked (`BatchLoop.decode`: schema ids, `examine_batch`)
queue         decoded → the agent starts on the batch (the channel and the batch lock)
apply         the agent's work on the batch (`BatchLoop.apply`), less `lookup`
lookup        Redis round trips while applying: which new requests an earlier run closed,
              amendable states (`BatchLoop.lookup_closed`, `lookup_amendable`)
write_wait    applied → its write starts (the write of the batch before still in flight)
redis_begin   the close decisions written to Redis (one round trip)
kafka         chunks, Tokens and billing events produced, acks awaited
redis         the Tokens, usage and counts script (the Tokens is readable at its end)
total         the END record's Kafka timestamp → its Tokens readable (wall clock)
commit        the batch's released offsets committed (`BatchLoop.commit`: off the request's
              path, when the commit ends does not delay its Tokens)
============  ==============================================================================

Beside the stages, every fetched batch is counted with its raw messages once
its write ends (``batches``), whether it closed a request or not, with outputs
or without: a batch's fixed costs (the fetch, the Redis round trips, the
produce request, the loop) are paid per batch, so at a low rate, where batches
are small, they are most of a record's CPU (`batch_summary`).

``fetch`` and ``total`` compare the producer's wall clock with the worker's: on one
machine they are the same clock; across machines they include the clocks' skew.

Histograms have logarithmic buckets (`BUCKET_RATIO` apart, from `MIN_SECONDS`), so a
percentile read from them is within 5 % and their counts can be subtracted: a
benchmark reads `Stages.snapshot` before and after a phase and `summarise`s the
difference (`difference`).  The worker serves the snapshot as JSON on ``/stages``
(`processors.metrics`), and each stage as a Prometheus histogram too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "BUCKET_RATIO",
    "MIN_SECONDS",
    "STAGES",
    "BatchTimes",
    "Stages",
    "batch_summary",
    "bucket_of",
    "bucket_upper",
    "difference",
    "percentile",
    "summarise",
]

#: The stages, in the order a request passes them (``total`` spans them; ``commit``
#: follows the Tokens).
STAGES: Final = (
    "fetch",
    "decode",
    "queue",
    "apply",
    "lookup",
    "write_wait",
    "redis_begin",
    "kafka",
    "redis",
    "total",
    "commit",
)
#: Each bucket's upper bound is this many times the one before.
BUCKET_RATIO: Final = 1.05
#: The first bucket's upper bound (seconds); a span at or below it falls in bucket 0.
MIN_SECONDS: Final = 1e-5
_LOG_RATIO: Final = math.log(BUCKET_RATIO)


def bucket_of(seconds: float) -> int:
    """The bucket of a span: the first whose upper bound is at least `seconds`."""
    if seconds <= MIN_SECONDS:
        return 0
    return math.ceil(math.log(seconds / MIN_SECONDS) / _LOG_RATIO - 1e-9)


def bucket_upper(index: int) -> float:
    """Bucket `index`'s upper bound in seconds."""
    return float(MIN_SECONDS * BUCKET_RATIO**index)


def percentile(buckets: Mapping[int, int], p: float) -> float | None:
    """The nearest-rank `p`th percentile of the spans counted in `buckets` (seconds, the
    upper bound of the bucket it falls in); None when nothing was counted."""
    total = sum(buckets.values())
    if total <= 0:
        return None
    rank = max(1, math.ceil(p / 100 * total))
    seen = 0
    for index in sorted(buckets):
        seen += buckets[index]
        if seen >= rank:
            return bucket_upper(index)
    return bucket_upper(max(buckets))


@dataclass(slots=True)
class _Histogram:
    count: int = 0
    total: float = 0.0
    buckets: dict[int, int] = field(default_factory=dict)


class Stages:
    """A histogram per stage (`STAGES`), counted per request closed."""

    def __init__(self) -> None:
        self._histograms = {stage: _Histogram() for stage in STAGES}
        #: Fetched batches whose write ended, and the raw messages they carried.
        self.batches = 0
        self.messages = 0
        #: Told each span observed (stage, seconds, requests): the Prometheus histograms.
        self.on_observe: Callable[[str, float, int], None] | None = None

    def observe(self, stage: str, seconds: float, requests: int = 1) -> None:
        """`requests` requests spent `seconds` in `stage` (a negative span, from clocks
        that disagree, counts as zero)."""
        if requests <= 0:
            return
        seconds = max(0.0, seconds)
        histogram = self._histograms[stage]
        histogram.count += requests
        histogram.total += seconds * requests
        index = bucket_of(seconds)
        histogram.buckets[index] = histogram.buckets.get(index, 0) + requests
        if self.on_observe is not None:
            self.on_observe(stage, seconds, requests)

    def batch(self, messages: int) -> None:
        """The write of a fetched batch of `messages` raw messages ended."""
        self.batches += 1
        self.messages += messages

    def snapshot(self) -> dict[str, Any]:
        """Every stage's counts so far, as JSON (``/stages``)."""
        return {
            "bucket_ratio": BUCKET_RATIO,
            "min_seconds": MIN_SECONDS,
            "batches": {"count": self.batches, "messages": self.messages},
            "stages": {
                stage: {
                    "count": h.count,
                    "sum_seconds": h.total,
                    "buckets": {str(i): n for i, n in sorted(h.buckets.items())},
                }
                for stage, h in self._histograms.items()
            },
        }


def difference(after: Mapping[str, Any], before: Mapping[str, Any] | None) -> dict[str, Any]:
    """What was counted between two snapshots (`before` None: all of `after`)."""
    old = {} if before is None else before.get("stages", {})
    stages: dict[str, Any] = {}
    for stage, now in after.get("stages", {}).items():
        then = old.get(stage, {"count": 0, "sum_seconds": 0.0, "buckets": {}})
        buckets = {
            key: n - int(then["buckets"].get(key, 0))
            for key, n in now["buckets"].items()
            if n - int(then["buckets"].get(key, 0)) > 0
        }
        stages[stage] = {
            "count": int(now["count"]) - int(then["count"]),
            "sum_seconds": float(now["sum_seconds"]) - float(then["sum_seconds"]),
            "buckets": buckets,
        }
    counted = after.get("batches", {"count": 0, "messages": 0})
    then_counted = {} if before is None else before.get("batches", {})
    batches = {
        key: int(counted.get(key, 0)) - int(then_counted.get(key, 0))
        for key in ("count", "messages")
    }
    return {**after, "stages": stages, "batches": batches}


def batch_summary(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """Batches counted (`Stages.batch`), their raw messages, and their mean size (None:
    no batch)."""
    counted = snapshot.get("batches", {})
    batches, messages = int(counted.get("count", 0)), int(counted.get("messages", 0))
    return {
        "batches": batches,
        "messages": messages,
        "mean_messages": round(messages / batches, 1) if batches else None,
    }


def summarise(snapshot: Mapping[str, Any], stages: Iterable[str] = STAGES) -> dict[str, Any]:
    """Per stage: requests counted, mean, p50, p90, p99 and p99.9 in milliseconds."""
    summary: dict[str, Any] = {}
    found = snapshot.get("stages", {})
    for stage in stages:
        data = found.get(stage)
        if data is None:
            continue
        buckets = {int(k): int(n) for k, n in data["buckets"].items()}
        count = int(data["count"])

        def ms(p: float, buckets: dict[int, int] = buckets) -> float | None:
            value = percentile(buckets, p)
            return None if value is None else round(value * 1000, 2)

        summary[stage] = {
            "requests": count,
            "mean_ms": round(float(data["sum_seconds"]) / count * 1000, 2) if count else None,
            "p50_ms": ms(50),
            "p90_ms": ms(90),
            "p99_ms": ms(99),
            "p999_ms": ms(99.9),
        }
    return summary


@dataclass(slots=True)
class BatchTimes:
    """One batch's way through the worker (`time.perf_counter` seconds, 0.0: not reached),
    and the Kafka timestamps of the END markers it carries (read when it is written)."""

    #: ``getmany`` returned the batch: monotonic, and wall clock (against record timestamps).
    fetched: float = 0.0
    fetched_wall: float = 0.0
    decoded: float = 0.0
    started: float = 0.0
    #: Seconds of Redis lookups while applying.
    lookup: float = 0.0
    applied: float = 0.0
    write_started: float = 0.0
    begun: float = 0.0
    produced: float = 0.0
    #: The Tokens written: monotonic, and wall clock.
    stored: float = 0.0
    stored_wall: float = 0.0
    #: Wall-clock Kafka timestamps of the END markers of the requests this batch closed.
    ends: list[float] = field(default_factory=list)
    #: Raw messages the batch carried.
    messages: int = 0

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def record(self, stages: Stages) -> None:
        """Count this batch's spans once per request it closed (`ends`); nothing for a
        batch that closed none (no request waited on it), nor for one never fetched
        (the timer's closes, batches handed over in tests).  Every fetched batch is
        counted with its messages (`Stages.batch`), with outputs or without."""
        if not self.fetched:
            return
        stages.batch(self.messages)
        closed = len(self.ends)
        if not closed or not self.stored:
            return
        for end in self.ends:
            stages.observe("fetch", self.fetched_wall - end)
            stages.observe("total", self.stored_wall - end)
        decoded = self.decoded or self.fetched
        started = self.started or decoded
        stages.observe("decode", decoded - self.fetched, closed)
        stages.observe("queue", started - decoded, closed)
        stages.observe("apply", self.applied - started - self.lookup, closed)
        stages.observe("lookup", self.lookup, closed)
        stages.observe("write_wait", self.write_started - self.applied, closed)
        stages.observe("redis_begin", self.begun - self.write_started, closed)
        stages.observe("kafka", self.produced - self.begun, closed)
        stages.observe("redis", self.stored - self.produced, closed)
