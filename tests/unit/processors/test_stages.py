"""`processors.stages`: the per-stage histograms of a request's close and their percentiles."""

from __future__ import annotations

import pytest

from benchmarks.pipeline_report import format_batches, format_stages
from benchmarks.pipeline_worker import merge_stages
from streamtally.processors.stages import (
    BUCKET_RATIO,
    BatchTimes,
    Stages,
    batch_summary,
    bucket_of,
    bucket_upper,
    difference,
    summarise,
)


@pytest.mark.parametrize("seconds", [2e-5, 0.001, 0.0123, 0.25, 3.0, 90.0])
def test_a_span_falls_in_the_bucket_whose_bounds_hold_it(seconds: float) -> None:
    index = bucket_of(seconds)
    assert bucket_upper(index - 1) < seconds <= bucket_upper(index) * (1 + 1e-9)
    assert bucket_upper(index) / seconds < BUCKET_RATIO


def test_percentiles_are_read_within_a_bucket_and_count_requests() -> None:
    stages = Stages()
    for ms in range(1, 101):  # 1 .. 100 ms, one request each
        stages.observe("kafka", ms / 1000)
    stages.observe("redis", 0.5, requests=3)  # one batch that closed three requests
    summary = summarise(stages.snapshot())
    kafka = summary["kafka"]
    assert kafka["requests"] == 100
    assert 50 <= kafka["p50_ms"] < 50 * BUCKET_RATIO
    assert 99 <= kafka["p99_ms"] < 99 * BUCKET_RATIO
    assert kafka["mean_ms"] == pytest.approx(50.5)
    assert summary["redis"]["requests"] == 3
    assert 500 <= summary["redis"]["p50_ms"] < 500 * BUCKET_RATIO
    assert summary["fetch"]["requests"] == 0
    assert summary["fetch"]["p50_ms"] is None


def test_a_difference_of_snapshots_counts_only_what_came_between() -> None:
    stages = Stages()
    stages.observe("apply", 0.5)
    before = stages.snapshot()
    stages.observe("apply", 0.002)
    stages.observe("apply", 0.002)
    between = summarise(difference(stages.snapshot(), before))["apply"]
    assert between["requests"] == 2
    assert between["p99_ms"] < 3  # the 500 ms before the phase is not in it
    merged = summarise(merge_stages([stages.snapshot(), stages.snapshot()]))["apply"]
    assert merged["requests"] == 6


def test_a_batch_counts_its_spans_once_per_request_it_closed() -> None:
    stages = Stages()
    times = BatchTimes(fetched=10.0, fetched_wall=1000.030, decoded=10.002, started=10.012)
    times.lookup, times.applied, times.write_started = 0.001, 10.016, 10.020
    times.begun, times.produced, times.stored, times.stored_wall = 10.023, 10.030, 10.032, 1000.062
    times.ends = [1000.000, 1000.010]  # two END markers, produced 30 and 20 ms before the fetch
    times.record(stages)
    summary = summarise(stages.snapshot())
    expected = {
        "decode": 2, "queue": 10, "apply": 3, "lookup": 1, "write_wait": 4,
        "redis_begin": 3, "kafka": 7, "redis": 2,
    }  # fmt: skip
    for stage, ms in expected.items():
        assert summary[stage]["requests"] == 2, stage
        assert ms <= summary[stage]["p50_ms"] < ms * BUCKET_RATIO + 0.01, stage
    assert 20 <= summary["fetch"]["p50_ms"] < 21
    assert 30 <= summary["fetch"]["p99_ms"] < 32
    assert 52 <= summary["total"]["p50_ms"] < 55
    assert 62 <= summary["total"]["p99_ms"] < 66
    table = "\n".join(format_stages(summary))
    assert "write_wait" in table
    assert "redis_begin" in table


def test_a_batch_that_closed_nothing_or_was_never_fetched_counts_no_span() -> None:
    stages = Stages()
    BatchTimes(fetched=1.0, fetched_wall=1.0, stored=2.0, stored_wall=2.0).record(stages)
    BatchTimes(stored=2.0, stored_wall=2.0, ends=[1.0]).record(stages)  # the timer's
    assert all(s["requests"] == 0 for s in summarise(stages.snapshot()).values())


def test_every_fetched_batch_is_counted_with_its_messages_closing_or_not() -> None:
    stages = Stages()
    assert batch_summary(stages.snapshot()) == {
        "batches": 0, "messages": 0, "mean_messages": None,
    }  # fmt: skip
    # Closed nothing, wrote nothing: still a batch the worker paid for.
    BatchTimes(fetched=1.0, fetched_wall=1.0, messages=30).record(stages)
    before = stages.snapshot()
    closing = BatchTimes(fetched=1.0, fetched_wall=1.0, stored=2.0, stored_wall=2.0, messages=7)
    closing.ends = [0.5]
    closing.record(stages)
    BatchTimes(fetched=2.0, fetched_wall=2.0, messages=5).record(stages)
    BatchTimes(stored=2.0, stored_wall=2.0, ends=[1.0], messages=99).record(stages)  # not fetched
    assert batch_summary(stages.snapshot()) == {
        "batches": 3, "messages": 42, "mean_messages": 14.0,
    }  # fmt: skip
    between = batch_summary(difference(stages.snapshot(), before))
    assert between == {"batches": 2, "messages": 12, "mean_messages": 6.0}
    merged = batch_summary(merge_stages([stages.snapshot(), before]))
    assert merged == {"batches": 4, "messages": 72, "mean_messages": 18.0}
    (line,) = format_batches("latency", between, cpu_seconds=0.003)
    assert "2 of 6.0 raw messages" in line
    assert "1.50 ms per batch" in line
    assert format_batches("latency", batch_summary(Stages().snapshot()), 1.0) == []
