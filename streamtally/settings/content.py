"""The content policy: what the worker keeps of the text downstream (`streamtally.core.content`;
docs/content-policy.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, model_validator

from streamtally.settings._base import env

__all__ = ["ContentSection"]


class ContentSection(BaseModel):
    """The content policy settings (a section of `Settings`)."""

    #: What the worker keeps of text, reasoning and tool arguments in Redis and on the
    #: chunks, Tokens and dead-letter topics: ``full``, ``redacted`` (length and keyed
    #: hash) or ``none`` (length only).  Billing is the same under every policy.
    content: str = Field(
        "full",
        pattern=r"^(full|redacted|none)$",
        validation_alias=env("STREAMTALLY_CONTENT", "content"),
    )
    #: The file holding the HMAC key of ``redacted`` (hex or base64, at least 32 bytes;
    #: read by the worker, never printed).  Required with ``redacted``.
    content_key_path: Path | None = Field(
        None, validation_alias=env("STREAMTALLY_CONTENT_KEY", "content_key_path")
    )
    #: Whether the worker writes the chunks topic (``off``: no chunk leaves the worker).
    chunks_topic: bool = Field(True, validation_alias=env("STREAMTALLY_CHUNKS", "chunks_topic"))

    @model_validator(mode="after")
    def _content_key_given(self) -> Self:
        if self.content == "redacted" and self.content_key_path is None:
            raise ValueError(
                "STREAMTALLY_CONTENT=redacted needs STREAMTALLY_CONTENT_KEY, "
                "the file holding the key of its HMAC"
            )
        return self
