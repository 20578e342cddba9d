"""The audit's account: each request the replay closed, set against the billing index.

`Ledger` receives the replay's outcomes one request at a time (`closed`, `partial`,
`dead_lettered`) and keeps only what the report needs: the counts, the discrepancies
found so far, the replay's sums per usage row and per tenant, the (tenant, day) pairs a
partial request may be counted in (their rows cannot be checked), and the expected event
of each request whose billing differs (read again whole at the end: `resolve`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from streamtally.audit._billing import BillingIndex
from streamtally.audit._compare import (
    Discrepancy,
    billing_discrepancies,
    event_digest,
    event_key,
    legacy_digest,
    missing_billing,
    unexpected_billing,
)
from streamtally.audit._range import TimeRange
from streamtally.audit._rerate import Rerating
from streamtally.audit._rows import (
    RowComparison,
    RowKey,
    RowSum,
    compare_rows,
    row_key,
    stored_row,
)
from streamtally.billing.events import event_id
from streamtally.core.identity import RequestRef
from streamtally.wire.records import BillingEvent, UsageSource

__all__ = ["ABORTED_LISTED", "Aborted", "Ledger", "RequestCounts", "Scope"]

#: How many aborted requests the report names (all are counted).
ABORTED_LISTED = 10_000


@dataclass(frozen=True, slots=True)
class Scope:
    """What the audit covers: receive times, and the tenants (None: every tenant)."""

    window: TimeRange
    tenants: frozenset[str] | None = None

    def has_tenant(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    def accepts(self, event: BillingEvent) -> bool:
        """Whether a billing event is of a request the audit must find."""
        return self.has_tenant(event.tenant) and self.window.contains(event.event_time)

    def checks_row(self, key: RowKey) -> bool:
        """Whether a usage row is built only from requests the audit covers."""
        tenant, _, day = key
        return self.has_tenant(tenant) and self.window.holds_day(day)


@dataclass(slots=True)
class RequestCounts:
    replayed: int = 0
    #: Of `replayed`, requests the replay amended (billed again as a later revision).
    amended: int = 0
    billed: int = 0
    matched: int = 0
    mismatched: int = 0
    missing_billing: int = 0
    unexpected_billing: int = 0
    conflicting_billing: int = 0
    partial: int = 0
    dead_lettered: int = 0

    def to_json(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class Aborted:
    """Requests the replay billed with `usage_source` aborted: cancelled (their END marker
    said so) before the provider reported any usage, billed with the counts they had.
    Their own kind in the report, not a discrepancy: the bill is what the raw records
    say (its events are checked like any other's)."""

    count: int = 0
    #: (tenant, request id) of the `ABORTED_LISTED` first in (tenant, request id) order,
    #: whatever order the replay met them in (a split audit's shares list the same ones);
    #: unsorted, up to twice that many, between `listed` calls.
    requests: list[RequestRef] = field(default_factory=list)

    def add(self, event: BillingEvent) -> None:
        self.count += 1
        self.requests.append(RequestRef(event.tenant, event.request_id))
        if len(self.requests) >= 2 * ABORTED_LISTED:
            self.requests = self.listed()

    def listed(self) -> list[RequestRef]:
        """The requests the report names: the first `ABORTED_LISTED` in order."""
        return sorted(self.requests)[:ABORTED_LISTED]

    def merge(self, other: Aborted) -> None:
        self.count += other.count
        self.requests = sorted([*self.requests, *other.requests])[:ABORTED_LISTED]

    def to_json(self) -> dict[str, Any]:
        listed = self.listed()
        return {
            "count": self.count,
            "requests": [{"tenant": r.tenant, "request_id": r.request_id} for r in listed],
            "listed": len(listed),
        }


@dataclass(slots=True)
class Ledger:
    index: BillingIndex
    scope: Scope
    counts: RequestCounts = field(default_factory=RequestCounts)
    #: ``--prices``: every request closed is also priced at other prices (None: not asked).
    rerating: Rerating | None = None
    discrepancies: list[Discrepancy] = field(default_factory=list)
    #: The requests billed as aborted (`UsageSource.ABORTED`).
    aborted: Aborted = field(default_factory=Aborted)
    #: Why requests were partial (straddling the start, open at the end, not yet processed).
    partial_reasons: Counter[str] = field(default_factory=Counter)
    _rows: dict[RowKey, RowSum] = field(default_factory=dict)
    _totals: dict[str, RowSum] = field(default_factory=dict)
    _unsure: set[tuple[str, str]] = field(default_factory=set)
    #: event key -> the replay's event, for requests whose billing differs.
    _suspects: dict[int, BillingEvent] = field(default_factory=dict)
    #: event key -> the replay's event, for requests billed nowhere.
    _missing: dict[int, BillingEvent] = field(default_factory=dict)
    #: The replay's values of the usage rows found differing (`compare_rows`).
    row_expected: dict[RowKey, dict[str, Any]] = field(default_factory=dict)
    _conflicting: set[int] = field(default_factory=set)
    _unexpected: set[int] = field(default_factory=set)
    #: Event keys of partial requests the index held nothing for (a split audit's merge
    #: needs them: such a bill may have been indexed by another share, `_split`).
    partial_missed: set[int] = field(default_factory=set)

    # -- the replay's outcomes -----------------------------------------------------------

    def closed(self, expected: BillingEvent, superseded: BillingEvent | None = None) -> None:
        """A request the replay closed and priced: `expected` is its billing event; for an
        amendment (revision n > 0), `superseded` is its revision n - 1, which the replay
        closed before: the bill that stands moves from one to the other (the rule of
        `BillingEvent.revision`), in the rows and totals as in Redis."""
        counts = self.counts
        if superseded is None:
            counts.replayed += 1
        else:
            counts.amended += 1
            self._rows.setdefault(row_key(superseded), RowSum()).add(superseded, -1)
            self._totals.setdefault(superseded.tenant, RowSum()).add(superseded, -1)
        if expected.usage_source is UsageSource.ABORTED:
            self.aborted.add(expected)
        self._rows.setdefault(row_key(expected), RowSum()).add(expected)
        self._totals.setdefault(expected.tenant, RowSum()).add(expected)
        if self.rerating is not None:
            self.rerating.add(expected)
        key = event_key(expected.event_id)
        entry = self.index.take(key)
        if entry is None:
            counts.missing_billing += 1
            self._missing[key] = expected
            self.discrepancies.append(missing_billing(expected))
        elif entry.conflicting:
            counts.conflicting_billing += 1
            self._suspects[key] = expected
            self._conflicting.add(key)
        elif entry.digest == event_digest(expected) or entry.digest == legacy_digest(expected):
            counts.matched += 1  # the same bill (billed before v3: without provenance)
        else:
            counts.mismatched += 1
            self._suspects[key] = expected

    def partial(self, ref: RequestRef, day: str, reason: str, revision: int = 0) -> None:
        """A request the audit cannot judge (at `revision`: an amended request open again
        at the snapshot); its billing (if any) and its row are not checked."""
        self.counts.partial += 1
        self.partial_reasons[reason] += 1
        key = event_key(event_id(ref.tenant, ref.request_id, revision))
        if self.index.take(key) is None:
            self.partial_missed.add(key)
        self._unsure.add((ref.tenant, day))

    def dead_lettered(self, ref: RequestRef) -> None:
        """A request whose records were all refused: nothing may bill it."""
        del ref
        self.counts.dead_lettered += 1

    # -- the end -------------------------------------------------------------------------

    def close_index(self) -> set[int]:
        """After the replay: what was billed for no request found; returns every key whose
        events `resolve` needs whole."""
        self.counts.billed = self.index.billed
        self._unexpected = self.index.remaining()
        self.counts.unexpected_billing = len(self._unexpected)
        return set(self._suspects) | self._unexpected

    def resolve(self, found: Mapping[int, Sequence[BillingEvent]]) -> None:
        """The discrepancies of the events `close_index` asked for, read whole."""
        for key, expected in self._suspects.items():
            events = found.get(key, ())
            conflicting = key in self._conflicting
            if conflicting:
                mine = event_digest(expected)
                events = [e for e in events if event_digest(e) != mine]
            self.discrepancies.extend(
                billing_discrepancies(expected, events, conflicting=conflicting)
            )
        for key in self._unexpected:
            for event in found.get(key, ())[:1]:
                self.discrepancies.append(unexpected_billing(event))

    @property
    def unexpected(self) -> set[int]:
        """The keys `close_index` found billed for no request replayed here."""
        return self._unexpected

    @property
    def suspects(self) -> Mapping[int, BillingEvent]:
        """event key -> the replay's event, for the requests whose billing differs
        (mismatched or conflicting)."""
        return self._suspects

    @property
    def missing(self) -> Mapping[int, BillingEvent]:
        """event key -> the replay's event, for the requests billed nowhere in the index."""
        return self._missing

    def sums(self) -> tuple[dict[RowKey, RowSum], dict[str, RowSum], set[tuple[str, str]]]:
        """The replay's sums per usage row and per tenant, and the (tenant, day) pairs a
        partial request may be counted in."""
        return self._rows, self._totals, self._unsure

    def add_sums(
        self,
        rows: Mapping[RowKey, RowSum],
        totals: Mapping[str, RowSum],
        unsure: set[tuple[str, str]],
    ) -> None:
        """Add another replay's `sums` (a share of a split audit) to this one's."""
        for key, other in rows.items():
            self._rows.setdefault(key, RowSum()).merge(other)
        for tenant, total in totals.items():
            self._totals.setdefault(tenant, RowSum()).merge(total)
        self._unsure |= unsure

    def compare_rows(self, stored: Sequence[Mapping[str, Any]]) -> tuple[RowComparison, int]:
        """The replay's usage rows against `stored` (`RedisStore.usage_rows`), those the
        audit covers fully; also returns how many rows in its tenants and days it skipped
        because a partial request may be counted in them."""
        found = dict(stored_row(row) for row in stored)
        keys = {k for k in set(found) | set(self._rows) if self.scope.checks_row(k)}
        unsure = {k for k in keys if (k[0], k[2]) in self._unsure}
        expected = {k: self._rows[k].values() for k in keys - unsure if k in self._rows}
        comparison = compare_rows(expected, found, keys - unsure)
        for d in comparison.discrepancies:
            key = (d.tenant, d.model or "", d.day or "")
            self.row_expected[key] = expected.get(key) or RowSum().values()
        return comparison, len(unsure)

    def expected_bill(self, event_id: str) -> BillingEvent | None:
        """The replay's billing event of `event_id`, for a request whose billing differs."""
        key = event_key(event_id)
        bill = self._suspects.get(key) or self._missing.get(key)
        return bill if bill is not None and bill.event_id == event_id else None

    def totals(self) -> dict[str, dict[str, Any]]:
        """Per tenant: requests replayed, the five usage fields and the cost."""
        out = {}
        for tenant, total in sorted(self._totals.items()):
            values = total.values()
            del values["unpriced_requests"]
            out[tenant] = values
        return out
