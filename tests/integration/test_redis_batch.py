"""The Redis store against a real Redis: the batch's layout, idempotency, exact cost carry, reads.

Every test on the shared database writes only keys of its own (a unique
request id prefix and tenants) and deletes them afterwards, so it can run
against the shared stack; that database must hold layout version 3 (the
`store` fixture claims it when it is empty, and fails with `LayoutError` on
older data: ``streamtally migrate``).  A usage row is kept as one part per
shard (``st:{T}:usage:...``), summed when read: the tests check both the
parts the scripts write and the rows `RedisStore.usage_rows` reads.  The
tests of the layout itself, of the TTLs and of the global counts use a
database of their own (`own_db`), flushed around them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.cli import main
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.ops.rebuild import TokensRecord, apply, join
from streamtally.processors.outputs import Closed, CloseReason
from streamtally.store import (
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    SHARDS,
    UNPRICED_FIELD,
    LayoutError,
    RedisBatch,
    RedisStore,
    amended_request,
    closed_key,
    layout_v2,
    row_member,
    shard_of,
    tokens_json,
    tokens_key,
    tokens_pattern,
    usage_key,
)
from streamtally.store.layout import (
    PREFIX,
    SHARD_TAGS,
    correction_key,
    dead_key,
    guard_key,
    rows_key,
    shard_of_position,
    shard_of_row,
    stats_key,
)
from streamtally.store.scripts import CLOSE_ONCE_SCRIPT
from streamtally.wire import avro
from streamtally.wire.records import BillingEvent
from tests.integration.isolation import db_url

pytestmark = pytest.mark.integration

PRICES = PriceTable.from_dict(
    {
        "version": "it-1",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {"gpt-4o-20*": {"input": "2.50", "cached_input": "1.25", "output": "10.00"}},
    }
)
WHEN = datetime(2026, 11, 21, 23, 59, 59, tzinfo=UTC)
DAY = "2026-11-21"
MODEL = "gpt-4o-2024-08-06"


class Scope:
    """Unique names for one test, and cleanup of everything written under them."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:12]
        self.tenants: set[str] = set()

    def rid(self, n: int | str) -> str:
        return f"it-{self.tag}-{n}"

    def tenant(self, name: str = "acme") -> str:
        tenant = f"{name}-{self.tag}"
        self.tenants.add(tenant)
        return tenant

    def ids_in_shard(self, tenant: str, shard: int, count: int = 1) -> list[str]:
        """`count` request ids of `tenant` whose requests live in `shard`.

        Requests of different shards add to different parts of their row; these
        add to the same hash, so the script's own sums and carries can be checked.
        """
        ids = []
        for n in range(count * SHARDS * 64):
            rid = self.rid(f"in{shard}-{n}")
            if shard_of(RequestRef(tenant, rid)) == shard:
                ids.append(rid)
                if len(ids) == count:
                    return ids
        raise AssertionError(f"not {count} ids of shard {shard}")  # pragma: no cover

    async def cleanup(self, client: aioredis.Redis) -> None:
        """Delete the Tokens keys, close markers and usage rows of this scope's tenants."""
        for tenant in self.tenants:
            pattern = tokens_pattern(tenant, f"it-{self.tag}-")
            # the same glob over the close markers: st:{T}:closed:{ref}, as in the Tokens key
            closed = pattern.replace("}:tokens:", "}:closed:", 1)
            assert closed != pattern
            for match in (pattern, closed):
                async for key in client.scan_iter(match=match, count=1000):
                    await client.delete(key)
        await RedisStore(client).delete_usage(self.tenants)


@pytest.fixture
async def scope(redis_client: aioredis.Redis) -> AsyncIterator[Scope]:
    s = Scope()
    yield s
    await s.cleanup(redis_client)


@pytest.fixture
async def store(redis_client: aioredis.Redis) -> RedisStore:
    """A store on the test's client (which the `redis_client` fixture closes), layout 3."""
    store = RedisStore(redis_client)
    await store.ensure_layout()
    return store


def make_tokens(
    request_id: str, usage: Usage | None = None, model: str | None = "gpt-4o-2024-08-06"
) -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model=model,
        text="Grüße, 世界",
        reasoning="",
        tool_calls=(),
        usage=usage or Usage(input_tokens=1000, cached_tokens=400, output_tokens=200),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=3,
    )


def billed(tokens: Tokens, tenant: str, cost: str | None = None) -> BillingEvent:
    event = bill(tokens, tenant, WHEN, PRICES)
    return event if cost is None else dataclasses.replace(event, cost=Decimal(cost))


async def hash_of(client: aioredis.Redis, key: str) -> dict[str, str]:
    raw = await client.hgetall(key)
    return {_str(k): _str(v) for k, v in raw.items()}


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def parts_of(
    client: aioredis.Redis, day: str, tenant: str, model: str
) -> dict[int, dict[str, str]]:
    """The parts of one usage row, by shard: every shard's hash that exists."""
    parts = {}
    for shard in range(SHARDS):
        fields = await hash_of(client, usage_key(shard, day, tenant, model))
        if fields:
            parts[shard] = fields
    return parts


async def row_total(client: aioredis.Redis, day: str, tenant: str, model: str) -> dict[str, int]:
    """The sum of a row's parts over the shards, field by field (cost_pico carried)."""
    total: dict[str, int] = {}
    for fields in (await parts_of(client, day, tenant, model)).values():
        for name, value in fields.items():
            total[name] = total.get(name, 0) + int(value)
    if "cost_pico" in total:
        carry, total["cost_pico"] = divmod(total["cost_pico"], 10**12)
        total["cost_units"] += carry
    return total


async def indexed_in(client: aioredis.Redis, member: str) -> set[int]:
    """The shards whose rows set holds `member`."""
    return {s for s in range(SHARDS) if await client.sismember(rows_key(s), member)}


# --------------------------------------------------------------------------- apply / replay


