"""The compiled hot path: the per-record modules, built with mypyc, used only while fresh.

The worker spends most of its time in a few pure-Python modules (`MODULES`:
the adapters, the fold, the normaliser, the raw decoders and the chunk
writer); the tap and its sender in the raw writer and the spool's frames.
``streamtally native build`` (run by ``make setup``;
`streamtally.ops.native`) compiles the very same sources with mypyc into C
extensions under ``streamtally/.native/``, with a manifest naming the
Python they were built for and a digest of every ``.py`` file of the package.

`activate` runs once, first thing when `streamtally` is imported.  It puts
the compiled modules in front of the sources (a meta path finder for exactly
those names) only when the manifest matches this interpreter and the digest
of the sources now: after any edit, checkout or pull the package runs as
plain Python until it is built again, so a compiled module is never older
than its source.  ``STREAMTALLY_NATIVE=off`` turns it off.  There is one
implementation either way: the tests run on whichever is active, and
`tests/unit/processors/test_native.py` checks that both fold alike.

This module uses the standard library only (it runs before anything else).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = [
    "BUILD_DIR",
    "ENV_NATIVE",
    "MANIFEST",
    "MODULES",
    "OFF_WORDS",
    "PACKAGE_DIR",
    "Status",
    "activate",
    "check_build",
    "python_tag",
    "source_digest",
    "status",
]

#: The modules compiled, each an import name under `streamtally`.
MODULES: Final = (
    "streamtally.core.adapters.anthropic",
    "streamtally.core.adapters.base",
    "streamtally.core.adapters.engines",
    "streamtally.core.adapters.finish",
    "streamtally.core.adapters.gemini",
    "streamtally.core.adapters.openai",
    "streamtally.core.adapters.openai_responses",
    "streamtally.core.adapters.usage",
    "streamtally.core.fold",
    "streamtally.core.normalize",
    "streamtally.core.sse",
    "streamtally.processors._records",
    "streamtally.processors.clock",
    "streamtally.processors.closing",
    "streamtally.processors.commits",
    "streamtally.processors.folding",
    "streamtally.processors.refusals",
    "streamtally.processors.requests",
    "streamtally.processors.sequencing",
    "streamtally.processors.table",
    "streamtally.producers.spool_frames",
    "streamtally.wire.avro._chunk_writer",
    "streamtally.wire.avro._codec",
    "streamtally.wire.avro._decoders",
    "streamtally.wire.avro._raw_readers",
    "streamtally.wire.avro._raw_writer",
    "streamtally.wire.provenance",
)
#: ``off`` (or ``0``, ``no``, ``false``): run the sources even when a fresh build exists.
ENV_NATIVE: Final = "STREAMTALLY_NATIVE"
PACKAGE_DIR: Final = Path(__file__).resolve().parent
#: Where ``streamtally native build`` puts the extensions and the manifest.
BUILD_DIR: Final = PACKAGE_DIR / ".native"
MANIFEST: Final = "manifest.json"
#: The values that turn a switch of the compiled hot path off (``STREAMTALLY_NATIVE``, and
#: ``STREAMTALLY_NATIVE_CACHE`` in `streamtally.settings`).
OFF_WORDS: Final = frozenset({"off", "0", "no", "false"})


@dataclass(frozen=True, slots=True)
class Status:
    """Whether the compiled modules are in use, and if not, why not."""

    active: bool
    reason: str
    modules: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.active:
            return f"compiled ({len(self.modules)} modules built with mypyc)"
        return f"plain Python ({self.reason})"


#: What `activate` found (one slot, replaced whole).
_found: list[Status] = [Status(False, "not activated")]


def status() -> Status:
    """What `activate` found when the package was imported."""
    return _found[0]


def python_tag() -> str:
    """The interpreter the extensions must have been built for: the suffix of its extension
    modules (implementation, version, ABI and platform: ``.cpython-311-x86_64-linux-gnu.so``)."""
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """SHA-256 over every ``.py`` file of the package (linked folders included): its path
    and its bytes, in path order.  Any change to any source changes it."""
    files: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(package_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        here = Path(folder)
        files += [
            ((here / n).relative_to(package_dir).as_posix(), here / n)
            for n in names
            if n.endswith(".py")
        ]
    digest = hashlib.sha256()
    for relative, path in sorted(files):
        digest.update(relative.encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds exactly the compiled modules (and mypyc's shared library), nothing else."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self._files = dict(files)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        del path, target  # a top-level name or not, the file is known by its full name
        file = self._files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def check_build(build_dir: Path, package_dir: Path) -> tuple[str | None, dict[str, Path]]:
    """(None, the files to load) for a fresh build; (why not, {}) otherwise."""
    try:
        manifest = json.loads((build_dir / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "not built: run `streamtally native build` (make setup does)", {}
    except (OSError, ValueError) as exc:
        return f"unreadable build manifest ({exc}): run `streamtally native build`", {}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "malformed build manifest: run `streamtally native build`", {}
    if manifest.get("python") != python_tag():
        return f"built for {manifest.get('python')}, not {python_tag()}: build again", {}
    if tuple(manifest.get("modules", ())) != MODULES:
        return "built for another list of modules: build again", {}
    if manifest.get("sources") != source_digest(package_dir):
        return "the sources changed since the build: run `streamtally native build`", {}
    files = {str(name): build_dir / str(file) for name, file in manifest["files"].items()}
    missing = sorted(name for name, file in files.items() if not file.is_file())
    if missing or not set(MODULES) <= set(files):
        return f"incomplete build (missing {', '.join(missing) or 'modules'}): build again", {}
    return None, files


def activate(
    build_dir: Path = BUILD_DIR,
    package_dir: Path = PACKAGE_DIR,
    environ: Mapping[str, str] = os.environ,
) -> Status:
    """Use the compiled modules if the build is fresh (see the module docstring)."""
    _found[0] = found = _activate(build_dir, package_dir, environ)
    return found


def _activate(build_dir: Path, package_dir: Path, environ: Mapping[str, str]) -> Status:
    if environ.get(ENV_NATIVE, "").strip().lower() in OFF_WORDS:
        return Status(False, f"{ENV_NATIVE}={environ[ENV_NATIVE]}")
    if any(isinstance(f, _CompiledFinder) for f in sys.meta_path):
        return _found[0]  # activated already
    early = sorted(name for name in MODULES if name in sys.modules)
    if early:
        return Status(False, f"imported before activation: {', '.join(early)}")
    reason, files = check_build(build_dir, package_dir)
    if reason is not None:
        return Status(False, reason)
    sys.meta_path.insert(0, _CompiledFinder(files))
    return Status(True, "fresh build", MODULES)
