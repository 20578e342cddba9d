"""The project's own sample transcripts (samples/) fold to their hand-written results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Source
from tests.expected import assert_matches, fold_file

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "samples"
EXPECTED: dict[str, dict[str, Any]] = json.loads(
    (REPO / "tests" / "expectations" / "samples.json").read_text()
)


def test_every_sample_has_an_expectation_and_a_manifest_line() -> None:
    on_disk = {
        str(p.relative_to(SAMPLES)) for p in SAMPLES.glob("*/*") if p.suffix in {".sse", ".jsonl"}
    }
    manifest = [json.loads(line) for line in (SAMPLES / "manifest.jsonl").read_text().splitlines()]
    assert on_disk == set(EXPECTED)
    assert {row["file"] for row in manifest} == on_disk
    assert len({row["request_id"] for row in manifest}) == len(manifest)
    assert all(Source(row["source"]) for row in manifest)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample(name: str) -> None:
    expected = EXPECTED[name]
    assert_matches(fold_file(SAMPLES / name, Source(expected["source"])), expected)
