"""The comparison of billing events, as pure functions, and what a discrepancy is.

A billing event is compared on `EVENT_FIELDS` (every field but `event_id`, its key, and
`price_table_version`: the replay prices with the settings' table, see the package
docstring).  A difference in `COST_FIELDS` is a ``cost_mismatch``, in
`PROVENANCE_FIELDS` a ``provenance_mismatch``, in any other field a ``usage_mismatch``;
each `Discrepancy` names one field.  Token counts and offsets are JSON numbers, costs
decimal strings with 12 places.  Usage rows are compared in `_rows`.

Provenance (BillingEvent v3: raw topic, partition, first and last offset, `raw_sha256`,
`usage_source`) is compared only when the billing event carries it: an event written
before v3 reads `usage_source` "unknown" and no provenance, which is no mismatch.  Its
digest then covers the other fields alone (`event_digest`), which is what the ledger
also tries (`legacy_digest`) before calling it a mismatch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from enum import StrEnum
from typing import Any, Final

from streamtally.core.models import USAGE_FIELDS
from streamtally.core.money import scaled_cost
from streamtally.wire.records import BillingEvent

__all__ = [
    "COST_FIELDS",
    "EVENT_FIELDS",
    "PROVENANCE_FIELDS",
    "Discrepancy",
    "Kind",
    "billing_discrepancies",
    "event_digest",
    "event_key",
    "event_values",
    "legacy_digest",
    "missing_billing",
    "unexpected_billing",
]

#: The fields of a billing event the audit compares, in report order.
EVENT_FIELDS: Final = (
    "request_id",
    "tenant",
    "model",
    "source",
    "finish_reason",
    *USAGE_FIELDS,
    "cost",
    "priced",
    "currency",
    "event_time",
    "raw_topic",
    "raw_partition",
    "first_offset",
    "last_offset",
    "raw_sha256",
    "usage_source",
)
#: Fields whose difference is a ``cost_mismatch``.
COST_FIELDS: Final = frozenset({"cost", "priced", "currency"})
#: Fields whose difference is a ``provenance_mismatch``, compared only when the billing
#: event carries provenance (BillingEvent v3; any other difference: ``usage_mismatch``).
PROVENANCE_FIELDS: Final = (
    "raw_topic",
    "raw_partition",
    "first_offset",
    "last_offset",
    "raw_sha256",
    "usage_source",
)


class Kind(StrEnum):
    """What a discrepancy is."""

    MISSING_BILLING = "missing_billing"
    UNEXPECTED_BILLING = "unexpected_billing"
    CONFLICTING_BILLING = "conflicting_billing"
    USAGE_MISMATCH = "usage_mismatch"
    COST_MISMATCH = "cost_mismatch"
    PROVENANCE_MISMATCH = "provenance_mismatch"
    USAGE_ROW_MISMATCH = "usage_row_mismatch"
    #: Records after a close at the request's timeout (or over a gap) changed its bill in
    #: the replay, but no billing event of that revision exists: they were dead-lettered
    #: instead of amending it (its amendable state had expired, or a worker of before
    #: amendments read them).  A missing bill of its own kind: billable records, unbilled.
    UNBILLED_AMENDMENT = "unbilled_amendment"
    #: ``--provider-usage``: the provider's usage report and the bills that stand differ in
    #: a (day, model, tenant) beyond the tolerance (`streamtally.audit.provider_usage`);
    #: `expected` is the provider's count, `found` the ledger's.  Never corrected.
    PROVIDER_USAGE_MISMATCH = "provider_usage_mismatch"


@dataclass(frozen=True, slots=True)
class Discrepancy:
    """One difference: a request's billing (`day` None) or a usage row (`request_id` None)."""

    kind: Kind
    request_id: str | None
    tenant: str
    model: str | None
    day: str | None
    field: str | None
    expected: Any
    found: Any
    #: The billing event id the discrepancy is about (the replay's, or the unexpected
    #: event's); None for a usage row.  Not part of the report: what a correction names.
    event_id: str | None = dataclass_field(default=None, compare=False)

    def sort_key(self) -> tuple[str, ...]:
        return (
            self.tenant,
            self.day or "",
            self.request_id or "",
            self.model or "",
            self.kind.value,
            self.field or "",
            json.dumps(self.found),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "day": self.day,
            "field": self.field,
            "expected": self.expected,
            "found": self.found,
        }


