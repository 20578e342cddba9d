"""The billing topic, read twice at most: a compact index first, the events themselves later.

`BillingIndex` keeps, per billing event in the audit's scope, 64 bits of its `event_id`
and 64 bits of a digest of its compared fields (`event_digest`): about 125 bytes per
request in CPython, whatever the events hold.  Byte-identical replays collapse; two
different events with one `event_id` are kept as a conflict, except a copy with provenance
(BillingEvent v3) of an event without it that is otherwise the same: a worker upgraded
while the request was replayed, one bill (the v3 copy is kept).  The other order (v3
first, then the same bill without provenance) is reported as a conflict.  The replay `take`s each
request's entry as it closes; what is left at the end was billed for no request it found.
Only the few events behind a discrepancy are read again, whole (`find_events`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from streamtally.audit._compare import event_digest, event_key, legacy_digest
from streamtally.billing.corrections import CorrectionLog
from streamtally.connection import KafkaConnection
from streamtally.wire.avro import (
    AvroDecodeError,
    decode_billing_event,
)
from streamtally.wire.kafka import read_topic
from streamtally.wire.records import BillingEvent

__all__ = ["BillingIndex", "Entry", "find_events", "index_billing"]


@dataclass(frozen=True, slots=True)
class Entry:
    """What the index knew of one request's billing: its digest, or that events conflict."""

    digest: int
    conflicting: bool = False


@dataclass(slots=True)
class BillingIndex:
    """event key -> digest of the billing events in scope (conflicts aside, rare)."""

    _digests: dict[int, int] = field(default_factory=dict)
    _conflicts: dict[int, set[int]] = field(default_factory=dict)
    #: Billing records read in scope (replays included).
    records: int = 0
    #: Distinct event ids in scope: the requests billed.
    billed: int = 0
    #: (partition, offset, reason) of records that did not decode.
    bad: list[tuple[int, int, str]] = field(default_factory=list)
    #: Billing records in scope superseded by a correction (``audit --correct``).
    superseded: int = 0

    def add(self, event: BillingEvent) -> None:
        self.records += 1
        key, digest = event_key(event.event_id), event_digest(event)
        known = self._digests.get(key)
        if known is None:
            self._digests[key] = digest
            self.billed += 1
        elif known != digest:
            if (
                event.has_provenance
                and key not in self._conflicts
                and legacy_digest(event) == known
            ):
                # The same bill written again with provenance (a worker upgraded to
                # BillingEvent v3 replayed it): one bill, the more telling copy kept.
                self._digests[key] = digest
                return
            self._conflicts.setdefault(key, {known}).add(digest)

    def take(self, key: int) -> Entry | None:
        """The entry of `key`, removed from the index; None when nothing was billed."""
        digest = self._digests.pop(key, None)
        if digest is None:
            return None
        return Entry(digest, self._conflicts.pop(key, None) is not None)

    def peek(self, key: int) -> Entry | None:
        """The entry of `key`, left in the index; None when nothing was billed."""
        digest = self._digests.get(key)
        return None if digest is None else Entry(digest, key in self._conflicts)

    def remaining(self) -> set[int]:
        """The keys never taken: billed, but for no request the replay found."""
        return set(self._digests)

    def __len__(self) -> int:
        return len(self._digests)


def _decoded(value: bytes | None) -> BillingEvent | str:
    if value is None:
        return "no value (tombstone)"
    try:
        return decode_billing_event(value)
    except AvroDecodeError as exc:
        return str(exc)


async def index_billing(
    servers: KafkaConnection | str,
    topic: str,
    ranges: Mapping[int, tuple[int, int]],
    accept: Callable[[BillingEvent], bool],
    index: BillingIndex,
    *,
    corrections: CorrectionLog | None = None,
    progress: Callable[[int], None] | None = None,
    standing: Callable[[BillingEvent], bool] | None = None,
) -> None:
    """Add the events of `ranges` (partition -> [start, end)) that `accept` takes to `index`.

    With `corrections`, the bills as corrected: the bills the corrections stand first (those
    `standing` takes; default `accept`), then the billing events no correction supersedes.
    """
    if corrections is not None:
        for bill in corrections.standing():
            if (standing or accept)(bill):
                index.add(bill)
    start = {p: r[0] for p, r in ranges.items()}
    end = {p: r[1] for p, r in ranges.items()}
    async with contextlib.aclosing(read_topic(servers, topic, start=start, end=end)) as records:
        async for record in records:
            event = _decoded(record.value)
            if isinstance(event, str):
                index.bad.append((record.partition, record.offset, event))
            elif corrections is not None and corrections.superseded(
                event, record.partition, record.offset
            ):
                index.superseded += accept(event)
            elif accept(event):
                index.add(event)
            if progress is not None:
                progress(1)


async def find_events(
    servers: KafkaConnection | str,
    topic: str,
    ranges: Mapping[int, tuple[int, int]],
    keys: Collection[int],
    *,
    corrections: CorrectionLog | None = None,
) -> dict[int, list[BillingEvent]]:
    """The distinct events of `ranges` whose event key is one of `keys`, in topic order
    (with `corrections`: as corrected, see `index_billing`)."""
    found: dict[int, list[BillingEvent]] = {}
    seen: set[tuple[int, int]] = set()
    for bill in () if corrections is None else corrections.standing():
        key = event_key(bill.event_id)
        if key in keys and (key, event_digest(bill)) not in seen:
            seen.add((key, event_digest(bill)))
            found.setdefault(key, []).append(bill)
    start = {p: r[0] for p, r in ranges.items()}
    end = {p: r[1] for p, r in ranges.items()}
    async with contextlib.aclosing(read_topic(servers, topic, start=start, end=end)) as records:
        async for record in records:
            event = _decoded(record.value)
            if isinstance(event, str) or (
                corrections is not None
                and corrections.superseded(event, record.partition, record.offset)
            ):
                continue
            key = event_key(event.event_id)
            if key not in keys:
                continue
            digest = event_digest(event)
            if (key, digest) not in seen:
                seen.add((key, digest))
                found.setdefault(key, []).append(event)
    return found
