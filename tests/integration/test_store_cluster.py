"""The Redis store on a real Redis Cluster of three masters (the session's `redis_cluster_url`).

Every write of layout 3 is a script on one shard, one hash slot; reads sum a
usage row's parts over the 16 shards and scan every master.  These tests write
requests that land in every shard (so on every master), then check what the
worker and the read commands rely on: exactly-once application, write-once
close decisions, dead letters counted once, rows summed exactly, Tokens found
by id and by tenant, the state TTL on Tokens and markers and none on rows.
The same behaviours on one Redis: `test_redis_batch.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from redis.asyncio.cluster import RedisCluster

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.store import (
    LAYOUT_KEY,
    LAYOUT_VERSION,
    SHARDS,
    RedisStore,
    closed_key,
    day_of,
    finished_request,
    shard_of,
    tokens_key,
    usage_key,
)
from streamtally.store.layout import guard_key

pytestmark = pytest.mark.integration

PRICES = PriceTable.from_dict(
    {
        "version": "t",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {"m-*": {"input": "2.50", "cached_input": "1.25", "output": "10.00"}},
    }
)
WHEN = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)
TTL_S = 600


def make_tokens(request_id: str, output: int = 200) -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model="m-1",
        text=f"answer of {request_id}: Grüße",
        reasoning="",
        tool_calls=(),
        usage=Usage(input_tokens=1000, output_tokens=output, cached_tokens=400),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=3,
    )


@pytest.fixture
async def store(redis_cluster_url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore.from_url(redis_cluster_url, cluster=True, state_ttl_s=TTL_S)
    await store.ensure_layout()
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
async def client(redis_cluster_url: str) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster_url)
    try:
        yield client
    finally:
        await client.aclose()


def refs_in_every_shard(tenant: str) -> list[RequestRef]:
    """Request refs of `tenant`, at least one per shard."""
    found: dict[int, RequestRef] = {}
    n = 0
    while len(found) < SHARDS:
        ref = RequestRef(tenant, f"r-{n}")
        found.setdefault(shard_of(ref), ref)
        n += 1
    return list(found.values())


async def test_the_layout_is_claimed_on_every_master(
    store: RedisStore, client: RedisCluster
) -> None:
    assert await store.layout_version() == LAYOUT_VERSION
    assert await client.get(LAYOUT_KEY) == LAYOUT_VERSION.encode()
    guards = [await client.get(guard_key(shard)) for shard in range(SHARDS)]
    assert guards == [LAYOUT_VERSION.encode()] * SHARDS
    masters = {client.get_node_from_key(guard_key(shard)).port for shard in range(SHARDS)}
    assert len(masters) == 3  # the 16 shards spread over all three masters
    await store.ensure_layout()  # claiming again changes nothing


async def test_requests_in_every_shard_apply_once_and_sum_into_rows(
    store: RedisStore, client: RedisCluster
) -> None:
    tenant = f"cl-{uuid.uuid4().hex[:8]}"
    refs = refs_in_every_shard(tenant)
    batch = [
        finished_request(
            make_tokens(ref.request_id, output=100 + i),
            bill(make_tokens(ref.request_id, output=100 + i), tenant, WHEN, PRICES),
            closed=f"{i} end",
            records=4,
        )
        for i, ref in enumerate(refs)
    ]
    assert await store.apply_requests(batch) == [True] * len(refs)
    assert await store.apply_requests(batch) == [False] * len(refs)  # a replay counts nothing

    assert await store.missing_tokens(refs) == []
    texts = await store.tokens_texts(refs)
    assert all(
        text is not None and ref.request_id in text for ref, text in zip(refs, texts, strict=True)
    )
    for ref in refs:
        assert 0 < await client.ttl(tokens_key(ref)) <= TTL_S
        assert 0 < await client.ttl(closed_key(ref)) <= TTL_S
    assert await store.tenants_of(refs[0].request_id) == [tenant]

    (row,) = await store.usage_rows(tenant=tenant)
    outputs = sum(100 + i for i in range(len(refs)))
    assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (
        len(refs), 1000 * len(refs), outputs
    )  # fmt: skip
    # cost per request: (600 * 2.50 + 400 * 1.25 + output * 10) / 1e6, summed exactly
    expected = sum(
        (Decimal(600 * 250 + 400 * 125) / 100 + Decimal((100 + i) * 10)) / 1_000_000
        for i in range(len(refs))
    )
    assert Decimal(row["cost"]) == expected
    parts = [usage_key(shard, day_of(WHEN), tenant, "m-1") for shard in range(SHARDS)]
    assert [await client.exists(key) for key in parts] == [1] * SHARDS  # a part per shard
    assert {await client.ttl(key) for key in parts} == {-1}  # rows never expire
    assert await store.delete_usage([tenant]) > 0
    assert await store.usage_rows(tenant=tenant) == []


async def test_a_close_decision_is_written_once_in_every_shard(store: RedisStore) -> None:
    refs = refs_in_every_shard(f"cl-{uuid.uuid4().hex[:8]}")
    first = {ref: f"{i} end" for i, ref in enumerate(refs)}
    assert await store.mark_closing(first) == {}
    assert await store.mark_closing(first) == {}  # the same decision again: no conflict
    second = {ref: f"{i} timeout" for i, ref in enumerate(refs)}
    assert await store.mark_closing(second) == first  # each shard reports its own
    assert await store.closed_markers(refs) == {ref: (m, False) for ref, m in first.items()}


async def test_dead_letters_count_once_across_shards(store: RedisStore) -> None:
    before = (await store.stats())["dead_lettered"]
    topic = f"cl-{uuid.uuid4().hex[:8]}.raw.sse"
    positions = [store.position_of(topic, p, o) for p in range(6) for o in range(8)]
    assert await store.count_dead_letters(positions) == len(positions)
    assert await store.count_dead_letters(positions[:10]) == 0
    assert (await store.stats())["dead_lettered"] == before + len(positions)
