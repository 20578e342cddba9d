"""Late usage amends the bill (issue 24), on the real stack.

A request sends three events of one of our OpenAI transcripts, then is quiet
for twice the worker's request timeout (3 s): the worker closes it as timed
out and bills revision 0 (0 tokens, ``error``).  Then the rest of the stream
comes, its usage and END: the worker applies it to the request's fold and
bills revision 1, superseding revision 0.  Checked from the outside, with the
read commands: the billing topic holds both revisions (1 names 0's
``event_id``), the Tokens in Redis is the fold of the whole transcript, the
tenant's usage row is that fold's usage, counted once, and nothing was
dead-lettered.

The second test SIGKILLs the worker between the first bill and the
amendment: the next worker finds the amendable state in Redis (the first
one's memory is gone) and amends once; a replay of the whole partition from
offset 0 (its consumer group's offsets reset) then changes nothing: no
revision billed twice, the usage row as it was.

The third takes the amendable state away (as past the state TTL): the late
usage is dead-lettered with that reason, and the audit reports the request as
an `unbilled_amendment`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from streamtally.billing.events import event_id
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.ops.worker_process import WorkerProcess
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.store import RedisStore
from streamtally.store.layout import amend_key
from streamtally.topics import Topics
from tests.integration.worker import REPO, SAMPLES, Endpoints, as_called, cli, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FILE = SAMPLES / "openai" / "text_usage.sse"
REQUEST_TIMEOUT_S = 3.0
FIRST = 3


@pytest.fixture
def scene(stack_endpoints: Endpoints, tmp_path: Path) -> Iterator[tuple[Settings, WorkerProcess]]:
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="amend",
        log=tmp_path / "worker.log",
        request_timeout=REQUEST_TIMEOUT_S,
    ) as (settings, worker):
        yield settings, worker


def _records(tenant: str, request_id: str) -> list[bytes]:
    """The transcript's raw records, received now."""
    now = datetime.now(UTC)
    _, records = raw_records(
        Source.OPENAI, FILE.read_bytes(), tenant=tenant, request_id=request_id, clock=lambda: now
    )
    return records


def _send(settings: Settings, request_id: str, records: list[bytes]) -> None:
    async def send() -> None:
        async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as raw:
            await raw.send_records(Source.OPENAI, request_id, records)

    asyncio.run(send())


def _closed(settings: Settings, ref: RequestRef) -> tuple[str, bool] | None:
    async def read() -> tuple[str, bool] | None:
        store = RedisStore.from_url(settings.redis_url, connect_timeout=5)
        try:
            return (await store.closed_markers([ref])).get(ref)
        finally:
            await store.aclose()

    return asyncio.run(read())


def _wait_revision(
    settings: Settings, ref: RequestRef, revision: int, worker: WorkerProcess, timeout: float
) -> str:
    """Wait until revision `revision` of `ref` is applied; its close marker."""
    deadline = time.monotonic() + timeout
    while True:
        found = _closed(settings, ref)
        if found is not None and found[1]:
            fields = found[0].split(" ")
            if (int(fields[3]) if len(fields) > 3 else 0) >= revision:
                return found[0]
        assert time.monotonic() < deadline, (found, worker.describe())
        assert worker.returncode is None, worker.describe()
        time.sleep(0.2)


def _read(settings: Settings, monkeypatch: pytest.MonkeyPatch, tenant: str) -> dict[str, Any]:
    """What the read commands say of `tenant`: its bills, its usage rows, the stats."""
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", settings.namespace)
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    export = cli("billing", "export", "--json")
    assert export.code == 0, export.err
    bills = [json.loads(line) for line in export.out.decode().splitlines()]
    usage = cli("usage", "--tenant", tenant, "--json")
    assert usage.code == 0, usage.err

    async def stats() -> dict[str, int]:
        store = RedisStore.from_url(settings.redis_url, connect_timeout=5)
        try:
            return await store.stats()
        finally:
            await store.aclose()

    return {
        "bills": sorted((b for b in bills if b["tenant"] == tenant), key=lambda b: b["revision"]),
        "rows": json.loads(usage.out),
        "stats": asyncio.run(stats()),
    }


