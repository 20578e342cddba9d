"""`streamtally stack up --brokers 3 --redis-cluster`: three KRaft nodes and a Redis Cluster.

One stack for the module, in a temporary state dir on spare ports (never the
shared stack's): started with the CLI, stopped with it afterwards, and then no
java or redis-server process of it may be left (pgrep).  On it, the pipeline
itself runs on the Redis Cluster (``REDIS_CLUSTER=1``) while a broker is
SIGKILLed, and must stay exact.  Costs about a minute and a half: a 3-node start
(~15 s), a broker killed until the others fence it (~10 s) and its restart
(~8 s), the pipeline run with its own broker kill (~30 s), a 3-node stop (~6 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from redis import Redis
from redis.cluster import RedisCluster

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS
from streamtally.ops.worker_process import WorkerProcess
from streamtally.stack import StackConfig, kafka, port_in_use, redis
from streamtally.stack.redis_cluster import SLOTS, cluster_info
from streamtally.store import tokens_key, tokens_pattern
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics, idempotent_producer, read_topic
from tests.integration.spare_stack import own_stack, run_stack, stack_env
from tests.integration.worker import SAMPLES, cli, run_streamtally, wait_for_tokens

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

#: Seconds one phase of the kill test may take to produce or consume its records.
PHASE_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    with own_stack(tmp_path_factory.mktemp("stack-cluster"), brokers=3, redis_cluster=True) as cfg:
        yield cfg


def test_status_shows_every_node_and_the_shape_is_remembered(cluster: StackConfig) -> None:
    status = run_stack(cluster, "status")
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
        # A created topic reaches every broker's metadata a moment later (until then the
        # broker asked answers UNKNOWN_TOPIC_OR_PARTITION, error code 3).
        deadline = time.monotonic() + 30
        while True:
            described = await admin.describe_topics([t.name for t in topics.all])
            if all(t["error_code"] == 0 and t["partitions"] for t in described):
                break
            assert time.monotonic() < deadline, described
            await asyncio.sleep(0.2)
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

        restart = await asyncio.to_thread(run_stack, cluster, "up")  # the shape is remembered
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


def _sample_manifest(tag: str) -> list[dict[str, str]]:
    """Every sample transcript of the repo under fresh ids, over three tenants."""
    rows = []
    for i, line in enumerate((SAMPLES / "manifest.jsonl").read_text().splitlines()):
        if line.strip():
            row = json.loads(line)
            rows.append(
                {
                    "file": str(SAMPLES / row["file"]),
                    "source": row["source"],
                    "request_id": f"cl-{tag}-{row['file'].replace('/', '-')}",
                    "tenant": f"t{i % 3}-{tag}",
                    **({"model": row["model"]} if "model" in row else {}),
                }
            )
    return rows


def _keys_per_master(cfg: StackConfig) -> dict[int, int]:
    """How many Tokens keys each master holds (SCAN of each node alone)."""
    counts = {}
    for port in cfg.redis_cluster_ports:
        node = Redis(host=cfg.host, port=port)
        try:
            counts[port] = sum(1 for _ in node.scan_iter(match=tokens_pattern(), count=1000))
        finally:
            node.close()
    return counts


def test_the_pipeline_is_exact_on_the_redis_cluster_through_a_broker_kill(
    cluster: StackConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker on three brokers and the Redis Cluster: every Tokens equal to its fold,
    usage rows equal to the sum of the folds, one billing event per request, though a
    broker is SIGKILLed halfway through production; the keys spread over every master.
    """
    tag = uuid.uuid4().hex[:8]
    env = stack_env(cluster)
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=cluster.all_bootstrap_servers(),
        REDIS_URL=cluster.local_redis_url(),
        REDIS_CLUSTER="1",
        STREAMTALLY_NAMESPACE=f"cl-{tag}",
        STREAMTALLY_REQUEST_TIMEOUT="20",
        STREAMTALLY_STATE_TTL="3600",
    )
    requests = _sample_manifest(tag)
    half = len(requests) // 2
    worker = WorkerProcess(tmp_path / "worker.log", env=env).start()
    try:
        worker.wait_until_ready(120)
        for part, rows in (("first", requests[:half]), ("second", requests[half:])):
            manifest = tmp_path / f"{part}.jsonl"
            manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
            produced = run_streamtally("produce", "--manifest", str(manifest), env=env)
            assert produced.returncode == 0, produced.stderr.decode(errors="replace")
            if part == "first":  # a broker dies with requests in flight; two stay in sync
                victim = kafka.statuses(cluster)[1]
                assert victim.pid is not None
                os.killpg(victim.pid, signal.SIGKILL)
        refs = [RequestRef(r["tenant"], r["request_id"]) for r in requests]
        missing = wait_for_tokens(cluster.local_redis_url(), refs, 120, worker, cluster=True)
        assert missing == set(), worker.describe()
        code, _ = worker.stop()
        assert code == 0, worker.describe()
    finally:
        if worker.running:
            worker.kill()
        restart = run_stack(cluster, "up")  # the shape is remembered: the killed broker comes back
        assert restart.returncode == 0, restart.stdout + restart.stderr

    expected_usage: dict[str, Counter[str]] = {}
    for row in requests:
        fold = cli("fold", "--source", row["source"], "--request-id", row["request_id"],
                   *(["--model", row["model"]] if "model" in row else []), row["file"])  # fmt: skip
        assert fold.code == 0, fold.err
        with monkeypatch.context() as patched:  # the command in this process, on the cluster
            for name in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "REDIS_CLUSTER"):
                patched.setenv(name, env[name])
            got = cli("tokens", "get", row["request_id"], "--tenant", row["tenant"])
        assert got.code == 0, got.err
        assert json.loads(got.out) == json.loads(fold.out), row["file"]
        totals = expected_usage.setdefault(row["tenant"], Counter())
        totals.update(json.loads(fold.out)["usage"])
        totals["requests"] += 1

    usage = run_streamtally("usage", "--json", env=env)
    assert usage.returncode == 0, usage.stderr.decode(errors="replace")
    found: dict[str, Counter[str]] = {}
    for row in json.loads(usage.stdout):
        if row["tenant"] in expected_usage:
            totals = found.setdefault(row["tenant"], Counter())
            totals.update({k: row[k] for k in (*USAGE_FIELDS, "requests")})
    assert found == expected_usage

    billing = run_streamtally("billing", "export", "--json", "--keep-replays", env=env)
    assert billing.returncode == 0, billing.stderr.decode(errors="replace")
    events = [json.loads(line) for line in billing.stdout.decode().splitlines()]
    by_request: dict[tuple[str, str], set[str]] = {}
    for event in events:
        key = (event["tenant"], event["request_id"])
        by_request.setdefault(key, set()).add(json.dumps(event, sort_keys=True))
    assert sorted(by_request) == sorted((r["tenant"], r["request_id"]) for r in requests)
    assert all(len(payloads) == 1 for payloads in by_request.values()), by_request

    per_master = _keys_per_master(cluster)
    assert all(count > 0 for count in per_master.values()), per_master
    assert sum(per_master.values()) >= len(requests)
    client = RedisCluster.from_url(cluster.local_redis_url())
    try:
        ttl = client.ttl(tokens_key(refs[0]))
    finally:
        client.close()
    assert 0 < ttl <= 3600  # Tokens expire after STREAMTALLY_STATE_TTL


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