async def test_apply_writes_tokens_row_and_index(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    tokens = make_tokens(scope.rid(1))
    sink = RedisBatch(store)
    sink.add(tokens, billed(tokens, tenant))
    assert await sink.flush() == [True]
    assert len(sink) == 0

    ref = RequestRef(tenant, tokens.request_id)
    stored = await redis_client.get(tokens_key(ref))
    expected = json.dumps(tokens.to_json_dict(), ensure_ascii=False, separators=(",", ":"))
    assert stored == expected.encode("utf-8")
    shard = shard_of(ref)
    assert tokens_key(ref).startswith(f"{PREFIX}{{{SHARD_TAGS[shard]}}}:")  # its shard's tag
    assert await store.tokens_text(ref) == expected
    assert await store.tokens(ref) == tokens.to_json_dict()
    # keyed by (tenant, request id): the same id of another tenant is not this request
    assert await store.tokens(RequestRef(scope.tenant("other"), tokens.request_id)) is None
    assert closed_key(ref).startswith(f"{PREFIX}{{{SHARD_TAGS[shard]}}}:")
    assert await redis_client.get(closed_key(ref)) == b"0 end"
    # the store keeps them for ever unless it is given a state TTL (this one is not)
    assert await redis_client.ttl(tokens_key(ref)) == -1
    assert await redis_client.ttl(closed_key(ref)) == -1

    # (600 * 2.50 + 400 * 1.25 + 200 * 10) / 1e6 = 0.004: the whole row is the part of
    # the request's shard, and only that shard's rows set names it
    assert await parts_of(redis_client, DAY, tenant, "gpt-4o-2024-08-06") == {
        shard: {
            "requests": "1",
            "input_tokens": "1000",
            "output_tokens": "200",
            "reasoning_tokens": "0",
            "cached_tokens": "400",
            "cache_write_tokens": "0",
            "cost_units": "0",
            "cost_pico": "4000000000",
        }
    }
    assert await redis_client.exists(usage_key(shard, DAY, tenant, "gpt-4o-2024-08-06"))
    assert await indexed_in(redis_client, row_member(DAY, tenant, "gpt-4o-2024-08-06")) == {shard}
    [row] = await store.usage_rows(tenant=tenant)
    assert (row["requests"], row["input_tokens"], row["cost"]) == (1, 1000, "0.004000000000")


async def test_reapplying_is_a_no_op(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    tokens = make_tokens(scope.rid(1))
    sink = RedisBatch(store)
    sink.add(tokens, billed(tokens, tenant))
    assert await sink.flush() == [True]
    before = await parts_of(redis_client, DAY, tenant, "gpt-4o-2024-08-06")
    assert [part["requests"] for part in before.values()] == ["1"]
    rows_before = await store.usage_rows(tenant=tenant)

    replay = RedisBatch(RedisStore(redis_client))  # a new process after a crash
    changed = make_tokens(scope.rid(1), usage=Usage(input_tokens=5))  # even if it differs
    replay.add(changed, billed(changed, tenant))
    replay.add(tokens, billed(tokens, tenant))
    assert await replay.flush() == [False, False]
    assert await parts_of(redis_client, DAY, tenant, "gpt-4o-2024-08-06") == before
    assert await store.usage_rows(tenant=tenant) == rows_before
    assert await store.tokens(RequestRef(tenant, tokens.request_id)) == tokens.to_json_dict()


async def test_duplicate_within_one_batch_counts_once(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    sink = RedisBatch(store)
    for n in (1, 2, 1):
        tokens = make_tokens(scope.rid(n))
        sink.add(tokens, billed(tokens, tenant))
    assert await sink.flush() == [True, True, False]
    rows = await store.usage_rows(tenant=tenant)
    assert [r["requests"] for r in rows] == [2]


async def test_a_bad_key_fails_its_shards_whole_batch_before_any_write(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    good, bad = scope.tenant("good"), scope.tenant("bad")
    second = make_tokens(scope.rid(2))
    shard = shard_of(RequestRef(bad, second.request_id))
    await redis_client.set(usage_key(shard, DAY, bad, MODEL), "not a hash")
    await redis_client.sadd(rows_key(shard), row_member(DAY, bad, MODEL))  # for cleanup
    # a request of another tenant in the same shard: one script call, checked before any write
    first = make_tokens(scope.ids_in_shard(good, shard)[0])
    sink = RedisBatch(store)
    sink.add(first, billed(first, good))
    sink.add(second, billed(second, bad))
    with pytest.raises(ResponseError, match="not a hash"):
        await sink.flush()
    for ref in (RequestRef(good, first.request_id), RequestRef(bad, second.request_id)):
        assert not await redis_client.exists(tokens_key(ref))
        assert not await redis_client.exists(closed_key(ref))
    assert await parts_of(redis_client, DAY, good, MODEL) == {}
    assert await indexed_in(redis_client, row_member(DAY, good, MODEL)) == set()
    assert await store.usage_rows(tenant=good) == []
    assert len(sink) == 2  # still queued for a retry


async def test_a_bad_key_of_one_shard_leaves_the_other_shards_calls_applied(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    """Each shard is one atomic call: another shard's requests go through, and a retry
    once the bad key is gone reports them as applied before."""
    good, bad = scope.tenant("good"), scope.tenant("bad")
    second = make_tokens(scope.rid(2))
    shard = shard_of(RequestRef(bad, second.request_id))
    await redis_client.set(usage_key(shard, DAY, bad, MODEL), "not a hash")
    await redis_client.sadd(rows_key(shard), row_member(DAY, bad, MODEL))  # for cleanup
    elsewhere = make_tokens(scope.ids_in_shard(good, (shard + 1) % SHARDS)[0])
    sink = RedisBatch(store)
    sink.add(elsewhere, billed(elsewhere, good))
    sink.add(second, billed(second, bad))
    with pytest.raises(ResponseError, match="not a hash"):
        await sink.flush()
    assert await store.has_tokens(RequestRef(good, elsewhere.request_id))
    assert not await store.has_tokens(RequestRef(bad, second.request_id))
    assert not await redis_client.exists(closed_key(RequestRef(bad, second.request_id)))
    assert len(sink) == 2

    await redis_client.delete(usage_key(shard, DAY, bad, MODEL))
    assert await sink.flush() == [False, True]
    assert [r["requests"] for r in await store.usage_rows(tenant=good)] == [1]
    assert [r["requests"] for r in await store.usage_rows(tenant=bad)] == [1]


# --------------------------------------------------------------------------- exact cost


async def test_cost_carries_exactly_across_the_pico_boundary(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    sink = RedisBatch(store)
    costs = ["0.999999999999", "0.000000000001", "0.600000000001", "123456789012.400000000000"]
    # all in one shard: the script itself adds them to one part of the row, and carries
    ids = scope.ids_in_shard(tenant, 5, len(costs))
    row = usage_key(5, DAY, tenant, MODEL)
    for n, cost in enumerate(costs):
        tokens = make_tokens(ids[n])
        sink.add(tokens, billed(tokens, tenant, cost))
        assert await sink.flush() == [True]
        if n == 1:  # 0.999999999999 + 0.000000000001 == 1 exactly: carried into the units
            fields = await hash_of(redis_client, row)
            assert (fields["cost_units"], fields["cost_pico"]) == ("1", "0")
    fields = await hash_of(redis_client, row)
    # 1 + 0.600000000001 + 123456789012.4 = 123456789014.000000000001
    assert (fields["cost_units"], fields["cost_pico"]) == ("123456789014", "1")
    assert list(await parts_of(redis_client, DAY, tenant, MODEL)) == [5]
    [usage] = await store.usage_rows(tenant=tenant)
    assert usage["cost"] == "123456789014.000000000001"
    assert Decimal(usage["cost"]) == sum((Decimal(c) for c in costs), Decimal(0))


async def test_the_parts_of_a_row_are_summed_exactly_when_read(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    """Two shards' parts, neither carrying alone: the read carries their picos into a unit."""
    tenant = scope.tenant()
    costs = ["0.999999999999", "0.000000000002", "2.5"]
    ids = [*scope.ids_in_shard(tenant, 3), *scope.ids_in_shard(tenant, 9, 2)]
    sink = RedisBatch(store)
    for rid, cost in zip(ids, costs, strict=True):
        tokens = make_tokens(rid)
        sink.add(tokens, billed(tokens, tenant, cost))
    assert await sink.flush() == [True, True, True]
    parts = await parts_of(redis_client, DAY, tenant, MODEL)
    assert {s: (p["requests"], p["cost_units"], p["cost_pico"]) for s, p in parts.items()} == {
        3: ("1", "0", "999999999999"),
        9: ("2", "2", "500000000002"),
    }
    assert await indexed_in(redis_client, row_member(DAY, tenant, MODEL)) == {3, 9}
    [usage] = await store.usage_rows(tenant=tenant)
    assert (usage["requests"], usage["input_tokens"]) == (3, 3000)
    assert usage["cost"] == "3.500000000001"
    assert await row_total(redis_client, DAY, tenant, MODEL) == {
        "requests": 3,
        "input_tokens": 3000,
        "output_tokens": 600,
        "reasoning_tokens": 0,
        "cached_tokens": 1200,
        "cache_write_tokens": 0,
        "cost_units": 3,
        "cost_pico": 500000000001,
    }


async def test_many_large_picos_never_leave_the_range(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    sink = RedisBatch(store)
    ids = scope.ids_in_shard(tenant, 12, 25)  # one part, 25 carries in one script call
    for rid in ids:
        tokens = make_tokens(rid)
        sink.add(tokens, billed(tokens, tenant, "7.999999999999"))
    assert all(await sink.flush())
    shard = shard_of(RequestRef(tenant, ids[0]))
    fields = await hash_of(redis_client, usage_key(shard, DAY, tenant, MODEL))
    assert (fields["cost_units"], fields["cost_pico"]) == ("199", "999999999975")
    [usage] = await store.usage_rows(tenant=tenant)
    assert (usage["requests"], usage["cost"]) == (25, "199.999999999975")


# --------------------------------------------------------------------------- unpriced requests


async def test_unpriced_requests_are_counted_in_their_row_once(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    priced = make_tokens(scope.rid("p"))
    unknown = [make_tokens(scope.rid(n), model="mystery-1") for n in (1, 2)]
    sink = RedisBatch(store)
    sink.add(priced, billed(priced, tenant))
    for tokens in unknown:
        event = billed(tokens, tenant)
        assert (event.priced, event.cost) == (False, Decimal(0))
        sink.add(tokens, event)
    assert await sink.flush() == [True, True, True]
    # a priced request writes no unpriced_requests field; an unpriced one adds 1
    priced_parts = await parts_of(redis_client, DAY, tenant, MODEL)
    assert len(priced_parts) == 1
    assert all(UNPRICED_FIELD not in part for part in priced_parts.values())
    parts = await parts_of(redis_client, DAY, tenant, "mystery-1")
    assert all(part[UNPRICED_FIELD] == part["requests"] for part in parts.values())
    total = await row_total(redis_client, DAY, tenant, "mystery-1")
    assert (total["requests"], total[UNPRICED_FIELD]) == (2, 2)
    assert (total["cost_units"], total["cost_pico"]) == (0, 0)

    replay = RedisBatch(store)
    replay.add(unknown[0], billed(unknown[0], tenant))
    assert await replay.flush() == [False]
    assert await parts_of(redis_client, DAY, tenant, "mystery-1") == parts  # counted once
    rows = {r["model"]: r for r in await store.usage_rows(tenant=tenant)}
    assert rows["mystery-1"]["unpriced_requests"] == 2
    assert rows["gpt-4o-2024-08-06"]["unpriced_requests"] == 0


async def test_a_row_written_before_the_field_reads_0_and_counts_on(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    tokens = make_tokens(scope.rid(1), model="mystery-1")
    # the part of the shard the new request adds to
    row = usage_key(shard_of(RequestRef(tenant, tokens.request_id)), DAY, tenant, "mystery-1")
    old: dict[Any, str] = {  # what the previous flush script wrote: no unpriced_requests
        "requests": "3",
        "input_tokens": "30",
        "output_tokens": "6",
        "reasoning_tokens": "0",
        "cached_tokens": "0",
        "cache_write_tokens": "0",
        "cost_units": "0",
        "cost_pico": "0",
    }
    await redis_client.hset(row, mapping=old)
    shard = shard_of(RequestRef(tenant, tokens.request_id))
    await redis_client.sadd(rows_key(shard), row_member(DAY, tenant, "mystery-1"))
    [before] = await store.usage_rows(tenant=tenant)
    assert (before["requests"], before["unpriced_requests"]) == (3, 0)

    sink = RedisBatch(store)
    sink.add(tokens, billed(tokens, tenant))
    assert await sink.flush() == [True]
    [after] = await store.usage_rows(tenant=tenant)
    assert (after["requests"], after["unpriced_requests"], after["input_tokens"]) == (4, 1, 1030)
    fields = await hash_of(redis_client, row)  # counted on in the same hash
    assert [fields[name] for name in ("requests", UNPRICED_FIELD, "input_tokens")] == [
        "4",
        "1",
        "1030",
    ]


async def test_the_rebuild_restores_unpriced_requests_from_the_billing_events(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    tenant = scope.tenant()
    priced, unknown = make_tokens(scope.rid("p")), make_tokens(scope.rid("u"), model="mystery-1")
    # as the rebuild reads them: decoded from the billing topic's bytes
    events = [
        avro.decode_billing_event(avro.encode_billing_event(billed(tokens, tenant)))
        for tokens in (priced, unknown)
    ]
    plan = join([TokensRecord(t.request_id, t) for t in (priced, unknown)], events)
    assert len(plan.requests) == 2
    result = await apply(store, plan.requests)
    assert (result.applied, result.present) == (2, 0)
    rows = {r["model"]: r for r in await store.usage_rows(tenant=tenant)}
    assert (rows["mystery-1"]["requests"], rows["mystery-1"]["unpriced_requests"]) == (1, 1)
    assert rows["gpt-4o-2024-08-06"]["unpriced_requests"] == 0
    assert (await apply(store, plan.requests)).present == 2  # a second rebuild changes nothing
    again = {r["model"]: r for r in await store.usage_rows(tenant=tenant)}
    assert again == rows


# --------------------------------------------------------------------------- reading


async def test_usage_rows_sum_requests_and_filter(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    acme, other = scope.tenant("acme:eu"), scope.tenant("other")
    a = make_tokens(scope.rid("a"), usage=Usage(input_tokens=1000, output_tokens=100))
    b = make_tokens(
        scope.rid("b"),
        usage=Usage(input_tokens=3000, cached_tokens=2000, output_tokens=50, reasoning_tokens=20),
    )
    c = make_tokens(scope.rid("c"), model=None, usage=Usage(input_tokens=7))
    d = make_tokens(scope.rid("d"))
    sink = RedisBatch(store)
    sink.add(a, billed(a, acme))
    sink.add(b, billed(b, acme))
    sink.add(c, billed(c, acme))
    sink.add(d, billed(d, other))
    assert await sink.flush() == [True] * 4

    rows = await store.usage_rows(tenant=acme)
    assert rows == [
        {
            "tenant": acme,
            "model": "gpt-4o-2024-08-06",
            "day": DAY,
            "requests": 2,
            "unpriced_requests": 0,
            "input_tokens": 4000,
            "output_tokens": 150,
            "reasoning_tokens": 20,
            "cached_tokens": 2000,
            "cache_write_tokens": 0,
            # a: 1000*2.5 + 100*10 = 3500; b: 1000*2.5 + 2000*1.25 + 50*10 = 5500 (per 1e6)
            "cost": "0.009000000000",
        },
        {
            "tenant": acme,
            "model": "unknown",
            "day": DAY,
            "requests": 1,
            "unpriced_requests": 1,  # no model: priced by no entry
            "input_tokens": 7,
            "output_tokens": 0,
            "reasoning_tokens": 0,
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "cost": "0.000000000000",
        },
    ]
    # the ":" in the tenant is escaped in the key, so it cannot collide with another row
    gpt_shards = {shard_of(RequestRef(acme, t.request_id)) for t in (a, b)}
    assert set(await parts_of(redis_client, DAY, acme, MODEL)) == gpt_shards
    for shard in gpt_shards:
        assert await redis_client.exists(usage_key(shard, DAY, acme, MODEL))
        assert f":usage:{DAY}:acme%3Aeu-{scope.tag}:{MODEL}" in usage_key(shard, DAY, acme, MODEL)
    for shard in range(SHARDS):
        head, tail = acme.split(":")
        assert usage_key(shard, DAY, acme, "m") != usage_key(shard, DAY, head, f"{tail}:m")
    assert [r["tenant"] for r in await store.usage_rows(tenant=other)] == [other]
    assert await store.usage_rows(tenant=acme, day="2026-11-22") == []
    assert len(await store.usage_rows(tenant=acme, day=DAY)) == 2
    everything = await store.usage_rows()
    assert {r["tenant"] for r in everything} >= {acme, other}


# --------------------------------------------------------------------------- store reads, counts


@pytest.fixture
async def own_client(
    redis_client: aioredis.Redis, redis_url: str, own_db: int
) -> AsyncIterator[aioredis.Redis]:
    """A client of a database of the test's own (`own_db`), emptied before and after it."""
    del redis_client  # it skips the test when Redis does not answer
    client = aioredis.from_url(db_url(redis_url, own_db), socket_connect_timeout=3)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.flushdb()
        await client.aclose()


@pytest.fixture
async def own_store(own_client: aioredis.Redis) -> RedisStore:
    """A store on the test's own database (`own_client`), empty but for its layout
    (claimed): the counts are this test's alone."""
    store = RedisStore(own_client)
    await store.ensure_layout()
    return store


A, B, C = RequestRef("acme", "a"), RequestRef("acme", "b"), RequestRef("acme", "c")


async def test_store_writes_and_reads_markers_tokens_and_counts(
    own_client: aioredis.Redis, own_store: RedisStore
) -> None:
    store = own_store
    assert await store.stats() == {"records": 0, "duplicates": 0, "dead_lettered": 0, "requests": 0}
    assert (await store.tokens_count(), await store.closed_count()) == (0, 0)
    assert (await store.dead_letter_count(), await store.usage_rows()) == (0, [])
    assert await store.missing_tokens([A, B]) == [A, B]
    assert await store.closed_markers([A]) == {}

    await store.mark_closing({A: "5 end", B: "7 timeout"})
    assert await store.closed_count() == 2
    assert await store.closed_markers([A, B, C]) == {
        A: ("5 end", False),
        B: ("7 timeout", False),
    }

    a = make_tokens("a")
    sink = RedisBatch(store)
    sink.add(a, billed(a, "acme"), closed="5 end", records=3, duplicates=1)
    assert await sink.flush() == [True]
    assert (await store.closed_markers([A, B]))[A] == ("5 end", True)
    assert (await store.has_tokens(A), await store.has_tokens(B)) == (True, False)
    assert await store.has_tokens(RequestRef("globex", "a")) is False  # another tenant's "a"
    assert await store.missing_tokens([B, A, C]) == [B, C]
    assert await store.tokens_texts([A, B]) == [tokens_json(a), None]
    assert await store.tokens_count() == 1
    assert await store.tenants_of("a") == ["acme"]
    assert await store.stats() == {"records": 3, "duplicates": 1, "dead_lettered": 0, "requests": 1}

    first, second = store.position_of("ns.raw.sse", 0, 5), store.position_of("ns.raw.sse", 1, 9)
    assert first == "ns.raw.sse:0:5"
    assert await store.count_dead_letters([first, second, first]) == 2
    for position in (first, second):  # one mark each, in its own shard
        assert await own_client.get(dead_key(position)) == b"1"
        tag = SHARD_TAGS[shard_of_position(position)]
        assert dead_key(position).startswith(f"{PREFIX}{{{tag}}}:")
    assert await store.count_dead_letters([second]) == 0  # counted once, however often
    assert await store.count_dead_letters([]) == 0
    assert await store.dead_letter_count() == 2
    assert (await store.stats())["dead_lettered"] == 2

    assert [row["tenant"] for row in await store.usage_rows()] == ["acme"]
    assert await store.delete_usage(["other"]) == 0
    assert await store.delete_usage(["acme"]) == 1
    assert await store.usage_rows() == []
    assert await store.has_tokens(A)  # the idempotency marker stays


async def test_store_reads_through_a_decoding_client(
    redis_url: str, own_db: int, own_store: RedisStore
) -> None:
    a = make_tokens("a")
    sink = RedisBatch(own_store)
    sink.add(a, billed(a, "acme"), closed="5 end", records=2)
    assert await sink.flush() == [True]
    await own_store.count_dead_letters([own_store.position_of("t", 0, 1)])

    decoding = RedisStore(aioredis.from_url(db_url(redis_url, own_db), decode_responses=True))
    try:
        assert await decoding.tokens_text(A) == tokens_json(a)
        assert await decoding.tokens_texts([A]) == [tokens_json(a)]
        assert await decoding.closed_markers([A]) == {A: ("5 end", True)}
        assert await decoding.tenants_of("a") == ["acme"]
        assert await decoding.layout_version() == LAYOUT_VERSION
        assert await decoding.usage_rows() == await own_store.usage_rows()
        assert await decoding.stats() == await own_store.stats()
        assert await decoding.delete_usage(["acme"]) == 1
    finally:
        await decoding.aclose()


async def test_the_state_ttl_applies_to_tokens_markers_and_dead_letters_not_to_rows(
    own_client: aioredis.Redis,
) -> None:
    """The worker's store (a state TTL) lets Tokens, close markers and dead-letter marks
    expire; usage row parts, rows sets, stats and the layout keys never expire."""
    store = RedisStore(own_client, state_ttl_s=60)
    assert store.state_ttl_s == 60
    await store.ensure_layout()
    early = RequestRef("acme", "early")
    assert await store.mark_closing({early: "3 timeout"}) == {}  # decided, not yet applied
    a = make_tokens("a")
    sink = RedisBatch(store)
    sink.add(a, billed(a, "acme"), closed="5 end", records=2)
    assert await sink.flush() == [True]
    position = store.position_of("ns.raw.sse", 0, 7)
    assert await store.count_dead_letters([position]) == 1

    shard = shard_of(A)
    assert await own_client.get(dead_key(position)) == b"1"
    for key in (tokens_key(A), closed_key(A), closed_key(early), dead_key(position)):
        assert 0 < await own_client.ttl(key) <= 60, key
    for key in (
        usage_key(shard, DAY, "acme", MODEL),
        rows_key(shard),
        stats_key(shard),
        stats_key(shard_of_position(position)),
        guard_key(shard),
        LAYOUT_KEY,
    ):
        assert await own_client.exists(key), key
        assert await own_client.ttl(key) == -1, key
    [row] = await store.usage_rows()
    assert (row["tenant"], row["requests"]) == ("acme", 1)


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def sync_scope(redis_url: str) -> Iterator[Scope]:
    """A `Scope` for synchronous tests (the CLI runs its own event loop)."""
    s = Scope()

    async def ping() -> None:
        client = aioredis.from_url(redis_url, socket_connect_timeout=3)
        try:
            await client.ping()
        finally:
            await client.aclose()

    try:
        asyncio.run(ping())
    except Exception as exc:  # noqa: BLE001 - any failure to reach Redis means skip
        pytest.skip(f"Redis at {redis_url} does not answer ({exc})")
    yield s

    async def cleanup() -> None:
        client = aioredis.from_url(redis_url)
        try:
            await s.cleanup(client)
        finally:
            await client.aclose()

    asyncio.run(cleanup())


def write(redis_url: str, *pairs: tuple[Tokens, BillingEvent]) -> list[bool]:
    async def run() -> list[bool]:
        client = aioredis.from_url(redis_url)
        try:
            store = RedisStore(client)
            await store.ensure_layout()
            sink = RedisBatch(store)
            for tokens, event in pairs:
                sink.add(tokens, event)
            return await sink.flush()
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_cli_tokens_get_prints_the_stored_text(
    redis_url: str, sync_scope: Scope, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    tokens, tenant = make_tokens(sync_scope.rid(1)), sync_scope.tenant()
    assert write(redis_url, (tokens, billed(tokens, tenant))) == [True]
    argv = ["tokens", "get", tokens.request_id, "--redis-url", redis_url]
    assert main([*argv, "--tenant", tenant]) == 0
    assert capsysbinary.readouterr().out == (tokens_json(tokens) + "\n").encode("utf-8")
    # without --tenant: the one tenant that holds the id
    assert main(argv) == 0
    assert capsysbinary.readouterr().out == (tokens_json(tokens) + "\n").encode("utf-8")


def test_cli_tokens_get_unknown_exits_2(
    redis_url: str, sync_scope: Scope, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = sync_scope.rid("missing")
    assert main(["tokens", "get", missing, "--redis-url", redis_url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"streamtally tokens: {missing} not found (unknown, or still streaming)\n"
    )
    # a request id one tenant used is unknown for another
    tokens, tenant, other = make_tokens(sync_scope.rid(1)), sync_scope.tenant(), "nobody"
    assert write(redis_url, (tokens, billed(tokens, tenant))) == [True]
    argv = ["tokens", "get", tokens.request_id, "--tenant", other, "--redis-url", redis_url]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"streamtally tokens: {tokens.request_id} of tenant {other} not found "
        "(unknown, or still streaming)\n"
    )


def test_cli_tokens_get_of_an_id_of_two_tenants_needs_the_tenant(
    redis_url: str, sync_scope: Scope, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    acme, globex = sync_scope.tenant("acme"), sync_scope.tenant("globex")
    mine = make_tokens(sync_scope.rid("shared"), usage=Usage(input_tokens=11))
    theirs = make_tokens(sync_scope.rid("shared"), usage=Usage(input_tokens=22))
    assert write(redis_url, (mine, billed(mine, acme)), (theirs, billed(theirs, globex))) == [
        True,
        True,
    ]
    argv = ["tokens", "get", mine.request_id, "--redis-url", redis_url]
    assert main(argv) == 2
    captured = capsysbinary.readouterr()
    assert captured.out == b""
    err = captured.err.decode()
    assert f"is a request of 2 tenants ({acme}, {globex}): pass --tenant" in err, err
    for tenant, tokens in ((acme, mine), (globex, theirs)):
        assert main([*argv, "--tenant", tenant]) == 0
        assert capsysbinary.readouterr().out == (tokens_json(tokens) + "\n").encode("utf-8")


def test_cli_usage_json_and_table(
    redis_url: str, sync_scope: Scope, capsys: pytest.CaptureFixture[str]
) -> None:
    tenant = sync_scope.tenant()
    a, b = make_tokens(sync_scope.rid("a")), make_tokens(sync_scope.rid("b"))
    write(redis_url, (a, billed(a, tenant)), (b, billed(b, tenant, "1.000000000001")))
    assert main(["usage", "--tenant", tenant, "--json", "--redis-url", redis_url]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [
        {
            "tenant": tenant,
            "model": "gpt-4o-2024-08-06",
            "day": DAY,
            "requests": 2,
            "unpriced_requests": 0,
            "input_tokens": 2000,
            "output_tokens": 400,
            "reasoning_tokens": 0,
            "cached_tokens": 800,
            "cache_write_tokens": 0,
            "cost": "1.004000000001",
        }
    ]
    assert main(["usage", "--tenant", tenant, "--day", DAY, "--redis-url", redis_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "DAY", "TENANT", "MODEL", "REQUESTS", "UNPRICED", "INPUT", "CACHED", "CACHE_WRITE",
        "OUTPUT", "REASONING", "COST",
    ]  # fmt: skip
    assert lines[2].split() == [
        DAY, tenant, "gpt-4o-2024-08-06", "2", "0", "2000", "800", "0", "400", "0",
        "1.004000000001",
    ]  # fmt: skip
    assert lines[-1].split() == [
        "TOTAL", "2", "0", "2000", "800", "0", "400", "0", "1.004000000001",
    ]  # fmt: skip
    assert len({len(line) for line in lines[:3]}) == 1  # aligned


def test_cli_unreachable_redis_says_how_to_start_the_stack(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["usage", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in err
    assert "streamtally stack up" in err


async def test_a_close_decision_is_written_once_and_a_different_one_is_reported(
    own_store: RedisStore,
) -> None:
    """Write-once close markers: the partition's first owner decides; no overwrite."""
    r1, r2, r3 = (RequestRef("acme", f"r-{n}") for n in (1, 2, 3))
    assert await own_store.mark_closing({r1: "41 timeout", r2: "7 end"}) == {}
    # the same decision again (a replay): nothing to report
    assert await own_store.mark_closing({r1: "41 timeout"}) == {}
    # another owner decides differently: reported, and the first decision stands
    assert await own_store.mark_closing({r1: "57 end", r3: "9 end"}) == {r1: "41 timeout"}
    markers = await own_store.closed_markers([r1, r2, r3])
    assert {ref: marker for ref, (marker, _) in markers.items()} == {
        r1: "41 timeout",
        r2: "7 end",
        r3: "9 end",
    }


def _refs_of_shards(*shards: int) -> list[RequestRef]:
    """One request of tenant acme in each of `shards`."""
    found: dict[int, RequestRef] = {}
    for n in range(SHARDS * 64):
        ref = RequestRef("acme", f"s-{n}")
        found.setdefault(shard_of(ref), ref)
    return [found[shard] for shard in shards]


async def _calls(client: aioredis.Redis, command: str) -> int:
    """How often the server ran `command` (``INFO commandstats``; 0: never)."""
    stats = await client.info("commandstats")
    entry = stats.get(f"cmdstat_{command}", {})
    return int(entry.get("calls", 0)) if isinstance(entry, dict) else 0


async def test_a_write_of_several_shards_is_one_round_trip_and_outlives_a_flushed_script_cache(
    own_client: aioredis.Redis, own_store: RedisStore
) -> None:
    """The calls of several shards go in one pipeline of EVALSHA, without redis-py's SCRIPT
    EXISTS before it; a Redis that lost its scripts (restarted, cache flushed) is sent the
    script and the calls again, and the decisions are written once."""
    r1, r2, r3, r4 = _refs_of_shards(0, 1, 2, 3)
    await own_client.script_load(CLOSE_ONCE_SCRIPT)  # cached, as after the first write
    exists, evalsha = await _calls(own_client, "script|exists"), await _calls(own_client, "evalsha")
    assert await own_store.mark_closing({r1: "3 end", r2: "4 end"}) == {}
    assert await _calls(own_client, "evalsha") - evalsha == 2  # one per shard, pipelined
    # No test process sends SCRIPT EXISTS since the store stopped doing it.
    assert await _calls(own_client, "script|exists") == exists
    await own_client.script_flush()
    # Every other client of the shared server re-sends its scripts by itself on NOSCRIPT.
    assert await own_store.mark_closing({r3: "5 end", r4: "6 timeout", r1: "9 end"}) == {
        r1: "3 end"
    }
    markers = await own_store.closed_markers([r1, r2, r3, r4])
    assert {ref: marker for ref, (marker, _) in markers.items()} == {
        r1: "3 end",
        r2: "4 end",
        r3: "5 end",
        r4: "6 timeout",
    }


# --------------------------------------------------------------------------- layout version


def _tokens_and_event(request_id: str, tenant: str = "acme") -> tuple[Tokens, BillingEvent]:
    tokens = make_tokens(request_id)
    return tokens, billed(tokens, tenant)


async def _keys(client: aioredis.Redis) -> dict[str, str]:
    """Every key of the database and its type."""
    return {_str(key): _str(await client.type(key)) async for key in client.scan_iter()}


async def test_ensure_layout_claims_an_empty_database_once(own_client: aioredis.Redis) -> None:
    store = RedisStore(own_client)
    assert await store.layout_version() is None
    assert not await store.holds_data()
    await store.ensure_layout()
    assert await own_client.get(LAYOUT_KEY) == LAYOUT_VERSION.encode() == b"3"
    # the global version and each shard's guard, nothing else
    guards = {guard_key(shard) for shard in range(SHARDS)}
    assert len(guards) == SHARDS
    assert await _keys(own_client) == dict.fromkeys({LAYOUT_KEY, *guards}, "string")
    for shard in range(SHARDS):
        assert await own_client.get(guard_key(shard)) == b"3"
    assert not await store.holds_data()  # the layout keys are not data
    await store.ensure_layout()  # idempotent
    assert await store.layout_version() == "3"

    # writes go through now; claiming again over layout-2 data changes nothing
    sink = RedisBatch(store)
    sink.add(*_tokens_and_event("a"))
    assert await sink.flush() == [True]
    assert await store.holds_data()
    before = await _keys(own_client)
    await store.ensure_layout()
    assert await _keys(own_client) == before
    assert await RedisStore(own_client).layout_version() == "3"


#: Data a streamtally before layout 2 left (no ``st:layout``; layout 2 spells these keys
#: the same), one kind per case.
V1_DATA = {
    "stats": (layout_v2.STATS_KEY, "hash"),
    "closed": (layout_v2.CLOSED_KEY, "hash"),
    "rows": (layout_v2.ROWS_KEY, "set"),
    "dead-seen": (layout_v2.DEAD_SEEN_KEY, "set"),
    "tokens-by-id": (f"{layout_v2.TOKENS_PREFIX}chatcmpl-1", "string"),
}


async def _write_v1(client: aioredis.Redis, key: str, kind: str) -> None:
    if kind == "hash":
        await client.hset(key, "records", "3")
    elif kind == "set":
        await client.sadd(key, row_member(DAY, "acme", "gpt-4o") if "usage" in key else "t:0:1")
    else:
        await client.set(key, tokens_json(make_tokens("chatcmpl-1")))


@pytest.mark.parametrize("kind", sorted(V1_DATA))
async def test_ensure_layout_refuses_data_of_layout_1(
    own_client: aioredis.Redis, kind: str
) -> None:
    key, redis_type = V1_DATA[kind]
    await _write_v1(own_client, key, redis_type)
    before = await _keys(own_client)
    store = RedisStore(own_client)
    assert await store.holds_data()
    with pytest.raises(LayoutError, match=r"layout version 1.*streamtally migrate"):
        await store.ensure_layout()
    assert await store.layout_version() is None  # not claimed
    assert await _keys(own_client) == before  # nothing written


@pytest.mark.parametrize(
    ("version", "says"),
    [
        (MIGRATING, "migrate` of this Redis is in progress"),
        (layout_v2.MIGRATING_FROM_1, "migrate` of this Redis is in progress"),
        ("2", r"layout version 2; run `streamtally migrate`"),
        ("4", "layout version '4'"),
    ],
    ids=["migrating", "migrating-from-1", "layout-2", "newer"],
)
async def test_ensure_layout_refuses_another_layout_version(
    own_client: aioredis.Redis, version: str, says: str
) -> None:
    await own_client.set(LAYOUT_KEY, version)  # even on an otherwise empty database
    store = RedisStore(own_client)
    with pytest.raises(LayoutError, match=says):
        await store.ensure_layout()
    assert await store.layout_version() == version
    assert await _keys(own_client) == {LAYOUT_KEY: "string"}  # no shard claimed


#: What ``st:layout`` holds (None: absent), what every shard's guard holds (None: absent),
#: and older data alongside or not.
NOT_LAYOUT_3 = {
    "absent-empty": (None, None, False),
    "absent-v1-data": (None, None, True),
    "layout-2": ("2", None, True),
    "migrating": (MIGRATING, None, False),
    "migrating-v2-data": (MIGRATING, None, True),
    # the global key alone does not let a script write: each checks its shard's guard
    "3-unclaimed-shards": (LAYOUT_VERSION, None, False),
    "guards-of-2": (LAYOUT_VERSION, "2", False),
}


@pytest.mark.parametrize("case", list(NOT_LAYOUT_3))
async def test_the_write_scripts_refuse_a_database_not_of_layout_3(
    own_client: aioredis.Redis, case: str
) -> None:
    """The flush, close-once and dead-letter scripts write nothing unless their shard's
    ``st:{T}:layout`` is "3"."""
    version, guard, old_data = NOT_LAYOUT_3[case]
    if version is not None:
        await own_client.set(LAYOUT_KEY, version)
    if guard is not None:
        for shard in range(SHARDS):
            await own_client.set(guard_key(shard), guard)
    if old_data:
        await _write_v1(own_client, layout_v2.STATS_KEY, "hash")
    before = {key: await own_client.dump(key) for key in await _keys(own_client)}
    store = RedisStore(own_client)  # never claimed: ensure_layout is not called
    # what the scripts say (Lua reads an absent key as false)
    said = "false" if guard is None else guard
    refusal = re.escape(PREFIX) + rf"\{{s\d+-\d+\}}:layout is {said}, not 3"
    tokens_and_event = _tokens_and_event("a")
    one_shard = re.escape(f"{guard_key(shard_of(A))} is {said}, not 3")

    sink = RedisBatch(store)
    sink.add(*tokens_and_event, closed="5 end", records=2)
    with pytest.raises(ResponseError, match=one_shard):  # one request: its own shard's guard
        await sink.flush()
    assert len(sink) == 1  # still queued
    with pytest.raises(ResponseError, match=refusal):
        await store.mark_closing({A: "5 end", B: "7 timeout"})
    with pytest.raises(ResponseError, match=refusal):
        await store.count_dead_letters([store.position_of("t", 0, 1)])

    after = {key: await own_client.dump(key) for key in await _keys(own_client)}
    assert after == before  # nothing written, nothing changed
    assert await store.closed_markers([A, B]) == {}
    assert await store.missing_tokens([A]) == [A]


# --------------------------------------------------------------------------- two tenants, one id


async def test_one_request_id_of_two_tenants_is_two_requests(
    own_client: aioredis.Redis, own_store: RedisStore
) -> None:
    store = own_store
    acme, acme_eu = RequestRef("acme", "shared"), RequestRef("acme:eu", "shared")
    # ("acme", "eu:shared") spells "acme:eu:shared" too, were the tenant not escaped
    lookalike = RequestRef("acme", "eu:shared")
    refs = [acme, acme_eu, lookalike]
    assert len({ref.text for ref in refs}) == 3
    assert acme_eu.text == "acme%3Aeu:shared"

    # close decisions: one tenant's never conflicts with the other's
    assert await store.mark_closing({acme: "5 end"}) == {}
    assert await store.mark_closing({acme_eu: "9 timeout", lookalike: "3 end"}) == {}
    assert await store.mark_closing({acme: "6 end"}) == {acme: "5 end"}  # its own only
    assert await store.closed_markers(refs) == {
        acme: ("5 end", False),
        acme_eu: ("9 timeout", False),
        lookalike: ("3 end", False),
    }

    mine = make_tokens("shared", usage=Usage(input_tokens=100, output_tokens=10))
    theirs = make_tokens("shared", usage=Usage(input_tokens=300, output_tokens=30))
    other = make_tokens("eu:shared", usage=Usage(input_tokens=1))
    sink = RedisBatch(store)
    sink.add(mine, billed(mine, "acme"), closed="5 end", records=4)
    sink.add(theirs, billed(theirs, "acme:eu"), closed="9 timeout", records=5)
    sink.add(other, billed(other, "acme"), closed="3 end", records=1)
    assert await sink.flush() == [True, True, True]  # none is a replay of another

    tokens_keys = {key for key in await _keys(own_client) if ":tokens:" in key}
    assert tokens_keys == {tokens_key(ref) for ref in refs}
    assert len(tokens_keys) == 3  # one id of three tenants: three requests
    closed_keys = {key for key in await _keys(own_client) if ":closed:" in key}
    assert closed_keys == {closed_key(ref) for ref in refs}
    assert [await own_client.get(closed_key(ref)) for ref in refs] == [
        b"5 end",
        b"9 timeout",
        b"3 end",
    ]
    assert await store.tokens_texts(refs) == [
        tokens_json(mine),
        tokens_json(theirs),
        tokens_json(other),
    ]
    assert await store.tokens_count() == 3
    assert await store.closed_markers(refs) == {
        acme: ("5 end", True),
        acme_eu: ("9 timeout", True),
        lookalike: ("3 end", True),
    }
    # two rows: acme's two requests ("shared" and "eu:shared"), acme:eu's one
    rows = await store.usage_rows()
    assert [(r["tenant"], r["requests"], r["input_tokens"]) for r in rows] == [
        ("acme", 2, 101),
        ("acme:eu", 1, 300),
    ]
    assert await store.tenants_of("shared") == ["acme", "acme:eu"]
    assert await store.tenants_of("eu:shared") == ["acme"]
    assert await store.tenants_of("nobody") == []
    assert (await store.stats())["requests"] == 3

    # a replay of one tenant's request changes nothing, and does not touch the other's
    before = await store.usage_rows()
    replay = RedisBatch(store)
    replay.add(mine, billed(mine, "acme"), closed="5 end", records=4)
    assert await replay.flush() == [False]
    assert await store.usage_rows() == before
    assert await store.tokens_text(acme_eu) == tokens_json(theirs)


# --------------------------------------------------------------------------- audit --correct


async def test_a_row_correction_is_added_once_and_keeps_the_row_writable(
    redis_client: aioredis.Redis, store: RedisStore, scope: Scope
) -> None:
    """`RedisStore.correct_row` (``audit --correct``): a signed difference, added once per id,
    to the part of the row in its correction shard; later flushes carry on from it."""
    tenant = scope.tenant()
    member = row_member(DAY, tenant, MODEL)
    shard = shard_of_row(member)
    sink = RedisBatch(store)
    first, second, third = scope.ids_in_shard(tenant, shard, 3)
    for rid, cost in ((first, "0.300000000000"), (second, "0.000000000002")):
        tokens = make_tokens(rid)
        sink.add(tokens, billed(tokens, tenant, cost))
    assert await sink.flush() == [True, True]
    # the second request was billed twice over, say: take one request and its cost out
    fix = {"requests": -1, "input_tokens": -1000, "cached_tokens": -400, "output_tokens": -200}
    # 0.300000000002 - 0.000000000003 = 0.299999999999: sent as -1 unit + 0.999999999997,
    # which carries back into the units: the part stays in range
    fix["cost_pico"] = -3
    marker = correction_key(shard, "c" * 32)
    try:
        assert await store.correct_row((DAY, tenant, MODEL), fix, "c" * 32) is True
        [row] = await store.usage_rows(tenant=tenant)
        assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (1, 1000, 200)
        assert row["cost"] == "0.299999999999"
        part = await hash_of(redis_client, usage_key(shard, DAY, tenant, MODEL))
        assert (part["cost_units"], part["cost_pico"]) == ("0", "299999999999")
        # the same correction again (a rerun after a failure) adds nothing
        assert await store.correct_row((DAY, tenant, MODEL), fix, "c" * 32) is False
        assert await store.usage_rows(tenant=tenant) == [row]
        # the worker's script still writes the corrected part, and carries exactly
        tokens = make_tokens(third)
        sink.add(tokens, billed(tokens, tenant, "0.700000000001"))
        assert await sink.flush() == [True]
        [row] = await store.usage_rows(tenant=tenant)
        assert (row["requests"], row["cost"]) == (2, "1.000000000000")
        # a row that only a correction writes is listed like any other
        other = scope.tenant("globex")
        added = {"requests": 1, "input_tokens": 7, "cost_pico": 10**12 + 5}
        assert await store.correct_row((DAY, other, MODEL), added, "d" * 32) is True
        [new] = await store.usage_rows(tenant=other)
        assert (new["requests"], new["input_tokens"], new["cost"]) == (1, 7, "1.000000000005")
        # a request billed in another shard withdrawn: the correction shard's part goes
        # below zero, the row (the sum of the parts) is exact
        third_tenant = scope.tenant("initech")
        third_shard = shard_of_row(row_member(DAY, third_tenant, MODEL))
        [elsewhere] = scope.ids_in_shard(third_tenant, (third_shard + 1) % SHARDS, 1)
        tokens = make_tokens(elsewhere)
        sink.add(tokens, billed(tokens, third_tenant, "0.250000000000"))
        assert await sink.flush() == [True]
        withdraw = {"requests": -1, "input_tokens": -1000, "cached_tokens": -400}
        withdraw |= {"output_tokens": -200, "cost_pico": -250_000_000_000}
        assert await store.correct_row((DAY, third_tenant, MODEL), withdraw, "e" * 32) is True
        [gone] = await store.usage_rows(tenant=third_tenant)
        assert (gone["requests"], gone["input_tokens"], gone["cost"]) == (0, 0, "0.000000000000")
        negative = await hash_of(redis_client, usage_key(third_shard, DAY, third_tenant, MODEL))
        assert negative["requests"] == "-1"
        assert (negative["cost_units"], negative["cost_pico"]) == ("-1", "750000000000")
    finally:
        other_shard = shard_of_row(row_member(DAY, scope.tenant("globex"), MODEL))
        third_shard = shard_of_row(row_member(DAY, scope.tenant("initech"), MODEL))
        await redis_client.delete(
            marker,
            correction_key(other_shard, "d" * 32),
            correction_key(third_shard, "e" * 32),
        )


# --------------------------------------------------------------------------- amendments


def _bill_of(tenant: str, rid: str, usage: Usage, when: datetime, revision: int) -> BillingEvent:
    return bill(make_tokens(rid, usage, MODEL), tenant, when, PRICES, revision=revision)


async def test_an_amendment_moves_the_bill_from_its_row_to_the_next_once(
    own_client: aioredis.Redis, own_store: RedisStore
) -> None:
    """Revision 0 on one day's row, revision 1 (the same request, closed the next day)
    on the next day's: the first row loses exactly the first bill (its cost borrowing a
    unit), the second gains the second; applying it again changes nothing."""
    store = own_store
    ref = RequestRef("acme", "amended")
    day1 = datetime(2026, 3, 1, 23, 59, tzinfo=UTC)
    day2 = datetime(2026, 3, 2, 0, 1, tzinfo=UTC)
    first = _bill_of("acme", ref.request_id, Usage(input_tokens=400_001), day1, 0)
    other = _bill_of("acme", "other", Usage(input_tokens=799_999), day1, 0)
    amended = _bill_of(
        "acme", ref.request_id, Usage(input_tokens=400_000, output_tokens=7), day2, 1
    )
    assert amended.supersedes == first.event_id
    tokens0 = make_tokens(ref.request_id, first.usage, MODEL)
    tokens1 = make_tokens(ref.request_id, amended.usage, MODEL)
    other_tokens = make_tokens("other", other.usage, MODEL)
    marker0 = Closed(3, CloseReason.TIMEOUT, True, 1, 0).marker()
    marker1 = Closed(9, CloseReason.END, True, 2, 1).marker()
    sink = RedisBatch(store)
    assert await store.mark_closing({ref: marker0}) == {}
    sink.add(tokens0, first, closed=marker0, records=3)
    sink.add(other_tokens, other, closed="5 end", records=2)
    sink.keep(ref, b"state of revision 0")
    assert await sink.flush() == [True, True]
    assert await store.amendable_states([ref]) == {ref: b"state of revision 0"}
    assert await store.closed_markers([ref]) == {ref: (marker0, True)}

    # The amendment's decision replaces revision 0's marker, and only that one.
    assert await store.mark_amending({ref: (marker1, "elsewhere")}) == {ref: marker0}
    assert await store.mark_amending({ref: (marker1, marker0)}) == {}
    assert await store.mark_amending({ref: (marker1, marker0)}) == {}  # the same again
    assert await store.closed_markers([ref]) == {ref: (marker1, False)}  # decided, not applied
    assert await store.close_history([ref, RequestRef("acme", "other")]) == {ref: [marker0]}
    change = amended_request(tokens1, amended, first, records=6, duplicates=1, amendable=None)
    assert await store.apply_amendments([change]) == [True]
    assert await store.closed_markers([ref]) == {ref: (marker1, True)}
    assert await store.amendable_states([ref]) == {}  # closed at its END: nothing to keep
    before = await store.usage_rows()
    assert await store.apply_amendments([change]) == [False]  # a replay: applied once
    assert await store.usage_rows() == before
    by_day = {row["day"]: row for row in before}
    # The first day keeps the other request only; their costs summed to whole units (3.00),
    # so taking the first's 1.0000025 off borrows a unit.
    assert first.cost + other.cost == 3
    assert (by_day["2026-03-01"]["requests"], by_day["2026-03-01"]["input_tokens"]) == (1, 799_999)
    assert Decimal(by_day["2026-03-01"]["cost"]) == other.cost
    assert (by_day["2026-03-02"]["requests"], by_day["2026-03-02"]["output_tokens"]) == (1, 7)
    assert Decimal(by_day["2026-03-02"]["cost"]) == amended.cost
    stats = await store.stats()
    assert (stats["records"], stats["duplicates"], stats["requests"]) == (11, 1, 2)
    assert json.loads(await own_client.get(tokens_key(ref)))["usage"]["output_tokens"] == 7
    # An amendment over a revision that was never applied is refused, writing nothing.
    skipped = _bill_of("acme", "never", Usage(input_tokens=1), day2, 1)
    base = _bill_of("acme", "never", Usage(), day1, 0)
    never = make_tokens("never", skipped.usage, MODEL)
    with pytest.raises(ResponseError, match="over revision -1"):
        await store.apply_amendments([amended_request(never, skipped, base)])
    assert await store.usage_rows() == before
