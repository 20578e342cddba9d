"""The project's own sample transcripts (samples/) fold to their hand-written results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.models import Source
from streamtally.normalize import fold_stream, read_events

REPO = Path(__file__).resolve().parents[2]
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
    source = Source(expected["source"])
    with (SAMPLES / name).open("rb") as stream:
        tokens = fold_stream(source, read_events(source, stream), fallback_request_id="fallback")
    got = tokens.to_json_dict()
    assert got["request_id"] == (expected["request_id"] or "fallback")
    for key in (
        "source",
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
        keys = ("index", "text", "reasoning", "tool_calls", "finish_reason", "finish_reason_raw")
        assert [{k: c[k] for k in keys} for c in got["choices"]] == expected["choices"]
    else:
        assert "choices" not in got
