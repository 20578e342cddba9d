"""What every section of the settings shares: how a field names its variable."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from pydantic import AliasChoices

__all__ = ["LOCAL_HOST", "env", "expanded"]

LOCAL_HOST: Final = "127.0.0.1"


def env(name: str, field: str) -> AliasChoices:
    """Read from the environment variable `name`; built in code by the field's own name."""
    return AliasChoices(field, name)


def expanded(path: Path | None) -> Path | None:
    return None if path is None else path.expanduser()
