"""`streamtally deadletter` and `streamtally rebuild` against a real worker, Kafka and Redis.

The module runs in its own namespace (``STREAMTALLY_NAMESPACE``: topics and
consumer group of its own, created by the commands it runs) and its own
Redis database (leased, `module_db`; flushed before and after), so it can wipe Redis
without touching anybody's data.  The Kafka commands run as subprocesses
(``python -m streamtally.cli``) so that `topics` reads the namespace; the
Redis read commands (`tokens get`, `usage`), which do not use Kafka, run
in-process (`tests.integration.worker.cli`) to keep the module fast.

The `run` fixture: a worker, the sample manifest produced under fresh
request ids, two garbage messages on the raw SSE topic, wait until all of it
is in Redis, stop the worker, then one dead letter re-sent byte-identically
(what a worker that crashed after sending it does).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from streamtally.core.identity import RequestRef
from streamtally.settings import DEFAULT_STATE_TTL_S
from streamtally.store import (
    LAYOUT_KEY,
    SHARDS,
    RedisStore,
    closed_key,
    position_of,
    shard_of,
    tokens_key,
)
from streamtally.store.layout import PREFIX, dead_key, guard_key, stats_key
from streamtally.store.layout_v2 import TOKENS_PREFIX as V1_TOKENS_PREFIX
from streamtally.topics import output_key
from streamtally.wire.avro import (
    decode_billing_event,
    decode_dead_letter,
    encode_billing_correction,
    encode_billing_event,
)
from streamtally.wire.kafka import read_topic
from streamtally.wire.records import BillingCorrection, BillingEvent
from tests.integration.isolation import db_url
from tests.integration.worker import (
    READY_LINE,
    SAMPLES,
    WorkerProcess,
    assert_stopped_cleanly,
    cli,
    run_streamtally,
    wait_for_tokens,
    write_manifest,
)

pytestmark = pytest.mark.integration

#: Seconds for the worker to join, and then to put everything into Redis.
READY_TIMEOUT_S = 60.0
PIPELINE_TIMEOUT_S = 60.0
#: Every few manifest lines: a sample of each source, quickly.
MANIFEST_STEP = 3


@dataclass(frozen=True, slots=True)
class Garbage:
    key: bytes | None
    value: bytes
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Run:
    namespace: str
    env: dict[str, str]
    redis_url: str
    #: The requests produced (tenant and request id).
    refs: list[RequestRef]
    garbage: list[Garbage]
    #: (original topic, partition, offset) of the dead letter sent twice.
    resent: tuple[str, int, int]

    def topic(self, name: str) -> str:
        return f"{self.namespace}.{name}"

    def streamtally(self, *args: str, timeout: float = 120.0) -> tuple[int, bytes, str]:
        done = run_streamtally(*args, env=self.env, timeout=timeout)
        return done.returncode, done.stdout, done.stderr.decode(errors="replace")


async def _send_garbage(
    servers: str, topic: str, messages: list[tuple[bytes | None, bytes]]
) -> list[Garbage]:
    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
    await producer.start()
    try:
        sent = []
        for key, value in messages:
            meta = await producer.send_and_wait(topic, value, key=key)
            sent.append(Garbage(key, value, meta.partition, meta.offset))
        return sent
    finally:
        await producer.stop()


async def _resend_first_dead_letter(servers: str, topic: str) -> bytes:
    """Send the first record of the dead-letter topic again, byte for byte; return its value."""
    async with contextlib.aclosing(read_topic(servers, topic)) as records:
        async for record in records:
            assert record.value is not None
            first = (record.key, record.value)
            break
        else:
            raise AssertionError(f"{topic} is empty")
    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, first[1], key=first[0])
    finally:
        await producer.stop()
    return first[1]


async def _delete_topics(servers: str, names: list[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=servers, request_timeout_ms=15000)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        mine = [name for name in names if name in existing]
        if mine:
            await admin.delete_topics(mine)
    finally:
        await admin.close()


def _wait_for_dead_letters(url: str, count: int, timeout: float) -> int:
    async def wait() -> int:
        store = RedisStore.from_url(url, connect_timeout=5)
        try:
            deadline = time.monotonic() + timeout
            seen = await store.dead_letter_count()
            while seen < count and time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                seen = await store.dead_letter_count()
            return seen
        finally:
            await store.aclose()

    return asyncio.run(wait())


@pytest.fixture(scope="module")
def run(
    bootstrap_servers: str, redis_url: str, module_db: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    tag = uuid.uuid4().hex[:10]
    namespace = f"st-dlrb-{tag}"
    url = db_url(redis_url, module_db)
    env = {
        "STREAMTALLY_NAMESPACE": namespace,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "REDIS_URL": url,
    }
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    client.flushdb()  # this module's own database
    directory = tmp_path_factory.mktemp("deadletter-rebuild")
    worker = WorkerProcess(directory / "worker.log", env)
    try:
        worker.start()
        worker.wait_for_log(READY_LINE, READY_TIMEOUT_S)

        rows = [
            json.loads(line)
            for line in (SAMPLES / "manifest.jsonl").read_text().splitlines()
            if line.strip()
        ][::MANIFEST_STEP]
        refs = []
        for row in rows:
            row["file"] = str(SAMPLES / row["file"])
            row["request_id"] = f"{row['request_id']}-{tag}"
            refs.append(RequestRef(row["tenant"], row["request_id"]))
        manifest = write_manifest(directory / "manifest.jsonl", rows)
        produced = run_streamtally("produce", "--manifest", str(manifest), env=env, timeout=120)
        assert produced.returncode == 0, produced.stderr.decode(errors="replace")

        garbage = asyncio.run(
            _send_garbage(
                bootstrap_servers,
                f"{namespace}.raw.sse",
                [
                    (
                        f"garbage-{tag}".encode(),
                        b"\x01\xffnot avro at all \xfe\x80 " + tag.encode(),
                    ),
                    # keyed: a keyless record is refused before it is decoded
                    (f"garbage-2-{tag}".encode(), b"\xc3\x01" + bytes(range(256)) + tag.encode()),
                ],
            )
        )
        missing = wait_for_tokens(url, refs, PIPELINE_TIMEOUT_S, worker)
        assert not missing, f"never reached Redis: {sorted(missing)}\n{worker.describe()}"
        seen = _wait_for_dead_letters(url, len(garbage), PIPELINE_TIMEOUT_S)
        assert seen == len(garbage), f"{seen} dead letters counted\n{worker.describe()}"
        assert_stopped_cleanly(worker)

        letter = decode_dead_letter(
            asyncio.run(_resend_first_dead_letter(bootstrap_servers, f"{namespace}.deadletter"))
        )
        resent = (letter.topic, letter.partition, letter.offset)
        yield Run(namespace, env, url, refs, garbage, resent)
    finally:
        worker.kill()
        with contextlib.suppress(Exception):
            client.flushdb()
        client.close()
        topics = [
            f"{namespace}.{name}"
            for name in ("raw.sse", "raw.engine", "chunks", "tokens", "billing", "deadletter")
        ]
        with contextlib.suppress(Exception):
            asyncio.run(_delete_topics(bootstrap_servers, topics))


# --------------------------------------------------------------------------- deadletter


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def test_deadletter_json_lists_exactly_the_garbage_with_its_bytes(run: Run) -> None:
    code, out, err = run.streamtally("deadletter", "--json")
    assert code == 0, err
    letters = [json.loads(line) for line in out.decode().splitlines()]
    got = {(d["topic"], d["partition"], d["offset"], d["key"], d["value"]) for d in letters}
    want = {
        (run.topic("raw.sse"), g.partition, g.offset, _b64(g.key), _b64(g.value))
        for g in run.garbage
    }
    assert got == want
    assert len(letters) == len(run.garbage)  # the re-sent copy is not a second letter
    for letter in letters:
        assert letter["error_type"] == "AvroDecodeError"
        assert letter["reason"]
        assert letter["value_size"] == len(base64.b64decode(letter["value"]))
        position = (letter["topic"], letter["partition"], letter["offset"])
        assert letter["copies"] == (2 if position == run.resent else 1)


def test_deadletter_summary_and_table(run: Run) -> None:
    code, out, err = run.streamtally("deadletter", "--json", "--summary")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["topic"] == run.topic("deadletter")
    assert (summary["total"], summary["duplicates_dropped"]) == (2, 1)
    # one message with a bad marker, one with the marker but an unknown schema fingerprint
    reasons = sorted((r["count"], r["error_type"], r["reason"]) for r in summary["by_reason"])
    assert [(count, kind) for count, kind, _ in reasons] == [(1, "AvroDecodeError")] * 2
    assert "bad marker 01ff" in reasons[0][2]
    assert "unknown writer schema fingerprint 0001020304050607" in reasons[1][2]

    code, out, err = run.streamtally("deadletter", "--limit", "1")
    assert code == 0, err
    text = out.decode()
    assert f"2 dead letters on {run.topic('deadletter')} (1 re-sent copy)" in text
    assert "AvroDecodeError" in text
    # --limit 1: the last dead letter only (which garbage message that is depends on the worker)
    listed = [g for g in run.garbage if f"{run.topic('raw.sse')}:{g.partition}:{g.offset} " in text]
    assert len(listed) == 1, text
    assert "last 1:" in text


def test_deadletter_says_in_one_line_when_kafka_is_unreachable(run: Run) -> None:
    code, out, err = run.streamtally("deadletter", "--bootstrap-servers", "127.0.0.1:1")
    assert code == 2
    assert out == b""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "cannot reach Kafka at 127.0.0.1:1" in lines[0]
    assert "streamtally stack up" in lines[0]


# --------------------------------------------------------------------------- rebuild


def _snapshot(url: str) -> dict[str, Any]:
    """Every key of the database with its type and value."""
    client = redis.Redis.from_url(url, socket_connect_timeout=5, decode_responses=True)
    try:
        out: dict[str, Any] = {}
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            if kind == "string":
                out[key] = client.get(key)
            elif kind == "hash":
                out[key] = client.hgetall(key)
            elif kind == "set":
                out[key] = sorted(client.smembers(key))
            else:
                raise AssertionError(f"unexpected {kind!r} {key!r}")
        return out
    finally:
        client.close()


def _ttls(url: str, keys: list[str]) -> list[int]:
    """The TTL of each key (-1: none, -2: absent)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        return [client.ttl(key) for key in keys]
    finally:
        client.close()


