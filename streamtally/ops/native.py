"""``streamtally native build``: compile the hot modules (`streamtally._native.MODULES`) with mypyc.

The build runs in a child process (mypy's analysis and the C compiler's
output stay out of the caller; its log is kept beside the build), into a
fresh folder that replaces ``streamtally/.native`` only once it is complete,
with its manifest: the interpreter it was built for and the digest of the
sources it was built from (`streamtally._native` checks both before it loads
anything).  The digest is taken before and after the build; sources edited
meanwhile fail it, rather than ship a build of sources that no longer exist.

Needs mypyc (part of mypy, in the dev extras), setuptools and a C compiler;
without them the package runs as plain Python, only slower.

A finished build is also kept in a cache (``$XDG_CACHE_HOME/streamtally/native``, or
``STREAMTALLY_NATIVE_CACHE``; ``off``: none; `Settings.native_cache`), under a key of
everything it was built from: the sources' digest, the interpreter, mypy's version, the
list of modules and the C compiler.  A clone whose sources equal an earlier build's
takes that build instead of compiling for a minute (a fresh clone of an unchanged commit,
a CI run); any other change builds anew.  The build taken is checked as any build is
(`check_build`), and the cache keeps the newest `CACHE_KEEP` builds.

Also runnable on its own: ``python -m streamtally.ops.native BUILD_DIR`` is
the child (it writes the extensions to ``BUILD_DIR/lib``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from streamtally._native import (
    BUILD_DIR,
    MANIFEST,
    MODULES,
    PACKAGE_DIR,
    check_build,
    python_tag,
    source_digest,
)
from streamtally.errors import NativeBuildError
from streamtally.ops.build_cache import BuildCache, install

__all__ = [
    "CACHE_KEEP",
    "GROUP",
    "BuildResult",
    "NativeBuildError",
    "build",
    "cache_key",
    "fresh",
]

#: The name of mypyc's shared library of the build (one module, at the top level).
GROUP: Final = "streamtally_native"
_LOG: Final = "build.log"
#: Kept beside the package (the same file system, so the swap is a rename).
_STAGING: Final = ".native-staging"
#: The builds the cache keeps (the newest by the time they were stored or taken).
CACHE_KEEP: Final = 4
#: mypyc's optimisation level for the C compiler (part of the cache key).
_OPT_LEVEL: Final = "3"


@dataclass(frozen=True, slots=True)
class BuildResult:
    built: bool  # False: the existing build was fresh
    seconds: float
    modules: tuple[str, ...]
    build_dir: Path
    cached: Path | None = None  # the cached build taken instead of compiling


def cache_key(digest: str) -> str:
    """The cache key of a build of the sources of `digest` here: everything it depends on."""
    parts = [python_tag(), _mypy_version(), digest, _OPT_LEVEL, _compiler() or "", *MODULES]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _take_cached(cache: BuildCache, key: str, staging: Path, package_dir: Path) -> bool:
    """Copy the cached build of `key` to `staging` if it is a fresh build of `package_dir`."""
    reason, _ = check_build(cache.entry(key), package_dir)
    if reason is not None:
        return False
    shutil.rmtree(staging, ignore_errors=True)
    return cache.take(key, staging)


def fresh(build_dir: Path = BUILD_DIR, package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether the build in `build_dir` matches this interpreter and these sources."""
    reason, _ = check_build(build_dir, package_dir)
    return reason is None


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    return shutil.which(cc[0]) if cc else None


