"""The tap: a live request's raw events to Kafka as they arrive, for Python gateways.

    async with Tap("localhost:9092", namespace="streamtally") as tap:
        async with tap.request(Source.OPENAI, tenant="acme") as req:
            async for chunk in upstream_body:
                await req.feed(chunk)  # raw bytes: decoded to SSE events here
                # or: await req.event(SseEvent(data)) / await req.event(engine_output_dict)

Each event becomes one raw record, stamped with its receive time (an aware
UTC clock), and is appended to the tap's spool, from which one background
task sends it to the Kafka client, which batches; nothing waits for Kafka,
nor for a request's end.  On a normal exit
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

Never dropped: the spool.  Every record is appended to a write-ahead spool
on local disk (`streamtally.producers.spool`: segment files, a CRC per record)
before `event` / `feed` return, so before the proxy forwards the bytes it came
from; one `write()`, no wait for Kafka.  A background sender
(`streamtally.producers.spool_sender`) produces the spool's records to Kafka in
order with the idempotent producer and moves the spool's durable cursor over
what Kafka acknowledged.  Kafka slow or down only delays: records wait in the
spool, keeping their capture time (``received_at``), and are sent when Kafka
is back.  The spool is fsynced every `spool_sync_ms` (group commit, 20 ms by
default).  A SIGKILLed process loses nothing it appended: a `Tap` opened on
the same directory sends from the cursor again (the records sent twice are
duplicates the worker drops).

Where the sender runs.  By default in this process, as a task of its event
loop.  With ``sender_process=True`` (what ``streamtally proxy`` does unless
``--sender inline``) it runs in a child process that the tap starts, and
starts again should it die (`streamtally.producers.sender_process`): this
process then only appends, and the Kafka client's work leaves its event
loop and its core.  The same `SpoolSender` runs there, over a reader of the
same spool; the child goes when this process goes, SIGKILL included.

Keep-alives. A call can be silent for minutes while it is alive (a reasoning model
thinking before its first token or between two), and the worker closes a request as
timed out once it has been quiet for its request timeout
(``STREAMTALLY_REQUEST_TIMEOUT``, 300 s by default, or its source's,
``STREAMTALLY_REQUEST_TIMEOUTS``). So while a request is in flight (between its first
record and its END: for the proxy, while the upstream call is), the tap appends a
keep-alive record for it whenever it produced no record for `keepalive_s` (30 s by
default; None turns them off): a `RawSseEvent` whose event is `KEEPALIVE_EVENT`
(``streamtally.keepalive``, no data), or for an engine source a `RawEngineOutput` EVENT
without a payload. It takes the next sequence number of the call, as its events do (one
background task looks at the calls once a second, or four times per `keepalive_s` when
that is shorter; each append is one synchronous step, so it never falls between the
records of one event), never waits for room in the spool (as an END marker), and the
worker applies it as activity with no chunk: the bill is the same. `keepalive_s` must be
well below the worker's request timeout (the tap cannot know it; a third of it at most
leaves room for a slow broker), and an engine source's worker must be of a version that
knows keep-alives (upgrade workers first: an older one refuses an engine keep-alive and
waits for its sequence number; it makes nothing of an SSE one, as of any event without
data). A request not yet sending (its id awaited), one numbered by its caller
(`event(..., seq=n)`) and one `suspend`ed get none. A request a caller forgot to end
stops being kept alive once it is garbage (weakly referenced): the worker then times it
out.

Backpressure.  `spool_bytes` (1 GiB by default) bounds the bytes not yet
acknowledged.  `Tap.full` is True from 90 % of it on (`spool_headroom_bytes`):
a proxy refuses new calls then; an event of a call in flight waits while the
spool is at `spool_bytes` (slowed, never dropped; END markers never wait).
`close` waits up to its timeout for Kafka to take what the spool holds, then
fsyncs: what is still unsent stays in the spool and is sent at the next start.

The directory.  `spool_dir`, by default `default_spool_dir`:
``<state dir>/spool/<namespace>`` (`Settings.state_dir`: ``.stack`` in a
clone, else ``~/.local/state/streamtally``; a command passes its loaded
settings, so that ``STREAMTALLY_STATE_DIR`` counts).  One process per
directory (a lock file; a second one gets `SpoolLocked` naming the pid of
the first): two gateways on one host need a directory each.  Starting a
`Tap` on a directory that holds unsent records sends them first.

Records Kafka refuses for good (too large: not for the records the tap
sizes) are kept in the spool's ``rejected/`` directory and counted `failed`,
as are events that cannot be encoded (their sequence number is skipped: the
worker sees the gap and closes the request `error`).

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
import math
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from streamtally.connection import KafkaConnection
from streamtally.core.adapters.base import Adapter, AdapterOptions
from streamtally.core.models import Source, utc_now
from streamtally.core.normalize import ADAPTERS, fallback_request_id, make_adapter
from streamtally.core.sse import SseDecoder, SseEvent
from streamtally.errors import InvalidEvent
from streamtally.producers.sender_process import SenderConfig, SenderProcess
from streamtally.producers.spool import (
    DEFAULT_MAX_BYTES,
    DEFAULT_SYNC_INTERVAL_S,
    Spool,
    SpoolError,
)
from streamtally.producers.spool_sender import KafkaSender, Sender, SpoolSender
from streamtally.settings import Settings
from streamtally.topics import DEFAULT_NAMESPACE
from streamtally.wire import avro
from streamtally.wire.framing import SINGLE_OBJECT, Framing
from streamtally.wire.records import PART_BYTES, PART_EVENT, RawEngineOutput, RawSseEvent
from streamtally.wire.tenant_keys import ProducerKey

__all__ = [
    "DEFAULT_KEEPALIVE_S",
    "DEFAULT_SPOOL_BYTES",
    "DEFAULT_SPOOL_SYNC_MS",
    "Sender",
    "Tap",
    "TapRequest",
    "TapStats",
    "default_spool_dir",
    "utf8_slices",
]

log = logging.getLogger("streamtally.producers.tap")

#: Default bytes of the spool not yet acknowledged by Kafka (1 GiB).
DEFAULT_SPOOL_BYTES: Final = DEFAULT_MAX_BYTES
#: Characters of SSE data that always fit one record: at most 4 UTF-8 bytes a character.
_WHOLE_CHARS: Final = PART_BYTES // 4
#: Default milliseconds between two fsyncs of the spool (group commit).
DEFAULT_SPOOL_SYNC_MS: Final = DEFAULT_SYNC_INTERVAL_S * 1000
#: Default events a request without a given id holds until the provider's id shows.
DEFAULT_ID_WAIT_EVENTS = 16
#: Default seconds without a record after which a request in flight gets a keep-alive
#: record: well below the worker's default request timeout (300 s).
DEFAULT_KEEPALIVE_S: Final = 30.0
#: Seconds between two looks at the requests in flight, at most (a quarter of
#: `keepalive_s` when that is shorter).
KEEPALIVE_TICK_S: Final = 1.0


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


def default_spool_dir(namespace: str = DEFAULT_NAMESPACE, settings: Settings | None = None) -> Path:
    """The spool directory of a `Tap` not given one: ``<state dir>/spool/<namespace>``
    (`Settings.state_dir` of `settings`; without them, of ``Settings()``, which reads no
    environment: ``.stack`` in a clone, else ``~/.local/state/streamtally``)."""
    return (settings or Settings()).state_dir / "spool" / namespace


@dataclass(slots=True)
class TapStats:
    """Counts of the tap's records since it started, and its spool now (`Tap.stats`)."""

    #: Records Kafka acknowledged (events and END markers).
    sent: int = 0
    #: Records that could not be encoded or spooled, or that Kafka refused for good (those
    #: are kept in the spool's ``rejected/``).
    failed: int = 0
    #: Requests ended, and those of them ended as cancelled.
    requests: int = 0
    cancelled: int = 0
    #: Records appended to the spool, and the keep-alive records among them.
    appended: int = 0
    keepalives: int = 0
    #: Bytes in the spool not yet acknowledged by Kafka, and the age of the oldest of them.
    spool_bytes: int = 0
    oldest_unsent_age_s: float = 0.0
    #: Sender processes started again after one died (with ``sender_process``).
    sender_restarts: int = 0


