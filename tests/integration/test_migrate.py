"""`streamtally migrate` against a real Kafka and Redis: version-1 and version-2 data by hand.

The module has a topic namespace of its own (``st-migrate-{uuid}``: only its
billing topic is created, and deleted at the end) and a Redis database of its
own (`own_db`, flushed before and after each test).  The version-1 data (`V1`)
is spelled as streamtally before layout 2 wrote it: ``st:tokens:{request_id}``
and `st:closed` fields ``{request_id}``, no ``st:layout``; the billing topic
holds the tenants of the billed ones.  The version-2 data (`V2_TOKENS` ...) is
spelled by `streamtally.store.layout_v2`.  One run of the command moves
version 1 to 2, then 2 to 3 (`streamtally.ops.migrate.shards`).  The
migration runs through the command (in this process,
`tests.integration.worker.cli`) or, to stop it half-way, through
`streamtally.ops.migrate` or by moving part of version 2 by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import pytest
import redis
from aiokafka.admin import AIOKafkaAdminClient
from redis.exceptions import ResponseError

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.ops import migrate
from streamtally.settings import DEFAULT_STATE_TTL_S
from streamtally.store import (
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    ROW_FIELDS,
    SHARDS,
    LayoutError,
    RedisBatch,
    RedisStore,
    closed_key,
    row_member,
    shard_of,
    tokens_json,
    tokens_key,
    usage_key,
)
from streamtally.store import layout_v2 as v2
from streamtally.store.layout import PREFIX, dead_key, guard_key, rows_key, stats_key
from streamtally.store.rows import usage_row
from streamtally.topics import Topics, encode_key
from streamtally.wire.avro import encode_billing_event
from streamtally.wire.kafka import ensure_topics, idempotent_producer
from tests.integration.isolation import db_url
from tests.integration.worker import cli

pytestmark = pytest.mark.integration

WHEN: Final = datetime(2026, 11, 21, 12, 30, tzinfo=UTC)
PRICES: Final = PriceTable.from_dict(
    {
        "version": "2026-11-01",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {"gpt-4.1-20*": {"input": "2.00", "cached_input": "0.50", "output": "8.00"}},
    }
)


@dataclass(frozen=True, slots=True)
class Entry:
    """One version-1 request: the tenants billed for it, whether it has Tokens, its marker."""

    tenants: tuple[str, ...]
    tokens: bool
    closed: str | None


#: Version-1 requests by id.
V1: Final = {
    "r1": Entry(("acme",), True, "5 end"),
    # the name r1 of acme moves to: must move out of the way first
    "acme:r1": Entry(("x:y",), True, "7 timeout"),
    "id%3A:z": Entry(("t%",), True, None),
    "nobill": Entry((), True, "9 end"),
    "shared": Entry(("a", "b"), True, "3 end"),
    "decided": Entry(("acme",), False, "11 end"),
    "orphan": Entry((), False, "13 end"),
}
#: The usage row of `UNTOUCHED`.
ROW: Final = ("2026-11-21", "acme", "gpt-4.1-2025-04-14")
#: What the step from 1 to 2 leaves alone (layouts 1 and 2 spell it the same).
UNTOUCHED: Final = {
    v2.STATS_KEY: {"records": "12", "duplicates": "1", "requests": "5"},
    v2.ROWS_KEY: {'["2026-11-21","acme","gpt-4.1-2025-04-14"]'},
    v2.usage_key("2026-11-21", "acme", "gpt-4.1-2025-04-14"): {
        "requests": "1",
        "input_tokens": "1520",
    },
    v2.DEAD_SEEN_KEY: {"t:0:1"},
}
#: `UNTOUCHED` in layout 3: the whole row and the stats in shard 0, the mark a key of its own.
UNTOUCHED_V3: Final = {
    stats_key(0): UNTOUCHED[v2.STATS_KEY],
    rows_key(0): UNTOUCHED[v2.ROWS_KEY],
    usage_key(0, *ROW): UNTOUCHED[v2.usage_key(*ROW)],
    dead_key("t:0:1"): "1",
}
#: Every shard's layout key, once the data is of layout 3.
GUARDS: Final = {guard_key(shard): LAYOUT_VERSION for shard in range(SHARDS)}


def make_tokens(request_id: str) -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model="gpt-4.1-2025-04-14",
        text=f"answer to {request_id}: Grüße",
        reasoning="",
        tool_calls=(),
        usage=Usage(input_tokens=1520, cached_tokens=1408, output_tokens=48),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=4,
    )


def v1_key(request_id: str) -> str:
    """The Tokens key of `request_id` as layout version 1 spelled it."""
    return v2.TOKENS_PREFIX + request_id


def stored(request_id: str) -> str:
    return tokens_json(make_tokens(request_id))


def expected_v3() -> dict[str, Any]:
    """The Redis of `V1` (and `UNTOUCHED`) once migrated to layout 2, then 3."""
    return {
        LAYOUT_KEY: "3",
        **GUARDS,
        tokens_key(RequestRef("acme", "r1")): stored("r1"),
        tokens_key(RequestRef("x:y", "acme:r1")): stored("acme:r1"),
        tokens_key(RequestRef("t%", "id%3A:z")): stored("id%3A:z"),
        closed_key(RequestRef("acme", "r1")): "5 end",
        closed_key(RequestRef("x:y", "acme:r1")): "7 timeout",
        closed_key(RequestRef("acme", "decided")): "11 end",
        # not moved into the shards: resolved by hand (`streamtally.ops.migrate`)
        migrate.UNPLACED_KEY: {"nobill": stored("nobill"), "shared": stored("shared")},
        migrate.UNPLACED_CLOSED_KEY: {"nobill": "9 end", "shared": "3 end"},
        **UNTOUCHED_V3,
    }


def state_kind(key: str) -> str | None:
    """ "tokens", "closed" or "dead" for a layout-3 key that expires after the state TTL."""
    if not key.startswith(PREFIX + "{"):
        return None
    tail = key.split("}:", 1)[1]
    kind = tail.split(":", 1)[0]
    return kind if kind in ("tokens", "closed", "dead") and ":" in tail else None


def assert_state_ttl(client: redis.Redis, limit: int) -> None:
    """Tokens, close markers and dead-letter marks expire within `limit` s (0: never), the rest
    never."""
    keys = sorted(client.scan_iter(count=1000))
    ttls = {key: client.ttl(key) for key in keys}
    stateful = {key for key in keys if state_kind(key) is not None}
    assert stateful, keys
    for key, ttl in ttls.items():
        if key in stateful and limit:
            assert 0 < ttl <= limit, (key, ttl)
        else:
            assert ttl == -1, (key, ttl)


def snapshot(client: redis.Redis) -> dict[str, Any]:
    """Every key of the database and its value (strings, hashes and sets)."""
    out: dict[str, Any] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == "string":
            out[key] = client.get(key)
        elif kind == "hash":
            out[key] = client.hgetall(key)
        elif kind == "set":
            out[key] = client.smembers(key)
        else:
            raise AssertionError(f"unexpected {kind!r} {key!r}")
    return out


def write_v1(client: redis.Redis) -> None:
    """`V1` and `UNTOUCHED` as streamtally before layout 2 wrote them (no st:layout)."""
    for request_id, entry in V1.items():
        if entry.tokens:
            client.set(v1_key(request_id), stored(request_id))
        if entry.closed is not None:
            client.hset(v2.CLOSED_KEY, request_id, entry.closed)
    for key, value in UNTOUCHED.items():
        if isinstance(value, dict):
            client.hset(key, mapping=value)
        else:
            client.sadd(key, *value)


@dataclass(frozen=True, slots=True)
class Stack:
    servers: str
    namespace: str
    url: str
    client: redis.Redis

    @property
    def billing_topic(self) -> str:
        return Topics.in_namespace(self.namespace).billing.name

    def migrate(self, *args: str) -> tuple[int, str, str]:
        """``streamtally migrate ARGS`` on this stack: exit status, stdout, stderr."""
        done = cli("migrate", "--bootstrap-servers", self.servers, "--redis-url", self.url, *args)
        return done.code, done.out.decode(), done.err


async def _produce_billing(servers: str, topic: str) -> None:
    producer = idempotent_producer(servers)
    await producer.start()
    try:
        for request_id, entry in V1.items():
            for tenant in entry.tenants:
                event = bill(make_tokens(request_id), tenant, WHEN, PRICES)
                await producer.send_and_wait(
                    topic, encode_billing_event(event), key=encode_key(request_id)
                )
        # a replay, and a record that does not decode: neither changes a tenant
        replay = bill(make_tokens("r1"), "acme", WHEN, PRICES)
        await producer.send_and_wait(topic, encode_billing_event(replay), key=b"r1")
        await producer.send_and_wait(topic, b"not avro", key=b"garbage")
    finally:
        await producer.stop()


async def _delete_topic(servers: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=servers, request_timeout_ms=15000)
    await admin.start()
    try:
        await admin.delete_topics([name])
    finally:
        await admin.close()


@pytest.fixture(scope="module")
def namespace(bootstrap_servers: str) -> Iterator[str]:
    """A namespace whose billing topic holds the billing events of `V1`."""
    name = f"st-migrate-{uuid.uuid4().hex}"
    topic = Topics.in_namespace(name).billing
    asyncio.run(ensure_topics(bootstrap_servers, (topic,)))
    try:
        asyncio.run(_produce_billing(bootstrap_servers, topic.name))
        yield name
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(_delete_topic(bootstrap_servers, topic.name))


@pytest.fixture
def stack(
    namespace: str,
    bootstrap_servers: str,
    redis_url: str,
    own_db: int,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Stack]:
    """A database of the test's own, empty, and the namespace the command reads."""
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", namespace)
    url = db_url(redis_url, own_db)
    client = redis.Redis.from_url(url, socket_connect_timeout=5, decode_responses=True)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        client.close()
        pytest.skip(f"Redis at {url} does not answer ({exc})")
    client.flushdb()
    try:
        yield Stack(bootstrap_servers, namespace, url, client)
    finally:
        client.flushdb()
        client.close()


