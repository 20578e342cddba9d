"""Sequencing: each record put in its place among its request's records.

One part of `RequestProcessor` (`processors.requests`).  `Sequencer.apply_as`
takes a record (already counted in and named its request, `call_of`) and decides
what it is: a replay of a closed request (dropped), a late record (dead-lettered),
the first record of a new request (opened, within the limits), a record after a
timeout's close that amends it (the request reopened as its next revision:
`_amend`, `_reopen`), a duplicate, a record ahead of a missing one (it waits), or
the next one (folded, `processors.folding`, with those that waited for it).  It
closes a request at its record limit and where an earlier run closed it
(`processors.closing`).
"""

from __future__ import annotations

from typing import Final

from streamtally.core.fold import Fold
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.core.normalize import Normalizer
from streamtally.errors import InputError
from streamtally.processors._records import _Open, _Raw
from streamtally.processors.amendable import Amendable
from streamtally.processors.clock import InputClock, input_time
from streamtally.processors.closing import Closer
from streamtally.processors.folding import RecordFolder
from streamtally.processors.limits import Limits
from streamtally.processors.outputs import Closed, CloseReason, Counters, Outputs, Position
from streamtally.processors.refusals import Refusals
from streamtally.processors.table import RequestTable
from streamtally.wire import avro
from streamtally.wire.records import EventKind, RawEngineOutput

__all__ = ["Sequencer"]

#: Each source's value (`.value` of an enum member is an interpreted property; one per record).
_VALUE_OF: Final = {source: source.value for source in Source}


