"""Every public provider transcript folds to the result written out by hand.

The expectations in `tests/expectations/` were derived from the normalisation
contract and the transcript bytes, independently of this code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Source
from tests.conftest import require_public_transcripts
from tests.expected import assert_matches, fold_file

EXPECTATIONS = Path(__file__).resolve().parents[2] / "expectations"


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    for path in sorted(EXPECTATIONS.glob("*.json")):
        if path.stem == "samples":
            continue  # our own transcripts: tests/unit/core/test_samples.py
        for name, expected in json.loads(path.read_text()).items():
            cases.append((path.stem, name, expected))
    return cases


CASES = _cases()


def test_every_public_transcript_has_an_expectation() -> None:
    root = require_public_transcripts()
    on_disk = {f"{p.parent.name}/{p.name}" for p in root.glob("*/*.sse")}
    expected = {f"{folder}/{name}" for folder, name, _ in CASES}
    assert on_disk == expected
    assert len(on_disk) == 68


@pytest.mark.parametrize(
    ("folder", "name", "expected"), CASES, ids=[f"{f}/{n}" for f, n, _ in CASES]
)
def test_public_transcript(folder: str, name: str, expected: dict[str, Any]) -> None:
    root = require_public_transcripts()
    got = fold_file(root / folder / name, Source(expected["source"]))
    assert_matches(got, expected)
