"""The usage API of `streamtally api`: its tokens file (docs/api.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from streamtally.settings._base import env

__all__ = ["ApiSection"]


class ApiSection(BaseModel):
    """The API's settings (a section of `Settings`)."""

    #: The tokens file of `streamtally api` (`streamtally.api.auth`): each bearer token's
    #: SHA-256 and the tenant it reads, or the operator role (``--tokens`` wins).
    api_tokens_path: Path | None = Field(
        None, validation_alias=env("STREAMTALLY_API_TOKENS", "api_tokens_path")
    )
