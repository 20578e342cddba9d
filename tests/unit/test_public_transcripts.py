"""Every public provider transcript folds to the result written out by hand.

The expectations in `tests/expectations/` were derived from the normalisation
contract and the transcript bytes, independently of this code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.models import Source
from streamtally.normalize import fold_stream, read_events
from tests.conftest import require_public_transcripts

EXPECTATIONS = Path(__file__).resolve().parent.parent / "expectations"


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    for path in sorted(EXPECTATIONS.glob("*.json")):
        if path.stem == "samples":
            continue  # our own transcripts: tests/unit/test_samples.py
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
    source = Source(expected["source"])
    with (root / folder / name).open("rb") as stream:
        tokens = fold_stream(source, read_events(source, stream), fallback_request_id="fallback")
    got = tokens.to_json_dict()
    if expected["request_id"] is None:
        assert got["request_id"] == "fallback"
    else:
        assert got["request_id"] == expected["request_id"]
    for key in (
        "model",
        "text",
        "reasoning",
        "tool_calls",
        "usage",
        "finish_reason",
        "finish_reason_raw",
    ):
        assert got[key] == expected[key], key
    if expected["error"] is None:
        assert got["error"] is None
    else:
        assert expected["error"] in (got["error"] or "")
    if "choices" in expected:
        assert [
            {
                k: c[k]
                for k in (
                    "index",
                    "text",
                    "reasoning",
                    "tool_calls",
                    "finish_reason",
                    "finish_reason_raw",
                )
            }
            for c in got["choices"]
        ] == expected["choices"]
    else:
        assert "choices" not in got
    assert got["chunks"] > 0
