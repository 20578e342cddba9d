"""The spool's sender: records from the spool to Kafka, in order, never dropped.

    sender = SpoolSender(spool, KafkaSender(servers, namespace, linger_ms=5, key=None))
    await sender.start()
    ...
    await sender.stop()

One asyncio task takes records from the spool in spool order (`Spool.take`:
from memory for what was just appended, from the segment files after a
restart or while Kafka is behind; or, in a sender process of its own,
`SpoolReader.take` from the files the writer published:
`streamtally.producers.sender_process`) and hands them to a `Sender` (in
production `KafkaSender`: `RawProducer.send_soon`, the idempotent producer
with ``acks=all``, each partition's records in one batch while its previous
one waits: `streamtally.producers.batches`), up to `max_in_flight` records
unacknowledged at once.  The producer keeps their order (one request's
records share a key, so a partition; the batches of a partition go in
order, and the idempotent producer never reorders a partition).  As
acknowledgements come, the spool's cursor moves over the contiguous prefix
of acknowledged records (`Spool.acknowledge`), never past a record Kafka
does not have.

Kafka down or failing.  A record whose send fails with anything but a
refusal of that record (below) starts an outage: the sender waits for the
records still in flight, rewinds to the first record not acknowledged, waits
(0.1 s, doubling up to 5 s) and sends again from there, for ever.  It logs
once when the outage starts and once when Kafka takes records again, never
per record.  Records acknowledged after the failed one are sent again: the
worker drops the duplicates.  Nothing is dropped.  After every
`RESTART_EVERY` failed tries in a row the sender is stopped and started
again (`KafkaSender` then makes a new Kafka client), so that a client that
stays wedged after an outage is replaced; a start that fails (Kafka still
away) is tried again at the next try.

Records refused for good.  Kafka refusing a record itself (too large,
corrupt, an invalid topic: `is_refusal`), or a sender raising something that
is not a Kafka or connection error (a record it cannot take), is not an
outage: the record is kept in the spool's ``rejected/records.seg`` (fsynced,
same framing: an operator can read it with `decode_frames` and send it
again), logged as an error naming its request, counted in `rejected`, and
only then does the cursor move past it.  The tap sizes its records far below
the raw topics' limit, so this should not happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, Final, Protocol

from aiokafka.errors import (
    CorruptRecordException,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
    UnsupportedForMessageFormatError,
)

from streamtally.connection import KafkaConnection
from streamtally.core.models import Source
from streamtally.errors import StreamtallyError
from streamtally.producers.raw import RawProducer
from streamtally.producers.spool import Spool, SpoolError, SpoolReader, SpoolRecord
from streamtally.wire.tenant_keys import ProducerKey

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "KafkaSender",
    "Sender",
    "SpoolSender",
    "is_refusal",
]

log = logging.getLogger("streamtally.producers.spool_sender")

#: Default records handed to the producer and not yet acknowledged.
DEFAULT_MAX_IN_FLIGHT: Final = 10_000
#: First and longest wait before sending again after a failure.
RETRY_FIRST_S: Final = 0.1
RETRY_MAX_S: Final = 5.0
#: Failed tries in a row after which the sender (the Kafka client) is started afresh.
RESTART_EVERY: Final = 5
#: Seconds a stop of the sender may take before a restart goes on without it.
STOP_TIMEOUT_S: Final = 10.0

#: Kafka errors that refuse a record itself: sending it again cannot succeed.
_REFUSALS: Final = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    CorruptRecordException,
    InvalidTopicError,
    UnsupportedForMessageFormatError,
)


def is_refusal(exc: BaseException) -> bool:
    """`exc` refuses its record for good (kept aside), rather than an outage (retried):
    Kafka's record errors (`_REFUSALS`), and anything that is neither a Kafka error nor
    an OS, connection or timeout error (a sender that cannot take the record)."""
    if isinstance(exc, _REFUSALS):
        return True
    return not isinstance(exc, KafkaError | OSError | TimeoutError | asyncio.CancelledError)


class Sender(Protocol):
    """What the spool's records are sent through (`RawProducer`'s `send`, a start, a stop)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        """Queue one record; the future resolves when Kafka has it (or fails).

        `auth` is its ``st-auth`` header, given only when the record has one.
        """
        ...


class KafkaSender:
    """A `RawProducer` (idempotent, ``acks=all``, batching) as a `Sender`; a start after a
    stop makes a new one (a Kafka client cannot be started twice)."""

    def __init__(
        self,
        bootstrap_servers: KafkaConnection | str,
        namespace: str,
        linger_ms: int,
        key: ProducerKey | None,
    ) -> None:
        self._servers = bootstrap_servers
        self._namespace = namespace
        self._linger_ms = linger_ms
        self._key = key
        self._producer = self._new()
        self._used = False

    def _new(self) -> RawProducer:
        return RawProducer(
            self._servers, namespace=self._namespace, linger_ms=self._linger_ms, key=self._key
        )

    async def start(self) -> None:
        if self._used:
            self._producer = self._new()
        self._used = True
        await self._producer.__aenter__()

    async def stop(self) -> None:
        await self._producer.__aexit__(None, None, None)

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        return self._producer.send_soon(source, request_id, value, auth=auth)


def _failure(future: asyncio.Future[Any]) -> BaseException | None:
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception()


