"""Checking a fold against a hand-written expectation (tests/expectations/*.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream, read_events

_FIELDS = (
    "source",
    "model",
    "text",
    "reasoning",
    "tool_calls",
    "usage",
    "finish_reason",
    "finish_reason_raw",
)
_CHOICE_FIELDS = ("index", "text", "reasoning", "tool_calls", "finish_reason", "finish_reason_raw")


def fold_file(path: Path, source: Source) -> dict[str, Any]:
    """`streamtally fold` of a transcript; a stream without an id gets the id "fallback"."""
    with path.open("rb") as stream:
        tokens = fold_stream(source, read_events(source, stream), fallback_request_id="fallback")
    return tokens.to_json_dict()


def assert_matches(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Every field of `expected`: exact, except `error` (a substring, or null)."""
    assert got["request_id"] == (expected["request_id"] or "fallback")
    for key in _FIELDS:
        assert got[key] == expected[key], key
    if expected["error"] is None:
        assert got["error"] is None
    else:
        assert expected["error"] in (got["error"] or "")
    if "choices" in expected:
        choices = [{k: c[k] for k in _CHOICE_FIELDS} for c in got["choices"]]
        assert choices == expected["choices"]
    else:
        assert "choices" not in got
    assert got["chunks"] > 0
