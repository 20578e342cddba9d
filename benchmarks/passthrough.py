"""The ceiling the pipeline benchmark compares the worker with: a plain pass-through.

A fresh aiokafka consumer (no group: `assign()` and `seek()`) reads a given
range of raw messages and a producer writes each value, with its key,
unchanged to the scratch topic `streamtally.bench.passthrough`.  It works in
the worker's rhythm: batches of up to `batch_size` records (the worker's
`STREAMTALLY_BATCH_SIZE`), every record of a batch sent, then the batch's
acks awaited before the next fetch (what the worker must do before it may
commit), with the worker's producer settings (acks=all, linger 5 ms, 1 MiB
batches).  So the figure is what one Python process moves through this
broker when it does no work on the messages: the worker can at best approach it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streamtally.connection import KafkaConnection, client_options
from streamtally.topics import DAY_MS, Topic
from streamtally.wire.kafka import ensure_topics

__all__ = ["PASSTHROUGH_TOPIC", "PassthroughResult", "ensure_passthrough_topic", "run"]

PASSTHROUGH_TOPIC: Final = "streamtally.bench.passthrough"
_PARTITIONS: Final = 6
#: Scratch data: kept one day, so repeated runs do not fill the disk.
_RETENTION_MS: Final = DAY_MS


@dataclass(frozen=True, slots=True)
class PassthroughResult:
    messages: int
    bytes: int
    #: From the first record consumed to the last record produced and acked.
    seconds: float

    @property
    def messages_per_second(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0


#: The scratch topic, declared like the pipeline's own topics.
_SCRATCH: Final = Topic(
    name=PASSTHROUGH_TOPIC,
    partitions=_PARTITIONS,
    retention_ms=_RETENTION_MS,
    value_schema="RawSseEvent or RawEngineOutput (raw records, copied unchanged)",
    description="scratch topic of the pass-through ceiling of the pipeline benchmark",
)


async def ensure_passthrough_topic(bootstrap_servers: KafkaConnection | str) -> bool:
    """Create the scratch topic if it is missing (never deletes anything); True if created."""
    return bool(await ensure_topics(bootstrap_servers, (_SCRATCH,)))


async def run(
    bootstrap_servers: KafkaConnection | str,
    start: Mapping[TopicPartition, int],
    end: Mapping[TopicPartition, int],
    *,
    batch_size: int = 2000,
    progress: Callable[[str], None] | None = None,
) -> PassthroughResult:
    """Pass the records in `[start[tp], end[tp])` of every partition through, as described."""
    wanted = {tp: end[tp] for tp in end if end[tp] > start.get(tp, 0)}
    total = sum(end[tp] - start.get(tp, 0) for tp in wanted)
    consumer = AIOKafkaConsumer(
        **client_options(bootstrap_servers),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=1 << 20,
    )
    producer = AIOKafkaProducer(
        **client_options(bootstrap_servers),
        acks="all",
        linger_ms=5,
        max_batch_size=1 << 20,
        max_request_size=8 << 20,
    )
    await consumer.start()
    try:
        await producer.start()
        try:
            if not wanted:
                return PassthroughResult(0, 0, 0.0)
            consumer.assign(list(wanted))
            for tp in wanted:
                consumer.seek(tp, start.get(tp, 0))
            return await _pump(
                consumer=consumer,
                producer=producer,
                wanted=wanted,
                total=total,
                batch_size=batch_size,
                progress=progress,
            )
        finally:
            await producer.stop()
    finally:
        await consumer.stop()


async def _pump(
    *,
    consumer: Any,
    producer: Any,
    wanted: dict[TopicPartition, int],
    total: int,
    batch_size: int,
    progress: Callable[[str], None] | None,
) -> PassthroughResult:
    remaining = dict(wanted)  # partition → end offset still to reach
    messages = size = 0
    first: float | None = None
    last_report = time.perf_counter()
    send = producer.send
    while remaining:
        batches: dict[TopicPartition, list[Any]] = await consumer.getmany(
            *remaining, timeout_ms=200, max_records=batch_size
        )
        if first is None and any(batches.values()):
            first = time.perf_counter()
        futures = []
        for tp, records in batches.items():
            stop = remaining.get(tp)
            if stop is None:
                continue
            for record in records:
                if record.offset >= stop:
                    break
                futures.append(await send(PASSTHROUGH_TOPIC, record.value, key=record.key))
                messages += 1
                size += len(record.value or b"")
            if records and records[-1].offset + 1 >= stop:
                del remaining[tp]
                consumer.pause(tp)
        if futures:
            await asyncio.gather(*futures)
        now = time.perf_counter()
        if progress is not None and now - last_report >= 2.0:
            last_report = now
            progress(f"  pass-through: {messages:,}/{total:,} messages")
    seconds = time.perf_counter() - first if first is not None else 0.0
    return PassthroughResult(messages, size, seconds)
