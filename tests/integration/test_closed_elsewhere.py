"""A request closed by the partition's other owner does not stop its partition committing.

After a rebalance two workers can both hold a request open; the first close decision
written to Redis stands, and the other worker writes nothing of its own close.  Its
records are then released as the other owner's, once that close is applied.  Before,
they stayed held for good: the partition's committed offset stopped at the request's
first record, and nothing after it was committed until a rebalance or a restart (which
then read everything since again).

Here, on the real stack: a worker reads request ``r`` (all but its END); another owner,
a `RequestProcessor` that read the same records, closes ``r`` by timeout and writes its
outputs through the worker's own sinks; then ``r``'s END and a whole request ``s`` arrive
on the same partition.  The worker's close of ``r`` is refused (another decision stands),
``r`` is billed once (the other owner's bill), and the group's committed offset of the
partition goes past ``s``.

The worker runs in a topic namespace of its own (its own consumer group) against the
shared Redis, with a tenant of its own; its usage rows are forgotten afterwards.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.ops import worker_process
from streamtally.processors.requests import CloseReason, Outputs, Position, RequestProcessor
from streamtally.processors.sinks import KafkaSink, RedisSink, Sinks
from streamtally.producers import RawProducer, raw_records
from streamtally.store import RedisStore
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics
from tests.integration.worker import REPO, SAMPLES, forget_usage, wait_for_tokens

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TRANSCRIPT = (SAMPLES / "openai" / "text_usage.sse").read_bytes()
#: How long the committed offset may take to pass `s` (it takes about a second).
COMMIT_WITHIN_S = 20.0


class _Clock:
    """The other owner's monotonic clock, moved by hand past its request timeout."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def namespace(stack_endpoints: Any, tmp_path: Path) -> Iterator[str]:
    name = f"elsewhere-{uuid.uuid4().hex[:8]}"
    asyncio.run(ensure_topics(stack_endpoints.bootstrap_servers, Topics.in_namespace(name).all))
    env = {
        **os.environ,
        **stack_endpoints.env(),
        "STREAMTALLY_NAMESPACE": name,
        "STREAMTALLY_WEB_PORT": "0",
        "STREAMTALLY_REQUEST_TIMEOUT": "60",  # the worker never times r out itself here
    }
    worker = worker_process.WorkerProcess(tmp_path / "worker.log", env, cwd=REPO).start()
    try:
        worker.wait_until_ready(60)
        yield name
        worker.check()
    finally:
        worker.stop(timeout=30)


def _same_partition(first: str, partitions: int, tag: str) -> str:
    """A request id of the form ``<tag>-<n>`` that the raw topics put on `first`'s partition."""
    choose = DefaultPartitioner()
    every = list(range(partitions))
    wanted = choose(first.encode(), every, every)
    return next(
        f"{tag}-{n}" for n in range(1000) if choose(f"{tag}-{n}".encode(), every, every) == wanted
    )


async def _committed(servers: str, topics: Topics, tp: TopicPartition) -> int | None:
    """The processors group's committed offset of `tp` (read only: joins no group)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=servers, group_id=topics.processors_group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        committed: int | None = await consumer.committed(tp)
        return committed
    finally:
        await consumer.stop()


def test_a_partition_keeps_committing_after_another_owner_closed_one_of_its_requests(
    stack_endpoints: Any, namespace: str, tmp_path: Path
) -> None:
    servers, url = stack_endpoints.bootstrap_servers, stack_endpoints.redis_url
    topics = Topics.in_namespace(namespace)
    tenant = f"elsewhere-{uuid.uuid4().hex[:8]}"
    r_id = f"r-{uuid.uuid4().hex[:8]}"
    p_id = _same_partition(r_id, topics.raw_sse.partitions, "p")
    s_id = _same_partition(r_id, topics.raw_sse.partitions, "s")
    r, p, s = (RequestRef(tenant, rid) for rid in (r_id, p_id, s_id))
    records = {
        rid: raw_records(Source.OPENAI, TRANSCRIPT, tenant=tenant, request_id=rid)[1]
        for rid in (r_id, p_id, s_id)
    }

    async def send(*batches: tuple[str, list[bytes]]) -> list[Any]:
        async with RawProducer(servers, namespace=namespace) as producer:
            sent = []
            for rid, values in batches:
                for value in values:
                    sent.append(await (await producer.send(Source.OPENAI, rid, value)))
            return sent

    try:
        # r all but its END, then a whole request p behind it: once p is billed, the
        # worker has read r's records (same partition, in order) and holds r open.
        sent = asyncio.run(send((r_id, records[r_id][:-1]), (p_id, records[p_id])))
        r_sent = sent[: len(records[r_id]) - 1]
        tp = TopicPartition(topics.raw_sse.name, r_sent[0].partition)
        assert {m.partition for m in sent} == {tp.partition}
        assert wait_for_tokens(url, [p], timeout=30) == set()
        r_first = r_sent[0].offset
        assert asyncio.run(_committed(servers, topics, tp)) in (None, r_first)

        # The other owner: it read r's records too, closed r by timeout, and wrote it.
        clock = _Clock()
        other = RequestProcessor(PriceTable.default(), timeout=5.0, clock=clock)
        out = Outputs()
        for meta, value in zip(r_sent, records[r_id][:-1], strict=True):
            position = Position(tp.topic, tp.partition, meta.offset, meta.timestamp / 1000)
            other.handle_sse(r_id.encode(), value, position, out)
        clock.now += 60
        out.extend(other.expire())
        [theirs] = out.completed
        assert theirs.closed.reason is CloseReason.TIMEOUT

        async def write_as_other_owner() -> None:
            redis = RedisSink(RedisStore.from_url(url, state_ttl_s=3600))  # test keys
            sinks = Sinks(KafkaSink(servers, topics), redis, lookup=redis.lookup)
            try:
                assert (await sinks.write(out)).elsewhere == frozenset()  # decided first
            finally:
                await sinks.close()

        asyncio.run(write_as_other_owner())

        # r's END (the worker closes r there: refused, the other decision stands), then s.
        s_sent = asyncio.run(send((r_id, records[r_id][-1:]), (s_id, records[s_id])))
        assert {m.partition for m in s_sent} == {tp.partition}
        past_s = s_sent[-1].offset + 1
        assert wait_for_tokens(url, [s], timeout=30) == set()
        deadline = time.monotonic() + COMMIT_WITHIN_S
        committed = asyncio.run(_committed(servers, topics, tp))
        while (committed or 0) < past_s and time.monotonic() < deadline:
            time.sleep(0.25)
            committed = asyncio.run(_committed(servers, topics, tp))
        assert committed == past_s, (
            f"the partition's committed offset stayed at {committed} (r's first record: "
            f"{r_first}), not past s ({past_s})"
        )

        async def stored() -> tuple[Any, Any]:
            store = RedisStore.from_url(url)
            try:
                return await store.tokens(r), await store.closed_markers([r])
            finally:
                await store.aclose()

        tokens, markers = asyncio.run(stored())
        assert markers == {r: (theirs.closed.marker(), True)}  # one decision: the other's
        assert tokens is not None
        assert tokens["error"] == theirs.tokens.error  # its bill: timed out
    finally:
        forget_usage(url, [tenant])
