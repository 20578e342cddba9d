"""Unit-test fixtures: every `Tap` not given a spool directory gets a fresh one per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamtally.producers import tap


@pytest.fixture(autouse=True)
def _spool_dir_per_test(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """`Tap`'s default spool directory (`default_spool_dir`) is a temporary one, so
    that no test sends another's records or finds its directory locked."""
    root = tmp_path_factory.mktemp("spool")
    monkeypatch.setattr(
        tap, "default_spool_dir", lambda namespace="streamtally", settings=None: root / namespace
    )
    return root