def build(
    *,
    force: bool = False,
    progress: Callable[[str], None] = print,
    cache: Path | None = None,
) -> BuildResult:
    """Build the package's compiled modules into `BUILD_DIR` unless a fresh build is there
    (or `force`); take the build of the same sources from the folder `cache` when it holds
    one (unless `force`), and keep a new build there (None: no cache)."""
    build_dir, package_dir = BUILD_DIR, PACKAGE_DIR
    started = time.perf_counter()
    if not force and fresh(build_dir, package_dir):
        return BuildResult(False, 0.0, MODULES, build_dir)
    if _compiler() is None:
        raise NativeBuildError(
            "no C compiler found (install gcc, or Debian's build-essential); "
            "streamtally runs as plain Python"
        )
    try:
        import mypyc.build  # noqa: F401 - only whether it is there
        import setuptools  # noqa: F401
    except ImportError as exc:
        raise NativeBuildError(
            f"{exc.name} is missing: install the dev extras (pip install -e '.[dev]'); "
            "streamtally runs as plain Python"
        ) from None
    digest = source_digest(package_dir)
    staging = build_dir.parent / _STAGING
    kept = None if cache is None else BuildCache(cache, keep=CACHE_KEEP)
    key = "" if kept is None else cache_key(digest)
    if not force and kept is not None and _take_cached(kept, key, staging, package_dir):
        install(staging, build_dir)
        seconds = time.perf_counter() - started
        return BuildResult(True, seconds, MODULES, build_dir, kept.entry(key))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log = staging / _LOG
    progress(f"compiling {len(MODULES)} modules with mypyc (log: {log}) …")
    with log.open("wb") as out:
        child = subprocess.run(
            [sys.executable, "-m", "streamtally.ops.native", str(staging)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=package_dir.parent,
            check=False,
        )
    if child.returncode != 0:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        errors = [line for line in lines if ": error:" in line] or lines[-1:]
        raise NativeBuildError(
            f"the mypyc build failed (exit {child.returncode}): "
            + " | ".join(errors[:3])
            + f"; the whole log: {log}"
        )
    if source_digest(package_dir) != digest:
        raise NativeBuildError("the sources changed during the build: run it again")
    files = _built_files(staging / "lib")
    manifest = {
        "format": 1,
        "python": python_tag(),
        "modules": list(MODULES),
        "sources": digest,
        "mypy": _mypy_version(),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "files": {name: f"lib/{path}" for name, path in files.items()},
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    for scratch in ("c", "obj"):  # the generated C and the objects: not needed to run
        shutil.rmtree(staging / scratch, ignore_errors=True)
    if kept is not None:
        kept.store_or_say(staging, key, progress, "the build")
    install(staging, build_dir)
    seconds = time.perf_counter() - started
    return BuildResult(True, seconds, MODULES, build_dir)


def _built_files(lib: Path) -> dict[str, str]:
    """Import name -> path under `lib` of every module built, mypyc's library included."""
    suffix = python_tag()
    files: dict[str, str] = {}
    for name in MODULES:
        relative = name.replace(".", "/") + suffix
        if not (lib / relative).is_file():
            raise NativeBuildError(f"the build made no {relative}")
        files[name] = relative
    shared = sorted(p.name for p in lib.glob(f"*__mypyc{suffix}"))
    if len(shared) != 1:
        raise NativeBuildError(f"expected one mypyc library in {lib}, found {shared}")
    files[shared[0].removesuffix(suffix)] = shared[0]
    return files


def _mypy_version() -> str:
    from mypy.version import __version__

    return str(__version__)


def _child(staging: Path) -> None:
    """Generate the C sources and compile them into `staging/lib` (run as the child)."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    paths = [str(PACKAGE_DIR / (name.removeprefix("streamtally.").replace(".", "/") + ".py"))
             for name in MODULES]  # fmt: skip
    extensions = mypycify(
        paths, target_dir=str(staging / "c"), group_name=GROUP, opt_level=_OPT_LEVEL
    )
    dist = Distribution({"name": "streamtally-native", "ext_modules": extensions})
    command: Any = dist.get_command_obj("build_ext")  # setuptools' build_ext
    command.build_lib = str(staging / "lib")
    command.build_temp = str(staging / "obj")
    command.parallel = os.cpu_count() or 1
    dist.run_command("build_ext")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m streamtally.ops.native STAGING_DIR")
    _child(Path(sys.argv[1]))