def _cost(value: Any) -> str:
    return format(scaled_cost(value), "f")


def event_values(event: BillingEvent, *, provenance: bool = True) -> dict[str, Any]:
    """The compared fields of `event` as JSON values (counts numbers, the cost a string).

    The `PROVENANCE_FIELDS` are there only when the event carries provenance
    (`BillingEvent.has_provenance`) and `provenance` is true.
    """
    values = {
        "request_id": event.request_id,
        "tenant": event.tenant,
        "model": event.model,
        "source": event.source.value,
        "finish_reason": event.finish_reason.value,
        **event.usage_counts(),
        "cost": _cost(event.cost),
        "priced": event.priced,
        "currency": event.currency,
        "event_time": event.event_time.isoformat(),
    }
    if provenance and event.has_provenance:
        values.update(
            raw_topic=event.raw_topic,
            raw_partition=event.raw_partition,
            first_offset=event.first_offset,
            last_offset=event.last_offset,
            raw_sha256=event.raw_sha256,
            usage_source=event.usage_source.value,
        )
    return values


def _digest(values: dict[str, Any]) -> int:
    text = json.dumps(list(values.values()), ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def event_digest(event: BillingEvent) -> int:
    """64 bits of a hash of the compared fields: equal digests, equal events (to 2**-64).

    An event without provenance (before BillingEvent v3) digests its other fields alone.
    """
    return _digest(event_values(event))


def legacy_digest(event: BillingEvent) -> int:
    """`event_digest` of `event` without its provenance: what an event of before v3 of the
    same bill digests to."""
    return _digest(event_values(event, provenance=False))


def event_key(event_id: str) -> int:
    """The index key of an `event_id` (its first 64 bits; 32 hex digits name a request)."""
    return int(event_id[:16], 16)


def _kind(name: str) -> Kind:
    if name in COST_FIELDS:
        return Kind.COST_MISMATCH
    if name in PROVENANCE_FIELDS:
        return Kind.PROVENANCE_MISMATCH
    return Kind.USAGE_MISMATCH


def _differences(expected: BillingEvent, found: BillingEvent) -> list[tuple[str, Any, Any]]:
    """The fields in which `found` differs from `expected`; provenance only when both
    carry it (an event of before v3 has none: not a mismatch)."""
    both = expected.has_provenance and found.has_provenance
    want = event_values(expected, provenance=both)
    got = event_values(found, provenance=both)
    return [
        (name, want[name], got[name])
        for name in EVENT_FIELDS
        if name in want and want[name] != got[name]
    ]


def billing_discrepancies(
    expected: BillingEvent, found: Sequence[BillingEvent], *, conflicting: bool
) -> list[Discrepancy]:
    """How the distinct billing events `found` for a request differ from the replay's.

    With one event (`conflicting` False) each differing field is a ``usage_mismatch`` or a
    ``cost_mismatch``; with several, each field in which one of them differs from the
    replay is a ``conflicting_billing``.
    """
    out = []
    for event in found:
        for name, want, got in _differences(expected, event):
            kind = Kind.CONFLICTING_BILLING if conflicting else _kind(name)
            out.append(
                Discrepancy(
                    kind,
                    expected.request_id,
                    expected.tenant,
                    expected.model,
                    None,
                    name,
                    want,
                    got,
                    event_id=expected.event_id,
                )
            )
    return out


def missing_billing(expected: BillingEvent) -> Discrepancy:
    """A request the replay closed and priced, with no billing event: what it should cost
    (an amendment's: `Kind.UNBILLED_AMENDMENT`)."""
    return Discrepancy(
        Kind.UNBILLED_AMENDMENT if expected.revision else Kind.MISSING_BILLING,
        expected.request_id,
        expected.tenant,
        expected.model,
        None,
        "cost",
        _cost(expected.cost),
        None,
        event_id=expected.event_id,
    )


def unexpected_billing(found: BillingEvent) -> Discrepancy:
    """A billing event of no request the replay found: what it charged."""
    return Discrepancy(
        Kind.UNEXPECTED_BILLING,
        found.request_id,
        found.tenant,
        found.model,
        None,
        "cost",
        None,
        _cost(found.cost),
        event_id=found.event_id,
    )
