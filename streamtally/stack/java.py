"""Finding a Java of a given version for the stack's JVM services.

The candidates, in order: an explicit choice (a ``java`` binary or a Java home,
e.g. ``STREAMTALLY_REGISTRY_JAVA``), ``$JAVA_HOME``, ``java`` on ``PATH``, then
every ``/usr/lib/jvm/*`` (newest version first).  The first one of at least the
version asked for wins; an explicit choice is the only candidate when given, so
that a wrong one is an error and not silently passed over.

``-version`` is asked once per binary (a JVM start: ~0.1 s); `find_java` takes
the function that asks, so that tests need no JVM.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from streamtally.errors import StackError

__all__ = ["JVM_DIR", "Java", "candidates", "find_java", "java_major", "parse_major"]

#: Where Debian (and Temurin's .deb) put Java homes.
JVM_DIR: Final = Path("/usr/lib/jvm")
_VERSION: Final = re.compile(r'version "(\d+)(?:\.(\d+))?')
_VERSION_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class Java:
    """A ``java`` binary, its major version, and its home (what ``JAVA_HOME`` names)."""

    java: Path
    major: int

    @property
    def home(self) -> Path:
        """The Java home: ``<home>/bin/java``, symbolic links (``/usr/bin/java``) followed."""
        return self.java.resolve().parent.parent

    @property
    def has_compiler(self) -> bool:
        """A JDK (``javac`` beside ``java``), not a runtime only: Maven compiles with it."""
        return (self.java.resolve().parent / "javac").is_file()


def parse_major(version_output: str) -> int | None:
    """The major version in ``java -version``'s output (``1.8.0_x`` is 8), or None."""
    match = _VERSION.search(version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1:
        major = int(match.group(2) or 0)
    return major


def java_major(java: Path) -> int | None:
    """The major version of the ``java`` binary `java` (None: it does not run or say)."""
    try:
        result = subprocess.run(
            [str(java), "-version"],
            capture_output=True,
            text=True,
            check=False,
            timeout=_VERSION_TIMEOUT_S,
        )
    except OSError:
        return None
    return parse_major(result.stderr + result.stdout)


def _binary(path: Path) -> Path:
    """``java`` itself, or ``<path>/bin/java`` when `path` is a Java home."""
    return path / "bin" / "java" if path.is_dir() else path


def _jvm_dir_candidates(jvm_dir: Path) -> list[Path]:
    """``<jvm_dir>/*/bin/java``, highest version number in the folder name first."""

    def number(home: Path) -> int:
        digits = re.search(r"(\d+)", home.name)
        return int(digits.group(1)) if digits else 0

    try:
        homes = [p for p in jvm_dir.iterdir() if (p / "bin" / "java").is_file()]
    except OSError:
        return []
    homes.sort(key=lambda p: (-number(p), p.name))
    return [home / "bin" / "java" for home in homes]


def candidates(environ: Mapping[str, str], jvm_dir: Path = JVM_DIR) -> list[Path]:
    """``$JAVA_HOME/bin/java``, ``java`` on ``PATH``, ``<jvm_dir>/*/bin/java``: each once."""
    found: list[Path] = []
    java_home = environ.get("JAVA_HOME", "").strip()
    if java_home:
        found.append(Path(java_home) / "bin" / "java")
    on_path = shutil.which("java", path=environ.get("PATH", ""))
    if on_path is not None:
        found.append(Path(on_path))
    found += _jvm_dir_candidates(jvm_dir)
    unique: list[Path] = []
    seen: set[Path] = set()
    for path in found:
        real = path.resolve()
        if real not in seen:
            seen.add(real)
            unique.append(path)
    return unique


def find_java(
    minimum: int,
    *,
    what: str,
    hint: str,
    override: Path | None = None,
    override_name: str = "",
    environ: Mapping[str, str],
    jvm_dir: Path = JVM_DIR,
    need_compiler: bool = False,
    version_of: Callable[[Path], int | None] = java_major,
) -> Java:
    """The first Java of version `minimum` or later (a JDK if `need_compiler`).

    `environ` gives ``JAVA_HOME`` and ``PATH``; `override` (a ``java`` or a Java home,
    set by `override_name`) is then the only candidate.  Errors say what `what` needs
    and how to get it (`hint`).
    """
    if override is not None:
        java = _binary(override.expanduser())
        major = version_of(java) if java.is_file() else None
        if major is None:
            raise StackError(
                f"{override_name}={override}: no java runs there; {what} needs a Java "
                f"{minimum}+: {hint}"
            )
        found = Java(java, major)
        if major < minimum:
            raise StackError(
                f"{override_name}={override} is Java {major}; {what} needs {minimum}+: {hint}"
            )
        if need_compiler and not found.has_compiler:
            raise StackError(
                f"{override_name}={override} is a Java runtime without javac; {what} needs "
                f"a JDK: {hint}"
            )
        return found
    seen = []
    for path in candidates(environ, jvm_dir):  # asked one by one: each answer starts a JVM
        major = version_of(path)
        if major is None:
            continue
        found = Java(path, major)
        if major >= minimum and (found.has_compiler or not need_compiler):
            return found
        seen.append(found)
    kind = "JDK" if need_compiler else "Java"
    listed = ", ".join(f"{j.java} ({j.major})" for j in seen) or "none"
    override_note = f", or point {override_name} at one" if override_name else ""
    raise StackError(f"{what} needs a {kind} {minimum}+; found {listed}: {hint}{override_note}")
