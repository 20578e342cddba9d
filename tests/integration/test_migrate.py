"""`streamtally migrate` against a real Kafka and Redis: version-1 data written by hand.

The module has a topic namespace of its own (``st-migrate-{uuid}``: only its
billing topic is created, and deleted at the end) and a Redis database of its
own (`DB`, flushed before and after each test).  The version-1 data (`V1`)
is spelled as streamtally before layout 2 wrote it: ``st:tokens:{request_id}``
and `st:closed` fields ``{request_id}``, no ``st:layout``; the billing topic
holds the tenants of the billed ones.  The migration runs through the
command (in this process, `tests.integration.worker.cli`) or, to stop it
half-way, through `streamtally.ops.migrate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import pytest
import redis
from aiokafka.admin import AIOKafkaAdminClient
from redis.exceptions import ResponseError

from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.core.pricing import PriceTable
from streamtally.ops import migrate
from streamtally.store import (
    CLOSED_KEY,
    DEAD_SEEN_KEY,
    LAYOUT_KEY,
    MIGRATING,
    ROWS_KEY,
    STATS_KEY,
    TOKENS_PREFIX,
    LayoutError,
    RedisSink,
    RedisStore,
    tokens_json,
    tokens_key,
    usage_key,
)
from streamtally.topics import Topics, encode_key
from streamtally.wire.avro import encode_billing_event
from streamtally.wire.billing import bill
from streamtally.wire.kafka import ensure_topics, idempotent_producer
from tests.integration.worker import cli

pytestmark = pytest.mark.integration

#: This module's own Redis database.
DB: Final = 14
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
#: What the migration leaves alone (the same in both layouts).
UNTOUCHED: Final = {
    STATS_KEY: {"records": "12", "duplicates": "1", "requests": "5"},
    ROWS_KEY: {'["2026-11-21","acme","gpt-4.1-2025-04-14"]'},
    usage_key("2026-11-21", "acme", "gpt-4.1-2025-04-14"): {
        "requests": "1",
        "input_tokens": "1520",
    },
    DEAD_SEEN_KEY: {"t:0:1"},
}


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
    return TOKENS_PREFIX + request_id


def stored(request_id: str) -> str:
    return tokens_json(make_tokens(request_id))


def expected_v2() -> dict[str, Any]:
    """The Redis of `V1` (and `UNTOUCHED`) once migrated."""
    return {
        LAYOUT_KEY: "2",
        tokens_key(RequestRef("acme", "r1")): stored("r1"),
        tokens_key(RequestRef("x:y", "acme:r1")): stored("acme:r1"),
        tokens_key(RequestRef("t%", "id%3A:z")): stored("id%3A:z"),
        CLOSED_KEY: {"acme:r1": "5 end", "x%3Ay:acme:r1": "7 timeout", "acme:decided": "11 end"},
        migrate.UNPLACED_KEY: {"nobill": stored("nobill"), "shared": stored("shared")},
        migrate.UNPLACED_CLOSED_KEY: {"nobill": "9 end", "shared": "3 end"},
        **UNTOUCHED,
    }


def db_url(url: str, db: int) -> str:
    base = url.split("?", 1)[0]
    head, _, tail = base.rpartition("/")
    return f"{head}/{db}" if tail.isdigit() and head.count("/") >= 2 else f"{base.rstrip('/')}/{db}"


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
            client.hset(CLOSED_KEY, request_id, entry.closed)
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
    namespace: str, bootstrap_servers: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    """This module's database, empty, and the namespace the command reads."""
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", namespace)
    url = db_url(redis_url, DB)
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
        "layout": "2",
    }
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
    assert f"{LAYOUT_KEY} is {MIGRATING!r}" in err

    assert snapshot(stack.client) == expected_v2()
    ensure_layout(stack.url)  # a worker starts now

    async def read(client: Any) -> tuple[Any, ...]:
        store = RedisStore(client)
        acme_r1 = RequestRef("acme", "r1")
        return (
            await store.tokens_text(acme_r1),
            await store.tenants_of("acme:r1"),
            await store.closed_markers([acme_r1, RequestRef("acme", "decided")]),
        )

    text, tenants, markers = ops(stack.url, read)
    assert text == stored("r1")
    assert tenants == ["x:y"]
    assert markers == {
        RequestRef("acme", "r1"): ("5 end", True),
        RequestRef("acme", "decided"): ("11 end", False),
    }

    code, out, err = stack.migrate()
    assert (code, err) == (0, "")
    assert out == "Redis is of layout 2 already: nothing to migrate\n"
    assert snapshot(stack.client) == expected_v2()


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