class Tap:
    """Streams raw events of live requests to the raw topics through a spool (see the
    module docstring)."""

    def __init__(
        self,
        bootstrap_servers: KafkaConnection | str | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        spool_dir: Path | str | None = None,
        spool_bytes: int = DEFAULT_SPOOL_BYTES,
        spool_headroom_bytes: int | None = None,
        spool_sync_ms: float = DEFAULT_SPOOL_SYNC_MS,
        spool_segment_bytes: int | None = None,
        max_in_flight: int | None = None,
        id_wait_events: int = DEFAULT_ID_WAIT_EVENTS,
        linger_ms: int = 5,
        sender: Sender | None = None,
        clock: Callable[[], datetime] = utc_now,
        options: AdapterOptions | None = None,
        key: ProducerKey | None = None,
        keepalive_s: float | None = DEFAULT_KEEPALIVE_S,
        framing: Framing = SINGLE_OBJECT,
        sender_process: bool = False,
    ) -> None:
        if spool_bytes < 1:
            raise ValueError(f"spool_bytes must be >= 1, got {spool_bytes}")
        if keepalive_s is not None and not (math.isfinite(keepalive_s) and keepalive_s > 0):
            raise ValueError(
                f"keepalive_s must be a finite number of seconds > 0 (None: off), got {keepalive_s}"
            )
        if not spool_sync_ms > 0:
            raise ValueError(f"spool_sync_ms must be > 0, got {spool_sync_ms}")
        self._process_config: SenderConfig | None = None
        if sender_process:
            if sender is not None:
                raise ValueError("sender_process runs KafkaSender: not with a sender of your own")
            if bootstrap_servers is None:
                raise ValueError("give bootstrap_servers")
            self._process_config = SenderConfig(
                bootstrap_servers, namespace, linger_ms, key, max_in_flight
            )
        elif sender is None:
            if bootstrap_servers is None:
                raise ValueError("give bootstrap_servers (or a sender)")
            sender = KafkaSender(bootstrap_servers, namespace, linger_ms, key)
        #: Where the spool lives (`default_spool_dir` unless given).
        self.spool_dir = Path(spool_dir) if spool_dir is not None else default_spool_dir(namespace)
        self.spool_bytes = spool_bytes
        self.spool_headroom_bytes = spool_headroom_bytes
        self.spool_sync_ms = spool_sync_ms
        self.spool_segment_bytes = spool_segment_bytes
        self.max_in_flight = max_in_flight
        self.id_wait_events = max(1, id_wait_events)
        self.clock = clock
        self.options = options
        #: With a key, every record carries its signed tenant claim (``st-auth``).
        self.key = key
        #: How each record's value is framed before it is signed and spooled
        #: (``STREAMTALLY_AVRO_FRAMING``: `streamtally.wire.framing.framing_for`).
        self.framing = framing
        self._stats = TapStats()
        self._sender = sender
        self._spool: Spool | None = None
        self._spool_sender: SpoolSender | SenderProcess | None = None
        #: Records not encoded or not spooled (the sender counts those Kafka refused).
        self._failed = 0
        #: Seconds without a record before a request in flight gets a keep-alive (None: off).
        self.keepalive_s = keepalive_s
        #: The requests that may need keep-alives (weakly: a request dropped unended goes).
        self._requests: weakref.WeakSet[TapRequest] = weakref.WeakSet()
        self._keepalive_task: asyncio.Task[None] | None = None

    @property
    def spool(self) -> Spool:
        """The spool (once the tap is started)."""
        if self._spool is None:
            raise RuntimeError("the tap is not started: `async with Tap(...)` or `await start()`")
        return self._spool

    @property
    def sender_process(self) -> SenderProcess | None:
        """The sender process (started with ``sender_process=True``; else None)."""
        return self._spool_sender if isinstance(self._spool_sender, SenderProcess) else None

    @property
    def full(self) -> bool:
        """The spool is nearly full (`Spool.full`): refuse new calls (calls in flight go on)."""
        return self._spool is not None and self._spool.full

    @property
    def stats(self) -> TapStats:
        """The counts, with the spool's figures as of now."""
        stats = self._stats
        spool = self._spool
        if spool is not None:
            stats.sent = spool.sent
            stats.appended = spool.appended
            stats.failed = self._failed + spool.rejected
            stats.spool_bytes = spool.unsent_bytes
            stats.oldest_unsent_age_s = spool.oldest_unsent_age_s()
            if isinstance(self._spool_sender, SenderProcess):
                stats.sender_restarts = self._spool_sender.restarts
        else:
            stats.failed = self._failed
        return stats

    async def start(self) -> Tap:
        """Open the spool (recovering what a previous process left unsent), start the
        Kafka client and the sender, which sends what the spool holds first."""
        options: dict[str, Any] = {
            "max_bytes": self.spool_bytes,
            "headroom_bytes": self.spool_headroom_bytes,
            "sync_interval_s": self.spool_sync_ms / 1000,
        }
        if self.spool_segment_bytes is not None:
            options["segment_bytes"] = self.spool_segment_bytes
        spool = await asyncio.to_thread(Spool, self.spool_dir, **options)
        await spool.start()
        spool_sender: SpoolSender | SenderProcess
        if self._process_config is not None:
            spool_sender = SenderProcess(spool, self._process_config)
        else:
            assert self._sender is not None
            spool_sender = SpoolSender(
                spool,
                self._sender,
                **({} if self.max_in_flight is None else {"max_in_flight": self.max_in_flight}),
            )
        try:
            await spool_sender.start()
        except BaseException:
            await spool.close()
            raise
        self._spool, self._spool_sender = spool, spool_sender
        if self.keepalive_s is not None:
            self._keepalive_task = asyncio.create_task(
                self._keep_alive_loop(self.keepalive_s), name="streamtally-tap-keepalive"
            )
        return self

    async def close(self, timeout: float = 30.0) -> None:
        """Wait at most `timeout` seconds for Kafka to take what the spool holds, stop the
        sender and the Kafka client, and close the spool (fsynced): what is unsent stays
        in it and is sent at the next start on the same directory."""
        spool, spool_sender = self._spool, self._spool_sender
        if spool is None or spool_sender is None or spool.closed:
            return
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await spool_sender.drain(timeout)
        await spool_sender.stop(max(1.0, deadline - loop.time()))
        await spool.close()
        if spool.unsent_records:
            log.warning(
                "tap closed with %d records (%d bytes) not acknowledged by Kafka within %gs: "
                "kept in the spool %s, sent at the next start on it",
                spool.unsent_records,
                spool.unsent_bytes,
                timeout,
                spool.directory,
            )

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
        request = TapRequest(self, source, tenant=tenant, request_id=request_id, model=model)
        self._requests.add(request)
        return request

    # ------------------------------------------------------------------ keep-alives

    def keep_alive(self, now: float | None = None) -> int:
        """Append a keep-alive record for every request in flight that produced no record
        for `keepalive_s` seconds by `now` (`time.monotonic`; the default: now); returns
        how many.  The background task calls it; nothing to do when keep-alives are off."""
        interval = self.keepalive_s
        if interval is None or self._spool is None or self._spool.closed:
            return 0
        at = time.monotonic() if now is None else now
        sent = 0
        for request in list(self._requests):
            if request._keep_alive(at, interval):
                sent += 1
        return sent

    async def _keep_alive_loop(self, interval: float) -> None:
        tick = max(0.01, min(KEEPALIVE_TICK_S, interval / 4))
        while True:
            await asyncio.sleep(tick)
            self.keep_alive()

    def _forget(self, request: TapRequest) -> None:
        """`request` ended or was suspended: no more keep-alives for it."""
        self._requests.discard(request)

    # ------------------------------------------------------------------ spooling

    async def _wait_for_room(self, request: TapRequest) -> None:
        spool = self.spool
        if spool.at_limit:
            self._append_chunk(request)  # nothing waits unwritten while the spool is full
        await spool.wait_for_room()

    def _append_chunk(self, request: TapRequest) -> None:
        """Append the records `request` gathered of the chunk it is fed (`TapRequest.feed`),
        in the order put."""
        records = request._chunk_records
        if not records:
            return
        request._chunk_records = []
        self._append(request, records)

    def _seal(
        self, tenant: str, request_id: str, seq: int, value: bytes
    ) -> tuple[bytes, bytes | None]:
        """`value` as the spool keeps it: framed (`framing`; `AvroEncodeError` when it
        cannot be), and with a `key` its ``st-auth``, signed over the framed bytes (the
        signature covers the bytes Kafka gets)."""
        value = self.framing.frame(value)
        key = self.key
        if key is None:
            return value, None
        return value, key.sign(tenant=tenant, request_id=request_id, seq=seq, value=value)

    def _put(self, request: TapRequest, request_id: str, seq: int, value: bytes) -> None:
        try:
            value, auth = self._seal(request.tenant, request_id, seq, value)
        except avro.AvroEncodeError as exc:
            self._failed += 1
            log.error("tap: record %d of request %s could not be framed: %s", seq, request_id, exc)
            return
        record = (request.source, request_id, value, auth)
        chunk = request._chunk_records
        if chunk is not None:  # in `feed`: appended with the rest of the chunk's records
            chunk.append(record)
        else:
            self._append(request, [record])

    def _append_values(
        self,
        request: TapRequest,
        request_id: str,
        values: list[bytes],
        auths: list[bytes | None] | None = None,
    ) -> None:
        """`_append` for the records of `values` (`TapRequest._send_chunk`)."""
        spool = self.spool
        before = spool.appended
        try:
            spool.append_values(request.source, request_id, values, auths)
        except SpoolError as exc:
            self._not_spooled(request, request_id, len(values) - (spool.appended - before), exc)

    def _append(
        self, request: TapRequest, records: list[tuple[Source, str, bytes, bytes | None]]
    ) -> None:
        """Append `records` of `request` to the spool, in order: those the disk did not take
        are counted failed and logged (the worker sees the gap), never raised to the caller."""
        spool = self.spool
        before = spool.appended
        try:
            spool.append_many(records)
        except SpoolError as exc:
            lost = len(records) - (spool.appended - before)
            self._not_spooled(request, records[-lost][1], lost, exc)

    def _not_spooled(
        self, request: TapRequest, request_id: str, lost: int, exc: SpoolError
    ) -> None:
        """`lost` records of `request`, the last ones appended, are not in the spool."""
        self._failed += lost
        log.error(
            "tap: %d records of request %s (%s, tenant %s) could not be spooled: %s",
            lost,
            request_id,
            request.source.value,
            request.tenant,
            exc,
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
        #: `source.is_sse`, looked up once (an enum property costs a call per event).
        self._sse = source.is_sse
        self.tenant = tenant
        self.model = model
        self._request_id = request_id or None
        self._finder: Adapter | None = (
            make_adapter(source, tap.options) if self._request_id is None else None
        )
        #: Events (with their receive times) waiting for the request id to be found.
        self._held: list[tuple[Any, datetime]] = []
        self._seq = 0
        self._decoder: SseDecoder | None = None
        #: Writes its SSE events' records (`avro.raw_sse_writer`), once its id is known.
        self._writer: avro.RawSseWriter | None = None
        #: The last receive time written, and it in microseconds (`_encode`).
        self._received: datetime | None = None
        self._received_micros = 0
        self._lines = bytearray()
        #: The bytes `feed` had while the request id is unknown (for the fallback id);
        #: None once it is known, or once an event came through `event` (no bytes).
        self._raw: bytearray | None = bytearray() if self._request_id is None else None
        self._ended = False
        #: `time.monotonic` when its last record was appended (keep-alives are timed by it).
        self._last_append = time.monotonic()
        #: Its caller numbers its events (`event(..., seq=n)`): the tap sends no keep-alive.
        self._numbered = False
        #: During `feed`: the spool records of the chunk's events (framed, signed), appended
        #: together when it returns or before an event waits for room (None: each at once).
        self._chunk_records: list[tuple[Source, str, bytes, bytes | None]] | None = None

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
        self._chunk_records = []  # one spool write for every record of this chunk
        received = self.tap.clock()  # the chunk's events all arrived now
        try:
            if self._sse:
                if self._decoder is None:
                    self._decoder = SseDecoder()
                events = self._decoder.feed(data)
                if events and self._whole_chunk(events):
                    self._send_chunk(events, received)
                    return
                for event in events:
                    await self._event(event, received)
                return
            self._lines += data
            *lines, rest = self._lines.split(b"\n")
            self._lines = bytearray(rest)
            for line in lines:
                await self._engine_line(bytes(line), received)
        finally:  # in the spool before `feed` returns: before the client has them
            self.tap._append_chunk(self)
            self._chunk_records = None

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
        self._numbered = True  # the numbers are the caller's: no keep-alive can take one
        self.tap._forget(self)
        received = self.tap.clock() if received_at is None else received_at
        await self.tap._wait_for_room(self)
        self._send([event], received, seq)

    async def _engine_line(self, line: bytes, received: datetime) -> None:
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
        await self._event(value, received)

    async def _event(self, event: Any, received: datetime | None = None) -> None:
        """One event, received at `received` (default: now)."""
        if self._ended:
            raise RuntimeError("the request has ended")
        if received is None:
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
            await self.tap._wait_for_room(self)
            self._send_held(held)
            return
        pieces = self._pieces(event)
        if self.tap.spool.at_limit:  # else no coroutine: nothing to wait for
            await self.tap._wait_for_room(self)
        self._send(pieces, received)

    def _whole_chunk(self, events: list[SseEvent]) -> bool:
        """Whether the SSE `events` of one chunk can go as one run (`_send_chunk`): as
        `_event` would send them, one record each, with nothing to wait for.  So: the
        request id known and the request not ended, the spool not at its limit, and no
        event cut into parts."""
        if self._request_id is None or self._ended or self.tap.spool.at_limit:
            return False
        return all(len(event.data) <= _WHOLE_CHARS for event in events)

    def _send_chunk(self, events: list[SseEvent], received: datetime) -> None:
        """`_event` for each of `events`, one upstream chunk's, once `_whole_chunk`: their
        records written by one call (`RawSseWriter.values`), framed and signed as `Tap._put`
        does (`Tap._seal`), and appended to the spool at once
        (`Spool.append_values`): the same records as one by one.  Should any of that
        fail, the events go one by one, each failure counted and logged as there."""
        request_id = self._request_id
        assert request_id is not None
        tap = self.tap
        first = self._seq
        auths: list[bytes | None] | None = None
        try:
            writer = self._sse_writer(request_id, received)
            values = writer.values(first, self._received_micros, events)
            if tap.framing.headers is not None or tap.key is not None:
                tenant = self.tenant
                sealed = [
                    tap._seal(tenant, request_id, first + n, value)
                    for n, value in enumerate(values)
                ]
                values = [value for value, _ in sealed]
                auths = None if tap.key is None else [auth for _, auth in sealed]
        except Exception:  # noqa: BLE001 - one by one: each failure counted, logged, numbered
            for event in events:
                self._send([event], received)
            return
        self._seq = first + len(values)
        tap._append_values(self, request_id, values, auths)
        self._last_append = time.monotonic()

    def _expand_held(self) -> list[tuple[list[Any], datetime]]:
        """The held events, each as the records it is sent as; none held any more."""
        held, self._held = self._held, []
        return [(self._pieces(event), received) for event, received in held]

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
        if not self._sse or len(event.data) <= _WHOLE_CHARS:
            return [event]
        slices = utf8_slices(event.data, PART_BYTES)
        if len(slices) == 1:
            return [event]
        parts: list[Any] = [SseEvent(piece, PART_EVENT) for piece in slices[:-1]]
        parts.append(SseEvent(slices[-1], event.event, event.id))
        return parts

    def _send_held(self, held: list[tuple[list[Any], datetime]]) -> None:
        """Send the held events (each as its records), in order."""
        for pieces, received in held:
            self._send(pieces, received)

    def _send(self, pieces: list[Any], received: datetime, explicit: int | None = None) -> None:
        """Encode the records of the next event and append them to the spool (their sequence
        numbers are taken even on failure: the worker sees the gap).

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
            self.tap._failed += 1
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
        self._last_append = time.monotonic()

    def _keep_alive(self, now: float, interval: float) -> bool:
        """A keep-alive record if the request is in flight and produced no record for
        `interval` seconds by `now`; whether one was appended.

        In flight: its first record sent (its id known), not ended or suspended, not
        numbered by its caller.  Synchronous, so it cannot fall between the records of
        one event (`_send` is synchronous too); it never waits for room in the spool.
        """
        if self._ended or self._numbered or self._seq == 0 or self._request_id is None:
            return False
        if now - self._last_append < interval:
            return False
        request_id, seq = self._request_id, self._seq
        self._seq += 1
        self._last_append = now
        received = self.tap.clock()
        try:
            if self.source.is_sse:
                value = avro.encode_raw_sse_event(
                    RawSseEvent.keepalive(
                        request_id=request_id,
                        seq=seq,
                        source=self.source,
                        tenant=self.tenant,
                        received_at=received,
                    )
                )
            else:
                value = avro.encode_raw_engine_output(
                    RawEngineOutput.keepalive(
                        request_id=request_id,
                        seq=seq,
                        source=self.source,
                        tenant=self.tenant,
                        received_at=received,
                        model=self.model,
                    )
                )
        except Exception as exc:  # noqa: BLE001 - counted and logged (the worker sees the gap)
            self.tap._failed += 1
            log.error(
                "tap: keep-alive %d of request %s could not be encoded: %r", seq, request_id, exc
            )
            return False
        self.tap._put(self, request_id, seq, value)
        self.tap._stats.keepalives += 1
        return True

    def _sse_writer(self, request_id: str, received: datetime) -> avro.RawSseWriter:
        """The request's SSE record writer (`avro.raw_sse_writer`), with `received` in
        microseconds in `_received_micros`: one conversion per chunk, one clock reading."""
        writer = self._writer
        if writer is None or writer.request_id != request_id:
            writer = self._writer = avro.raw_sse_writer(request_id, self.source, self.tenant)
        if received is not self._received:
            self._received, self._received_micros = received, avro.micros_of(received)
        return writer

    def _encode(self, event: Any, request_id: str, seq: int, received: datetime) -> bytes:
        if self._sse:
            # The bytes `encode_raw_sse_event` writes for the RawSseEvent of these fields,
            # without making the record: the request's own fields are written once.
            writer = self._sse_writer(request_id, received)
            return writer.value(seq, self._received_micros, event.event, event.data, event.id)
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

    def end(self, *, cancelled: bool = False) -> None:
        """The request is over: its END marker (cancelled: the client went away); never waits.

        `async with` calls it; calling it again does nothing.
        """
        if self._ended:
            return
        if not cancelled:
            self._drain_bytes()
        self._ended = True
        self.tap._forget(self)
        if self._request_id is None:
            if self._held and self._raw is not None:
                self._request_id = fallback_request_id(bytes(self._raw))
            else:
                self._request_id = "tap-" + uuid.uuid4().hex
        if self._held:
            held = self._expand_held()
            self._send_held(held)
        if self._seq == 0:
            return  # no event: nothing to end (the worker refuses a lone END)
        self.tap._stats.requests += 1
        if cancelled:
            self.tap._stats.cancelled += 1
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
        self.tap._forget(self)
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
        """`_event` without waiting for room (at the end: `end` never waits)."""
        received = self.tap.clock()
        if self._request_id is None:
            self._held.append((event, received))
            self._find_id(event)
            return
        self._send(pieces=self._pieces(event), received=received)