def _folded() -> dict[str, Any]:
    done = cli("fold", "--source", "openai", str(FILE))
    assert done.code == 0, done.err
    folded: dict[str, Any] = json.loads(done.out)
    assert folded["usage"]["output_tokens"] > 0
    return folded


def _check_amended(seen: dict[str, Any], tenant: str, request_id: str) -> None:
    folded = _folded()
    first, amended = seen["bills"]
    assert (first["revision"], first["supersedes"]) == (0, None)
    assert first["finish_reason"] == "error"
    assert (first["input_tokens"], first["output_tokens"]) == (0, 0)
    assert amended["revision"] == 1
    assert amended["event_id"] == event_id(tenant, request_id, 1)
    assert amended["supersedes"] == first["event_id"] == event_id(tenant, request_id)
    assert amended["finish_reason"] == "stop"
    for name in ("input_tokens", "output_tokens"):
        assert amended[name] == folded["usage"][name]
    (row,) = seen["rows"]
    assert row["requests"] == 1
    for name in ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens"):
        assert row[name] == folded["usage"][name], (name, row)
    assert seen["stats"]["dead_lettered"] == 0


def _tokens(tenant: str, request_id: str) -> dict[str, Any]:
    got = cli("tokens", "get", request_id, "--tenant", tenant)
    assert got.code == 0, got.err
    tokens: dict[str, Any] = json.loads(got.out)
    return tokens


