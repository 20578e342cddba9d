"""Records handed to Kafka a batch at a time: per partition, everything queued while
the partition's previous batch waited.

aiokafka's ``send`` does, for every record, a metadata wait, a partitioner
call, a size check, a future and an append to its accumulator: about 15 µs
of Python per record, two fifths of the tap's sender process under the
proxy benchmark.  The spool's sender hands Kafka thousands of records a
second that are already encoded and framed, so `Batches` takes them as they
come (`queue`, synchronous, returns the record's future) and writes them
into ``BatchBuilder``\\ s, one partition at a time, submitted with
``send_batch``.  The producer is the same idempotent one (``acks=all``): it
numbers each batch when it drains it, so its retries neither duplicate nor
reorder.

Batch size follows the load.  aiokafka keeps at most one batch of a
partition in its accumulator: ``send_batch`` waits until the one before has
been drained into a produce request, and a request takes one batch per
partition.  So each partition has a lane here: a task that submits a batch
and, while ``send_batch`` waits, lets the partition's next records gather;
once it returns, the next batch takes all of them.  (Submitting each
event-loop turn's records as a batch of its own, as this module once did,
made batches of a few records under load, each waiting a produce request of
its own: Kafka then took a few thousand records a second, and the records
waited behind each other.)  The price: a batch handed over takes no more
records while it waits in the accumulator, where ``send`` would still add
to it, so a record can wait one produce request longer than with ``send``.
That suits the spool's sender, whose records no client waits for; a caller
that times each record (the pipeline benchmark's latency phase) uses ``send``.

Order.  Records keep the order they were queued in, per partition: they are
routed to their lanes in queue order (one turn's routing waits for the turn
before), and a lane submits its batches one after another.

Outcome.  Every record's future settles with its batch: the batch's
metadata when Kafka has it, else the batch's error, on each record of it.
A record larger than the producer's request limit fails alone at once with
`MessageSizeTooLargeError`, as ``send`` refuses it, and never joins a batch.
Records are partitioned as ``send`` partitions them (`KeyPartitioner`, the
Kafka default for a key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError

from streamtally.wire.kafka import KeyPartitioner

__all__ = ["Batches"]

log = logging.getLogger("streamtally.producers.batches")

#: Bytes a record's batch framing and headers take beyond its key and value (an upper bound).
_OVERHEAD = 128


@dataclass(slots=True)
class _Queued:
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    future: asyncio.Future[Any]


@dataclass(slots=True)
class _Lane:
    """One partition's records not yet in a batch, and the task submitting them."""

    topic: str
    partition: int
    records: deque[_Queued] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class Batches:
    """`queue` records for `producer` (started by its owner); `drain` before stopping it."""

    def __init__(self, producer: AIOKafkaProducer, *, max_request_bytes: int) -> None:
        self._producer = producer
        self._max_request_bytes = max_request_bytes
        self._partitioner = KeyPartitioner()
        self._queued: list[_Queued] = []
        self._routing: asyncio.Task[None] | None = None
        self._lanes: dict[tuple[str, int], _Lane] = {}
        #: The running loop, looked up once: each lookup asks the kernel for the pid.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Batches submitted, and records in them (for the benchmarks and tests).
        self.batches = 0
        self.records = 0

    def queue(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        """Queue one record for its partition's next batch; its future resolves when Kafka
        has it (or fails with its batch's error)."""
        loop = self._loop
        if loop is None or loop.is_closed():  # one lookup per loop, not per record
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        size = len(key) + len(value) + _OVERHEAD
        if headers is None:
            headers = []  # a list: aiokafka's builder takes no other
        else:
            size += sum(len(k) + len(v) for k, v in headers)
        if size > self._max_request_bytes:
            future.set_exception(
                MessageSizeTooLargeError(
                    f"a record of {size} bytes is larger than the request limit "
                    f"({self._max_request_bytes} bytes)"
                )
            )
            return future
        if not self._queued:
            loop.call_soon(self._route_queued)
        self._queued.append(_Queued(topic, key, value, headers, future))
        return future

    async def drain(self) -> None:
        """Wait until everything queued so far is in the producer's hands (not acknowledged:
        the producer's ``flush`` or ``stop`` waits for that)."""
        if self._queued:
            self._route_queued()
        routing = self._routing
        if routing is not None:
            await asyncio.shield(routing)
        while True:
            busy = [lane.task for lane in self._lanes.values() if lane.task is not None]
            if not busy:
                return
            await asyncio.wait([asyncio.shield(task) for task in busy])

    def _route_queued(self) -> None:
        queued, self._queued = self._queued, []
        if not queued:
            return
        self._routing = asyncio.get_running_loop().create_task(self._route(queued, self._routing))

    async def _route(self, queued: list[_Queued], before: asyncio.Task[None] | None) -> None:
        """Each record of one turn to its partition's lane, in queue order."""
        if before is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await before
        partitions: dict[str, list[int]] = {}
        try:
            for q in queued:
                if q.topic not in partitions:
                    partitions[q.topic] = sorted(await self._producer.partitions_for(q.topic))
        except Exception as exc:  # noqa: BLE001 - every record settles with the failure
            _fail([q.future for q in queued], exc)
            return
        partitioner, lanes = self._partitioner, self._lanes
        for q in queued:
            every = partitions[q.topic]
            tp = (q.topic, partitioner(q.key, every, every))
            lane = lanes.get(tp)
            if lane is None:
                lane = lanes[tp] = _Lane(*tp)
            lane.records.append(q)
            if lane.task is None:
                lane.task = asyncio.get_running_loop().create_task(self._send(lane))

    async def _send(self, lane: _Lane) -> None:
        """Submit `lane`'s records as they come: each batch takes every record queued
        while the one before waited for room in the accumulator."""
        records = lane.records
        futures: list[asyncio.Future[Any]] = []
        try:
            while records:
                builder = self._producer.create_batch()
                futures = []
                while records and _append(builder, records[0]):
                    futures.append(records.popleft().future)
                if not futures:  # never: an empty batch takes any first record
                    refused = RuntimeError("an empty Kafka batch refused a record")
                    _fail([records.popleft().future], refused)
                    continue
                try:
                    batch = await self._producer.send_batch(
                        builder, lane.topic, partition=lane.partition
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the batch's records settle with it
                    _fail(futures, exc)
                    continue
                self.batches += 1
                self.records += len(futures)
                batch.add_done_callback(lambda done, settled=futures: _settle(done, settled))
                futures = []
        except BaseException as exc:  # cancelled, or a record the builder cannot take
            _fail(futures, exc)
            _fail([q.future for q in records], exc)
            records.clear()
            if not isinstance(exc, Exception):
                raise
            log.error("a batch of %s[%d] failed to build: %r", lane.topic, lane.partition, exc)
        finally:
            lane.task = None


def _append(builder: Any, q: _Queued) -> bool:
    """Whether `builder` took the record (it is full when not)."""
    taken = builder.append(timestamp=None, key=q.key, value=q.value, headers=q.headers)
    return taken is not None


def _settle(batch: asyncio.Future[Any], futures: list[asyncio.Future[Any]]) -> None:
    if batch.cancelled():
        _fail(futures, asyncio.CancelledError())
        return
    failure = batch.exception()
    if failure is not None:
        _fail(futures, failure)
        return
    result = batch.result()
    for future in futures:
        if not future.done():
            future.set_result(result)


def _fail(futures: list[asyncio.Future[Any]], exc: BaseException) -> None:
    for future in futures:
        if not future.done():
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)