def _kind(key: str) -> str:
    """Which layout-3 key `key` is: "closed", "stats", "dead", or "other"."""
    tail = key.split("}:", 1)[1] if key.startswith(PREFIX + "{") else ""
    if tail.startswith("closed:"):
        return "closed"
    if tail == "stats":
        return "stats"
    if tail.startswith("dead:"):
        return "dead"
    return "other"


def _read_state(run: Run) -> tuple[bytes, dict[RequestRef, bytes]]:
    """`streamtally usage --json` and `tokens get` of every request: what a user sees."""
    usage = cli("usage", "--json", "--redis-url", run.redis_url)
    assert usage.code == 0, usage.err
    tokens: dict[RequestRef, bytes] = {}
    for ref in run.refs:
        got = cli(
            "tokens", "get", ref.request_id, "--tenant", ref.tenant, "--redis-url", run.redis_url
        )
        assert got.code == 0, got.err
        tokens[ref] = got.out
    return usage.out, tokens


def _flush(url: str) -> None:
    """Empty this module's own Redis database."""
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()


def _rebuild(run: Run, *args: str) -> dict[str, Any]:
    code, out, err = run.streamtally("rebuild", "--json", *args)
    assert code == 0, err
    summary: dict[str, Any] = json.loads(out)
    return summary


