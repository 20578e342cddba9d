"""What a rebuild handles: Tokens records as read, requests to write, and those left out.

`TokensRecord` is one record of the Tokens topic, `Request` one request to
write (its Tokens and its billing event), `Skipped` one left out with its
`SkipReason`.  How they are made is in the package docstring
(`streamtally.ops.rebuild`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from streamtally.core.identity import RequestRef
from streamtally.core.models import Tokens
from streamtally.wire.records import BillingEvent


class SkipReason(StrEnum):
    """Why a request was not rebuilt."""

    NO_BILLING = "tokens without billing event"
    NO_TOKENS = "billing event without tokens"
    DELETED = "deleted (tombstone on the tokens topic)"
    MISMATCH = "billing event does not match tokens"
    CONFLICT = "several distinct billing events"
    AMBIGUOUS = "v1 tokens record, several tenants billed this id"
    UNDECODABLE = "record does not decode"
    REFUSED = "refused by the sink"


@dataclass(frozen=True, slots=True)
class Skipped:
    """A request the rebuild left out, and why.

    `request_id` is None for a record whose request is unknown (no usable
    key); `tenant` is None when the request's tenant is unknown (a v1 Tokens
    record, keyed by the request id alone, that no single tenant's billing
    event claims).
    """

    request_id: str | None
    reason: SkipReason
    detail: str = ""
    tenant: str | None = None

    @classmethod
    def of(cls, ref: RequestRef, reason: SkipReason, detail: str = "") -> Skipped:
        """The request `ref` skipped for `reason`."""
        return cls(ref.request_id, reason, detail, ref.tenant)

    @property
    def ref(self) -> RequestRef | None:
        """The skipped request, when both its tenant and its request id are known."""
        if self.request_id is None or self.tenant is None:
            return None
        return RequestRef(self.tenant, self.request_id)


@dataclass(frozen=True, slots=True)
class TokensRecord:
    """One Tokens topic record, in topic order: its key and the Tokens, a tombstone or bad bytes."""

    #: The record's key as text: `RequestRef.text` (v2), or the request id alone (v1).
    key: str
    #: None for a tombstone, or when the record did not decode (`error` then says why).
    tokens: Tokens | None = None
    error: str | None = None
    #: Where the record is (``topic[partition]@offset``), for messages; "" when not known.
    where: str = ""


@dataclass(frozen=True, slots=True)
class Request:
    """One request to write: its latest Tokens and its billing event (whose tenant it is)."""

    tokens: Tokens
    billing: BillingEvent

    @property
    def ref(self) -> RequestRef:
        """The request: the billing event's tenant and the request id."""
        return RequestRef(self.billing.tenant, self.tokens.request_id)
