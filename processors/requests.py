"""The stream-processing logic, free of Kafka and Redis: raw records in, outputs out.

`RequestProcessor` keeps one `_Open` state per request in flight (its
`Normalizer` and its `Fold`), keyed by the request's identity, `RequestRef`
(tenant and request id: two tenants that reuse one provider id are two
requests, neither can close or bill the other), applies each raw record in
sequence order, and
closes a request at its end-of-stream marker or when it has been quiet for
longer than the timeout.  The faust agents (`processors.app`) only move
bytes between topics, Redis and this class; `streamtally fold` runs the same
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

import logging
import time
from collections import Counter as CounterOf
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from streamtally.core.fold import NO_FINISH, Fold
from streamtally.core.identity import RequestRef
from streamtally.core.models import Tokens
from streamtally.core.normalize import Normalizer
from streamtally.core.pricing import PriceTable
from streamtally.core.sse import SseEvent
from streamtally.errors import InputError
from streamtally.processors.clock import InputClock, input_time
from streamtally.processors.limits import (
    PERMANENT_ERRORS,
    TOMBSTONE,
    Limits,
    refused_at_the_edge,
)
from streamtally.processors.outputs import (
    Closed,
    CloseReason,
    Completed,
    Counters,
    Outputs,
    Position,
)
from streamtally.wire import avro
from streamtally.wire.billing import bill
from streamtally.wire.records import (
    BillingEvent,
    DeadLetter,
    EventKind,
    RawEngineOutput,
    RawSseEvent,
)

log = logging.getLogger(__name__)

__all__ = [
    "CloseReason",
    "Closed",
    "Completed",
    "Counters",
    "Limits",
    "Outputs",
    "Position",
    "RequestProcessor",
]

#: How many closed requests are remembered locally (Redis remembers them all).
CLOSED_MEMORY = 200_000

RawRecord = RawSseEvent | RawEngineOutput


@dataclass(frozen=True, slots=True)
class _Raw:
    """A decoded raw record with where it came from and its original bytes."""

    record: RawRecord
    position: Position
    key: bytes | None
    value: bytes
    #: The request the record belongs to: (tenant, request id).
    ref: RequestRef


@dataclass(slots=True)
class _Open:
    normalizer: Normalizer
    fold: Fold
    tenant: str
    source: str
    next_seq: int
    last_time: datetime
    #: Its partition's input clock at its last record (`processors.clock`).
    last_input: float
    #: The highest offset of any record of this request seen so far: where it closes.
    max_offset: int
    topic_partition: tuple[str, int]
    records: int = 0
    duplicates: int = 0
    #: Records that arrived ahead of a missing sequence number, by seq, with their bytes.
    waiting: dict[int, _Raw] = field(default_factory=dict)
    #: Set when an earlier run decided to close this request here.
    close_at: Closed | None = None


class RequestProcessor:
    """Applies raw records of many interleaved requests; see the module docstring."""

    def __init__(
        self,
        prices: PriceTable,
        *,
        timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits | None = None,
    ) -> None:
        self.prices = prices
        #: The same table without a single price: what an unpriceable request is billed by.
        self._no_prices = PriceTable.from_dict(
            {
                "version": prices.version,
                "currency": prices.currency,
                "unit": prices.unit,
                "models": {},
            },
            origin="no prices",
        )
        self.timeout = timeout
        self.limits = Limits() if limits is None else limits
        self._open_by_tenant: CounterOf[str] = CounterOf()
        self.counters = Counters()
        #: When requests went quiet: the partitions' input clocks (see `processors.clock`).
        self.input_clock = InputClock(clock)
        #: Whether a partition is caught up and answering (the worker wires its consumer in;
        #: None: every partition is, as in a test or a replay with no consumer to ask).
        self.live: Callable[[Hashable, int], bool] | None = None
        self._open: dict[RequestRef, _Open] = {}
        self._closed: OrderedDict[RequestRef, Closed] = OrderedDict()
        self._pending_close: dict[RequestRef, Closed] = {}

    @property
    def open_requests(self) -> int:
        return len(self._open)

    # -- what the agent asks Redis about ------------------------------------------------

    def unknown(self, refs: Iterable[RequestRef]) -> set[RequestRef]:
        """Requests this process knows nothing of: ask Redis whether they closed."""
        return {
            r
            for r in refs
            if r not in self._open and r not in self._closed and r not in self._pending_close
        }

    def is_open(self, ref: RequestRef) -> bool:
        return ref in self._open

    def learn_closed(self, ref: RequestRef, closed: Closed) -> None:
        """An earlier run closed `ref` (applied) or decided to (not yet applied)."""
        if closed.applied:
            self._remember(ref, closed)
        else:
            self._pending_close[ref] = closed

    # -- records ------------------------------------------------------------------------
    #
    # A message is first `read` (refused at the edge, or decoded: a `_Raw` whose `ref`
    # says which request it belongs to), then, once the agent has asked Redis about
    # the batch's unknown requests, `arrive`d.  `handle_sse` and `handle_engine` do both.

    def read_sse(
        self, key: bytes | None, value: bytes | None, position: Position, out: Outputs
    ) -> _Raw | None:
        """Decode one message of the raw SSE topic; None when it was dead-lettered into `out`."""
        return self._read(avro.decode_raw_sse_event, key, value, position, out)

    def read_engine(
        self, key: bytes | None, value: bytes | None, position: Position, out: Outputs
    ) -> _Raw | None:
        """Decode one message of the raw engine topic; None when it was dead-lettered."""
        return self._read(avro.decode_raw_engine_output, key, value, position, out)

    def handle_sse(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs | None = None,
    ) -> Outputs:
        """One message of the raw SSE topic; its outputs are added to `out` (or a new one)."""
        out = Outputs() if out is None else out
        raw = self.read_sse(key, value, position, out)
        if raw is not None:
            self.arrive(out, raw)
        return out

    def handle_engine(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs | None = None,
    ) -> Outputs:
        """One message of the raw engine-output topic; its outputs are added to `out`."""
        out = Outputs() if out is None else out
        raw = self.read_engine(key, value, position, out)
        if raw is not None:
            self.arrive(out, raw)
        return out

    def expire(self) -> Outputs:
        """Close every request that has been quiet for longer than the timeout."""
        out = Outputs()
        clock = self.input_clock
        clock.tick(self.live)
        timeout = self.timeout
        quiet = []
        for ref, state in self._open.items():
            now = clock.now(state.topic_partition)
            if now is not None and now - state.last_input > timeout:
                quiet.append(ref)
        for ref in quiet:
            state = self._open[ref]
            reason = CloseReason.GAP if state.waiting else CloseReason.TIMEOUT
            self._finish(out, ref, state, reason)
            self.counters.requests_timed_out += 1
        return out

    def _refused_by_limits(self, tenant: str) -> InputError | None:
        limits = self.limits
        if len(self._open) >= limits.open_requests:
            return InputError(
                f"the worker holds {len(self._open)} open requests, the limit "
                f"(STREAMTALLY_MAX_OPEN_REQUESTS={limits.open_requests})"
            )
        if self._open_by_tenant[tenant] >= limits.open_per_tenant:
            return InputError(
                f"tenant {tenant!r} has {self._open_by_tenant[tenant]} open requests, the limit "
                f"(STREAMTALLY_MAX_OPEN_PER_TENANT={limits.open_per_tenant})"
            )
        return None

    def _release(self, tenant: str) -> None:
        left = self._open_by_tenant[tenant] - 1
        if left > 0:
            self._open_by_tenant[tenant] = left
        else:
            del self._open_by_tenant[tenant]

    def drop_partitions(self, topic_partitions: set[tuple[str, int]]) -> list[RequestRef]:
        """Forget the open requests of partitions this worker no longer owns (a rebalance).

        Their records were not acknowledged, so the partition's next owner
        receives them all again.
        """
        dropped = [r for r, s in self._open.items() if s.topic_partition in topic_partitions]
        for ref in dropped:
            state = self._open.pop(ref)
            self._release(state.tenant)
            self.counters.revoked += len(state.waiting)
        self.input_clock.forget(topic_partitions)
        return dropped

    # -- internals: each adds what it produces to `out` ----------------------------------

    def _read(
        self,
        decode: Callable[[bytes], RawRecord],
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
    ) -> _Raw | None:
        self.counters.received += 1
        refused = refused_at_the_edge(key, value)
        if refused is not None or value is None:  # dead-lettered, so the counts reconcile
            self._refuse(out, refused or TOMBSTONE, key, value or b"", position)
            return None
        try:
            record = decode(value)
        except PERMANENT_ERRORS as exc:
            self._refuse(out, exc, key, value, position)
            return None
        if key != record.request_id.encode():
            reason = InputError(
                f"message key {key!r} is not the record's request id {record.request_id!r}"
            )
            self._refuse(
                out,
                reason,
                key,
                value,
                position,
                source=record.source.value,
                request_id=record.request_id,
            )
            return None
        return _Raw(record, position, key, value, RequestRef(record.tenant, record.request_id))

    def _refuse(
        self,
        out: Outputs,
        exc: Exception,
        key: bytes | None,
        value: bytes,
        position: Position,
        *,
        source: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Dead-letter a record refused before it reached a request; it still moves its
        partition's offset (what "caught up" is judged by), without a time."""
        self.input_clock.saw((position.topic, position.partition), position.offset)
        self._dead(out, exc, key, value, position, source=source, request_id=request_id)

    def arrive(self, out: Outputs, raw: _Raw) -> None:
        """Apply a record `read` returned (in partition order), adding its outputs to `out`."""
        record, key, value, position, ref = raw.record, raw.key, raw.value, raw.position, raw.ref
        request_id = record.request_id
        source = record.source.value
        tp = (position.topic, position.partition)
        input_now = self.input_clock.saw(
            tp, position.offset, input_time(record.received_at.timestamp(), position.timestamp)
        )
        closed = self._closed.get(ref)
        if closed is not None:
            if position.offset <= closed.offset:
                self.counters.replayed += 1
                return
            late = InputError(f"event for request {ref}, which is already closed")
            self._dead(out, late, key, value, position, source=source, request_id=request_id)
            return
        state = self._open.get(ref)
        if state is None and record.kind is EventKind.END and record.seq == 0:
            # An end marker that is a request's first record: no event to bill (a phantom
            # 0-cost request otherwise).  (A later END ahead of its events waits for them.)
            lone = InputError(f"end marker of request {ref}, which has no events")
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
                    request_id,
                    model=record.model if isinstance(record, RawEngineOutput) else None,
                ),
                fold=Fold(request_id, record.source, max_text_bytes=self.limits.text_bytes),
                tenant=record.tenant,
                source=source,
                next_seq=0,
                last_time=record.received_at,
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

    def _apply(
        self, out: Outputs, ref: RequestRef, state: _Open, raw: _Raw, *, closing: bool = False
    ) -> None:
        """Apply the next record of a request; an END closes it unless it is `closing` already."""
        record, position = raw.record, raw.position
        state.next_seq = record.seq + 1
        state.last_time = record.received_at
        if record.kind is EventKind.END:
            state.records += 1
            self.counters.applied += 1
            if not closing:
                self._finish(out, ref, state, CloseReason.END)
            return
        event: Any = (
            SseEvent(record.data, record.event, record.sse_id)
            if isinstance(record, RawSseEvent)
            else record.payload
        )
        try:
            chunks = state.normalizer.feed(event, record.received_at)
            values = [avro.encode_chunk(chunk) for chunk in chunks]
        except PERMANENT_ERRORS as exc:
            self._dead(
                out,
                exc,
                raw.key,
                raw.value,
                position,
                source=state.source,
                request_id=ref.request_id,
            )
            return
        state.records += 1
        self.counters.applied += 1
        for chunk in chunks:
            state.fold.add(chunk)
        out.chunks.extend(chunks)
        out.chunk_values.extend(values)
        out.chunk_refs.extend([ref] * len(chunks))

    def _finish(self, out: Outputs, ref: RequestRef, state: _Open, reason: CloseReason) -> None:
        """Close a request: at its END, by timeout, or over a gap (see `CloseReason`)."""
        del self._open[ref]
        self._release(state.tenant)
        message = NO_FINISH
        if reason is CloseReason.GAP:
            first_missing = state.next_seq
            for seq in sorted(state.waiting):
                self._apply(out, ref, state, state.waiting.pop(seq), closing=True)
            state.fold.fail(
                f"raw events missing from seq {first_missing}: closed after "
                f"{self.timeout:g}s without them"
            )
        elif reason is CloseReason.TIMEOUT:
            message = f"request timed out: no end-of-stream marker within {self.timeout:g}s"
        elif reason is CloseReason.LIMIT:
            message = (
                f"request closed at its record limit ({self.limits.records_per_request} records)"
            )
        for seq in sorted(state.waiting):  # after the END marker: too late to belong
            waiting = state.waiting.pop(seq)
            late = InputError(f"event seq {seq} of request {ref} after its end marker")
            self._dead(
                out,
                late,
                waiting.key,
                waiting.value,
                waiting.position,
                source=state.source,
                request_id=ref.request_id,
            )
        self._close(out, ref, state, message, Closed(state.max_offset, reason, False))

    def _close(
        self, out: Outputs, ref: RequestRef, state: _Open, reason: str, closed: Closed
    ) -> None:
        when = state.last_time
        chunks = state.normalizer.end(when, fallback_request_id=ref.request_id)
        values = [avro.encode_chunk(chunk) for chunk in chunks]
        for chunk in chunks:
            state.fold.add(chunk)
        tokens = state.fold.result(ended=True, reason=reason)
        tokens_value = avro.encode_tokens(tokens)
        billing, billing_value = self._bill(tokens, state.tenant, when)
        self._remember(ref, Closed(closed.offset, closed.reason, applied=True))
        self.counters.requests_completed += 1
        out.chunks.extend(chunks)
        out.chunk_values.extend(values)
        out.chunk_refs.extend([ref] * len(chunks))
        out.completed.append(
            Completed(
                tokens,
                billing,
                closed,
                state.records,
                state.duplicates,
                tokens_value=tokens_value,
                billing_value=billing_value,
            )
        )

    def _bill(self, tokens: Tokens, tenant: str, when: datetime) -> tuple[BillingEvent, bytes]:
        """The request's billing event and its Avro value; never fails on the price.

        An unknown model, or a cost the billing record cannot carry (beyond
        decimal(38,12)), is billed as unpriced: ``priced=False``, cost 0,
        counted, and logged for an operator to re-rate.  Should pricing fail
        otherwise, the request is billed by a table without a single price:
        unpriced too.
        """
        try:
            billing = bill(tokens, tenant, when, self.prices)
            value = avro.encode_billing_event(billing)
        except PERMANENT_ERRORS as exc:
            log.warning(
                "request %s (tenant %s, model %s) billed at 0 as unpriced: %s",
                ascii(tokens.request_id),
                ascii(tenant),
                ascii(tokens.model),
                exc,
            )
            billing = bill(tokens, tenant, when, self._no_prices)
            value = avro.encode_billing_event(billing)
        if not billing.priced:  # counted once, whichever way it was billed
            self.counters.unpriced += 1
        return billing, value

    def _remember(self, ref: RequestRef, closed: Closed) -> None:
        self._closed[ref] = closed
        self._closed.move_to_end(ref)
        if len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def _dead(
        self,
        out: Outputs,
        exc: Exception,
        key: bytes | None,
        value: bytes,
        position: Position,
        *,
        source: str | None = None,
        request_id: str | None = None,
    ) -> None:
        self.counters.dead_lettered += 1
        # The record's own Kafka time, not the wall clock: a replay dead-letters
        # the same record into the same bytes.
        when = (
            datetime.fromtimestamp(position.timestamp, UTC)
            if position.timestamp is not None
            else datetime(1970, 1, 1, tzinfo=UTC)
        )
        out.dead_letters.append(
            DeadLetter(
                topic=position.topic,
                partition=position.partition,
                offset=position.offset,
                key=key,
                value=value,
                reason=str(exc),
                error_type=type(exc).__name__,
                source=source,
                request_id=request_id,
                dead_lettered_at=when,
            )
        )
