"""Finished builds kept on this machine, whole, under a key of everything they were built from.

A clone or a state dir that needs a build some other one already made takes a copy
instead of building it again: `streamtally native build` its compiled modules
(`streamtally.ops.native`), `streamtally stack up` its Kafka jars and its schema
registry's application (`streamtally.stack.kafka_jars`, `streamtally.stack.registry`).
Each keeps its builds in a folder of its own (`BuildCache.root`), one sub-folder per key;
the caller names the key, and checks what it takes as it checks any build of its own.

An entry is written whole or not at all (copied to a scratch folder beside it, then
renamed), so a process killed while storing leaves no half entry, and two processes
storing the same key at once leave one.  Taking one copies it (hard links where the
file system allows, so a 130 MB application costs no space twice); nothing ever writes
into an entry after it is stored.  Only the `BuildCache.keep` newest entries (by the
time they were stored or last taken) are kept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuildCache", "install"]


def install(staging: Path, target: Path) -> None:
    """Put the complete build folder `staging` in place of `target` (renames only: the old
    one is moved aside first, then removed; `staging` must be on `target`'s file system)."""
    old = target.with_name(f"{target.name}-old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(source: str, target: str) -> None:
    """Hard-link `source` at `target`; copy it where links cannot be made (another file
    system, a file system without them)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@dataclass(frozen=True, slots=True)
class BuildCache:
    """The builds of one kind (``root``), the newest `keep` of them."""

    root: Path
    keep: int = 4

    def entry(self, key: str) -> Path:
        return self.root / key

    def take(self, key: str, target: Path) -> bool:
        """Put a copy of the entry of `key` at `target` (which must not exist); False if the
        cache has none."""
        entry = self.entry(key)
        if not entry.is_dir():
            return False
        shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        with contextlib.suppress(OSError):
            os.utime(entry)  # (the newest are kept)
        return True

    def store(self, source: Path, key: str) -> None:
        """Keep a copy of the finished build at `source` as the entry of `key` (unless there is
        one), then drop all but the newest `keep` entries.  `OSError` if it cannot be written."""
        entry = self.entry(key)
        if entry.exists():
            return
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        scratch = self.root / f".{key}-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(source, scratch, symlinks=True, copy_function=_link_or_copy)
        try:
            scratch.rename(entry)
        except OSError:  # another process stored the same build meanwhile
            shutil.rmtree(scratch, ignore_errors=True)
        self._trim()

    def store_or_say(self, source: Path, key: str, say: Callable[[str], None], what: str) -> None:
        """`store`, or say why `what` is not kept: a build that cannot be kept is still a
        build, so the caller goes on with it."""
        try:
            self.store(source, key)
        except OSError as exc:
            say(f"{what} not kept in {self.root}: {exc}")

    def _trim(self) -> None:
        entries = sorted(
            (p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for old in entries[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
