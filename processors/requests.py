"""The stream-processing logic, free of Kafka and Redis: raw records in, outputs out.

`RequestProcessor` keeps one `_Open` state per request in flight (its
`Normalizer` and its `Fold`), keyed by the request's identity, `RequestRef`
(tenant and request id: two tenants that reuse one provider id are two
requests, neither can close or bill the other), applies each raw record in
sequence order, and
closes a request at its end-of-stream marker or when it has been quiet for
longer than the timeout (its source's, `timeout_of`: ``STREAMTALLY_REQUEST_TIMEOUTS``
over ``STREAMTALLY_REQUEST_TIMEOUT``; a keep-alive record, `KEEPALIVE_EVENT`, is a record
like any other, so a call its producer still keeps alive never goes quiet).  The faust
agents (`processors.app`) only move bytes between topics, Redis and this class;
`streamtally fold` runs the same
`Normalizer` and `Fold`, so the pipeline and the command cannot disagree.

Replays.  The worker acknowledges a request's raw records only once the
request is closed and its outputs are durable, so after a crash Kafka
redelivers every record of every request that was still open.  What the
processor cannot know by itself is which requests an earlier run already
closed: the agent `read`s a batch first (decoding tells each record's
request), asks Redis about every request it has not seen yet and hands the
answers to `learn_closed`, then lets each record `arrive`.  A record of
a closed request at or before its closing offset is a replay (dropped, it was
counted when the request closed); after it, a late event (dead-lettered).  A
request an earlier run decided to close but did not finish writing is closed
again at the same offset for the same reason, so its outputs are the same.

Events in parts.  An SSE event too large for one raw record comes as part
records (`PART_EVENT`, see `streamtally.producers.tap`) and a last record under
its own name: each part is applied (counted, in the provenance, no chunk) by
keeping its data in the request's `_Open`; the last record's data is their sum,
normalised as one event.  In sequence order, so parts arriving out of order or
twice are held or dropped as any record.  The part (or last record) that takes
the joined event past `Limits.event_bytes` is dead-lettered with the reason
and the request closed at it with what it had (`CloseReason.LIMIT`), as at its
record limit: a replay closes it there again.  Parts without their last record
at the close are not billed, and the request's Tokens says so.

New calls.  A producer keyed by the provider's id can send two calls with one id
(Ollama's ids repeat).  A record of seq 0 of an id whose request closed, after its
closing offset and received after every record of it (`Closed.last_received`, kept in
the close marker), starts a new call: the request ``call_request_id(id, received_at)``
(`call_of`), with its own Tokens, close marker and billing `event_id`; later records of
the id belong to it.  A re-sent record keeps its receive time, so it never starts one.
The id is a function of the record, so a replay derives it again: the agent asks Redis
about the new calls a batch may start too (`to_learn`), and the commit gate never
stops inside a new call's offsets (`span_of`), so a replay always meets its first
record before its later ones.  Calls of one id that overlap still merge (the second's
records are duplicates), and a new call's later record that arrives before its first
is late: producers that know their calls give each its own id (`new_call_id`).

Every raw record ends in exactly one of: applied, duplicate (a re-sent
sequence number, dropped), dead-lettered (with the reason), or replayed
(counted by the run that closed its request).  Per closed request the
counts of applied records and duplicates travel with its outputs; dead
letters are counted by position, so a replay never counts twice.

Poison.  Every output is encoded here, as it is made, not later in a sink:
a record whose event cannot be decoded, validated, normalised or encoded
(a lone surrogate, a count beyond a 64-bit long, ...) is dead-lettered with
the reason before anything of it is folded, and touches nothing else of its
batch.  A request's close cannot fail on its price: a cost the billing record
cannot carry is billed as unpriced (cost 0, counted in
`Counters.unpriced`) for an operator to re-rate.  The sinks then only move
bytes, so the only failures left to them are transient (retried).  What is
refused before it is decoded, and the limits, are in `processors.limits`;
the results are in `processors.outputs`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from streamtally.core.fold import Fold
from streamtally.core.identity import RequestRef, call_request_id, epoch_micros
from streamtally.core.normalize import Normalizer
from streamtally.errors import InputError
from streamtally.processors._closing import _Closing
from streamtally.processors._records import RawRecord, _Open, _Raw
from streamtally.processors.amendable import Amendable
from streamtally.processors.clock import input_time
from streamtally.processors.limits import Limits
from streamtally.processors.outputs import (
    Closed,
    CloseReason,
    Completed,
    Counters,
    Outputs,
    Position,
    Refused,
)
from streamtally.wire import avro
from streamtally.wire.records import EventKind, RawEngineOutput

__all__ = [
    "CloseReason",
    "Closed",
    "Completed",
    "Counters",
    "Limits",
    "Outputs",
    "Position",
    "RawRecord",
    "Refused",
    "RequestProcessor",
]


class Message(Protocol):
    """A raw record as the agent hands it over (`processors.source.RawMessage`)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> float | None: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


