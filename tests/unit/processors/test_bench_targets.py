"""The pipeline benchmark's latency targets: issue 28's, by the rate of the latency phase."""

from __future__ import annotations

import pytest

from benchmarks.pipeline_report import TARGET_RATIO, target_p99_ms


@pytest.mark.parametrize(
    ("rate", "below"),
    [
        (1_000.0, 100.0),
        (5_000.0, 100.0),
        (5_001.0, 300.0),
        (20_000.0, 300.0),
        (20_001.0, None),
    ],
)
def test_the_p99_target_is_the_one_of_the_rate(rate: float, below: float | None) -> None:
    assert target_p99_ms(rate) == below


def test_the_headroom_target_is_six_tenths_of_the_pass_through() -> None:
    assert TARGET_RATIO == 0.6