def test_rebuild_restores_usage_and_tokens_and_is_idempotent(run: Run) -> None:
    usage, tokens = _read_state(run)
    rows = json.loads(usage)
    assert sum(row["requests"] for row in rows) == len(run.refs)
    # a subprocess prints the same bytes as the in-process command
    first_ref = run.refs[0]
    code, out, err = run.streamtally("tokens", "get", first_ref.request_id)
    assert (code, out) == (0, tokens[first_ref]), err
    before = _snapshot(run.redis_url)
    assert before[LAYOUT_KEY] == "3"
    assert all(before[guard_key(shard)] == "3" for shard in range(SHARDS))
    assert {tokens_key(ref) for ref in run.refs} <= before.keys()
    # the worker's close markers and dead-letter marks, each at its own key
    closed = {key for key in before if _kind(key) == "closed"}
    assert closed == {closed_key(ref) for ref in run.refs}
    # "offset reason last-receive-µs" (the last field: when a later call of the id is new)
    assert all(re.fullmatch(r"\d+ [a-z_]+ \d+", before[key]) for key in closed), closed
    raw_sse = run.topic("raw.sse")
    dead = {dead_key(position_of(raw_sse, g.partition, g.offset)) for g in run.garbage}
    assert {key for key in before if _kind(key) == "dead"} == dead
    assert all(before[key] == "1" for key in dead)
    # the worker's state TTL (the default, 8 days) on Tokens, markers and marks; none on rows
    stateful = sorted({tokens_key(ref) for ref in run.refs} | closed | dead)
    assert all(0 < ttl <= DEFAULT_STATE_TTL_S for ttl in _ttls(run.redis_url, stateful))
    rows = sorted(key for key in before if ":usage:" in key)
    assert rows
    assert set(_ttls(run.redis_url, rows)) == {-1}

    # Redis holds Tokens: refused without --yes, and nothing written
    code, out, err = run.streamtally("rebuild")
    assert code == 1
    assert f"Tokens of {len(run.refs)} requests" in err
    assert "--yes" in err
    assert _snapshot(run.redis_url) == before

    # Redis of layout version 1 (Tokens keyed by request id alone, no st:layout): refused
    _flush(run.redis_url)
    client = redis.Redis.from_url(run.redis_url, socket_connect_timeout=5)
    try:
        client.set(V1_TOKENS_PREFIX + first_ref.request_id, tokens[first_ref].strip())
    finally:
        client.close()
    v1 = _snapshot(run.redis_url)
    code, out, err = run.streamtally("rebuild", "--yes")
    assert (code, out) == (2, b""), err
    assert len(err.strip().splitlines()) == 1, err
    assert "layout version 1" in err
    assert "streamtally migrate" in err
    assert _snapshot(run.redis_url) == v1

    _flush(run.redis_url)
    emptied = cli("usage", "--json", "--redis-url", run.redis_url)
    assert (emptied.code, json.loads(emptied.out)) == (0, [])
    assert cli("tokens", "get", first_ref.request_id, "--redis-url", run.redis_url).code == 2

    first = _rebuild(run, "--yes", "--batch-size", "5", "--progress-every", "4")
    assert first["applied"] == len(run.refs)
    assert first["already_present"] == 0
    assert first["skipped"] == []
    assert _read_state(run) == (usage, tokens)

    rebuilt = _snapshot(run.redis_url)
    # the dead-letter marks are raw-record state, not restorable: gone
    assert {k: v for k, v in rebuilt.items() if _kind(k) == "other"} == {
        k: v for k, v in before.items() if _kind(k) == "other"
    }
    assert [k for k in rebuilt if _kind(k) == "dead"] == []
    assert {k: v for k, v in rebuilt.items() if _kind(k) == "closed"} == dict.fromkeys(
        closed, "0 end"
    )
    # each shard counts the requests it holds; the raw-record counts are not restorable
    per_shard = [sum(shard_of(ref) == shard for ref in run.refs) for shard in range(SHARDS)]
    assert {k: v for k, v in rebuilt.items() if _kind(k) == "stats"} == {
        stats_key(shard): {"requests": str(n), "records": "0", "duplicates": "0"}
        for shard, n in enumerate(per_shard)
        if n
    }
    assert sum(per_shard) == len(run.refs)

    second = _rebuild(run, "--yes")
    assert (second["applied"], second["already_present"]) == (0, len(run.refs))
    assert second["skipped"] == []
    assert _snapshot(run.redis_url) == rebuilt
    assert _read_state(run) == (usage, tokens)