class RequestProcessor(_Closing):
    """Applies raw records of many interleaved requests; see the module docstring."""

    # -- records ------------------------------------------------------------------------
    #
    # A message is first `read` (refused at the edge, or decoded: a `_Raw` whose `ref`
    # says which request it belongs to), then, once the agent has asked Redis about
    # the batch's unknown requests, `arrive`d.  `handle_sse` and `handle_engine` do both.
    # `read` is `examine` (decoding and the edge's checks: pure, so the worker does it
    # for the next batch while one is being written) and `take` (counting it in).

    def examine_sse(
        self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> RawRecord | Refused:
        """What a message of the raw SSE topic holds, or why it is refused; changes nothing.

        `headers` are the record's Kafka headers (its ``st-auth`` claim, checked when the
        processor has a `trust` file).
        """
        return self._examine(avro.decode_raw_sse_event, key, value, headers)

    def examine_engine(
        self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> RawRecord | Refused:
        """What a message of the raw engine topic holds, or why it is refused."""
        return self._examine(avro.decode_raw_engine_output, key, value, headers)

    def read_sse(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> _Raw | None:
        """Decode one message of the raw SSE topic; None when it was dead-lettered into `out`."""
        return self.take(self.examine_sse(key, value, headers), key, value, position, out)

    def read_engine(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> _Raw | None:
        """Decode one message of the raw engine topic; None when it was dead-lettered."""
        return self.take(self.examine_engine(key, value, headers), key, value, position, out)

    # -- a batch at a time: the agent's loops, here so that they run compiled too -------

    def examine_batch(
        self, messages: Sequence[Message], sse_topic: str
    ) -> list[RawRecord | Refused]:
        """`examine_sse` (a message of `sse_topic`) or `examine_engine` every message."""
        return [
            (self.examine_sse if m.topic == sse_topic else self.examine_engine)(
                m.key, m.value, m.headers
            )
            for m in messages
        ]

    def take_batch(
        self, messages: Sequence[Message], examined: Sequence[RawRecord | Refused], out: Outputs
    ) -> list[_Raw | None]:
        """`take` every message of a batch (in order) with what `examine_*` made of it."""
        return [
            self.take(
                seen, m.key, m.value, Position(m.topic, m.partition, m.offset, m.timestamp), out
            )
            for m, seen in zip(messages, examined, strict=True)
        ]

    def arrive_batch(
        self,
        out: Outputs,
        messages: Sequence[Message],
        raws: Sequence[_Raw | None],
        partitions: dict[tuple[str, int], Hashable],
        partition: Callable[[str, int], Hashable],
    ) -> list[tuple[Hashable, int, RequestRef | None, int | None]]:
        """`arrive` every record `take_batch` returned; per message, what the commit gate
        holds: (its partition, named by `partitions` or else `partition(topic, number)`,
        its offset, its request while that is open, and `span`): see `span_of`."""
        holds: list[tuple[Hashable, int, RequestRef | None, int | None]] = []
        for m, raw in zip(messages, raws, strict=True):
            ref = None
            span = None
            if raw is not None:
                call = self.call_of(raw)
                was_open = call in self._open
                self.arrive_as(out, raw, call)
                if call in self._open:
                    ref = call
                if raw.record.seq == 0 and call != raw.ref:
                    span = self.span_of(call, m.offset, was_open)
            key = (m.topic, m.partition)
            tp = partitions.get(key)
            if tp is None:
                tp = partitions[key] = partition(m.topic, m.partition)
            holds.append((tp, m.offset, ref, span))
        return holds

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
        if not was_open and call in self._open:
            return -1
        closed = self._closed.get(call)
        if closed is not None and offset <= closed.offset:
            return closed.offset
        return None

    def handle_sse(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> Outputs:
        """One message of the raw SSE topic; its outputs are added to `out` (or a new one)."""
        out = Outputs() if out is None else out
        raw = self.read_sse(key, value, position, out, headers=headers)
        if raw is not None:
            self.arrive(out, raw)
        return out

    def handle_engine(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> Outputs:
        """One message of the raw engine-output topic; its outputs are added to `out`."""
        out = Outputs() if out is None else out
        raw = self.read_engine(key, value, position, out, headers=headers)
        if raw is not None:
            self.arrive(out, raw)
        return out

    def expire(self) -> Outputs:
        """Close every request that has been quiet for longer than its timeout (its
        source's, `timeout_of`)."""
        out = Outputs()
        clock = self.input_clock
        clock.tick(self.live)
        timeout = self.timeout
        timeouts = self.timeouts
        quiet = []
        for ref, state in self._open.items():
            now = clock.now(state.topic_partition)
            limit = timeouts.get(state.source, timeout) if timeouts else timeout
            if now is not None and now - state.last_input > limit:
                quiet.append(ref)
        for ref in quiet:
            state = self._open[ref]
            reason = CloseReason.GAP if state.waiting else CloseReason.TIMEOUT
            self._finish(out, ref, state, reason)
            self.counters.requests_timed_out += 1
        return out

    def arrive(self, out: Outputs, raw: _Raw) -> RequestRef:
        """Apply a record `read` returned (in partition order), adding its outputs to `out`;
        returns the request it was a record of (its own, or a new call of its id)."""
        call = self.call_of(raw)
        self.arrive_as(out, raw, call)
        return call

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
        last = closed if closed is not None else pending
        assert last is not None
        if closed is not None and not closed.amendable:
            late = InputError(
                f"event for request {raw.ref}, which is already closed (at its "
                f"{closed.reason.value}: nothing comes after it)"
            )
            self._dead(out, late, key, value, position, source=source, request_id=request_id)
            return None
        revision = last.revision if closed is not None else last.revision - 1
        kept = self._amendable.get(ref)
        if kept is None or kept.revision != revision:
            gone = InputError(
                f"event for request {raw.ref}, closed at its {last.reason.value} and no "
                f"longer amendable: its state (revision {revision}) is not kept any more "
                "(older than STREAMTALLY_STATE_TTL)"
            )
            self._dead(out, gone, key, value, position, source=source, request_id=request_id)
            return None
        if closed is not None and record.seq in kept.seqs:
            again = InputError(
                f"event seq {record.seq} of request {raw.ref}, which it had when it closed "
                f"at its {closed.reason.value}: a duplicate, nothing to amend"
            )
            self._dead(out, again, key, value, position, source=source, request_id=request_id)
            return None
        if closed is not None and record.is_keepalive:
            idle = InputError(
                f"keep-alive of request {raw.ref} after its close at its "
                f"{closed.reason.value}: no billable information, nothing to amend"
            )
            self._dead(out, idle, key, value, position, source=source, request_id=request_id)
            return None
        refused = self._refused_by_limits(record.tenant)
        if refused is not None:
            self._dead(out, refused, key, value, position, source=source, request_id=request_id)
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
        self._open_by_tenant[record.tenant] += 1
        self._closed.pop(ref, None)
        state = self._open[ref] = _Open(
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
            else self._planned_close(ref, kept.revision + 1),
            revision=kept.revision + 1,
            previous=kept.bill,
            previous_marker=kept.marker,
            floor=kept.closed_offset,
        )
        if pending is not None:
            self._pending_close.pop(ref, None)
        state.uncounted = {again.seq for again, _ in records}
        counters = self.counters
        dead = counters.dead_lettered
        silent = Outputs()
        for again, k in records:
            position = Position(kept.topic, kept.partition, k.offset)
            one = _Raw(again, position, None, k.value, RequestRef(again.tenant, again.request_id))
            if again.seq == state.next_seq:
                self._apply(silent, ref, state, one, closing=True)
                while state.next_seq in state.waiting:
                    self._apply(silent, ref, state, state.waiting.pop(state.next_seq), closing=True)
            elif again.seq > state.next_seq:
                state.waiting[again.seq] = one
        counters.dead_lettered = dead  # (none: each was applied before, and is again)
        for again, _ in records:
            state.latest = max(state.latest, again.received_at)
        return state

    def _planned_close(self, ref: RequestRef, revision: int) -> Closed | None:
        """Where an earlier run closed revision `revision` of `ref` (`plan_closes`)."""
        planned = self._planned.get(ref)
        if not planned:
            return None
        closed = planned.pop(revision, None)
        if not planned:
            del self._planned[ref]
        return closed

    def call_of(self, raw: _Raw) -> RequestRef:
        """The request a record belongs to: its (tenant, request id), or a new call of it.

        The rule (any producer): a record of seq 0 of a request id whose request is
        closed starts a new call when it comes after the close (a higher offset) and was
        received after every record of the closed request (`Closed.last_received`).  The
        new call is the request ``call_request_id(id, received_at)``: a function of the
        record, so every replay derives it again.  A re-sent record of the closed request
        keeps its receive time, so it is no new call: it stays a replay or a late record.
        Later records of the id (seq > 0) belong to its latest call (`_calls`), as does a
        seq 0 while that call is open (a duplicate: overlapping calls of one id merge).
        """
        ref = raw.ref
        calls = self._calls
        current = calls.get(ref, ref) if calls else ref
        if current in self._open:
            return current
        record = raw.record
        if record.seq == 0:
            first = self._closed.get(ref)
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

    def arrive_as(self, out: Outputs, raw: _Raw, ref: RequestRef) -> None:
        """`arrive`, the record taken as one of the request `ref` (`call_of`)."""
        record, key, value, position = raw.record, raw.key, raw.value, raw.position
        request_id = record.request_id
        source = record.source.value
        tp = (position.topic, position.partition)
        input_now = self.input_clock.saw(
            tp, position.offset, input_time(record.received_at.timestamp(), position.timestamp)
        )
        closed = self._closed.get(ref)
        state: _Open | None
        if closed is not None:
            if position.offset <= closed.offset:
                self.counters.replayed += 1
                return
            state = self._amend(out, raw, ref, closed, None)
            if state is None:
                return
        else:
            state = self._open.get(ref)
            if state is None:
                pending = self._pending_close.get(ref)
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
            self._dead(out, lone, key, value, position, source=source, request_id=request_id)
            return
        if state is None:
            refused = self._refused_by_limits(record.tenant)
            if refused is not None:
                self._dead(out, refused, key, value, position, source=source, request_id=request_id)
                return
            self._open_by_tenant[record.tenant] += 1
            state = self._open[ref] = _Open(
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
                close_at=self._pending_close.pop(ref, None),
            )
        elif source != state.source:
            mixed = InputError(
                f"request {ref} changed source mid-stream ({state.source} → {source})"
            )
            self._dead(out, mixed, key, value, position, source=source, request_id=request_id)
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
            self._dead(out, many, key, value, position, source=source, request_id=request_id)
            state.max_offset = max(state.max_offset, position.offset)
            self._finish(out, ref, state, CloseReason.LIMIT)
            return
        state.last_input = 0.0 if input_now is None else input_now
        state.max_offset = max(state.max_offset, position.offset)
        if record.seq < state.next_seq or record.seq in state.waiting:
            self.counters.duplicates += 1
            state.duplicates += 1
        elif record.seq > state.next_seq:
            state.waiting[record.seq] = raw  # wait for the gap
        else:
            self._apply(out, ref, state, raw)
            while ref in self._open and state.next_seq in state.waiting:
                self._apply(out, ref, state, state.waiting.pop(state.next_seq))
        planned = state.close_at
        if planned is not None and ref in self._open and position.offset >= planned.offset:
            # An earlier run closed this request here: close it the same way again.
            self._finish(out, ref, state, planned.reason)
