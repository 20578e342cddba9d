"""streamtally: exact per-request token records, usage and billing from LLM token streams."""

from pathlib import Path

from streamtally import _native

__version__ = "0.1.0"

#: The folders of the package that a clone links to its top-level folders
#: (docs/architecture.md, "One import root"); in a wheel they are plain folders.
LINKED: tuple[str, ...] = ("topics", "processors", "producers", "_schemas")


def _check_links(package: Path) -> None:
    """Stop with what to do when a checkout wrote the links as files (no symlink support)."""
    broken = [name for name in LINKED if (package / name).is_file()]
    if broken:
        raise ImportError(
            f"streamtally/{', streamtally/'.join(broken)} must be links to the top-level "
            "folders of the clone, but this checkout made them plain files (git without "
            "symlink support): clone again with symlinks on (`git config --global "
            "core.symlinks true`; on Windows with Developer Mode), or install the wheel"
        )


_check_links(Path(__file__).parent)
# First, before any other module of the package: the compiled hot path, if built and fresh.
_native.activate()
