"""The open-request table: the requests in flight, and what is remembered of closed ones.

One part of `RequestProcessor` (`processors.requests`).  `RequestTable` holds
every request the processor has open (an `_Open` each, by `RequestRef`), how many
each tenant has open, the requests it knows closed (by this run or, as Redis said,
an earlier one or another owner of the partition), closes an earlier run decided
but did not finish writing, each reused request id's latest call (`call_of`),
the amendable states of requests closed at their timeout or over a gap (bounded
in bytes, oldest out first), and where an earlier run closed amended revisions.

It answers which request a record belongs to (`call_of`), what the agent must ask
Redis before a batch is applied (`unknown`, `requests_of`, `amendable_to_fetch`),
and forgets the open requests of revoked partitions.  It decides nothing about
records: the sequencer (`processors.sequencing`) and the close
(`processors.closing`) change it.
"""

from __future__ import annotations

from collections import Counter as CounterOf
from collections import OrderedDict
from collections.abc import Iterable

from streamtally.core.identity import RequestRef, call_request_id, epoch_micros
from streamtally.processors._records import _Open, _Raw
from streamtally.processors.amendable import Amendable
from streamtally.processors.clock import InputClock
from streamtally.processors.outputs import Closed, Counters

__all__ = ["AMENDABLE_MEMORY_BYTES", "CLOSED_MEMORY", "RequestTable"]

#: How many closed requests are remembered locally (Redis remembers them all).
CLOSED_MEMORY = 200_000
#: Bytes of record values of amendable requests kept locally (Redis keeps them all for the
#: state TTL; one evicted here is asked of Redis when a record for it comes).
AMENDABLE_MEMORY_BYTES = 64 << 20


