"""One ledger, one rule: the bill that stands for each request, from the billing and
corrections topics.

The billing topic is append-only and written at least once.  The worker bills revision 0
of a request when it first closes it, and revision n > 0 (BillingEvent v5) when records
that arrived after a close at its timeout or over a gap amend it; ``streamtally audit
--correct`` appends corrections to the corrections topic (`streamtally.billing.corrections`)
and never rewrites a bill.  Every revision and every corrected bill carries the request's
whole usage and cost, never a difference.  A consumer gets the bills as they stand by this
rule; `BillingLedger` is its one implementation (``billing export --ledger`` and
``rebuild`` read through it; the audit applies its corrections half, `CorrectionLog`,
and rule 3 as it replays: its expected rows take an amended request's superseded
revision out as the next one closes, `streamtally.audit._ledger.Ledger.closed`,
which keeps it at one sum per row instead of every bill):

1. **One bill per event id.**  The first record of an event id read is its bill (all the
   records of a request are on one partition, keyed by the request: that is offset
   order).  A later record equal to it is a replay, dropped; a later *different* one is
   a conflict: reported, and no bill (the first stays).
2. **A correction decides an event id.**  A correction names the event id it decides
   (`superseded_event_id`, or for a missing bill its `corrected` bill's id); the latest
   one naming an id, in corrections topic order, decides it (replace semantics: applied
   twice, it changes nothing more).  It applies when the id's billing record lies below
   the correction's ``billing_before`` offset of its partition (the audit saw it), or when
   no record of the id was read: the id's bill is then `corrected`, or none when
   `corrected` is null (withdrawn).  A record at or past ``billing_before`` was written
   after the audit: it stays the id's bill, and the next audit judges it.
3. **The highest revision stands.**  Each event id of a request (tenant, request_id) has
   a revision: its billing record's `revision` (a record written before v5 reads 0), or,
   for an id only a correction names, its `corrected` bill's.  Only the id of the
   request's highest revision stands; every lower one is superseded, whatever was read
   first.  Revision n names revision n - 1 in `supersedes`, so following those links
   lands on the same bill when every revision was read.
4. **One bill per request**: the bill of its highest revision's id, as rule 2 left it.
   Two ids of one request at the same highest revision (forged, or billed under two id
   schemes) both stand and are reported (`Settled.split`).

The edge cases, as these rules settle them:

- a revision read before the one it supersedes still stands (rule 3 compares revisions,
  not the order read);
- revision 0 corrected by an audit, then a worker revision 1: revision 1 stands (the
  correction decided revision 0's id, which revision 1 supersedes); a correction of
  revision 1 stands in revision 1's place;
- an amendment only a correction bills (``unbilled_amendment``: no superseded id, the
  `corrected` bill of revision n) stands over revision n - 1, as the worker's would;
- the highest revision withdrawn: the request has no bill (its lower revisions stay
  superseded);
- the same event id read several times, or a correction read twice: one bill, one
  decision (rules 1 and 2).

A request's usage row in Redis holds its standing bill (revision n replaces revision
n - 1 there, once: `streamtally.store.scripts.AMEND_SCRIPT`; ``audit --correct`` sets a
row right beside its corrections), so the standing bills of a tenant sum to its usage
rows, one request per standing bill.

This module does not import fastavro.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from streamtally.billing.corrections import CorrectionLog
from streamtally.core.identity import RequestRef
from streamtally.wire.records import BillingCorrection, BillingEvent

__all__ = ["BillingLedger", "Seen", "Settled", "Standing"]


class Seen(enum.Enum):
    """What a billing record was to the ledger (`BillingLedger.add`)."""

    #: The first record of its event id: the id's bill.
    BILL = "bill"
    #: Equal to the bill of its event id: a replay, dropped.
    REPLAY = "replay"
    #: Different from the bill of its event id: a conflict, no bill.
    CONFLICT = "conflict"


@dataclass(frozen=True, slots=True)
class Standing:
    """A bill that stands: the worker's as written, or the one a correction put in place."""

    event: BillingEvent
    #: The correction that put `event` in place; None: the billing record stands as is.
    correction: BillingCorrection | None = None

    @property
    def ref(self) -> RequestRef:
        return RequestRef(self.event.tenant, self.event.request_id)


