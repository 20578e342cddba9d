"""`streamtally stack up --brokers 3 --redis-cluster`: three KRaft nodes and a Redis Cluster.

One stack for the module, in a temporary state dir on spare ports (never the
shared stack's): started with the CLI, stopped with it afterwards, and then no
java or redis-server process of it may be left (pgrep).  Costs about a minute:
a 3-node start (~15 s), a broker killed until the others fence it (~10 s) and
its restart (~8 s), a 3-node stop (~6 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from redis.cluster import RedisCluster

from streamtally.ops.stack import StackConfig, kafka, port_in_use, redis
from streamtally.ops.stack.redis_cluster import SLOTS, cluster_info
from streamtally.settings import ENV_BOOTSTRAP_SERVERS, ENV_REDIS_CLUSTER, ENV_REDIS_URL
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics, idempotent_producer, read_topic
from tests.integration.worker import streamtally

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

TOOLS = ("java", "mvn", "redis-server", "redis-cli")
#: Seconds one phase of the kill test may take to produce or consume its records.
PHASE_TIMEOUT_S = 90.0


def _spare_config(state_dir: Path) -> StackConfig:
    """A 3-broker, Redis Cluster config on ports nothing listens on (nor the shared stack)."""
    for _ in range(50):
        kafka_port = random.randrange(21000, 29000, 10)
        redis_port = random.randrange(31000, 39000, 10)
        cfg = StackConfig(
            state_dir,
            kafka_port=kafka_port,
            controller_port=kafka_port + 1,
            redis_port=redis_port,
            brokers=3,
            redis_cluster=True,
        )
        if not any(port_in_use(cfg.host, port) for _, port in cfg.named_ports()):
            return cfg
    pytest.fail("no spare ports for a 3-broker stack and a Redis Cluster")


def _env(cfg: StackConfig) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL, ENV_REDIS_CLUSTER)
    }
    env.update(
        STREAMTALLY_STATE_DIR=str(cfg.state_dir),
        STREAMTALLY_KAFKA_PORT=str(cfg.kafka_port),
        STREAMTALLY_CONTROLLER_PORT=str(cfg.controller_port),
        STREAMTALLY_REDIS_PORT=str(cfg.redis_port),
    )
    return env


def _stack(cfg: StackConfig, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        streamtally("stack", *args),
        env=_env(cfg),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _leftovers(cfg: StackConfig) -> list[str]:
    """The java and redis-server processes of this stack still running (pgrep)."""
    patterns = [f"kafka.Kafka {cfg.state_dir}/"]
    patterns += [f"redis-server {cfg.host}:{port}" for port in cfg.redis_cluster_ports]
    found = []
    for pattern in patterns:
        result = subprocess.run(
            ["pgrep", "-a", "-f", pattern], capture_output=True, text=True, check=False
        )
        found += [line[:160] for line in result.stdout.splitlines()]
    return found


def _kill_what_is_left(cfg: StackConfig) -> None:
    """SIGKILL the nodes `stack down` left running (only processes that are this stack's)."""
    for st in [*kafka.statuses(cfg), *redis.statuses(cfg)]:
        if st.running and st.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(st.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        message = f"the local stack needs {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    cfg = _spare_config(tmp_path_factory.mktemp("stack-cluster"))
    try:
        start = time.monotonic()
        up = _stack(cfg, "up", "--brokers", "3", "--redis-cluster")
        print(up.stdout, up.stderr, f"(up took {time.monotonic() - start:.1f} s)")
        assert up.returncode == 0, up.stdout + up.stderr
        yield cfg
    finally:
        down = _stack(cfg, "down", "--timeout", "30", timeout=180)
        _kill_what_is_left(cfg)
        assert down.returncode == 0, down.stdout + down.stderr
        deadline = time.monotonic() + 10
        while _leftovers(cfg) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _leftovers(cfg) == []


def test_status_shows_every_node_and_the_shape_is_remembered(cluster: StackConfig) -> None:
    status = _stack(cluster, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    lines = status.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:6]] == [
        "kafka-1",
        "kafka-2",
        "kafka-3",
        "redis-1",
        "redis-2",
        "redis-3",
    ]
    assert all(": running (pid " in line for line in lines[:6])
    assert lines[-1].endswith(f"REDIS_URL={cluster.local_redis_url()} REDIS_CLUSTER=1")
    shape = json.loads((cluster.state_dir / "stack.json").read_text())
    assert shape == {"brokers": 3, "redis_cluster": True}


async def test_the_project_topics_get_three_copies(cluster: StackConfig) -> None:
    servers = cluster.local_bootstrap_servers()  # the first broker finds the others
    topics = Topics.in_namespace(f"rf-{uuid.uuid4().hex[:8]}")
    assert await ensure_topics(servers, topics.all) == [t.name for t in topics.all]
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        assert len((await admin.describe_cluster())["brokers"]) == 3
        described = await admin.describe_topics([t.name for t in topics.all])
    finally:
        await admin.close()
    for topic in described:
        assert {len(p["replicas"]) for p in topic["partitions"]} == {3}, topic
    # min.insync.replicas 2 on the topics the worker writes (the broker has them as given)
    assert topics.billing.on_cluster(3).config()["min.insync.replicas"] == "2"


async def _partitions(servers: str, topic: str, count: int) -> list[dict[str, Any]]:
    """The topic's partitions once metadata lists all `count` of them with a leader."""
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            (described,) = await admin.describe_topics([topic])
            partitions: list[dict[str, Any]] = described["partitions"]
            if len(partitions) == count and all(p["leader"] >= 0 for p in partitions):
                return partitions
            assert time.monotonic() < deadline, f"{topic} has no leaders: {described}"
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def test_a_killed_broker_loses_nothing(cluster: StackConfig) -> None:
    servers = cluster.all_bootstrap_servers()
    topic = Topics.in_namespace(f"kill-{uuid.uuid4().hex[:8]}").chunks  # RF 3, min.insync 2
    await ensure_topics(servers, (topic,))
    partitions = await _partitions(servers, topic.name, topic.partitions)
    victim = next(p["leader"] for p in partitions if p["partition"] == 0)

    sent: list[bytes] = []
    producer = idempotent_producer(servers)  # acks=all, idempotent
    consumer = AIOKafkaConsumer(
        topic.name,
        bootstrap_servers=servers,
        group_id=f"{topic.name}.group",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    received: list[bytes] = []

    async def produce(phase: str, count: int) -> None:
        values = [f"{phase}-{i}".encode() for i in range(count)]
        futures = [await producer.send(topic.name, v, key=v) for v in values]
        await asyncio.wait_for(asyncio.gather(*futures), PHASE_TIMEOUT_S)
        sent.extend(values)

    async def consume_all() -> None:
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while set(received) != set(sent):
            assert time.monotonic() < deadline, f"{len(set(sent) - set(received))} not consumed"
            batches = await consumer.getmany(timeout_ms=500)
            received.extend(r.value for records in batches.values() for r in records)
        await consumer.commit()

    await producer.start()
    await consumer.start()
    try:
        await produce("before", 300)
        await consume_all()

        # SIGKILL the leader of partition 0: no controlled shutdown, its peers fence it.
        pid = kafka.statuses(cluster)[victim - 1].pid
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        started = time.monotonic()
        await produce("during", 300)  # acks=all still succeeds: 2 in-sync replicas remain
        await consume_all()
        print(f"broker {victim} killed: 300 records through in {time.monotonic() - started:.1f} s")
        assert not kafka.statuses(cluster)[victim - 1].running

        restart = await asyncio.to_thread(_stack, cluster, "up")  # the shape is remembered
        assert restart.returncode == 0, restart.stdout + restart.stderr
        assert f"kafka-{victim}: starting" in restart.stdout
        await produce("after", 300)
        await consume_all()
    finally:
        await consumer.stop()
        await producer.stop()

    deadline = time.monotonic() + 60
    while True:  # the restarted broker caught up: back in every partition's ISR
        partitions = await _partitions(servers, topic.name, topic.partitions)
        if all(len(p["isr"]) == 3 for p in partitions):
            break
        assert time.monotonic() < deadline, (
            f"the restarted broker is not in every ISR: {partitions}"
        )
        await asyncio.sleep(0.5)
    assert sorted(set(received)) == sorted(sent)
    # Everything acknowledged is in the log, exactly once (idempotent producer).
    async with contextlib.aclosing(read_topic(servers, topic.name)) as records:
        logged = [record.value async for record in records]
    assert sorted(v for v in logged if v is not None) == sorted(sent)


def test_the_redis_cluster_serves_every_slot_then_stops(cluster: StackConfig) -> None:
    for port in cluster.redis_cluster_ports:
        info = cluster_info(cluster.host, port)
        assert info is not None
        assert info["cluster_state"] == "ok"
        assert info["cluster_slots_ok"] == str(SLOTS)
        assert info["cluster_known_nodes"] == "3"
    client = RedisCluster.from_url(cluster.local_redis_url())
    try:
        by_master: dict[int, str] = {}
        for i in range(1000):
            key = f"st-cluster-test:{i}"
            by_master.setdefault(client.get_node_from_key(key).port, key)
            if len(by_master) == 3:
                break
        assert sorted(by_master) == list(cluster.redis_cluster_ports)
        for port, key in by_master.items():
            assert client.set(key, str(port)) is True
        assert {port: client.get(key) for port, key in by_master.items()} == {
            port: str(port).encode() for port in by_master
        }
        assert len({client.keyslot(key) for key in by_master.values()}) == 3
    finally:
        client.close()
    redis.down(cluster, print, timeout=30)
    assert not any(st.running for st in redis.statuses(cluster))
    assert not any(port_in_use(cluster.host, port) for port in cluster.redis_cluster_ports)