def test_rebuild_progress_is_reported_on_stderr(run: Run) -> None:
    code, out, err = run.streamtally(
        "rebuild", "--yes", "--batch-size", "2", "--progress-every", "2"
    )
    assert code == 0, err
    total = len(run.refs)
    progress = [line for line in err.splitlines() if "requests (" in line]
    assert progress, err
    assert progress[-1].startswith(f"streamtally rebuild: {total}/{total} requests (0 applied")
    assert f"0 applied, {total} already present, 0 skipped" in out.decode()
    assert "not restored" in out.decode()


async def _billing(servers: str, topic: str) -> list[tuple[int, int, BillingEvent]]:
    out = []
    async with contextlib.aclosing(read_topic(servers, topic)) as records:
        async for record in records:
            assert record.value is not None
            out.append((record.partition, record.offset, decode_billing_event(record.value)))
    return out


async def _produce(servers: str, topic: str, key: bytes, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


def test_rebuild_takes_the_bills_as_corrected(run: Run) -> None:
    """A request billed twice under two event ids is skipped by a rebuild (which bill is
    right?); once a correction (``audit --correct``: the second bill is unexpected, withdrawn)
    supersedes the forged one, the rebuild restores the request, as a billing consumer
    would apply it."""
    usage, tokens = _read_state(run)
    servers = run.env["KAFKA_BOOTSTRAP_SERVERS"]
    billing = asyncio.run(_billing(servers, run.topic("billing")))
    true = next(e for _, _, e in billing if RequestRef(e.tenant, e.request_id) == run.refs[0])
    ref = RequestRef(true.tenant, true.request_id)
    forged = dataclasses.replace(true, event_id="f" * 32, output_tokens=true.output_tokens + 7)
    asyncio.run(
        _produce(servers, run.topic("billing"), output_key(ref), encode_billing_event(forged))
    )
    _flush(run.redis_url)
    conflicted = _rebuild(run, "--yes")
    assert [(s["tenant"], s["request_id"]) for s in conflicted["skipped"]] == [
        (ref.tenant, ref.request_id)
    ]
    assert conflicted["applied"] == len(run.refs) - 1

    # the billing topic's end offsets now: the correction supersedes below them
    ends = {p: o + 1 for p, o, _ in asyncio.run(_billing(servers, run.topic("billing")))}
    correction = BillingCorrection(
        correction_id="a" * 32,
        audit_id="b" * 32,
        reason="unexpected_billing",
        field="cost",
        tenant=forged.tenant,
        request_id=forged.request_id,
        model=forged.model,
        superseded_event_id=forged.event_id,
        billing_before=ends,
        corrected=None,
        created_at=datetime.now(UTC),
    )
    asyncio.run(
        _produce(
            servers,
            run.topic("billing.corrections"),
            output_key(ref),
            encode_billing_correction(correction),
        )
    )
    _flush(run.redis_url)
    corrected = _rebuild(run, "--yes")
    assert corrected["skipped"] == []
    assert corrected["applied"] == len(run.refs)
    assert (corrected["corrections"], corrected["billing_superseded"]) == (1, 1)
    assert _read_state(run) == (usage, tokens)
