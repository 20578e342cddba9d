"""Shared test helpers: where the public transcripts live."""

from __future__ import annotations

import os
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
