"""Records handed to Kafka a batch at a time: one `send_batch` per partition per loop turn.

aiokafka's ``send`` does, for every record, a metadata wait, a partitioner
call, a size check, a future and an append to its accumulator: about 15 µs
of Python per record, two fifths of the tap's sender process under the
proxy benchmark.  The spool's sender hands Kafka thousands of records a
second that are already encoded and framed, so `Batches` takes them as they
come (`queue`, synchronous, returns the record's future) and, once per turn
of the event loop, writes everything queued into one `BatchBuilder` per
partition (several when one is full) and submits them with ``send_batch``.
The producer is the same idempotent one (``acks=all``): it numbers each
batch when it drains it, so its retries neither duplicate nor reorder.

Order.  Records keep the order they were queued in, per partition: the
builders of one turn are submitted in the order they were made, and one
turn's submission waits for the turn before (a chain of tasks), so a later
turn never overtakes an earlier one that waits for room in the accumulator.

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
from dataclasses import dataclass
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


class Batches:
    """`queue` records for `producer` (started by its owner); `drain` before stopping it."""

    def __init__(self, producer: AIOKafkaProducer, *, max_request_bytes: int) -> None:
        self._producer = producer
        self._max_request_bytes = max_request_bytes
        self._partitioner = KeyPartitioner()
        self._queued: list[_Queued] = []
        self._last: asyncio.Task[None] | None = None
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
        """Queue one record for this loop turn's batches; its future resolves when Kafka
        has it (or fails with its batch's error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        headers = [] if headers is None else headers  # a list: aiokafka's builder takes no other
        size = len(key) + len(value) + sum(len(k) + len(v) for k, v in headers) + _OVERHEAD
        if size > self._max_request_bytes:
            future.set_exception(
                MessageSizeTooLargeError(
                    f"a record of {size} bytes is larger than the request limit "
                    f"({self._max_request_bytes} bytes)"
                )
            )
            return future
        if not self._queued:
            loop.call_soon(self._submit_queued)
        self._queued.append(_Queued(topic, key, value, headers, future))
        return future

    async def drain(self) -> None:
        """Wait until everything queued so far is in the producer's hands (not acknowledged:
        the producer's ``flush`` or ``stop`` waits for that)."""
        if self._queued:
            self._submit_queued()
        last = self._last
        if last is not None:
            await asyncio.shield(last)

    def _submit_queued(self) -> None:
        queued, self._queued = self._queued, []
        if not queued:
            return
        self._last = asyncio.get_running_loop().create_task(self._submit(queued, self._last))

    async def _submit(self, queued: list[_Queued], before: asyncio.Task[None] | None) -> None:
        if before is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await before
        try:
            builders = await self._build(queued)
        except Exception as exc:  # noqa: BLE001 - every record settles with the failure
            _fail([q.future for q in queued], exc)
            return
        for topic, partition, builder, futures in builders:
            try:
                batch = await self._producer.send_batch(builder, topic, partition=partition)
            except asyncio.CancelledError:
                _fail(futures, asyncio.CancelledError())
                raise
            except Exception as exc:  # noqa: BLE001 - the batch's records settle with it
                _fail(futures, exc)
                continue
            self.batches += 1
            self.records += len(futures)
            batch.add_done_callback(lambda done, records=futures: _settle(done, records))

    async def _build(
        self, queued: list[_Queued]
    ) -> list[tuple[str, int, Any, list[asyncio.Future[Any]]]]:
        """The batches of one turn: per partition, as few builders as fit, in queue order."""
        partitions: dict[str, list[int]] = {}
        for q in queued:
            if q.topic not in partitions:
                partitions[q.topic] = sorted(await self._producer.partitions_for(q.topic))
        out: list[tuple[str, int, Any, list[asyncio.Future[Any]]]] = []
        current: dict[tuple[str, int], tuple[Any, list[asyncio.Future[Any]]]] = {}
        partitioner = self._partitioner
        for q in queued:
            every = partitions[q.topic]
            tp = (q.topic, partitioner(q.key, every, every))
            entry = current.get(tp)
            if entry is None or not _append(entry[0], q):
                builder = self._producer.create_batch()
                if not _append(builder, q):  # never: an empty batch takes any first record
                    raise RuntimeError("an empty Kafka batch refused a record")
                entry = (builder, [])
                current[tp] = entry
                out.append((tp[0], tp[1], builder, entry[1]))
            entry[1].append(q.future)
        return out


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
