"""The tap: a live request's raw events to Kafka as they arrive, for Python gateways.

    async with Tap("localhost:9092", namespace="streamtally") as tap:
        async with tap.request(Source.OPENAI, tenant="acme") as req:
            async for chunk in upstream_body:
                await req.feed(chunk)  # raw bytes: decoded to SSE events here
                # or: await req.event(SseEvent(data)) / await req.event(engine_output_dict)

Each event becomes one raw record, stamped with its receive time (an aware
UTC clock), and is handed to one background task that gives it to the Kafka
client, which batches; nothing waits for a request's end.  On a normal exit
of `request` the END marker follows; on an exception or a cancellation (the
client went away mid-stream) the END marker says `cancelled`
(`RawSseEvent.end(..., cancelled=True)`, `RawEngineOutput.end(..., cancelled=True)`)
and the worker closes the request `cancelled` with the usage seen so far.

Large events.  An SSE event whose data is over `PART_BYTES` (512 KiB) of UTF-8
is sent as several records with consecutive sequence numbers (`utf8_slices`,
cut on character boundaries): part records (event `PART_EVENT`,
``streamtally.part``) carrying the slices of its data, the last record under
the event's own name and id with the final slice.  Every record then stays far
below the raw topics' ``max.message.bytes``; the worker joins the parts into
the one event before normalising it (`streamtally.processors.requests`).
Engine outputs are sent as one record each, whatever their size.

Bounded, never blocking: at most `max_buffered` records wait in the tap or in
the Kafka client, unacknowledged.  When Kafka is slow and the bound is
reached, an event waits for room at most `budget_s` (for all of its records: an
event sent in parts is sent or dropped whole); what still does not fit
is dropped, counted (`TapStats.dropped_over_budget`) and logged.  A dropped
event keeps its sequence number, so the worker sees the gap and closes the
request `error` ("raw events missing") after its timeout: a loss is never
silent.  END markers are never dropped (one per request beyond the bound).
Records Kafka refuses count as `failed`, acknowledged ones as `sent`.

The request id.  Given (`request_id=`), it keys every record from the first.
Otherwise it is the provider's id, found in the stream as `streamtally fold`
finds it (the first event carries it for every SSE source): events wait in
the request until it is known, at most `id_wait_events` of them; a stream
that ends before naming one gets `streamtally produce`'s fallback
(``sha256-`` of its bytes, when they all came through `feed`), and one that
goes on without naming one a random ``tap-`` id.

Explicit sequence numbers.  A request whose id is given may number its
events itself (`event(..., seq=n)`): a producer that sees one provider
response through several calls (the Responses API's background mode: a
stream, its resumption from a sequence number, polls of the finished
response) keys them all by the response's id and the provider's own
sequence numbers, so that what two calls both carry is a re-sent record (a
duplicate for the worker), never a second bill.  The END marker then follows
the highest number sent.  `suspend` leaves such a request without END: the
response goes on upstream, and a later call (or the worker's timeout) ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol

from streamtally.connection import KafkaConnection
from streamtally.core.adapters.base import Adapter, AdapterOptions
from streamtally.core.models import Source, utc_now
from streamtally.core.normalize import ADAPTERS, fallback_request_id, make_adapter
from streamtally.core.sse import SseDecoder, SseEvent
from streamtally.errors import InvalidEvent
from streamtally.producers.raw import RawProducer
from streamtally.topics import DEFAULT_NAMESPACE
from streamtally.wire import avro
from streamtally.wire.records import PART_BYTES, PART_EVENT, RawEngineOutput, RawSseEvent
from streamtally.wire.tenant_keys import ProducerKey

__all__ = ["Sender", "Tap", "TapRequest", "TapStats", "utf8_slices"]

log = logging.getLogger("streamtally.producers.tap")

#: Default seconds an event may wait for room in the buffer.
DEFAULT_BUDGET_S = 0.005
#: Default records waiting in the tap or the Kafka client, unacknowledged.
DEFAULT_MAX_BUFFERED = 10_000
#: Default events a request without a given id holds until the provider's id shows.
DEFAULT_ID_WAIT_EVENTS = 16


def utf8_slices(data: str, size: int) -> list[str]:
    """`data` cut into consecutive slices of at most `size` UTF-8 bytes, each cut on a
    character boundary (`size` >= 4); ``"".join`` of them is `data`.  Lone surrogates
    pass through as they are (the Avro encoder refuses them later, as for a whole event).
    """
    if size < 4:
        raise ValueError(f"size must be >= 4 (a UTF-8 character), got {size}")
    raw = data.encode("utf-8", "surrogatepass")
    if len(raw) <= size:
        return [data]
    out = []
    start, end = 0, len(raw)
    while end - start > size:
        cut = start + size
        while raw[cut] & 0xC0 == 0x80:  # a continuation byte: back to its character's start
            cut -= 1
        out.append(raw[start:cut].decode("utf-8", "surrogatepass"))
        start = cut
    out.append(raw[start:].decode("utf-8", "surrogatepass"))
    return out


class Sender(Protocol):
    """What the tap sends through (`RawProducer`'s `send`, plus a start and a stop)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        """Queue one record; the future resolves when Kafka has it (or fails).

        `auth` is its ``st-auth`` header, given only when the tap has a key.
        """
        ...


class _KafkaSender:
    """A `RawProducer` (idempotent, batching) as a `Sender`."""

    def __init__(
        self,
        bootstrap_servers: KafkaConnection | str,
        namespace: str,
        linger_ms: int,
        key: ProducerKey | None,
    ) -> None:
        self._producer = RawProducer(
            bootstrap_servers, namespace=namespace, linger_ms=linger_ms, key=key
        )

    async def start(self) -> None:
        await self._producer.__aenter__()

    async def stop(self) -> None:
        await self._producer.__aexit__(None, None, None)

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        return await self._producer.send(source, request_id, value, auth=auth)


@dataclass(slots=True)
class TapStats:
    """Counts of the tap's records since it started."""

    #: Records Kafka acknowledged (events and END markers).
    sent: int = 0
    #: Records dropped because they found no room in the buffer within the budget (an
    #: event sent in parts is dropped whole: all of its records).
    dropped_over_budget: int = 0
    #: Records that could not be encoded or that Kafka refused.
    failed: int = 0
    #: Requests ended, and those of them ended as cancelled.
    requests: int = 0
    cancelled: int = 0


class Tap:
    """Streams raw events of live requests to the raw topics (see the module docstring)."""

    def __init__(
        self,
        bootstrap_servers: KafkaConnection | str | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        budget_s: float = DEFAULT_BUDGET_S,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        id_wait_events: int = DEFAULT_ID_WAIT_EVENTS,
        linger_ms: int = 5,
        sender: Sender | None = None,
        clock: Callable[[], datetime] = utc_now,
        options: AdapterOptions | None = None,
        key: ProducerKey | None = None,
    ) -> None:
        if budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s}")
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, got {max_buffered}")
        if sender is None:
            if bootstrap_servers is None:
                raise ValueError("give bootstrap_servers (or a sender)")
            sender = _KafkaSender(bootstrap_servers, namespace, linger_ms, key)
        self.budget_s = budget_s
        self.max_buffered = max_buffered
        self.id_wait_events = max(1, id_wait_events)
        self.clock = clock
        self.options = options
        #: With a key, every record carries its signed tenant claim (``st-auth``).
        self.key = key
        self.stats = TapStats()
        self._sender = sender
        self._queue: deque[tuple[Source, str, bytes, bytes | None]] = deque()
        #: Records queued here or given to the sender and not yet acknowledged.
        self._buffered = 0
        self._ready = asyncio.Event()  # the queue has something (or the tap is closing)
        self._space = asyncio.Event()  # a buffered record went away
        self._closing = False
        self._pump_task: asyncio.Task[None] | None = None

    @property
    def buffered(self) -> int:
        """Records waiting in the tap or in the Kafka client, unacknowledged."""
        return self._buffered

    async def start(self) -> Tap:
        await self._sender.start()
        self._pump_task = asyncio.create_task(self._pump(), name="streamtally-tap")
        return self

    async def close(self, timeout: float = 30.0) -> None:
        """Send what is buffered (at most `timeout` seconds), then stop the Kafka client."""
        self._closing = True
        self._ready.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._pump_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._pump_task), timeout)
            except TimeoutError:
                self._pump_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._pump_task
        while self._buffered > len(self._queue) and loop.time() < deadline:
            self._space.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._space.wait(), deadline - loop.time())
        if self._queue:
            left = len(self._queue)
            self._queue.clear()
            self._buffered -= left
            self.stats.failed += left
            log.error("tap closed with %d records not sent within %gs", left, timeout)
        await self._sender.stop()
        await asyncio.sleep(0)  # the last acknowledgements' callbacks
        if self._buffered:
            log.error("tap closed with %d records not acknowledged by Kafka", self._buffered)

    async def __aenter__(self) -> Tap:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def request(
        self,
        source: Source,
        *,
        tenant: str,
        request_id: str | None = None,
        model: str | None = None,
    ) -> TapRequest:
        """One request's tap, an async context manager (see `TapRequest`)."""
        if not tenant:
            raise ValueError("tenant must not be empty")
        return TapRequest(self, source, tenant=tenant, request_id=request_id, model=model)

    # ------------------------------------------------------------------ buffering

    async def _room(self, wanted: int) -> int:
        """How many of `wanted` records fit, waiting at most the budget for room."""
        if self._buffered + wanted <= self.max_buffered:
            return wanted
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget_s
        while self._buffered + wanted > self.max_buffered:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._space.clear()
            try:
                await asyncio.wait_for(self._space.wait(), remaining)
            except TimeoutError:
                break
        return max(0, min(wanted, self.max_buffered - self._buffered))

    def _room_now(self, wanted: int) -> int:
        return max(0, min(wanted, self.max_buffered - self._buffered))

    def _put(self, request: TapRequest, request_id: str, seq: int, value: bytes) -> None:
        key = self.key
        auth = (
            None
            if key is None
            else key.sign(tenant=request.tenant, request_id=request_id, seq=seq, value=value)
        )
        self._queue.append((request.source, request_id, value, auth))
        self._buffered += 1
        self._ready.set()

    async def _pump(self) -> None:
        """Hand queued records to the sender, in order; count what Kafka says of each."""
        queue = self._queue
        while True:
            while not queue:
                if self._closing:
                    return
                self._ready.clear()
                await self._ready.wait()
            source, request_id, value, auth = queue.popleft()
            try:
                if auth is None:
                    future = await self._sender.send(source, request_id, value)
                else:
                    future = await self._sender.send(source, request_id, value, auth=auth)
            except Exception as exc:  # noqa: BLE001 - counted and logged; the tap goes on
                self._gone(failed=exc, request_id=request_id)
                continue
            future.add_done_callback(self._acked)

    def _acked(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._gone(failed=asyncio.CancelledError(), request_id=None)
        elif (exc := future.exception()) is not None:
            self._gone(failed=exc, request_id=None)
        else:
            self._gone(failed=None, request_id=None)

    def _gone(self, *, failed: BaseException | None, request_id: str | None) -> None:
        self._buffered -= 1
        self._space.set()
        if failed is None:
            self.stats.sent += 1
            return
        self.stats.failed += 1
        log.error(
            "tap: Kafka did not take a record%s: %r",
            f" of request {request_id!r}" if request_id else "",
            failed,
        )


class TapRequest:
    """One live request: `event` / `feed` as it streams; END (or cancelled END) on exit."""

    def __init__(
        self,
        tap: Tap,
        source: Source,
        *,
        tenant: str,
        request_id: str | None,
        model: str | None,
    ) -> None:
        self.tap = tap
        self.source = source
        self.tenant = tenant
        self.model = model
        self._request_id = request_id or None
        self._finder: Adapter | None = (
            make_adapter(source, tap.options) if self._request_id is None else None
        )
        self._held: list[tuple[Any, datetime]] = []
        self._seq = 0
        self._decoder: SseDecoder | None = None
        self._lines = bytearray()
        #: The bytes `feed` had while the request id is unknown (for the fallback id);
        #: None once it is known, or once an event came through `event` (no bytes).
        self._raw: bytearray | None = bytearray() if self._request_id is None else None
        self._ended = False
        #: Events of this request dropped over budget.
        self.dropped = 0

    @property
    def request_id(self) -> str | None:
        """The request id, once known (given, or found in the stream)."""
        return self._request_id

    async def __aenter__(self) -> TapRequest:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end(cancelled=exc_type is not None)

    async def feed(self, data: bytes) -> None:
        """Raw bytes of the response body as they arrive: SSE, or engine JSON lines."""
        if self._raw is not None:
            if self._request_id is None:
                self._raw += data
            else:
                self._raw = None
        if self.source.is_sse:
            if self._decoder is None:
                self._decoder = SseDecoder()
            for event in self._decoder.feed(data):
                await self._event(event)
            return
        self._lines += data
        *lines, rest = self._lines.split(b"\n")
        self._lines = bytearray(rest)
        for line in lines:
            await self._engine_line(bytes(line))

    async def event(
        self,
        event: SseEvent | dict[str, Any],
        *,
        seq: int | None = None,
        received_at: datetime | None = None,
    ) -> None:
        """One raw event: an `SseEvent`, or an engine output (the dict its JSON line parses to).

        `seq` numbers it explicitly (a request with a given id only; see the module
        docstring), and `received_at` (only with `seq`, aware) stamps it with a time the
        caller derives from the event itself, so that two taps of the same event make the
        same record: a copy the worker takes for a re-send, never for a new call.
        """
        self._raw = None
        if seq is None:
            if received_at is not None:
                raise ValueError("received_at is given only with an explicit seq")
            await self._event(event)
            return
        if self._request_id is None or self._finder is not None:
            raise ValueError("an explicit seq needs a request id given up front")
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        if received_at is not None and received_at.utcoffset() is None:
            raise ValueError("received_at must be an aware datetime")
        if self._ended:
            raise RuntimeError("the request has ended")
        received = self.tap.clock() if received_at is None else received_at
        if await self.tap._room(1):
            self._send([event], received, seq)
        else:
            self.dropped += 1
            self.tap.stats.dropped_over_budget += 1
            self._seq = max(self._seq, seq + 1)
            log.warning(
                "tap: request %s (%s, tenant %s): event %d dropped over budget",
                self._request_id,
                self.source.value,
                self.tenant,
                seq,
            )

    async def _engine_line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            value = json.loads(line)
        except ValueError as exc:
            log.warning(
                "tap: request %s (%s): a line that is not JSON was not sent: %s",
                self._request_id,
                self.source.value,
                exc,
            )
            return
        await self._event(value)

    async def _event(self, event: Any) -> None:
        if self._ended:
            raise RuntimeError("the request has ended")
        received = self.tap.clock()
        if self._request_id is None:
            self._held.append((event, received))
            self._find_id(event)
            if self._request_id is None:
                if len(self._held) < self.tap.id_wait_events:
                    return
                self._request_id = "tap-" + uuid.uuid4().hex
                log.warning(
                    "tap: no %s request id in the first %d events: sent as %s",
                    self.source.value,
                    len(self._held),
                    self._request_id,
                )
            held = self._expand_held()
            room = await self.tap._room(self._needed(held))
            self._send_held(held, room)
            return
        pieces = self._pieces(event)
        need = min(len(pieces), self.tap.max_buffered)
        if await self.tap._room(need) >= need:
            self._send(pieces, received)
        else:
            self._drop(len(pieces))

    def _expand_held(self) -> list[tuple[list[Any], datetime]]:
        """The held events, each as the records it is sent as; none held any more."""
        held, self._held = self._held, []
        return [(self._pieces(event), received) for event, received in held]

    def _needed(self, held: list[tuple[list[Any], datetime]]) -> int:
        """Room the held events need (an event of more parts than the bound: the bound)."""
        limit = self.tap.max_buffered
        return sum(min(len(pieces), limit) for pieces, _ in held)

    def _find_id(self, event: Any) -> None:
        finder = self._finder
        assert finder is not None
        try:
            finder.feed(event)
        except InvalidEvent:
            return  # the worker dead-letters it; the id may still come
        if finder.provider_request_id is not None:
            self._request_id = finder.provider_request_id
            self._finder = None

    def _pieces(self, event: Any) -> list[Any]:
        """The records one event is sent as: itself, or (an SSE event whose data is over
        `PART_BYTES` of UTF-8) its part events, then its last slice under its own name."""
        if not self.source.is_sse or len(event.data) <= PART_BYTES // 4:
            return [event]  # at most 4 UTF-8 bytes a character: it fits
        slices = utf8_slices(event.data, PART_BYTES)
        if len(slices) == 1:
            return [event]
        parts: list[Any] = [SseEvent(piece, PART_EVENT) for piece in slices[:-1]]
        parts.append(SseEvent(slices[-1], event.event, event.id))
        return parts

    def _send_held(self, held: list[tuple[list[Any], datetime]], room: int) -> None:
        """Send held events (each as its records) while `room` records fit; drop the rest."""
        limit = self.tap.max_buffered
        for pieces, received in held:
            need = min(len(pieces), limit)
            if room >= need:
                self._send(pieces, received)
                room -= need
            else:
                room = 0
                self._drop(len(pieces))

    def _send(self, pieces: list[Any], received: datetime, explicit: int | None = None) -> None:
        """Encode the records of the next event and queue them (their sequence numbers are
        taken even on failure: the worker sees the gap).

        An event numbered `explicit` by its caller is one record, sent whole: the numbers
        after it are the caller's, so it cannot be cut into parts.
        """
        request_id = self._request_id
        assert request_id is not None
        if explicit is None:
            first = self._seq
            self._seq += len(pieces)
        else:
            first = explicit
            self._seq = max(self._seq, explicit + len(pieces))
        try:
            values = [
                self._encode(piece, request_id, first + i, received)
                for i, piece in enumerate(pieces)
            ]
        except Exception as exc:  # noqa: BLE001 - counted and logged, never the caller's
            self.tap.stats.failed += 1
            log.error(
                "tap: event %d of request %s (%s) could not be encoded: %r",
                first,
                request_id,
                self.source.value,
                exc,
            )
            return
        for i, value in enumerate(values):
            self.tap._put(self, request_id, first + i, value)

    def _encode(self, event: Any, request_id: str, seq: int, received: datetime) -> bytes:
        if self.source.is_sse:
            return avro.encode_raw_sse_event(
                RawSseEvent(
                    request_id=request_id,
                    seq=seq,
                    source=self.source,
                    tenant=self.tenant,
                    received_at=received,
                    event=event.event,
                    data=event.data,
                    sse_id=event.id,
                )
            )
        return avro.encode_raw_engine_output(
            RawEngineOutput(
                request_id=request_id,
                seq=seq,
                source=self.source,
                tenant=self.tenant,
                received_at=received,
                payload=event,
                model=self.model,
            )
        )

    def _drop(self, count: int) -> None:
        first = self.dropped == 0
        self.dropped += count
        self._seq += count  # the gap tells the worker that events are missing
        self.tap.stats.dropped_over_budget += count
        if first:
            log.warning(
                "tap: request %s (%s, tenant %s): Kafka is behind, %d buffered; "
                "event %d dropped after waiting %gs",
                self._request_id,
                self.source.value,
                self.tenant,
                self.tap.buffered,
                self._seq - count,
                self.tap.budget_s,
            )

    def end(self, *, cancelled: bool = False) -> None:
        """The request is over: its END marker (cancelled: the client went away); never waits.

        `async with` calls it; calling it again does nothing.
        """
        if self._ended:
            return
        if not cancelled:
            self._drain_bytes()
        self._ended = True
        if self._request_id is None:
            if self._held and self._raw is not None:
                self._request_id = fallback_request_id(bytes(self._raw))
            else:
                self._request_id = "tap-" + uuid.uuid4().hex
        if self._held:
            held = self._expand_held()
            self._send_held(held, self.tap._room_now(self._needed(held)))
        if self.dropped:
            log.warning(
                "tap: request %s (%s, tenant %s): %d events dropped over budget",
                self._request_id,
                self.source.value,
                self.tenant,
                self.dropped,
            )
        if self._seq == 0:
            return  # no event: nothing to end (the worker refuses a lone END)
        self.tap.stats.requests += 1
        if cancelled:
            self.tap.stats.cancelled += 1
        received = self.tap.clock()
        if self.source.is_sse:
            value = avro.encode_raw_sse_event(
                RawSseEvent.end(
                    request_id=self._request_id,
                    seq=self._seq,
                    source=self.source,
                    tenant=self.tenant,
                    received_at=received,
                    cancelled=cancelled,
                )
            )
        else:
            value = avro.encode_raw_engine_output(
                RawEngineOutput.end(
                    request_id=self._request_id,
                    seq=self._seq,
                    source=self.source,
                    tenant=self.tenant,
                    received_at=received,
                    model=self.model,
                    cancelled=cancelled,
                )
            )
        self.tap._put(self, self._request_id, self._seq, value)
        self._seq += 1

    def suspend(self) -> None:
        """Stop here without an END marker: the response goes on upstream (module docstring).

        The events sent stay; a later request of the same id, or the worker's
        timeout, ends it.  Calling `end` or `suspend` afterwards does nothing.
        """
        if self._ended:
            return
        self._ended = True
        log.info(
            "tap: request %s (%s, tenant %s) left open after %d events",
            self._request_id,
            self.source.value,
            self.tenant,
            self._seq,
        )

    def _drain_bytes(self) -> None:
        """At a normal end: what the byte decoders still hold (Gemini's raw JSON error tail)."""
        if self._decoder is not None:
            events = self._decoder.close()
            taken = ADAPTERS[self.source].take_trailing_body(self._decoder.trailing_non_sse())
            if taken is not None:
                events.append(taken)
            for event in events:
                self._event_now(event)
        elif self._lines.strip():
            line, self._lines = bytes(self._lines), bytearray()
            try:
                self._event_now(json.loads(line))
            except ValueError as exc:
                log.warning("tap: a last line that is not JSON was not sent: %s", exc)

    def _event_now(self, event: Any) -> None:
        """`_event` without waiting: at the end, only what fits now is sent."""
        received = self.tap.clock()
        if self._request_id is None:
            self._held.append((event, received))
            self._find_id(event)
            return
        pieces = self._pieces(event)
        need = min(len(pieces), self.tap.max_buffered)
        if self.tap._room_now(need) >= need:
            self._send(pieces, received)
        else:
            self._drop(len(pieces))
