"""The linked folders (docs/architecture.md, "One import root"): links in git, and a clear
stop where a checkout wrote them as plain files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import streamtally

ROOT = Path(__file__).parents[3]


def test_the_package_folders_are_links_to_the_top_level_ones() -> None:
    for name in streamtally.LINKED:
        link = ROOT / "streamtally" / name
        target = ROOT / ("schemas" if name == "_schemas" else name)
        assert link.is_symlink(), name
        assert link.resolve() == target.resolve(), name


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="no git")
def test_git_stores_them_as_links() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-s", *(f"streamtally/{name}" for name in streamtally.LINKED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert sorted(line.split()[0] for line in listed) == ["120000"] * len(streamtally.LINKED)


def test_a_checkout_without_symlinks_stops_saying_what_to_do(tmp_path: Path) -> None:
    for name in streamtally.LINKED:
        (tmp_path / name).mkdir()
    streamtally._check_links(tmp_path)  # folders (a wheel): fine
    (tmp_path / "processors").rmdir()
    (tmp_path / "processors").write_text("../processors")  # what git writes without symlinks
    with pytest.raises(ImportError, match=r"streamtally/processors must be links.*core\.symlinks"):
        streamtally._check_links(tmp_path)
