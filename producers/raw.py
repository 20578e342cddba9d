"""The raw-event producer (see the package docstring)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from aiokafka.errors import KafkaConnectionError

from streamtally.connection import KafkaConnection, as_connection
from streamtally.core.adapters.base import AdapterOptions
from streamtally.core.models import Source, utc_now
from streamtally.core.normalize import (
    discover_request_id,
    fallback_request_id,
    fold_stream,
    make_adapter,
    read_events,
)
from streamtally.core.sse import NonSseLine, SseEvent
from streamtally.errors import InputError, InvalidEvent, NotAStream, StackError
from streamtally.producers.batches import Batches
from streamtally.topics import DEFAULT_NAMESPACE, Topics, encode_key
from streamtally.wire import avro
from streamtally.wire.framing import SINGLE_OBJECT, Framing
from streamtally.wire.kafka import MAX_REQUEST_BYTES, idempotent_producer
from streamtally.wire.records import RawEngineOutput, RawSseEvent
from streamtally.wire.tenant_keys import HEADER, ProducerKey

__all__ = ["RawProducer", "SentRequest", "raw_records"]


@dataclass(frozen=True, slots=True)
class SentRequest:
    request_id: str
    tenant: str
    source: Source
    #: Raw events sent, the end-of-stream marker not included.
    events: int


def raw_records(
    source: Source,
    data: bytes,
    *,
    tenant: str,
    request_id: str | None = None,
    options: AdapterOptions | None = None,
    clock: Any = utc_now,
    model: str | None = None,
    strict: bool = False,
    max_record_bytes: int | None = None,
) -> tuple[str, list[bytes]]:
    """The request id and the encoded raw records (events, then END) of one transcript.

    Engine outputs are always checked (`_check_engine_lines`).  With
    `strict`, the transcript must also be one `streamtally fold` takes
    whole: every event valid for `source`, no text that is not SSE (the
    source's documented trailing body, Gemini's raw JSON error, excepted),
    and some content (`InvalidEvent` or `NotAStream`, naming the event or
    line).  With `max_record_bytes`, an event whose record is larger is
    refused (`InputError`, naming the event).  Nothing is sent here: a
    caller that checks every transcript first sends nothing of a bad one.
    """
    non_sse: list[NonSseLine] = []
    events = list(
        read_events(source, io.BytesIO(data), on_non_sse=non_sse.append if strict else None)
    )
    if source.is_sse:
        found = request_id or discover_request_id(source, events, options)
    else:
        found = _check_engine_lines(source, events, options)
    if strict:
        _check_whole(source, events, non_sse, options)
    rid = request_id or found or fallback_request_id(data)
    records = []
    for number, record in enumerate(
        _encode(source, events, rid, tenant=tenant, clock=clock, model=model), start=1
    ):
        if max_record_bytes is not None and len(record) > max_record_bytes:
            raise InputError(
                f"event {number} makes a record of {len(record)} bytes, more than the "
                f"{max_record_bytes} bytes a raw record may have; nothing was sent"
            )
        records.append(record)
    return rid, records


def _check_engine_lines(
    source: Source, events: list[Any], options: AdapterOptions | None
) -> str | None:
    """Refuse a file with a line that is not a valid output of its engine; its request id.

    Engine outputs travel as structured Avro records, which would quietly give
    a foreign line the shape of a valid one (missing fields take their
    defaults); so such a file is refused here, before anything is sent.
    Outputs are numbered as `streamtally fold` numbers events (blank lines
    are no output).
    """
    adapter = make_adapter(source, options)
    for number, event in enumerate(events, start=1):
        try:
            adapter.feed(event)
        except InvalidEvent as exc:
            raise InvalidEvent(
                f"event {number} is not a valid {source.value} output ({exc}); nothing was sent"
            ) from exc
    return adapter.provider_request_id


def _check_whole(
    source: Source,
    events: list[Any],
    non_sse: list[NonSseLine],
    options: AdapterOptions | None,
) -> None:
    """Refuse what `streamtally fold` would skip or refuse: the check of `strict`."""
    invalid: list[tuple[int, InvalidEvent]] = []
    try:
        fold_stream(
            source,
            events,
            options=options,
            fallback_request_id="checked",
            on_invalid=lambda number, exc: invalid.append((number, exc)),
        )
    except NotAStream as empty:
        if not invalid:
            raise NotAStream(f"{empty}; nothing was sent") from empty
    if invalid:
        number, first = invalid[0]
        more = f" (and {len(invalid) - 1} more)" if len(invalid) > 1 else ""
        raise InvalidEvent(
            f"event {number} is not a valid {source.value} event ({first}){more}; nothing was sent"
        ) from first
    if non_sse:
        line = non_sse[0]
        more = f" (and {len(non_sse) - 1} more lines)" if len(non_sse) > 1 else ""
        text = line.text if len(line.text) <= 60 else line.text[:59] + "…"
        raise InvalidEvent(f"line {line.number} is not SSE: {text!r}{more}; nothing was sent")


def _encode(
    source: Source,
    events: list[Any],
    request_id: str,
    *,
    tenant: str,
    clock: Any,
    model: str | None,
) -> Iterator[bytes]:
    seq = 0
    for event in events:
        received: datetime = clock()
        if source.is_sse:
            assert isinstance(event, SseEvent)
            yield avro.encode_raw_sse_event(
                RawSseEvent(
                    request_id=request_id,
                    seq=seq,
                    source=source,
                    tenant=tenant,
                    received_at=received,
                    event=event.event,
                    data=event.data,
                    sse_id=event.id,
                )
            )
        else:
            yield avro.encode_raw_engine_output(
                RawEngineOutput(
                    request_id=request_id,
                    seq=seq,
                    source=source,
                    tenant=tenant,
                    received_at=received,
                    payload=event,
                    model=model,
                )
            )
        seq += 1
    if source.is_sse:
        yield avro.encode_raw_sse_event(
            RawSseEvent.end(
                request_id=request_id, seq=seq, source=source, tenant=tenant, received_at=clock()
            )
        )
    else:
        yield avro.encode_raw_engine_output(
            RawEngineOutput.end(
                request_id=request_id,
                seq=seq,
                source=source,
                tenant=tenant,
                received_at=clock(),
                model=model,
            )
        )


class RawProducer:
    """An idempotent Kafka producer of raw records."""

    def __init__(
        self,
        bootstrap_servers: KafkaConnection | str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        linger_ms: int = 5,
        key: ProducerKey | None = None,
        framing: Framing = SINGLE_OBJECT,
    ) -> None:
        #: How `send_records` frames the values it is given (``STREAMTALLY_AVRO_FRAMING``:
        #: `streamtally.wire.framing.framing_for`); `send` sends a value as it is.
        self.framing = framing
        #: The Kafka written to (plain servers: a PLAINTEXT connection); printed as its servers.
        self.kafka = as_connection(bootstrap_servers)
        #: With a key, every record carries its signed tenant claim (``st-auth`` header).
        self.key = key
        self.topics = Topics.in_namespace(namespace)
        self._producer = idempotent_producer(self.kafka, linger_ms=linger_ms)
        self._batches = Batches(self._producer, max_request_bytes=MAX_REQUEST_BYTES)

    async def __aenter__(self) -> RawProducer:
        try:
            await self._producer.start()
        except KafkaConnectionError as exc:
            raise StackError(
                f"cannot reach Kafka at {self.kafka.unreachable()}: start it with "
                "`streamtally stack up` or set KAFKA_BOOTSTRAP_SERVERS"
            ) from exc
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._batches.drain()
        finally:
            await self._producer.stop()

    async def send_transcript(
        self,
        source: Source,
        data: bytes,
        *,
        tenant: str,
        request_id: str | None = None,
        options: AdapterOptions | None = None,
        model: str | None = None,
        strict: bool = False,
        max_record_bytes: int | None = None,
    ) -> SentRequest:
        """Send one request's raw events and its end marker; wait until Kafka has them.

        `model` is recorded with engine outputs, which do not name their model;
        `strict` and `max_record_bytes` are the checks of `raw_records`, made
        before anything is sent.
        """
        rid, records = raw_records(
            source,
            data,
            tenant=tenant,
            request_id=request_id,
            options=options,
            model=model,
            strict=strict,
            max_record_bytes=max_record_bytes,
        )
        await self.send_records(source, rid, records)
        return SentRequest(rid, tenant, source, len(records) - 1)

    async def send_records(self, source: Source, request_id: str, records: list[bytes]) -> None:
        """Send encoded records of one request (single-object messages, as `raw_records`
        makes them: framed here) and wait until Kafka has them all."""
        frame = self.framing.frame
        futures = [await self.send(source, request_id, frame(value)) for value in records]
        await asyncio.gather(*futures)

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        """Queue one encoded record, framed already; the returned future resolves when
        Kafka has it.

        With a `key`, the record carries the ``st-auth`` header (`_topic_and_headers`).
        """
        topic, headers = self._topic_and_headers(source, value, auth)
        future: asyncio.Future[Any] = await self._producer.send(
            topic, value, key=encode_key(request_id), headers=headers
        )
        return future

    def send_soon(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        """`send` without waiting: the record joins its partition's next batch (`Batches`:
        the records queued while the partition's previous batch waited, in order).  For
        callers that hand Kafka many records at once, the tap's spool sender."""
        topic, headers = self._topic_and_headers(source, value, auth)
        return self._batches.queue(topic, encode_key(request_id), value, headers)

    def _topic_and_headers(
        self, source: Source, value: bytes, auth: bytes | None
    ) -> tuple[str, list[tuple[str, bytes]] | None]:
        """The raw topic of `source`, and with a `key` the ``st-auth`` header: `auth` when the
        caller signed the record already, else signed here from the decoded record."""
        topic = (self.topics.raw_sse if source.is_sse else self.topics.raw_engine).name
        if self.key is None:
            return topic, None
        if auth is None:
            record = (
                avro.decode_raw_sse_event(value)
                if source.is_sse
                else avro.decode_raw_engine_output(value)
            )
            auth = self.key.sign(
                tenant=record.tenant, request_id=record.request_id, seq=record.seq, value=value
            )
        return topic, [(HEADER, auth)]

    async def flush(self) -> None:
        await self._producer.flush()
