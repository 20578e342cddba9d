"""The tap's path to Kafka (`Batches`) against the real broker, as `benchmarks.sender_batches`
drives it: every record lands once, and a steady stream makes batches of many records.

(A batch per event-loop turn once made batches of about two records under a steady
stream, each waiting for a produce request of its own.)  The records/s themselves are
the benchmark's to report, not this test's.
"""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from benchmarks.sender_batches import measure
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics

pytestmark = pytest.mark.integration

RECORDS = 3000


async def _end_total(servers: str, topic: str, partitions: int) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=servers)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


@pytest.mark.parametrize("mode", ["batches", "send"])
async def test_every_record_lands_once_and_batches_follow_the_load(
    bootstrap_servers: str, mode: str
) -> None:
    raw = Topics.in_namespace(f"st-batches-{uuid.uuid4().hex[:8]}").raw_sse
    await ensure_topics(bootstrap_servers, (raw,))
    before = await _end_total(bootstrap_servers, raw.name, raw.partitions)
    run = await measure(
        mode,
        records=RECORDS,
        in_flight=500,
        per_turn=20,
        size=200,
        servers=bootstrap_servers,
        topic=raw.name,
    )
    assert run.records == RECORDS
    assert await _end_total(bootstrap_servers, raw.name, raw.partitions) - before == RECORDS
    if mode == "batches":
        # 20 records a turn over 6 partitions: a batch per turn would hold about 3.
        assert run.batches <= RECORDS / 10, f"{run.batches} batches for {RECORDS} records"
    else:
        assert run.batches == 0