class SpoolSender:
    """Sends a `Spool`'s records through a `Sender` (see the module docstring)."""

    def __init__(
        self,
        spool: Spool | SpoolReader,
        sender: Sender,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        retry_first_s: float = RETRY_FIRST_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.spool = spool
        self.sender = sender
        self.max_in_flight = max_in_flight
        self.retry_first_s = retry_first_s
        self.retry_max_s = retry_max_s
        #: Outages begun, and records sent again after one.
        self.outages = 0
        self.resent = 0
        self._in_flight: deque[tuple[SpoolRecord, asyncio.Future[Any]]] = deque()
        self._wake = asyncio.Event()
        #: The in-flight future `_run` waits for (`_watch`).
        self._watched: asyncio.Future[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._outage_since: float | None = None
        self._started = False
        #: Failed tries in a row, and the sender needs a start (a restart's start failed).
        self._failed_tries = 0
        self._needs_start = False
        #: Times the sender was started afresh during outages.
        self.restarts = 0
        spool.add_listener(self._wake.set)

    @property
    def in_flight(self) -> int:
        """Records handed to the sender and not yet settled."""
        return len(self._in_flight)

    @property
    def in_outage(self) -> bool:
        return self._outage_since is not None

    async def start(self) -> SpoolSender:
        """Start the sender (`Sender.start`: Kafka must be reachable), then the task."""
        await self.sender.start()
        self._started = True
        self._task = asyncio.create_task(self._run(), name="streamtally-spool-sender")
        return self

    async def drain(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds until Kafka has every record of the spool."""
        return await self.spool.wait_sent(timeout)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop the task (what is in flight and not acknowledged stays in the spool) and
        the sender (at most `timeout` seconds)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._in_flight.clear()
        if self._started:
            self._started = False
            try:
                await asyncio.wait_for(self.sender.stop(), timeout)
            except TimeoutError:
                log.warning("the Kafka producer did not stop within %gs", timeout)

    async def _send(self, record: SpoolRecord) -> asyncio.Future[Any]:
        try:
            if record.auth is None:
                future = await self.sender.send(record.source, record.key, record.value)
            else:
                future = await self.sender.send(
                    record.source, record.key, record.value, auth=record.auth
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - settled as a failed send, like Kafka's
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
        return future

    def _settled(self, _future: asyncio.Future[Any]) -> None:
        self._wake.set()

    async def _run(self) -> None:
        spool, in_flight = self.spool, self._in_flight
        backoff = self.retry_first_s
        while True:
            self._wake.clear()
            while len(in_flight) < self.max_in_flight:
                records = spool.take(self.max_in_flight - len(in_flight))
                if not records:
                    break
                for record in records:
                    in_flight.append((record, await self._send(record)))
            acked, end = 0, 0
            while in_flight and in_flight[0][1].done() and _failure(in_flight[0][1]) is None:
                end = in_flight.popleft()[0].end
                acked += 1
            if acked:
                spool.acknowledge(end, acked)
                if self._outage_since is not None:
                    log.warning(
                        "Kafka takes records again after %.1fs; the spool sends what waited "
                        "(%d records, %d bytes unsent)",
                        time.monotonic() - self._outage_since,
                        spool.unsent_records,
                        spool.unsent_bytes,
                    )
                    self._outage_since = None
                    self._failed_tries = 0
                    backoff = self.retry_first_s
            if in_flight and in_flight[0][1].done():
                record, future = in_flight[0]
                failure = _failure(future)
                assert failure is not None
                if is_refusal(failure):
                    in_flight.popleft()
                    try:
                        spool.reject(record, repr(failure))
                    except (OSError, SpoolError) as exc:
                        log.error("the refused record could not be kept: %r (retried)", exc)
                        in_flight.appendleft((record, future))
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, self.retry_max_s)
                    continue
                await self._outage(record, failure, backoff)
                backoff = min(backoff * 2, self.retry_max_s)
                continue
            if in_flight and not in_flight[0][1].done():
                self._watch(in_flight[0][1])
                await self._wake.wait()
            elif not spool.unread():
                await self._wake.wait()

    def _watch(self, head: asyncio.Future[Any]) -> None:
        """Wake `_run` when `head`, the oldest record in flight, settles.  Only the oldest:
        the cursor moves over a prefix of acknowledged records, so a record behind it
        settling changes nothing until it does (one callback per wait, not per record)."""
        if self._watched is not head:
            self._watched = head
            head.add_done_callback(self._settled)

    async def _outage(self, record: SpoolRecord, failure: BaseException, backoff: float) -> None:
        """The send of `record` (at the cursor) failed: let what is in flight settle, then
        wait `backoff` and take again from it."""
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self.outages += 1
            log.warning(
                "Kafka did not take a record of request %r: %r; the spool keeps every record "
                "and sends again from it until Kafka takes them (%d bytes unsent)",
                record.key,
                failure,
                self.spool.unsent_bytes,
            )
        in_flight = self._in_flight
        await asyncio.wait([future for _, future in in_flight])
        self.resent += len(in_flight)
        in_flight.clear()
        self.spool.rewind(record.position)
        await asyncio.sleep(backoff)
        self._failed_tries += 1
        if self._needs_start or self._failed_tries % RESTART_EVERY == 0:
            await self._restart()

    async def _restart(self) -> None:
        """Stop the sender (bounded) and start it again; a failed start is tried again at
        the next failed try (sends fail meanwhile, as during the outage)."""
        if not self._needs_start:
            try:
                await asyncio.wait_for(self.sender.stop(), STOP_TIMEOUT_S)
            except (TimeoutError, KafkaError, OSError) as exc:
                log.warning("the Kafka client did not stop cleanly: %r", exc)
        try:
            await self.sender.start()
        except (StreamtallyError, KafkaError, OSError) as exc:
            if not self._needs_start:
                log.warning("the Kafka client could not start again (tried again): %s", exc)
            self._needs_start = True
            return
        self._needs_start = False
        self.restarts += 1
        log.info("the Kafka client was started afresh after %d failed tries", self._failed_tries)
