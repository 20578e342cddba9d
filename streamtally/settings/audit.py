"""The audit: how far a provider's usage report may differ and still match (docs/audit.md)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from streamtally.settings._base import env

__all__ = ["AuditSection"]


class AuditSection(BaseModel):
    """The audit's settings (a section of `Settings`)."""

    #: ``audit --provider-usage``: how far the provider's counts and the ledger's may differ
    #: and still match, ``rel=0.001,tokens=2000,requests=2`` (``--provider-tolerance``
    #: wins; `streamtally.audit.provider_usage.Tolerance`); none: exact.
    provider_tolerance: str | None = Field(
        None, validation_alias=env("STREAMTALLY_PROVIDER_TOLERANCE", "provider_tolerance")
    )
