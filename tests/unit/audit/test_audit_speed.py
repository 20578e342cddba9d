"""The audit benchmark's arithmetic (`benchmarks.audit_speed`): the projected day, the
figures of a run and its table (no stack: the figures are made up)."""

from __future__ import annotations

import math

import pytest

from benchmarks.audit_speed import (
    AuditSpeed,
    ProcessFigures,
    RunFigures,
    format_report,
    projected_day_seconds,
)
from benchmarks.pipeline_report import Machine


def test_a_day_is_its_events_over_sixteen_processes_at_the_rate_of_one() -> None:
    # 1,000 requests/s of 179 events for a day, 16 processes at 20,000 events/s each.
    day = projected_day_seconds(20_000, 1, 179)
    assert day == pytest.approx(86_400 * 1_000 * 179 / (20_000 * 16))
    assert day / 3600 == pytest.approx(13.43, abs=0.01)
    # two processes that went through 40,000 events/s together: 20,000 each, the same day
    assert projected_day_seconds(40_000, 2, 179) == pytest.approx(day)
    # 22 events per request (the README's chat-sized requests): 1.65 h
    assert projected_day_seconds(20_000, 1, 22) / 3600 == pytest.approx(1.65, abs=0.01)
    assert projected_day_seconds(20_000, 1, 179, cores=32) == pytest.approx(day / 2)
    assert projected_day_seconds(20_000, 1, 179, requests_per_second=500) == pytest.approx(day / 2)
    assert math.isinf(projected_day_seconds(0, 1, 179))


def test_a_run_says_its_rate_cpu_per_event_and_day() -> None:
    worker = ProcessFigures("worker", 10, 5.0, 130.0, False)
    shares = [ProcessFigures(f"share {i}/2", 11 + i, 4.0, 300.0, True) for i in range(2)]
    one = RunFigures("worker", 10.0, 200_000, 5.0, [worker], 1, 200.0)
    two = RunFigures("audit --workers 2", 8.0, 200_000, 9.0, shares, 2, 200.0)
    assert (one.events_per_second, one.cpu_us_per_event) == (20_000, 25.0)
    assert one.projected_day_seconds == pytest.approx(86_400 * 1_000 * 200 / (20_000 * 16))
    assert two.projected_day_seconds == pytest.approx(86_400 * 1_000 * 200 / (12_500 * 16))
    assert one.to_json()["projected_day_hours"] == pytest.approx(15.0)
    # by CPU: 200,000 events in 9 CPU seconds (the parent's included), a core each
    assert two.projected_day_cpu_seconds == pytest.approx(86_400 * 1_000 * 200 * 9 / 200_000 / 16)
    speed = AuditSpeed(
        machine=Machine(2, "cpu", "Linux", "CPython 3.11", 1.0, 1.0, None, None, None, None),
        run_id="r",
        namespace="n",
        tenant="t",
        requests=1_000,
        raw_events=200_000,
        requests_by_source={},
        runs=[one, two, RunFigures("audit", 0.0, 0, 0.0, [], 1, 200.0, exit_code=2)],
        checks={"same_report": False},
    )
    text = format_report(speed)
    assert "200.0 per request" in text
    assert "15.0 h" in text
    assert "share 1/2 4.0 s, 300 MiB, compiled" in text
    assert "worker 5.0 s, 130 MiB, plain" in text
    assert "same_report NO" in text
    assert speed.to_json()["runs"][2]["projected_day_hours"] is None
