"""The tap and its producers: the key their records are signed with (docs/tenants.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from streamtally.settings._base import env

__all__ = ["TapSection"]


class TapSection(BaseModel):
    """The tap's settings (a section of `Settings`)."""

    #: The key file `streamtally produce` signs its records with (``--key-file`` wins).
    producer_key_path: Path | None = Field(
        None, validation_alias=env("STREAMTALLY_PRODUCER_KEY", "producer_key_path")
    )
