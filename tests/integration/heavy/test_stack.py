"""The local stack answers: Kafka metadata/topic round trip via aiokafka, Redis PING.

Uses ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` when set (an existing cluster);
otherwise brings the local stack up first (idempotent, same as
``streamtally stack up``: in the shape it was last started with) and leaves it
running.  `test_stack_cluster.py` starts a 3-broker stack and a Redis Cluster of
its own.
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis as redis_client
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from streamtally.settings import ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL, Settings
from streamtally.stack import StackConfig, kafka, redis

pytestmark = pytest.mark.integration


def _uses_local_stack() -> bool:
    return not (os.environ.get(ENV_BOOTSTRAP_SERVERS) or os.environ.get(ENV_REDIS_URL))


@pytest.fixture(scope="module")
def stack() -> StackConfig:
    cfg = StackConfig.from_settings(Settings.load())
    if _uses_local_stack():
        kafka.up(cfg, print)
        redis.up(cfg, print)
    return cfg


def test_local_services_report_running(stack: StackConfig) -> None:
    if not _uses_local_stack():
        pytest.skip("KAFKA_BOOTSTRAP_SERVERS/REDIS_URL point at an external stack")
    assert all(st.running for st in kafka.statuses(stack))
    assert all(st.running for st in redis.statuses(stack))
    assert len(kafka.statuses(stack)) == stack.brokers
    assert Settings.load().bootstrap_servers == stack.local_bootstrap_servers()
    assert Settings.load().redis_url == stack.local_redis_url()


async def test_kafka_metadata_lists_a_broker(stack: StackConfig) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=Settings.load().bootstrap_servers)
    await admin.start()
    try:
        cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    assert cluster["brokers"], cluster
    assert cluster["cluster_id"]


async def test_kafka_topic_round_trip(stack: StackConfig) -> None:
    topic = f"stack-test-{uuid.uuid4().hex[:12]}"
    servers = Settings.load().bootstrap_servers
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"hello", key=b"k")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=servers,
            group_id=f"{topic}-group",
            auto_offset_reset="earliest",
        )
        await consumer.start()
        try:
            record = await consumer.getone()
        finally:
            await consumer.stop()
        assert (record.key, record.value) == (b"k", b"hello")
    finally:
        await admin.delete_topics([topic])
        await admin.close()


def test_redis_ping_and_persistence(stack: StackConfig) -> None:
    client = redis_client.Redis.from_url(Settings.load().redis_url)
    try:
        assert client.ping() is True
        if _uses_local_stack():
            assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        client.close()