@dataclass(slots=True)
class Settled:
    """The ledger as it stands (`BillingLedger.settle`)."""

    #: One bill per request (two or more only for a `split` request), ordered by
    #: (event_time, event_id).
    bills: list[Standing] = field(default_factory=list)
    #: Event ids superseded by a higher revision of their request (rule 3).
    revised: int = 0
    #: Event ids read on the billing topic whose bill a correction decides (rule 2):
    #: replaced by its `corrected` bill, or withdrawn.
    corrected: int = 0
    #: Requests with several ids at their highest revision: several bills stand (rule 4).
    split: list[RequestRef] = field(default_factory=list)

    def events(self) -> list[BillingEvent]:
        """The standing bills' events."""
        return [bill.event for bill in self.bills]


@dataclass(frozen=True, slots=True)
class _Slot:
    """One event id of a request, as rule 2 leaves it."""

    revision: int
    #: The id's bill; None: withdrawn by a correction.
    bill: BillingEvent | None
    correction: BillingCorrection | None
    #: Whether a billing record of the id was read.
    read: bool


class BillingLedger:
    """The billing and corrections topics read so far, settled by the module's rule.

    `add` each billing record with its partition and offset, and `correct` each correction
    in corrections topic order (or pass a `CorrectionLog` already read); the two topics may
    be read in any interleaving, since a correction says by offsets which bills it saw.
    `settle` then gives the bills that stand, one per request.
    """

    def __init__(self, corrections: CorrectionLog | None = None) -> None:
        #: The corrections, as `CorrectionLog` applies them (latest per event id).
        self.corrections = CorrectionLog() if corrections is None else corrections
        self._records: dict[str, tuple[BillingEvent, int, int]] = {}
        #: Billing records added, of those the replays, and the conflicts (the id's bill,
        #: the different record).
        self.records = 0
        self.replays = 0
        self.conflicts: list[tuple[BillingEvent, BillingEvent]] = []

    def add(self, event: BillingEvent, partition: int, offset: int) -> Seen:
        """The billing record `event` read at (`partition`, `offset`), and what it is (rule 1)."""
        if partition < 0 or offset < 0:
            raise ValueError(f"a record's partition and offset are >= 0, got {partition}@{offset}")
        self.records += 1
        known = self._records.get(event.event_id)
        if known is None:
            self._records[event.event_id] = (event, partition, offset)
            return Seen.BILL
        if known[0] == event:
            self.replays += 1
            return Seen.REPLAY
        self.conflicts.append((known[0], event))
        return Seen.CONFLICT

    def correct(self, correction: BillingCorrection) -> None:
        """The next correction of the corrections topic (rule 2)."""
        self.corrections.add(correction)

    def _slot(self, event_id: str) -> tuple[RequestRef, _Slot] | None:
        """The request of `event_id` and its slot by rule 2; None: a withdrawal of a bill
        never read (nothing to withdraw)."""
        record = self._records.get(event_id)
        correction = self.corrections.latest(event_id)
        if correction is not None and (record is None or correction.covers(record[1], record[2])):
            corrected = correction.corrected
            base = corrected if record is None else record[0]
            if base is None:
                return None
            slot = _Slot(base.revision, corrected, correction, read=record is not None)
            return RequestRef(base.tenant, base.request_id), slot
        if record is None:  # a correction names it, so this is not reached
            raise KeyError(event_id)
        event = record[0]
        return RequestRef(event.tenant, event.request_id), _Slot(event.revision, event, None, True)

    def settle(self) -> Settled:
        """The bills that stand now (rules 2 to 4); the ledger can be added to afterwards."""
        by_request: dict[RequestRef, list[_Slot]] = {}
        settled = Settled()
        for event_id in self._records.keys() | self.corrections.decided().keys():
            found = self._slot(event_id)
            if found is None:
                continue
            ref, slot = found
            settled.corrected += slot.read and slot.correction is not None
            by_request.setdefault(ref, []).append(slot)
        for ref, slots in by_request.items():
            top = max(slot.revision for slot in slots)
            standing = [
                Standing(slot.bill, slot.correction)
                for slot in slots
                if slot.revision == top and slot.bill is not None
            ]
            settled.revised += sum(slot.revision < top for slot in slots)
            if len(standing) > 1:
                settled.split.append(ref)
            settled.bills.extend(standing)
        settled.bills.sort(key=lambda bill: (bill.event.event_time, bill.event.event_id))
        settled.split.sort()
        return settled

    def bills(self) -> list[BillingEvent]:
        """The standing bills (`settle`), ordered by (event_time, event_id)."""
        return self.settle().events()