class Sequencer:
    """Puts each record of a request in its place; see the module docstring."""

    def __init__(
        self,
        table: RequestTable,
        refusals: Refusals,
        folder: RecordFolder,
        closer: Closer,
        *,
        limits: Limits,
        counters: Counters,
        input_clock: InputClock,
    ) -> None:
        self.table = table
        self.refusals = refusals
        self.folder = folder
        self.closer = closer
        self.limits = limits
        self.counters = counters
        self.input_clock = input_clock

    def apply_as(self, out: Outputs, raw: _Raw, ref: RequestRef) -> None:
        """Apply a record (in partition order) as one of the request `ref` (`call_of`),
        adding its outputs to `out`."""
        record, key, value, position = raw.record, raw.key, raw.value, raw.position
        request_id = record.request_id
        source = _VALUE_OF[record.source]
        table = self.table
        dead = self.refusals.dead
        tp = (position.topic, position.partition)
        input_now = self.input_clock.saw(
            tp, position.offset, input_time(record.received_at.timestamp(), position.timestamp)
        )
        closed = table.closed.get(ref)
        state: _Open | None
        if closed is not None:
            if position.offset <= closed.offset:
                self.counters.replayed += 1
                return
            state = self._amend(out, raw, ref, closed, None)
            if state is None:
                return
        else:
            state = table.open.get(ref)
            if state is None:
                pending = table.pending_close.get(ref)
                if pending is not None and pending.revision > 0:
                    # An earlier run decided this request's next revision and did not
                    # write it: it starts again from the revision before.
                    state = self._amend(out, raw, ref, None, pending)
                    if state is None:
                        return
            if state is not None and position.offset <= state.floor:
                self.counters.replayed += 1  # a record of the revision it supersedes
                return
        if (
            state is None
            and record.seq == 0
            and (record.kind is EventKind.END or record.is_keepalive)
        ):
            # An end marker (or a keep-alive) that is a request's first record: no event to
            # bill (a phantom 0-cost request otherwise).  (A later one waits for its events.)
            what = "end marker" if record.kind is EventKind.END else "keep-alive"
            lone = InputError(f"{what} of request {ref}, which has no events")
            dead(out, lone, key, value, position, source=source, request_id=request_id)
            return
        if state is None:
            refused = self.refusals.refused_by_limits(record.tenant)
            if refused is not None:
                dead(out, refused, key, value, position, source=source, request_id=request_id)
                return
            state = _Open(
                normalizer=Normalizer(
                    record.source,
                    ref.request_id,
                    model=record.model if isinstance(record, RawEngineOutput) else None,
                ),
                fold=Fold(ref.request_id, record.source, max_text_bytes=self.limits.text_bytes),
                tenant=record.tenant,
                source=source,
                next_seq=0,
                last_time=record.received_at,
                latest=record.received_at,
                last_input=0.0 if input_now is None else input_now,
                max_offset=position.offset,
                topic_partition=tp,
                close_at=table.pending_close.pop(ref, None),
            )
            table.open_to(ref, state)
        elif source != state.source:
            mixed = InputError(
                f"request {ref} changed source mid-stream ({state.source} → {source})"
            )
            dead(out, mixed, key, value, position, source=source, request_id=request_id)
            return
        state.latest = max(state.latest, record.received_at)
        held = state.records + state.duplicates + len(state.waiting)
        if held >= self.limits.records_per_request and record.kind is not EventKind.END:
            # Closed here with what it has (deterministic: a replay closes it at this very
            # record again); its later records are late.  Memory stays bounded.
            many = InputError(
                f"request {ref} has {held} records, the limit "
                f"(STREAMTALLY_MAX_RECORDS_PER_REQUEST={self.limits.records_per_request})"
            )
            dead(out, many, key, value, position, source=source, request_id=request_id)
            state.max_offset = max(state.max_offset, position.offset)
            self.closer.finish(out, ref, state, CloseReason.LIMIT)
            return
        state.last_input = 0.0 if input_now is None else input_now
        state.max_offset = max(state.max_offset, position.offset)
        if record.seq < state.next_seq or record.seq in state.waiting:
            self.counters.duplicates += 1
            state.duplicates += 1
        elif record.seq > state.next_seq:
            state.waiting[record.seq] = raw  # wait for the gap
        else:
            folder = self.folder
            closes = folder.fold(out, ref, state, raw)
            while closes is None and state.next_seq in state.waiting:
                closes = folder.fold(out, ref, state, state.waiting.pop(state.next_seq))
            if closes is not None:
                self.closer.finish(out, ref, state, closes)
        planned = state.close_at
        if planned is not None and ref in table.open and position.offset >= planned.offset:
            # An earlier run closed this request here: close it the same way again.
            self.closer.finish(out, ref, state, planned.reason)

    def _amend(
        self,
        out: Outputs,
        raw: _Raw,
        ref: RequestRef,
        closed: Closed | None,
        pending: Closed | None,
    ) -> _Open | None:
        """A record after the close of `ref`: the request opened again as its next
        revision (its records so far applied again, silently), or None when the record
        was dead-lettered: the request closed at its END or a limit, its amendable state
        is gone, or the record is one it had.

        `closed`: its close as known (the record is after it); `pending`: instead, the
        close of its next revision an earlier run decided and did not write.
        """
        record, key, value, position = raw.record, raw.key, raw.value, raw.position
        source, request_id = record.source.value, record.request_id
        dead = self.refusals.dead
        last = closed if closed is not None else pending
        assert last is not None
        if closed is not None and not closed.amendable:
            late = InputError(
                f"event for request {raw.ref}, which is already closed (at its "
                f"{closed.reason.value}: nothing comes after it)"
            )
            dead(out, late, key, value, position, source=source, request_id=request_id)
            return None
        revision = last.revision if closed is not None else last.revision - 1
        kept = self.table.amendable.get(ref)
        if kept is None or kept.revision != revision:
            gone = InputError(
                f"event for request {raw.ref}, closed at its {last.reason.value} and no "
                f"longer amendable: its state (revision {revision}) is not kept any more "
                "(older than STREAMTALLY_STATE_TTL)"
            )
            dead(out, gone, key, value, position, source=source, request_id=request_id)
            return None
        if closed is not None and record.seq in kept.seqs:
            again = InputError(
                f"event seq {record.seq} of request {raw.ref}, which it had when it closed "
                f"at its {closed.reason.value}: a duplicate, nothing to amend"
            )
            dead(out, again, key, value, position, source=source, request_id=request_id)
            return None
        if closed is not None and record.is_keepalive:
            idle = InputError(
                f"keep-alive of request {raw.ref} after its close at its "
                f"{closed.reason.value}: no billable information, nothing to amend"
            )
            dead(out, idle, key, value, position, source=source, request_id=request_id)
            return None
        refused = self.refusals.refused_by_limits(record.tenant)
        if refused is not None:
            dead(out, refused, key, value, position, source=source, request_id=request_id)
            return None
        return self._reopen(ref, raw, kept, pending)

    def _reopen(self, ref: RequestRef, raw: _Raw, kept: Amendable, pending: Closed | None) -> _Open:
        """Open `ref` again as revision ``kept.revision + 1``: its kept records applied
        in sequence order through a new `Normalizer` and `Fold` (those after a missing
        one wait for it), counted and written nothing of (they were, at its first close).
        """
        decode = avro.decode_raw_engine_output if kept.engine else avro.decode_raw_sse_event
        records = sorted(((decode(k.value), k) for k in kept.records), key=lambda pair: pair[0].seq)
        first = records[0][0] if records else raw.record
        record = raw.record
        table = self.table
        table.closed.pop(ref, None)
        state = _Open(
            normalizer=Normalizer(
                first.source,
                ref.request_id,
                model=first.model if isinstance(first, RawEngineOutput) else None,
            ),
            fold=Fold(ref.request_id, first.source, max_text_bytes=self.limits.text_bytes),
            tenant=record.tenant,
            source=first.source.value,
            next_seq=0,
            last_time=first.received_at,
            latest=first.received_at,
            last_input=0.0,
            max_offset=raw.position.offset,
            topic_partition=(kept.topic, kept.partition),
            close_at=pending
            if pending is not None
            else table.planned_close(ref, kept.revision + 1),
            revision=kept.revision + 1,
            previous=kept.bill,
            previous_marker=kept.marker,
            floor=kept.closed_offset,
        )
        table.open_to(ref, state)
        if pending is not None:
            table.pending_close.pop(ref, None)
        state.uncounted = {again.seq for again, _ in records}
        counters = self.counters
        dead = counters.dead_lettered
        silent = Outputs()
        folder = self.folder
        for again, k in records:
            position = Position(kept.topic, kept.partition, k.offset)
            one = _Raw(again, position, None, k.value, RequestRef(again.tenant, again.request_id))
            if again.seq == state.next_seq:
                folder.fold(silent, ref, state, one, closing=True)
                while state.next_seq in state.waiting:
                    folder.fold(silent, ref, state, state.waiting.pop(state.next_seq), closing=True)
            elif again.seq > state.next_seq:
                state.waiting[again.seq] = one
        counters.dead_lettered = dead  # (none: each was applied before, and is again)
        for again, _ in records:
            state.latest = max(state.latest, again.received_at)
        return state
