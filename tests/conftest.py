"""Shared test helpers: where the public transcripts live."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("STREAMTALLY_SHARED", REPO.parent / "shared"))
PROVIDER_FIXTURES = SHARED / "fixtures" / "providers"


def require_public_transcripts() -> Path:
    """The folder of public transcripts; skips (locally) or fails (CI) when it is missing."""
    if PROVIDER_FIXTURES.is_dir():
        return PROVIDER_FIXTURES
    if os.environ.get("CI"):
        pytest.fail(f"public transcripts missing at {PROVIDER_FIXTURES} (CI must have ../shared)")
    pytest.skip(f"public transcripts not found at {PROVIDER_FIXTURES}")


@pytest.fixture(autouse=True)
def _no_schema_ids_across_tests() -> Iterator[None]:
    """The process's table of Confluent schema ids (and its registry) start empty in every
    test: one test's registry is not the next one's."""
    from streamtally.wire import avro

    avro.forget_ids()
    yield
    avro.forget_ids()
