"""The replay: raw records through the processors' own `RequestProcessor`, nothing written.

The processor is the worker's (`streamtally.processors.requests`): the same decoding,
sequence order, duplicates, gaps, record limit, normalisation, fold and pricing, so the
audit cannot disagree with the pipeline about what a request is.  What differs is only
what the processor is told:

- its clock is the input alone (no wall time): a partition's clock moves with its records'
  times, and a request quiet for longer than its timeout by that clock closes (the
  worker's settings: ``STREAMTALLY_REQUEST_TIMEOUT`` and the per-source
  ``STREAMTALLY_REQUEST_TIMEOUTS``; keep-alive records are records like any other);
- the close decisions the worker wrote to Redis (`RedisStore.closed_markers`, looked up as
  the worker does for each request it has not seen) are handed over as not yet applied, so
  a request the worker closed by timeout, over a gap or at its record limit is closed
  again at the same offset for the same reason (`Closed`, what a restarted worker does);
  the marker a `streamtally rebuild` writes names no offset and is ignored, and a marker
  before the request's first record here makes its records late (dead-lettered), as the
  worker found them;
- no limit on open requests (a worker's limit depends on its share of the partitions).

Per request, one outcome goes to the `Outcomes` (the `Ledger`): closed with its billing
event, or partial (its first record in the range is not its first event: it straddles the
range's start; still open at the snapshot's end; or closed at an offset the processors had
not committed at the snapshot: its outputs may not be written yet), or dead-lettered whole
(an end marker with no events).  A request's state is dropped once it closed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from streamtally.audit._range import TimeRange
from streamtally.core.identity import RequestRef, call_request_id
from streamtally.ops.rebuild import CLOSED_MARKER
from streamtally.processors.clock import input_time
from streamtally.processors.requests import Closed, Completed, Outputs, Position, RequestProcessor
from streamtally.store import day_of
from streamtally.wire.kafka import TopicRecord
from streamtally.wire.records import BillingEvent, EventKind

__all__ = ["Lookup", "Outcomes", "Replay", "ReplayStats"]

#: Close decisions of requests: `RedisStore.closed_markers` as ref -> (marker, applied).
Lookup = Callable[[list[RequestRef]], Awaitable[Mapping[RequestRef, tuple[str, bool]]]]


class Outcomes(Protocol):
    def closed(self, expected: BillingEvent, superseded: BillingEvent | None = None) -> None: ...

    def partial(self, ref: RequestRef, day: str, reason: str, revision: int = 0) -> None: ...

    def dead_lettered(self, ref: RequestRef) -> None: ...


@dataclass(slots=True)
class ReplayStats:
    """Raw records by what the replay did with them (the processor counts the rest)."""

    read: int = 0
    #: Received outside the range (read because offsets are found by append time).
    outside: int = 0
    #: Of tenants not audited.
    other_tenants: int = 0
    #: Of requests that straddle the range's start.
    straddling: int = 0


@dataclass(slots=True)
class _Track:
    tp: tuple[str, int]
    last: datetime


class Replay:
    """Feeds batches of raw records (each partition in offset order) to a `RequestProcessor`."""

    def __init__(
        self,
        processor: RequestProcessor,
        *,
        sse_topic: str,
        window: TimeRange,
        tenants: frozenset[str] | None,
        lookup: Lookup,
        committed: Mapping[tuple[str, int], int],
        outcomes: Outcomes,
    ) -> None:
        self.processor = processor
        self._sse_topic = sse_topic
        self._window = window
        self._tenants = tenants
        self._lookup = lookup
        self._committed = committed
        self._outcomes = outcomes
        self.stats = ReplayStats()
        self._open: dict[RequestRef, _Track] = {}
        #: Requests first seen after their first event: ref -> time of their last record.
        self._straddling: dict[RequestRef, datetime] = {}

    async def feed(self, batch: Sequence[TopicRecord]) -> None:
        """Apply a batch of records, then close what went quiet; outcomes as they come."""
        processor, out = self.processor, Outputs()
        window, tenants = self._window, self._tenants
        kept = []  # (record, audited?) in partition order: skipped ones still move the clock
        for rec in batch:
            position = Position(rec.topic, rec.partition, rec.offset, rec.timestamp_ms / 1000)
            read = processor.read_sse if rec.topic == self._sse_topic else processor.read_engine
            raw = read(rec.key, rec.value, position, out, rec.headers)
            if raw is None:  # refused before it names a request (counted by the processor)
                continue
            if not window.contains(raw.record.received_at):
                self.stats.outside += 1
            elif tenants is not None and raw.record.tenant not in tenants:
                self.stats.other_tenants += 1
                kept.append((raw, False))
            else:
                kept.append((raw, True))
        self.stats.read += len(batch)
        straddling = self._straddling
        # Each request's first record of the batch (reversed: the earliest one wins).
        firsts = {
            raw.ref: raw for raw, mine in reversed(kept) if mine and raw.ref not in straddling
        }
        unknown = processor.unknown(firsts)
        # New calls of a reused id (`RequestProcessor.call_of`): the first record of each,
        # by the request it would be; their close decisions are looked up with the rest.
        starts = {
            RequestRef(
                raw.ref.tenant, call_request_id(raw.ref.request_id, raw.record.received_at)
            ): raw
            for raw, mine in kept
            if mine and raw.record.seq == 0
        }
        calls = processor.unknown(processor.requests_of(raw for raw, mine in kept if mine))
        calls = {call for call in calls if call in starts and call not in firsts}
        asked = unknown | calls
        markers = await self._lookup(sorted(asked)) if asked else {}
        for call in calls:
            known = markers.get(call)
            marker = _marker(known)
            if marker is None:
                continue
            if marker.offset < starts[call].position.offset:
                processor.closed_earlier(
                    call, Closed(marker.offset, marker.reason, True, marker.last_received)
                )
            else:
                processor.closed_earlier(call, marker)
        for ref in asked:
            later = _later_closes(markers.get(ref))
            if later:  # an amended request: where its later revisions closed
                processor.plan_closes(ref, later)
        for ref in unknown:
            first = firsts[ref]
            marker = _marker(markers.get(ref))
            if marker is not None and marker.offset < first.position.offset:
                processor.closed_earlier(
                    ref, Closed(marker.offset, marker.reason, True, marker.last_received)
                )
            elif first.record.seq > 0:
                straddling[ref] = first.record.received_at
            elif marker is not None:
                processor.closed_earlier(ref, marker)
        for raw, mine in kept:
            ref, record = raw.ref, raw.record
            if not mine or ref in straddling:
                self._tick(raw.position, record.received_at)
                if not mine:
                    continue
                self.stats.straddling += 1
                straddling[ref] = record.received_at
                if record.kind is EventKind.END:
                    del straddling[ref]
                    self._outcomes.partial(ref, day_of(record.received_at), "straddles the start")
                continue
            call = processor.call_of(raw)  # the record's request, or a new call of its id
            was_open, done = processor.is_open(call), len(out.completed)
            processor.apply_as(out, raw, call)
            tp = (raw.position.topic, raw.position.partition)
            for completed in out.completed[done:]:
                self._closed(completed, tp)
            if processor.is_open(call):
                track = self._open.get(call)
                if track is None:
                    self._open[call] = _Track(tp, record.received_at)
                else:
                    track.last = record.received_at
            elif not was_open and len(out.completed) == done and processor.unknown([call]):
                self._outcomes.dead_lettered(call)  # refused as it would open
        for completed in processor.expire().completed:
            track = self._open.get(completed.ref)
            self._closed(completed, None if track is None else track.tp)

    def finish(self) -> None:
        """The end of the snapshot: whatever is still open is partial."""
        for ref, track in self._open.items():
            revision = self.processor.revision_of(ref)
            self._outcomes.partial(ref, day_of(track.last), "open at the snapshot", revision)
        for ref, last in self._straddling.items():
            self._outcomes.partial(ref, day_of(last), "straddles the start")
        self._open.clear()
        self._straddling.clear()

    def _tick(self, position: Position, received_at: datetime) -> None:
        """A record the replay skips still moves its partition's input clock, as in the worker."""
        at = input_time(received_at.timestamp(), position.timestamp)
        self.processor.input_clock.saw((position.topic, position.partition), position.offset, at)

    def _closed(self, completed: Completed, tp: tuple[str, int] | None) -> None:
        self._open.pop(completed.ref, None)
        billing = completed.billing
        if tp is not None and completed.closed.offset >= self._committed.get(tp, 0):
            day = day_of(billing.event_time)
            self._outcomes.partial(completed.ref, day, "not yet processed", billing.revision)
        else:
            self._outcomes.closed(billing, completed.supersedes)


def _marker(known: tuple[str, bool] | None) -> Closed | None:
    """The close decision a looked-up marker states (as not yet applied), or None: no
    marker, the one `streamtally rebuild` writes (no offset), or not a worker's marker
    (the records decide).  For an amended request the lookup gives its close history, one
    marker per line (revision 0 first): its first close."""
    if known is None or known[0] == CLOSED_MARKER:
        return None
    try:
        return Closed.from_marker(known[0].split("\n", 1)[0], applied=False)
    except ValueError:
        return None


def _later_closes(known: tuple[str, bool] | None) -> list[Closed]:
    """The closes of an amended request's revisions n > 0, from its close history."""
    if known is None or "\n" not in known[0]:
        return []
    try:
        return [Closed.from_marker(m, applied=False) for m in known[0].split("\n")[1:]]
    except ValueError:
        return []
