"""The record of the corrections topic: one `BillingCorrection` per discrepancy an audit corrected.

Written only by ``streamtally audit --correct`` (`streamtally.audit`), never by the
worker, and never instead of a billing event: the billing topic is kept as it was
written, and a correction says which of its events it supersedes.  A billing consumer
applies a correction with replace semantics, so applying one twice, or two corrections of
one request from one audit (one per differing field), changes nothing more:

- `superseded_event_id` set, `corrected` set: what was billed under that id (from the
  billing events below `billing_before`) is replaced by `corrected`;
- `superseded_event_id` set, `corrected` None: that bill is withdrawn (an unexpected bill);
- `superseded_event_id` None, `corrected` set: `corrected` is billed (a missing bill);
- `request_id` None: a usage row was corrected in Redis; the usage fields, `requests` and
  `cost` are the whole row's corrected values (informational for a billing consumer).

`CorrectionLog` keeps, per event id, the correction that decides it.  How corrections
combine with the worker's revisions of a bill (BillingEvent v5) into the one bill that
stands per request is the rule of `streamtally.wire.ledger` (`BillingLedger`).

This module does not import fastavro (`streamtally.wire.avro` encodes and decodes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime
from decimal import Decimal
from types import MappingProxyType
from typing import Final

from streamtally.core.models import USAGE_FIELDS
from streamtally.core.money import scaled_cost
from streamtally.wire.records import BillingEvent

__all__ = ["CORRECTION_REASONS", "BillingCorrection", "CorrectionLog"]

#: The discrepancy kinds a correction can be for (`streamtally.audit.Kind` values).
CORRECTION_REASONS: Final = frozenset(
    {
        "missing_billing",
        "unexpected_billing",
        "conflicting_billing",
        "usage_mismatch",
        "cost_mismatch",
        "provenance_mismatch",
        "usage_row_mismatch",
        "unbilled_amendment",
    }
)
_HEX: Final = frozenset("0123456789abcdef")


def _is_id(text: str) -> bool:
    return len(text) == 32 and _HEX.issuperset(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class BillingCorrection:
    """One correction (value of ``<namespace>.billing.corrections``; see the module docstring)."""

    correction_id: str
    audit_id: str
    reason: str
    field: str | None = None
    tenant: str
    request_id: str | None = None
    model: str | None = None
    day: str | None = None
    #: The discrepancy's expected and found values as JSON text (None: absent).
    expected: str | None = None
    found: str | None = None
    superseded_event_id: str | None = None
    #: Billing partition -> its end offset at the audit's snapshot.
    billing_before: Mapping[int, int] = dataclass_field(
        default_factory=lambda: MappingProxyType({})
    )
    corrected: BillingEvent | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    requests: int = 0
    cost: Decimal = Decimal(0)
    currency: str = "USD"
    created_at: datetime

    def __post_init__(self) -> None:
        for name in ("correction_id", "audit_id"):
            if not _is_id(getattr(self, name)):
                raise ValueError(f"{name} must be 32 lower-case hex digits")
        if self.reason not in CORRECTION_REASONS:
            raise ValueError(f"unknown correction reason {self.reason!r}")
        if not self.tenant:
            raise ValueError("tenant must not be empty")
        row = self.request_id is None
        if row and (self.day is None or self.corrected is not None):
            raise ValueError("a usage row correction names its day and carries no bill")
        if not row and self.day is not None:
            raise ValueError("a request correction names no day")
        if self.superseded_event_id is None and self.corrected is None and not row:
            raise ValueError("a request correction supersedes a bill, or carries one")
        for name in (*USAGE_FIELDS, "requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        scaled_cost(self.cost)
        for partition, offset in self.billing_before.items():
            if partition < 0 or offset < 0:
                raise ValueError("billing_before holds partitions and offsets >= 0")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")

    def supersedes(self, event_id: str, partition: int, offset: int) -> bool:
        """Whether the billing event `event_id` at (`partition`, `offset`) is superseded."""
        return event_id == self.superseded_event_id and self.covers(partition, offset)

    def covers(self, partition: int, offset: int) -> bool:
        """Whether the audit saw the billing record at (`partition`, `offset`): below
        `billing_before` (a record at or past it was written after the audit)."""
        return offset < self.billing_before.get(partition, 0)

    @property
    def names(self) -> str | None:
        """The event id this correction decides: `superseded_event_id`, or for a missing
        bill its `corrected` bill's id; None for a usage row correction."""
        if self.superseded_event_id is not None:
            return self.superseded_event_id
        return None if self.corrected is None else self.corrected.event_id


class CorrectionLog:
    """The corrections of a corrections topic read so far, as a billing consumer applies them.

    Add them in topic order (`add`); then a billing event is `superseded` when the latest
    correction of its event id says so, and `standing` are the bills the corrections
    put in place of what they superseded (revisions aside: `BillingLedger` applies both).
    Usage row corrections (no request) carry no bill and are only counted.
    """

    def __init__(self) -> None:
        self._latest: dict[str, BillingCorrection] = {}
        #: Corrections added, and of those the usage row ones.
        self.records = 0
        self.rows = 0

    def add(self, correction: BillingCorrection) -> None:
        self.records += 1
        event_id = correction.names
        if event_id is None:
            self.rows += 1
            return
        self._latest[event_id] = correction  # a later correction replaces an earlier one

    def superseded(self, event: BillingEvent, partition: int, offset: int) -> bool:
        """Whether the billing event at (`partition`, `offset`) is superseded by a correction."""
        latest = self._latest.get(event.event_id)
        return latest is not None and latest.covers(partition, offset)

    def latest(self, event_id: str) -> BillingCorrection | None:
        """The correction that decides `event_id` (the latest naming it), if any."""
        return self._latest.get(event_id)

    def decided(self) -> Mapping[str, BillingCorrection]:
        """Event id -> the correction that decides it (read-only view)."""
        return MappingProxyType(self._latest)

    def standing(self) -> list[BillingEvent]:
        """The bills that stand by correction (each event id's latest), in no set order."""
        return [c.corrected for c in self._latest.values() if c.corrected is not None]

    def corrected(self, event_id: str) -> bool:
        """Whether a correction names `event_id`."""
        return event_id in self._latest

    def __len__(self) -> int:
        return len(self._latest)