def test_usage_after_twice_the_timeout_amends_the_bill(
    scene: tuple[Settings, WorkerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, worker = scene
    tenant, request_id = f"am-{uuid.uuid4().hex[:6]}", f"req-{uuid.uuid4().hex[:8]}"
    ref = RequestRef(tenant, request_id)
    _send(settings, request_id, _records(tenant, request_id)[:FIRST])
    _wait_revision(settings, ref, 0, worker, timeout=60)
    time.sleep(REQUEST_TIMEOUT_S)  # quiet for twice the timeout in all
    _send(settings, request_id, _records(tenant, request_id)[FIRST:])
    marker = _wait_revision(settings, ref, 1, worker, timeout=60)
    assert marker.split(" ")[1] == "end"
    seen = _read(settings, monkeypatch, tenant)
    _check_amended(seen, tenant, request_id)
    # The Tokens in Redis: the fold of the whole transcript, as if it never went quiet.
    assert _tokens(tenant, request_id) == as_called(_folded(), request_id)
    # The audit agrees, without --correct: both revisions billed, the row as it stands.
    audit = cli("audit", "--tenant", tenant, "--json")
    assert audit.code == 0, json.dumps(json.loads(audit.out), indent=1)
    report = json.loads(audit.out)
    assert (report["requests"]["replayed"], report["requests"]["amended"]) == (1, 1)
    assert report["requests"]["matched"] == 2
    assert report["usage_rows"]["matched"] == 1
    worker.check()


def _rewind_group(settings: Settings) -> None:
    """Set the worker group's committed offsets of the raw SSE topic back to 0."""
    topics = Topics.in_namespace(settings.namespace)

    async def rewind() -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.bootstrap_servers,
            group_id=topics.worker_app_id,
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            partitions = [
                TopicPartition(topics.raw_sse.name, p) for p in range(topics.raw_sse.partitions)
            ]
            consumer.assign(partitions)
            await consumer.commit({tp: OffsetAndMetadata(0, "") for tp in partitions})
        finally:
            await consumer.stop()

    asyncio.run(rewind())


def test_a_worker_killed_between_the_bill_and_its_amendment_amends_once(
    scene: tuple[Settings, WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    settings, worker = scene
    tenant, request_id = f"ak-{uuid.uuid4().hex[:6]}", f"req-{uuid.uuid4().hex[:8]}"
    ref = RequestRef(tenant, request_id)
    _send(settings, request_id, _records(tenant, request_id)[:FIRST])
    _wait_revision(settings, ref, 0, worker, timeout=60)
    worker.kill()  # SIGKILL: its memory of the request (the amendable state) is gone
    env = dict(worker.env or {})
    second = WorkerProcess(tmp_path / "second.log", env, cwd=REPO).start()
    try:
        second.wait_until_ready(60)
        time.sleep(REQUEST_TIMEOUT_S)
        _send(settings, request_id, _records(tenant, request_id)[FIRST:])
        _wait_revision(settings, ref, 1, second, timeout=60)
        seen = _read(settings, monkeypatch, tenant)
        _check_amended(seen, tenant, request_id)
        second.kill()
        # Every record of the partition read again: replays, nothing billed twice.
        _rewind_group(settings)
        third = WorkerProcess(tmp_path / "third.log", env, cwd=REPO).start()
        try:
            third.wait_until_ready(60)
            _send(settings, "marker", _records(tenant, "marker"))  # one more request
            _wait_revision(settings, RequestRef(tenant, "marker"), 0, third, timeout=60)
            again = _read(settings, monkeypatch, tenant)
            revisions = [b["revision"] for b in again["bills"] if b["request_id"] == request_id]
            assert revisions == [0, 1]  # read again, billed again: no
            (row,) = again["rows"]
            usage = _folded()["usage"]
            assert row["requests"] == 2  # the request and the marker, once each
            for name in ("input_tokens", "output_tokens"):
                assert row[name] == 2 * usage[name], (name, row)
            assert again["stats"]["dead_lettered"] == 0
            third.check()
        finally:
            third.stop(timeout=30)
    finally:
        second.kill()


def test_late_records_that_cannot_amend_are_reported_by_the_audit(
    scene: tuple[Settings, WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The request's amendable state is gone (as past the state TTL) and the worker that
    closed it restarted: its late usage is dead-lettered with that reason, and the audit,
    whose replay amends it, reports an `unbilled_amendment` (billable records, unbilled)."""
    settings, worker = scene
    tenant, request_id = f"au-{uuid.uuid4().hex[:6]}", f"req-{uuid.uuid4().hex[:8]}"
    ref = RequestRef(tenant, request_id)
    _send(settings, request_id, _records(tenant, request_id)[:FIRST])
    _wait_revision(settings, ref, 0, worker, timeout=60)
    worker.kill()

    async def expire_state() -> None:
        store = RedisStore.from_url(settings.redis_url, connect_timeout=5)
        client = aioredis.from_url(settings.redis_url)
        try:
            assert await store.amendable_states([ref]) != {}
            assert await client.delete(amend_key(ref)) == 1  # as its TTL would
            assert await store.amendable_states([ref]) == {}
        finally:
            await store.aclose()
            await client.aclose()

    asyncio.run(expire_state())
    second = WorkerProcess(tmp_path / "second.log", dict(worker.env or {}), cwd=REPO).start()
    try:
        second.wait_until_ready(60)
        rest = _records(tenant, request_id)[FIRST:]
        _send(settings, request_id, rest)
        seen = _read(settings, monkeypatch, tenant)
        deadline = time.monotonic() + 60
        while seen["stats"]["dead_lettered"] < len(rest):
            assert time.monotonic() < deadline, (seen["stats"], second.describe())
            time.sleep(0.5)
            seen = _read(settings, monkeypatch, tenant)
        assert [b["revision"] for b in seen["bills"]] == [0]
        letters = cli("deadletter", "--json")
        assert letters.code == 0, letters.err
        reasons = {json.loads(line)["reason"] for line in letters.out.decode().splitlines()}
        assert any("no longer amendable" in reason for reason in reasons), reasons
        audit = cli("audit", "--tenant", tenant, "--json")
        assert audit.code == 1, audit.out
        report = json.loads(audit.out)
        kinds = {d["kind"] for d in report["discrepancies"]}
        assert "unbilled_amendment" in kinds, report["discrepancies"]
        (unbilled,) = [d for d in report["discrepancies"] if d["kind"] == "unbilled_amendment"]
        assert unbilled["request_id"] == request_id
        second.check()
    finally:
        second.stop(timeout=30)
