"""The stream-processing logic, free of Kafka and Redis: raw records in, outputs out.

`RequestProcessor` keeps one `_Open` state per request in flight (its
`Normalizer` and its `Fold`), applies each raw record, and closes a request at
its end-of-stream marker or when it has been quiet for longer than the
timeout.  The faust agents (`processors.agents`) only move bytes between
topics and this class; `streamtally fold` runs the same `Normalizer` and
`Fold`, so the pipeline and the command cannot disagree.

Every raw record ends in exactly one of: applied, duplicate (a re-sent
sequence number, dropped), or dead-lettered (with the reason), so the
counts reconcile: in = applied + duplicates + dead-lettered.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from streamtally import avro
from streamtally.billing import bill
from streamtally.errors import InputError
from streamtally.fold import NO_FINISH, Fold
from streamtally.models import Chunk, Tokens, utc_now
from streamtally.normalize import Normalizer
from streamtally.pricing import PriceTable
from streamtally.records import BillingEvent, DeadLetter, EventKind, RawEngineOutput, RawSseEvent
from streamtally.sse import SseEvent

__all__ = ["Completed", "Counters", "Outputs", "Position", "RequestProcessor"]

#: How many closed request ids are remembered to dead-letter late events.
CLOSED_MEMORY = 200_000


@dataclass(frozen=True, slots=True)
class Position:
    """Where a raw record came from."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Completed:
    """A finished request: its record and its billing event."""

    tokens: Tokens
    billing: BillingEvent


@dataclass(slots=True)
class Outputs:
    chunks: list[Chunk] = field(default_factory=list)
    completed: list[Completed] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)

    def extend(self, other: Outputs) -> None:
        self.chunks.extend(other.chunks)
        self.completed.extend(other.completed)
        self.dead_letters.extend(other.dead_letters)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.completed or self.dead_letters)


@dataclass(slots=True)
class Counters:
    """Raw records by outcome; `received == applied + duplicates + dead_lettered`."""

    received: int = 0
    applied: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    requests_completed: int = 0
    requests_timed_out: int = 0


@dataclass(slots=True)
class _Open:
    normalizer: Normalizer
    fold: Fold
    tenant: str
    next_seq: int
    last_time: datetime
    last_seen: float


class RequestProcessor:
    """Applies raw records of many interleaved requests; see the module docstring."""

    def __init__(
        self,
        prices: PriceTable,
        *,
        timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prices = prices
        self.timeout = timeout
        self.counters = Counters()
        self._clock = clock
        self._open: dict[str, _Open] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def handle_sse(self, key: bytes | None, value: bytes, position: Position) -> Outputs:
        """One message of the raw SSE topic."""
        self.counters.received += 1
        try:
            record = avro.decode_raw_sse_event(value)
        except InputError as exc:
            return self._dead(exc, key, value, position)
        event = SseEvent(record.data, record.event, record.sse_id)
        return self._apply(record, event, key, value, position)

    def handle_engine(self, key: bytes | None, value: bytes, position: Position) -> Outputs:
        """One message of the raw engine-output topic."""
        self.counters.received += 1
        try:
            record = avro.decode_raw_engine_output(value)
        except InputError as exc:
            return self._dead(exc, key, value, position)
        return self._apply(record, record.payload, key, value, position)

    def expire(self) -> Outputs:
        """Close every request that has been quiet for longer than the timeout."""
        out = Outputs()
        deadline = self._clock() - self.timeout
        for request_id in [r for r, s in self._open.items() if s.last_seen < deadline]:
            state = self._open.pop(request_id)
            reason = f"request timed out: no end-of-stream marker within {self.timeout:g}s"
            out.extend(self._close(request_id, state, state.last_time, reason))
            self.counters.requests_timed_out += 1
        return out

    def _apply(
        self,
        record: RawSseEvent | RawEngineOutput,
        event: Any,
        key: bytes | None,
        value: bytes,
        position: Position,
    ) -> Outputs:
        request_id = record.request_id
        source = record.source.value
        if key is not None and key != request_id.encode():
            reason = InputError(
                f"message key {key!r} is not the record's request id {request_id!r}"
            )
            return self._dead(reason, key, value, position, source=source, request_id=request_id)
        if request_id in self._closed:
            late = InputError(f"event for request {request_id!r}, which is already closed")
            return self._dead(late, key, value, position, source=source, request_id=request_id)
        state = self._open.get(request_id)
        if state is None:
            state = self._open[request_id] = _Open(
                normalizer=Normalizer(record.source, request_id),
                fold=Fold(request_id, record.source),
                tenant=record.tenant,
                next_seq=0,
                last_time=record.received_at,
                last_seen=self._clock(),
            )
        elif record.source.value != state.normalizer.source.value or record.tenant != state.tenant:
            mixed = InputError(
                f"request {request_id!r} changed source or tenant mid-stream "
                f"({state.normalizer.source.value}/{state.tenant} → {source}/{record.tenant})"
            )
            return self._dead(mixed, key, value, position, source=source, request_id=request_id)
        if record.seq < state.next_seq:
            self.counters.duplicates += 1
            return Outputs()
        state.next_seq = record.seq + 1
        state.last_time = record.received_at
        state.last_seen = self._clock()
        if record.kind is EventKind.END:
            self.counters.applied += 1
            del self._open[request_id]
            return self._close(request_id, state, record.received_at, NO_FINISH)
        try:
            chunks = state.normalizer.feed(event, record.received_at)
        except InputError as exc:
            return self._dead(exc, key, value, position, source=source, request_id=request_id)
        self.counters.applied += 1
        for chunk in chunks:
            state.fold.add(chunk)
        return Outputs(chunks=chunks)

    def _close(self, request_id: str, state: _Open, when: datetime, reason: str) -> Outputs:
        chunks = state.normalizer.end(when, fallback_request_id=request_id)
        for chunk in chunks:
            state.fold.add(chunk)
        tokens = state.fold.result(ended=True, reason=reason)
        billing = bill(tokens, state.tenant, when, self.prices)
        self._closed[request_id] = None
        if len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)
        self.counters.requests_completed += 1
        return Outputs(chunks=chunks, completed=[Completed(tokens, billing)])

    def _dead(
        self,
        exc: Exception,
        key: bytes | None,
        value: bytes,
        position: Position,
        *,
        source: str | None = None,
        request_id: str | None = None,
    ) -> Outputs:
        self.counters.dead_lettered += 1
        letter = DeadLetter(
            topic=position.topic,
            partition=position.partition,
            offset=position.offset,
            key=key,
            value=value,
            reason=str(exc),
            error_type=type(exc).__name__,
            source=source,
            request_id=request_id,
            dead_lettered_at=utc_now(),
        )
        return Outputs(dead_letters=[letter])