def ensure_layout(url: str) -> None:
    async def check() -> None:
        store = RedisStore.from_url(url, connect_timeout=5)
        try:
            await store.ensure_layout()
        finally:
            await store.aclose()

    asyncio.run(check())


def ops(url: str, work: Any) -> Any:
    """Run ``work(client)`` (a coroutine function) with an async client of `url`."""

    async def main() -> Any:
        import redis.asyncio as aioredis

        client = aioredis.from_url(url, socket_connect_timeout=5)
        try:
            return await work(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


# --------------------------------------------------------------------------- the migration


def test_version_1_moves_to_its_tenants_keys_and_a_second_run_changes_nothing(
    stack: Stack,
) -> None:
    write_v1(stack.client)
    with pytest.raises(LayoutError, match="streamtally migrate"):
        ensure_layout(stack.url)

    code, out, err = stack.migrate("--json", "--batch-size", "2", "--progress-every", "2")
    assert code == 0, err
    summary = json.loads(out)
    assert out.count("\n") == 1
    assert {k: summary[k] for k in ("outcome", "dry_run", "layout_before", "layout")} == {
        "outcome": "migrated",
        "dry_run": False,
        "layout_before": None,
        "layout": "3",
    }
    # then layout 2 to 3: the three placed Tokens and markers, the row, the stats, the mark
    assert summary["shards"] == {"tokens": 3, "closed": 3, "rows": 1, "stats": 1, "dead_letters": 1}
    assert (summary["billing_events"], summary["billing_undecodable"]) == (7, 1)
    assert summary["billing_request_ids"] == 5
    assert {
        k: summary[k]
        for k in ("moved_before", "moved", "closed_moved", "unplaced", "closed_unplaced")
    } == {"moved_before": 0, "moved": 3, "closed_moved": 3, "unplaced": 2, "closed_unplaced": 2}
    assert (summary["closed_dropped"], summary["unplaced_total"]) == (1, 2)
    assert summary["unplaced_requests"] == [
        {"request_id": "nobill", "reason": "no billing event", "tenants": []},
        {"request_id": "shared", "reason": "billed to 2 tenants", "tenants": ["a", "b"]},
    ]
    assert summary["dropped_closed"] == [
        {"request_id": "orphan", "reason": "no billing event", "tenants": []}
    ]
    assert "2/7 request ids migrated" in err
    assert "7/7 request ids migrated" in err
    assert f"{LAYOUT_KEY} is {v2.MIGRATING_FROM_1!r}" in err
    assert f"{LAYOUT_KEY} is {MIGRATING!r}" in err
    assert err.rstrip().endswith(f"{LAYOUT_KEY} is '3'")

    assert snapshot(stack.client) == expected_v3()
    assert_state_ttl(stack.client, DEFAULT_STATE_TTL_S)
    ensure_layout(stack.url)  # a worker starts now

    async def read(client: Any) -> tuple[Any, ...]:
        store = RedisStore(client)
        acme_r1 = RequestRef("acme", "r1")
        return (
            await store.tokens_text(acme_r1),
            await store.tenants_of("acme:r1"),
            await store.closed_markers([acme_r1, RequestRef("acme", "decided")]),
            await store.usage_rows(),
            await store.stats(),
        )

    text, tenants, markers, rows, stats = ops(stack.url, read)
    assert text == stored("r1")
    assert tenants == ["x:y"]
    assert markers == {
        RequestRef("acme", "r1"): ("5 end", True),
        RequestRef("acme", "decided"): ("11 end", False),
    }
    assert [(r["day"], r["tenant"], r["model"]) for r in rows] == [ROW]
    assert (rows[0]["requests"], rows[0]["input_tokens"]) == (1, 1520)
    assert rows[0]["cost"] == "0.000000000000"
    assert stats == {"records": 12, "duplicates": 1, "dead_lettered": 0, "requests": 5}

    code, out, err = stack.migrate()
    assert (code, err) == (0, "")
    assert out == "Redis is of layout 3 already: nothing to migrate\n"
    assert snapshot(stack.client) == expected_v3()


def test_the_text_summary_lists_what_could_not_be_placed(stack: Stack) -> None:
    write_v1(stack.client)
    code, out, err = stack.migrate()
    assert code == 0, err
    lines = out.splitlines()
    assert (
        lines[0]
        == "migrated to layout 2: 3 requests moved to their tenant's keys, 3 close markers moved"
    )
    assert "  unplaced nobill: no billing event" in lines
    assert "  unplaced shared: billed to 2 tenants (a, b)" in lines
    assert "  dropped orphan: no billing event" in lines
    assert (
        "1 billing records did not decode: their requests count as without billing event" in lines
    )
    assert lines[-1] == (
        "layout 2 to 3: 3 Tokens, 3 close markers, 1 usage rows and 1 dead-letter marks "
        "moved into the shards"
    )


def test_a_dry_run_writes_nothing(stack: Stack) -> None:
    write_v1(stack.client)
    before = snapshot(stack.client)
    code, out, err = stack.migrate("--dry-run", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["outcome"], summary["dry_run"], summary["layout"]) == ("planned", True, None)
    assert (summary["moved"], summary["unplaced"], summary["closed_dropped"]) == (3, 2, 1)
    assert summary["shards"] is None  # planned once layout 2 is: it depends on the first step
    assert snapshot(stack.client) == before

    code, out, err = stack.migrate("--dry-run")
    assert code == 0, err
    assert out.startswith("dry run, nothing written: layout 1 to 2: 3 requests would be moved")
    assert out.endswith("then layout 2 to 3 (planned once layout 2 is)\n")
    assert snapshot(stack.client) == before


def test_an_interrupted_run_blocks_writers_and_a_rerun_ends_it(stack: Stack) -> None:
    write_v1(stack.client)

    async def first_batch(client: Any) -> migrate.Plan:
        assert await migrate.begin(client) is None
        billing = await migrate.read_billing(stack.servers, stack.billing_topic)
        entries = await migrate.scan(client)
        steps = migrate.plan(entries.tokens, entries.closed, billing, entries.moved)
        await migrate.apply_batch(client, steps.steps[:4])
        return steps

    steps = ops(stack.url, first_batch)
    # acme:r1, decided and id%3A:z moved, nobill unplaced: the moved keys must not be
    # read as version-1 ids "x%3Ay:acme:r1" or "t%25:id%3A:z" (no billing: unplaced)
    assert [s.request_id for s in steps.steps[:4]] == ["acme:r1", "decided", "id%3A:z", "nobill"]
    half = snapshot(stack.client)
    assert half[LAYOUT_KEY] == v2.MIGRATING_FROM_1
    assert half[migrate.MOVED_KEY] == {"acme:decided", "x%3Ay:acme:r1", "t%25:id%3A:z"}
    assert v1_key("r1") in half
    assert v2.tokens_key(RequestRef("x:y", "acme:r1")) in half

    with pytest.raises(LayoutError, match=r"in progress or was interrupted"):
        ensure_layout(stack.url)

    async def worker_flush(client: Any) -> None:
        sink = RedisBatch(RedisStore(client))
        tokens = make_tokens("late")
        sink.add(tokens, bill(tokens, "acme", WHEN, PRICES), closed="1 end", records=1)
        await sink.flush()

    # the flush script checks its shard's layout key: not set before the move to 3 ends
    late = re.escape(f"{guard_key(shard_of(RequestRef('acme', 'late')))} is false, not 3")
    with pytest.raises(ResponseError, match=late):
        ops(stack.url, worker_flush)
    assert snapshot(stack.client) == half

    code, out, err = stack.migrate("--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["layout_before"] == v2.MIGRATING_FROM_1
    assert summary["layout"] == "3"
    assert (summary["moved_before"], summary["moved"], summary["closed_moved"]) == (3, 1, 1)
    assert (summary["unplaced"], summary["closed_dropped"]) == (1, 1)
    assert summary["unplaced_total"] == 2  # nobill, unplaced by the first run, and shared
    assert summary["shards"]["tokens"] == summary["shards"]["closed"] == 3
    assert "resuming an interrupted migration" in err
    assert snapshot(stack.client) == expected_v3()
    ensure_layout(stack.url)


def test_a_run_stopped_before_its_last_step_only_finishes_on_rerun(stack: Stack) -> None:
    """Everything moved, st:layout still "1>2": ``st:tokens:acme:r1`` is r1 of acme, moved."""
    write_v1(stack.client)

    async def all_but_finish(client: Any) -> None:
        await migrate.begin(client)
        billing = await migrate.read_billing(stack.servers, stack.billing_topic)
        entries = await migrate.scan(client)
        steps = migrate.plan(entries.tokens, entries.closed, billing, entries.moved)
        await migrate.apply(client, steps.steps, batch_size=3)

    ops(stack.url, all_but_finish)
    assert stack.client.get(LAYOUT_KEY) == v2.MIGRATING_FROM_1
    assert "acme:r1" in stack.client.smembers(migrate.MOVED_KEY)

    code, out, err = stack.migrate("--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["moved_before"], summary["moved"], summary["unplaced"]) == (4, 0, 0)
    assert snapshot(stack.client) == expected_v3()


def test_a_step_that_no_longer_fits_writes_nothing_of_its_batch(stack: Stack) -> None:
    write_v1(stack.client)

    async def stale(client: Any) -> None:
        await migrate.begin(client)
        billing = await migrate.read_billing(stack.servers, stack.billing_topic)
        entries = await migrate.scan(client)
        steps = migrate.plan(entries.tokens, entries.closed, billing, entries.moved)
        await client.delete(v1_key("r1"))  # the last step's key: gone since the scan
        await migrate.apply_batch(client, steps.steps)

    before = snapshot(stack.client)
    with pytest.raises(migrate.MigrateError, match=f"{v1_key('r1')} is no longer a Tokens string"):
        ops(stack.url, stale)
    del before[v1_key("r1")]
    assert snapshot(stack.client) == {**before, LAYOUT_KEY: v2.MIGRATING_FROM_1}


# --------------------------------------------------------------------------- layout 2 to 3

#: Layout-2 requests: whether each has Tokens, and its close marker (None: none).
V2_REQUESTS: Final = {
    RequestRef("acme", "r1"): (True, "5 end"),
    RequestRef("x:y", "acme:r1"): (True, "7 timeout"),  # a ':' in the tenant
    RequestRef("t%", "id%3A:z"): (True, None),  # a '%' in the tenant, escapes in the id
    RequestRef("Grüße GmbH", "要求-1"): (True, "2 end"),  # not ASCII
    RequestRef("acme", "decided"): (False, "11 end"),  # decided, never applied
}
#: Layout-2 usage rows: (day, tenant, model) -> the row hash.
V2_ROWS: Final[dict[tuple[str, str, str], dict[Any, str]]] = {
    ("2026-11-21", "acme", "gpt-4.1-2025-04-14"): {
        **dict.fromkeys(ROW_FIELDS[:-1], "0"),
        "requests": "2",
        "input_tokens": "3040",
        "cached_tokens": "2816",
        "output_tokens": "96",
        "cost_units": "1",
        "cost_pico": "250000000000",
    },
    ("2026-11-21", "x:y", "gpt-4.1-2025-04-14"): {
        **dict.fromkeys(ROW_FIELDS[:-1], "0"),
        "requests": "1",
        "input_tokens": "7",
        "cost_pico": "999999999999",
    },
    ("2026-11-22", "t%", "unknown"): {
        **dict.fromkeys(ROW_FIELDS, "0"),
        "requests": "3",
        "unpriced_requests": "1",
        "reasoning_tokens": "12",
        "cache_write_tokens": "5",
        "cost_units": "4",
    },
    ("2026-11-22", "Grüße GmbH", "org/model:v1"): {
        **dict.fromkeys(ROW_FIELDS[:-1], "0"),
        "requests": "1",
        "output_tokens": "42",
        "cost_pico": "1",
    },
}
V2_STATS: Final[dict[Any, str]] = {
    "records": "40",
    "duplicates": "3",
    "requests": "4",
    "dead_lettered": "2",
}
V2_DEAD: Final = ("ns.raw.sse:0:17", "ns.raw.engine:2:5")
#: What the move to layout 3 moves, as the command's summary counts it.
V2_MOVES: Final = {"tokens": 4, "closed": 4, "rows": 4, "stats": 1, "dead_letters": 2}


def write_v2(client: redis.Redis) -> None:
    """`V2_REQUESTS`, `V2_ROWS`, `V2_STATS` and `V2_DEAD` as streamtally's layout 2 wrote them."""
    client.set(LAYOUT_KEY, v2.VERSION)
    for ref, (has_tokens, marker) in V2_REQUESTS.items():
        if has_tokens:
            client.set(v2.tokens_key(ref), stored(ref.request_id))
        if marker is not None:
            client.hset(v2.CLOSED_KEY, v2.closed_field(ref), marker)
    for row, fields in V2_ROWS.items():
        client.hset(v2.usage_key(*row), mapping=fields)
        client.sadd(v2.ROWS_KEY, row_member(*row))
    client.hset(v2.STATS_KEY, mapping=V2_STATS)
    client.sadd(v2.DEAD_SEEN_KEY, *V2_DEAD)


def expected_from_v2() -> dict[str, Any]:
    """The Redis of `write_v2` once moved to layout 3."""
    return {
        LAYOUT_KEY: "3",
        **GUARDS,
        **{
            tokens_key(ref): stored(ref.request_id)
            for ref, (has_tokens, _) in V2_REQUESTS.items()
            if has_tokens
        },
        **{
            closed_key(ref): marker
            for ref, (_, marker) in V2_REQUESTS.items()
            if marker is not None
        },
        # a row is the sum of its parts: shard 0 holds all of each
        **{usage_key(0, *row): fields for row, fields in V2_ROWS.items()},
        rows_key(0): {row_member(*row) for row in V2_ROWS},
        stats_key(0): V2_STATS,
        **{dead_key(position): "1" for position in V2_DEAD},
    }


def v2_rows(client: redis.Redis) -> list[dict[str, Any]]:
    """The layout-2 usage rows, decoded as `RedisStore.usage_rows` decodes rows."""
    rows = []
    for member in sorted(client.smembers(v2.ROWS_KEY)):
        day, tenant, model = json.loads(member)
        key = v2.usage_key(day, tenant, model)
        row = usage_row(day, tenant, model, [(key, client.hmget(key, list(ROW_FIELDS)))])
        assert row is not None
        rows.append(row)
    return sorted(rows, key=lambda r: (r["day"], r["tenant"], r["model"]))


def read_v3(
    url: str,
) -> tuple[list[dict[str, Any]], dict[str, int], dict[RequestRef, Any], list[Any]]:
    """Through `RedisStore`: the usage rows, the stats, the close markers and the Tokens."""

    async def read(client: Any) -> tuple[Any, ...]:
        store = RedisStore(client)
        refs = list(V2_REQUESTS)
        return (
            await store.usage_rows(),
            await store.stats(),
            await store.closed_markers(refs),
            await store.tokens_texts(refs),
        )

    rows, stats, markers, texts = ops(url, read)
    return rows, stats, markers, texts


def assert_moved_from_v2(stack: Stack, rows_before: list[dict[str, Any]], ttl: int) -> None:
    """Everything of `write_v2` at its layout-3 key, nothing of layout 2 left, reads unchanged."""
    after = snapshot(stack.client)
    assert after == expected_from_v2()
    assert all(key == LAYOUT_KEY or key.startswith(PREFIX + "{") for key in after), sorted(after)
    assert_state_ttl(stack.client, ttl)
    rows, stats, markers, texts = read_v3(stack.url)
    assert rows == rows_before
    assert stats == {name: int(value) for name, value in V2_STATS.items()}
    assert markers == {
        ref: (marker, has_tokens)
        for ref, (has_tokens, marker) in V2_REQUESTS.items()
        if marker is not None
    }
    assert texts == [
        stored(ref.request_id) if has_tokens else None
        for ref, (has_tokens, _) in V2_REQUESTS.items()
    ]
    ensure_layout(stack.url)  # a worker starts now


@pytest.mark.parametrize("ttl", [None, "3600", "0"], ids=["default-ttl", "ttl-3600", "no-ttl"])
def test_layout_2_moves_into_the_shards_and_a_second_run_changes_nothing(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, ttl: str | None
) -> None:
    if ttl is not None:
        monkeypatch.setenv("STREAMTALLY_STATE_TTL", ttl)
    write_v2(stack.client)
    with pytest.raises(LayoutError, match=r"layout version 2; run `streamtally migrate`"):
        ensure_layout(stack.url)
    before = snapshot(stack.client)
    rows_before = v2_rows(stack.client)
    assert len(rows_before) == len(V2_ROWS)
    by_tenant = {r["tenant"]: r for r in rows_before}
    assert (by_tenant["acme"]["cost"], by_tenant["acme"]["requests"]) == ("1.250000000000", 2)
    assert (by_tenant["t%"]["unpriced_requests"], by_tenant["t%"]["cost"]) == (1, "4.000000000000")

    code, out, err = stack.migrate("--dry-run", "--json")
    assert code == 0, err
    assert json.loads(out) == {
        "dry_run": True,
        "layout_before": "2",
        "layout": "2",
        "shards": V2_MOVES,
        "outcome": "planned",
    }
    assert snapshot(stack.client) == before

    code, out, err = stack.migrate("--json", "--batch-size", "3")
    assert code == 0, err
    assert json.loads(out) == {
        "dry_run": False,
        "layout_before": "2",
        "layout": "3",
        "shards": V2_MOVES,
        "outcome": "migrated",
    }
    assert f"{LAYOUT_KEY} is {MIGRATING!r}" in err
    assert_moved_from_v2(stack, rows_before, DEFAULT_STATE_TTL_S if ttl is None else int(ttl))

    moved = snapshot(stack.client)
    code, out, err = stack.migrate()
    assert (code, out, err) == (0, "Redis is of layout 3 already: nothing to migrate\n", "")
    assert snapshot(stack.client) == moved


def test_a_move_stopped_by_a_key_in_the_way_resumes_where_it_stopped(stack: Stack) -> None:
    """Batches of one: the Tokens before the one in the way move, then the run stops at
    "2>3"; once the key is gone the next run moves the rest."""
    write_v2(stack.client)
    rows_before = v2_rows(stack.client)
    # the Tokens move in the order of their layout-2 keys: "G" < "a" < "t" < "x"
    order = sorted((v2.tokens_key(ref), ref) for ref, (t, _) in V2_REQUESTS.items() if t)
    refs = [ref for _, ref in order]
    assert refs[2] == RequestRef("t%", "id%3A:z")
    stack.client.set(tokens_key(refs[2]), "in the way")

    code, out, err = stack.migrate("--batch-size", "1")
    assert (code, out) == (1, "")
    last = err.splitlines()[-1]
    assert f"{tokens_key(refs[2])} exists already: nothing of this batch was moved" in last
    assert f"{LAYOUT_KEY} stays '2>3': run `streamtally migrate` again" in last
    half = snapshot(stack.client)
    assert half[LAYOUT_KEY] == MIGRATING
    for ref in refs[:2]:  # moved, with the TTL
        assert half[tokens_key(ref)] == stored(ref.request_id)
        assert v2.tokens_key(ref) not in half
        assert 0 < stack.client.ttl(tokens_key(ref)) <= DEFAULT_STATE_TTL_S
    for ref in refs[2:]:  # not moved
        assert half[v2.tokens_key(ref)] == stored(ref.request_id)
    assert half[tokens_key(refs[2])] == "in the way"
    assert len(half[v2.CLOSED_KEY]) == 4  # the close markers come after the Tokens
    assert not any(key in half for key in GUARDS)
    with pytest.raises(LayoutError, match=r"in progress or was interrupted"):
        ensure_layout(stack.url)

    async def worker_flush(client: Any) -> None:
        tokens = make_tokens("late")
        sink = RedisBatch(RedisStore(client))
        sink.add(tokens, bill(tokens, "acme", WHEN, PRICES), closed="1 end", records=1)
        await sink.flush()

    with pytest.raises(
        ResponseError, match=re.escape(PREFIX) + r"\{s\d+-\d+\}:layout is false, not 3"
    ):
        ops(stack.url, worker_flush)
    assert snapshot(stack.client) == half

    stack.client.delete(tokens_key(refs[2]))
    code, out, err = stack.migrate("--json", "--batch-size", "1")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["layout_before"], summary["layout"]) == (MIGRATING, "3")
    assert summary["shards"] == {**V2_MOVES, "tokens": 2}
    assert_moved_from_v2(stack, rows_before, DEFAULT_STATE_TTL_S)


def test_a_move_interrupted_half_way_is_finished_by_the_next_run(stack: Stack) -> None:
    """The layout key at "2>3" and part of the data moved (as the move script moves it): the run
    moves the rest, and the text summary counts only that."""
    write_v2(stack.client)
    rows_before = v2_rows(stack.client)
    stack.client.set(LAYOUT_KEY, MIGRATING)
    acme_r1, decided = RequestRef("acme", "r1"), RequestRef("acme", "decided")
    stack.client.rename(v2.tokens_key(acme_r1), tokens_key(acme_r1))
    stack.client.expire(tokens_key(acme_r1), 600)
    stack.client.set(closed_key(decided), "11 end", ex=600)
    stack.client.hdel(v2.CLOSED_KEY, v2.closed_field(decided))
    row = ("2026-11-21", "x:y", "gpt-4.1-2025-04-14")
    stack.client.rename(v2.usage_key(*row), usage_key(0, *row))
    stack.client.sadd(rows_key(0), row_member(*row))
    stack.client.srem(v2.ROWS_KEY, row_member(*row))
    stack.client.set(dead_key(V2_DEAD[0]), "1", ex=600)
    stack.client.srem(v2.DEAD_SEEN_KEY, V2_DEAD[0])

    code, out, err = stack.migrate()
    assert code == 0, err
    assert out == (
        "layout 2 to 3: 3 Tokens, 3 close markers, 3 usage rows and 1 dead-letter marks "
        "moved into the shards\n"
    )
    assert f"{LAYOUT_KEY} is '3'" in err
    assert_moved_from_v2(stack, rows_before, DEFAULT_STATE_TTL_S)


# --------------------------------------------------------------------------- other layouts, errors


def test_an_empty_redis_is_claimed_and_layout_3_is_left_alone(stack: Stack) -> None:
    code, out, err = stack.migrate("--dry-run")
    assert (code, err) == (0, "")
    assert out == (
        "Redis holds no streamtally data of layout 1\n"
        "then layout 2 to 3 (planned once layout 2 is)\n"
    )
    assert snapshot(stack.client) == {}

    code, out, err = stack.migrate("--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["outcome"], summary["layout"]) == ("empty", "3")
    assert summary["shards"] == {"tokens": 0, "closed": 0, "rows": 0, "stats": 0, "dead_letters": 0}
    assert snapshot(stack.client) == {LAYOUT_KEY: "3", **GUARDS}

    code, out, err = stack.migrate()
    assert (code, out, err) == (0, "Redis is of layout 3 already: nothing to migrate\n", "")
    code, out, err = stack.migrate("--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == {
        "dry_run": False,
        "layout_before": "3",
        "layout": "3",
        "shards": None,
        "outcome": "up to date",
    }
    assert snapshot(stack.client) == {LAYOUT_KEY: "3", **GUARDS}


def test_an_unknown_layout_is_refused(stack: Stack) -> None:
    write_v1(stack.client)
    stack.client.set(LAYOUT_KEY, "3\x1b[2J")
    before = snapshot(stack.client)
    code, out, err = stack.migrate()
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert "\x1b" not in err
    assert err.startswith("streamtally migrate: Redis holds layout version '3\\x1b[2J'")
    assert snapshot(stack.client) == before


def test_kafka_unreachable_is_one_line_and_the_rerun_hint(stack: Stack) -> None:
    write_v1(stack.client)
    before = snapshot(stack.client)
    done = cli("migrate", "--bootstrap-servers", "127.0.0.1:1", "--redis-url", stack.url)
    assert (done.code, done.out) == (2, b"")
    last = done.err.splitlines()[-1]
    assert last.startswith("streamtally migrate: cannot reach Kafka at 127.0.0.1:1")
    assert "run `streamtally migrate` again" in last
    assert snapshot(stack.client) == {**before, LAYOUT_KEY: v2.MIGRATING_FROM_1}


def test_redis_unreachable_is_one_line(stack: Stack) -> None:
    done = cli(
        "migrate", "--bootstrap-servers", stack.servers, "--redis-url", "redis://127.0.0.1:1/0"
    )
    assert (done.code, done.out) == (2, b"")
    assert done.err.startswith("streamtally migrate: cannot reach Redis at redis://127.0.0.1:1/0")
    assert done.err.count("\n") == 1
