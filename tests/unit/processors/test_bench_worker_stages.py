"""`benchmarks.worker_stages` puts the pipeline benchmark's traffic through the worker's stages.

Figures are never asserted (they are the benchmark's to report); what is held: every
request of the traffic is closed, every stage is timed, and the messages are the
traffic's.
"""

from __future__ import annotations

from benchmarks.worker_stages import STAGES, measure


def test_every_request_closes_and_every_stage_is_timed() -> None:
    figures = measure("unit", 600, 64)
    assert figures.requests > 1
    assert figures.closed == figures.requests
    assert figures.messages >= 600 + figures.requests  # events, then an END each
    assert tuple(figures.microseconds) == STAGES
    assert all(us > 0 for us in figures.microseconds.values())
    assert figures.total == sum(figures.microseconds.values())