class RequestTable:
    """The requests open here and what is known of closed ones; see the module docstring."""

    def __init__(self, counters: Counters, input_clock: InputClock) -> None:
        self.counters = counters
        self.input_clock = input_clock
        #: The open requests, and how many each tenant has open (`open_to`, `release`).
        self.open: dict[RequestRef, _Open] = {}
        self.open_by_tenant: CounterOf[str] = CounterOf()
        #: Requests known closed (applied, or decided elsewhere), most recent last.
        self.closed: OrderedDict[RequestRef, Closed] = OrderedDict()
        #: Closes an earlier run decided and did not apply: the request closes there again.
        self.pending_close: dict[RequestRef, Closed] = {}
        #: A request id's latest call, when it is not the request of that id itself (a new
        #: call of a closed request's id: `call_of`), by the id's request.
        self.calls: OrderedDict[RequestRef, RequestRef] = OrderedDict()
        #: Requests closed at their timeout or over a gap, as their next revision starts
        #: from (`processors.amendable`), most recent last, and the bytes they hold.
        self.amendable: OrderedDict[RequestRef, Amendable] = OrderedDict()
        self._amendable_bytes = 0
        #: Bytes of record values of amendable requests kept in memory (oldest out first).
        self.amendable_memory_bytes = AMENDABLE_MEMORY_BYTES
        #: Where earlier runs closed amended requests' later revisions, by revision.
        self._planned: dict[RequestRef, dict[int, Closed]] = {}

    # -- open requests ------------------------------------------------------------------

    def open_to(self, ref: RequestRef, state: _Open) -> None:
        """`ref` is open (new, or reopened as its next revision) with `state`."""
        self.open_by_tenant[state.tenant] += 1
        self.open[ref] = state

    def release(self, ref: RequestRef, state: _Open) -> None:
        """`ref` closes: no longer open, nor counted against its tenant."""
        del self.open[ref]
        left = self.open_by_tenant[state.tenant] - 1
        if left > 0:
            self.open_by_tenant[state.tenant] = left
        else:
            del self.open_by_tenant[state.tenant]

    def is_open(self, ref: RequestRef) -> bool:
        return ref in self.open

    def revision_of(self, ref: RequestRef) -> int:
        """The revision an open request's close will bill (0 unless it was reopened)."""
        state = self.open.get(ref)
        return 0 if state is None else state.revision

    def drop_partitions(self, topic_partitions: set[tuple[str, int]]) -> list[RequestRef]:
        """Forget the open requests of partitions this worker no longer owns (a rebalance).

        Their records were not acknowledged, so the partition's next owner
        receives them all again.
        """
        dropped = [r for r, s in self.open.items() if s.topic_partition in topic_partitions]
        for ref in dropped:
            state = self.open[ref]
            self.release(ref, state)
            self.counters.revoked += len(state.waiting)
        if self.calls and dropped:
            gone = set(dropped)
            for first in [r for r, call in self.calls.items() if call in gone]:
                del self.calls[first]
        self.input_clock.forget(topic_partitions)
        return dropped

    # -- which request a record belongs to ----------------------------------------------

    def call_of(self, raw: _Raw) -> RequestRef:
        """The request a record belongs to: its (tenant, request id), or a new call of it.

        The rule (any producer): a record of seq 0 of a request id whose request is
        closed starts a new call when it comes after the close (a higher offset) and was
        received after every record of the closed request (`Closed.last_received`).  The
        new call is the request ``call_request_id(id, received_at)``: a function of the
        record, so every replay derives it again.  A re-sent record of the closed request
        keeps its receive time, so it is no new call: it stays a replay or a late record.
        Later records of the id (seq > 0) belong to its latest call (`calls`), as does a
        seq 0 while that call is open (a duplicate: overlapping calls of one id merge).
        """
        ref = raw.ref
        calls = self.calls
        current = calls.get(ref, ref) if calls else ref
        if current in self.open:
            return current
        record = raw.record
        if record.seq == 0:
            first = self.closed.get(ref)
            if (
                first is not None
                and first.last_received is not None
                and raw.position.offset > first.offset
                and epoch_micros(record.received_at) > first.last_received
            ):
                current = RequestRef(
                    ref.tenant, call_request_id(ref.request_id, record.received_at)
                )
                self._remember_call(ref, current)
        return current

    def span_of(self, call: RequestRef, offset: int, was_open: bool) -> int | None:
        """For the first record of a new call (`call` is not its id's own request), the end
        of the offsets the commit gate may not stop inside: -1 while the call is open (the
        gate learns its closing offset when it finishes), its closing offset when an
        earlier run closed it (the record is a replay), None for any other record.

        A restarted worker, or a partition's next owner, that read from inside a new
        call's offsets would meet its later records without its first one, and could not
        tell which call they belong to: so the committed offset stays at the call's first
        record until every record up to its close is done (`CommitGate`).
        """
        if not was_open and call in self.open:
            return -1
        closed = self.closed.get(call)
        if closed is not None and offset <= closed.offset:
            return closed.offset
        return None

    def _remember_call(self, ref: RequestRef, call: RequestRef) -> None:
        """`call` is the latest call of `ref`'s request id (bounded as closed requests are)."""
        calls = self.calls
        calls[ref] = call
        calls.move_to_end(ref)
        if len(calls) > CLOSED_MEMORY:
            calls.popitem(last=False)

    # -- what the agent asks Redis about ------------------------------------------------

    def unknown(self, refs: Iterable[RequestRef]) -> set[RequestRef]:
        """Requests this process knows nothing of: ask Redis whether they closed."""
        return {
            r
            for r in refs
            if r not in self.open and r not in self.closed and r not in self.pending_close
        }

    def requests_of(self, raws: Iterable[_Raw | None]) -> set[RequestRef]:
        """The requests the records `raws` may belong to: their own (tenant, request id),
        the latest call of that id this process knows of, and for a record of seq 0 the
        new call it would start (`call_request_id`).  Ask Redis about the `unknown` ones
        before they are applied: which of them an earlier run closed."""
        calls = self.calls
        refs: set[RequestRef] = set()
        for raw in raws:
            if raw is None:
                continue
            ref = raw.ref
            refs.add(ref)
            if calls:
                current = calls.get(ref)
                if current is not None:
                    refs.add(current)
            record = raw.record
            if record.seq == 0 and ref not in self.open:
                refs.add(
                    RequestRef(ref.tenant, call_request_id(ref.request_id, record.received_at))
                )
        return refs

    def amendable_to_fetch(self, raws: Iterable[_Raw | None]) -> set[RequestRef]:
        """Requests the records `raws` would amend whose state is not held here: ask the
        store for it (`amendable_fetched`) before they are applied.

        Those closed at their timeout or over a gap (as last known) with a record after
        their close, and those whose next revision an earlier run decided on but did not
        write (it starts from the revision before).
        """
        wanted: set[RequestRef] = set()
        for raw in raws:
            if raw is None:
                continue
            ref = raw.ref
            if self.calls:
                ref = self.calls.get(ref, ref)
            if ref in self.open or ref in self.amendable or ref in wanted:
                continue
            closed = self.closed.get(ref)
            if closed is not None:
                if closed.amendable and raw.position.offset > closed.offset:
                    wanted.add(ref)
                continue
            pending = self.pending_close.get(ref)
            if pending is not None and pending.revision > 0:
                wanted.add(ref)
        return wanted

    # -- closes known -------------------------------------------------------------------

    def closed_earlier(self, ref: RequestRef, closed: Closed) -> None:
        """An earlier run closed `ref` (applied) or decided to (not yet applied)."""
        if closed.applied:
            self.remember(ref, closed)
        else:
            self.pending_close[ref] = closed

    def closed_elsewhere(self, ref: RequestRef, closed: Closed) -> None:
        """Another owner of its partition decided `ref`'s close first (`closed`, applied or
        not yet): that decision stands, not the one this process made (whose outputs were
        not written).  Its later records are judged by it: replays up to its offset,
        late after."""
        self.pending_close.pop(ref, None)
        self.remember(ref, closed)

    def forget_closed(self, refs: Iterable[RequestRef]) -> None:
        """Forget these closes (decided elsewhere, not known applied, of a partition this
        worker no longer owns): should the partition come back, their records are read
        again and Redis asked, so the request is closed and applied where it was decided
        instead of its records being dropped as replays of a close nobody applied."""
        for ref in refs:
            self.closed.pop(ref, None)
            self.pending_close.pop(ref, None)

    def remember(self, ref: RequestRef, closed: Closed) -> None:
        """`ref` is closed at `closed` (the most recent; bounded at `CLOSED_MEMORY`)."""
        self.closed[ref] = closed
        self.closed.move_to_end(ref)
        if len(self.closed) > CLOSED_MEMORY:
            self.closed.popitem(last=False)

    def plan_closes(self, ref: RequestRef, closes: Iterable[Closed]) -> None:
        """Where an earlier run closed revisions n > 0 of `ref` (the audit's replay: the
        request's close history): each closes there again when it is reopened."""
        planned = self._planned.setdefault(ref, {})
        for closed in closes:
            if closed.revision > 0:
                planned[closed.revision] = closed

    def planned_close(self, ref: RequestRef, revision: int) -> Closed | None:
        """Where an earlier run closed revision `revision` of `ref` (`plan_closes`)."""
        planned = self._planned.get(ref)
        if not planned:
            return None
        closed = planned.pop(revision, None)
        if not planned:
            del self._planned[ref]
        return closed

    # -- amendable states ---------------------------------------------------------------

    def amendable_fetched(self, ref: RequestRef, amendable: Amendable | None) -> None:
        """What the store keeps of `ref` for its amendments (None: nothing, it expired: its
        late records are dead-lettered with that reason; nothing is remembered of it, so
        memory stays bounded whatever a tenant sends)."""
        if amendable is not None:
            self.keep_amendable(ref, amendable)

    def keep_amendable(self, ref: RequestRef, amendable: Amendable) -> None:
        """Keep `ref`'s amendable state (the oldest out first past the memory bound)."""
        old = self.amendable.pop(ref, None)
        if old is not None:
            self._amendable_bytes -= old.size
        self.amendable[ref] = amendable
        self._amendable_bytes += amendable.size
        while self._amendable_bytes > self.amendable_memory_bytes and len(self.amendable) > 1:
            _, evicted = self.amendable.popitem(last=False)
            self._amendable_bytes -= evicted.size

    def drop_amendable(self, ref: RequestRef) -> Amendable | None:
        old = self.amendable.pop(ref, None)
        if old is not None:
            self._amendable_bytes -= old.size
        return old