def test_a_dry_run_writes_nothing(stack: Stack) -> None:
    write_v1(stack.client)
    before = snapshot(stack.client)
    code, out, err = stack.migrate("--dry-run", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["outcome"], summary["dry_run"], summary["layout"]) == ("planned", True, None)
    assert (summary["moved"], summary["unplaced"], summary["closed_dropped"]) == (3, 2, 1)
    assert snapshot(stack.client) == before

    code, out, err = stack.migrate("--dry-run")
    assert code == 0, err
    assert out.startswith("dry run, nothing written: layout 1 to 2: 3 requests would be moved")
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
    assert half[LAYOUT_KEY] == MIGRATING
    assert half[migrate.MOVED_KEY] == {"acme:decided", "x%3Ay:acme:r1", "t%25:id%3A:z"}
    assert v1_key("r1") in half
    assert tokens_key(RequestRef("x:y", "acme:r1")) in half

    with pytest.raises(LayoutError, match=r"in progress or was interrupted"):
        ensure_layout(stack.url)

    async def worker_flush(client: Any) -> None:
        sink = RedisSink(RedisStore(client))
        tokens = make_tokens("late")
        sink.add(tokens, bill(tokens, "acme", WHEN, PRICES), closed="1 end", records=1)
        await sink.flush()

    with pytest.raises(ResponseError, match=f"{LAYOUT_KEY} is 1>2, not 2"):
        ops(stack.url, worker_flush)
    assert snapshot(stack.client) == half

    code, out, err = stack.migrate("--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["layout_before"] == MIGRATING
    assert (summary["moved_before"], summary["moved"], summary["closed_moved"]) == (3, 1, 1)
    assert (summary["unplaced"], summary["closed_dropped"]) == (1, 1)
    assert summary["unplaced_total"] == 2  # nobill, unplaced by the first run, and shared
    assert "resuming an interrupted migration" in err
    assert snapshot(stack.client) == expected_v2()
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
    assert stack.client.get(LAYOUT_KEY) == MIGRATING
    assert "acme:r1" in stack.client.smembers(migrate.MOVED_KEY)

    code, out, err = stack.migrate("--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["moved_before"], summary["moved"], summary["unplaced"]) == (4, 0, 0)
    assert snapshot(stack.client) == expected_v2()


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
    assert snapshot(stack.client) == {**before, LAYOUT_KEY: MIGRATING}


# --------------------------------------------------------------------------- other layouts, errors


def test_an_empty_redis_is_claimed_and_layout_2_is_left_alone(stack: Stack) -> None:
    code, out, err = stack.migrate("--dry-run")
    assert (code, err) == (0, "")
    assert out == "Redis holds no streamtally data: nothing to migrate\n"
    assert snapshot(stack.client) == {}

    code, out, err = stack.migrate("--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["outcome"] == "empty"
    assert snapshot(stack.client) == {LAYOUT_KEY: "2"}

    code, out, err = stack.migrate()
    assert (code, out, err) == (0, "Redis is of layout 2 already: nothing to migrate\n", "")


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
    assert snapshot(stack.client) == {**before, LAYOUT_KEY: MIGRATING}


def test_redis_unreachable_is_one_line(stack: Stack) -> None:
    done = cli(
        "migrate", "--bootstrap-servers", stack.servers, "--redis-url", "redis://127.0.0.1:1/0"
    )
    assert (done.code, done.out) == (2, b"")
    assert done.err.startswith("streamtally migrate: cannot reach Redis at redis://127.0.0.1:1/0")
    assert done.err.count("\n") == 1
