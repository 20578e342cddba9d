"""`streamtally audit` against the real broker and Redis, with a real worker.

Its own topic namespace (``audit-<hex>``) and Redis database (leased, `module_db`),
emptied before and after.  The module's traffic: every sample (44 requests, three tenants),
a request with no end marker (the worker closes it by timeout, 20 s), one with a re-sent
record, one whose records straddle a moment `T`, and three more requests after `T`.  Once
every request is in Redis and the processors have committed everything:

- the whole audit is clean, its counts are what was produced, and the selections
  (``--tenant``, ``--since`` / ``--until`` around `T`, whole days) cover what they say;
- then one tampering at a time, each of another tenant, and after each the audit reports
  exactly the discrepancies so far: a usage row changed with HINCRBY, a forged billing
  event for a request that never existed, a second, different billing event for an
  existing request, and a request billed with altered usage and a `raw_sha256` that is
  not of its raw records (the worker stopped, the request's outputs written as a worker
  would, its billing event altered, then a new worker started, which finds the request
  closed and skips it): a ``usage_mismatch`` and a ``provenance_mismatch``.
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import DefaultPartitioner

from streamtally.audit import (
    AuditOptions,
    Share,
    audit_corrections,
    merge_parts,
    run_share,
    take_plan,
)
from streamtally.audit._corrections import CorrectionPlan
from streamtally.billing.corrections import CorrectionLog
from streamtally.billing.events import event_id
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source
from streamtally.processors.requests import Position, RequestProcessor
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.store import SHARDS, RedisBatch, RedisStore, usage_key
from streamtally.topics import Topics, encode_key, output_key
from streamtally.wire import avro
from streamtally.wire.kafka import ensure_topics, idempotent_producer, read_topic
from streamtally.wire.records import BillingEvent
from tests.integration.isolation import db_url
from tests.integration.worker import REQUEST_TIMEOUT_S, SAMPLES, WorkerProcess, cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

#: Seconds the worker gets to put every request into Redis (one closes by timeout).
SETTLE_S = 120.0
#: Requests produced after `T`.
LATE = ("openai/text_usage.sse", "anthropic/text_end_turn.sse", "gemini/thoughts_cached.sse")


@dataclass(frozen=True, slots=True)
class Sent:
    ref: RequestRef
    source: Source
    path: Path
    model: str | None = None


@dataclass
class Scene:
    tag: str
    env: dict[str, str]
    log_dir: Path
    worker: WorkerProcess
    topics: Topics
    servers: str
    url: str
    #: Received before T (the samples, the timed-out one, the one with a re-sent record).
    early: list[Sent] = field(default_factory=list)
    straddler: Sent | None = None
    late: list[Sent] = field(default_factory=list)
    t: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def everything(self) -> list[Sent]:
        assert self.straddler is not None
        return [*self.early, self.straddler, *self.late]

    def tenant(self, name: str) -> str:
        return f"{name}-{self.tag}"


def _flush(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _records(sent: Sent, clock: Any = None) -> list[bytes]:
    options: dict[str, Any] = {} if clock is None else {"clock": clock}
    _, records = raw_records(
        sent.source,
        sent.path.read_bytes(),
        tenant=sent.ref.tenant,
        request_id=sent.ref.request_id,
        model=sent.model,
        **options,
    )
    return records


async def _send(servers: str, namespace: str, batches: list[tuple[Sent, list[bytes]]]) -> None:
    async with RawProducer(servers, namespace=namespace) as producer:
        for sent, records in batches:
            await producer.send_records(sent.source, sent.ref.request_id, records)


def _samples(scene: Scene) -> list[Sent]:
    out = []
    for line in (SAMPLES / "manifest.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            ref = RequestRef(scene.tenant(row["tenant"]), f"{row['request_id']}-{scene.tag}")
            out.append(Sent(ref, Source(row["source"]), SAMPLES / row["file"], row.get("model")))
    return out


def _produce(scene: Scene) -> None:
    ns, servers = scene.topics.namespace, scene.servers
    samples = _samples(scene)
    quiet = Sent(
        RequestRef(scene.tenant("acme"), f"quiet-{scene.tag}"),
        Source.ANTHROPIC,
        SAMPLES / "anthropic" / "text_end_turn.sse",
    )
    resent = Sent(
        RequestRef(scene.tenant("globex"), f"resent-{scene.tag}"),
        Source.OPENAI,
        SAMPLES / "openai" / "text_usage.sse",
    )
    resent_records = _records(resent)
    batches = [(s, _records(s)) for s in samples]
    batches.append((quiet, _records(quiet)[:-1]))  # no end marker: closed by timeout
    batches.append((resent, [*resent_records[:2], resent_records[1], *resent_records[2:]]))
    asyncio.run(_send(servers, ns, batches))
    scene.early = [*samples, quiet, resent]
    # The straddler: its first events received before T, the rest after.
    scene.t = datetime.now(UTC) + timedelta(seconds=1)
    after = scene.t + timedelta(seconds=1)
    straddler = Sent(
        RequestRef(scene.tenant("initech"), f"straddler-{scene.tag}"),
        Source.OPENAI,
        SAMPLES / "openai" / "text_usage.sse",
    )
    calls = iter(range(10_000))
    records = _records(straddler, clock=lambda: datetime.now(UTC) if next(calls) < 2 else after)
    asyncio.run(_send(servers, ns, [(straddler, records[:2])]))
    time.sleep(max(0.0, (after - datetime.now(UTC)).total_seconds()) + 0.5)
    asyncio.run(_send(servers, ns, [(straddler, records[2:])]))
    scene.straddler = straddler
    scene.late = [
        Sent(
            RequestRef(scene.tenant("acme"), f"late-{i}-{scene.tag}"),
            Source(path.split("/")[0]),
            SAMPLES / path,
        )
        for i, path in enumerate(LATE)
    ]
    asyncio.run(_send(servers, ns, [(s, _records(s)) for s in scene.late]))


async def _settled(scene: Scene, timeout: float) -> None:
    """Every request's Tokens in Redis, and every raw record committed by the processors."""
    store = RedisStore.from_url(scene.url, connect_timeout=5)
    admin = AIOKafkaAdminClient(bootstrap_servers=scene.servers)
    consumer = AIOKafkaConsumer(bootstrap_servers=scene.servers)
    await admin.start()
    await consumer.start()
    deadline = time.monotonic() + timeout
    try:
        refs = [s.ref for s in scene.everything]
        tps = [TopicPartition(t.name, p) for t in scene.topics.raw for p in range(t.partitions)]
        while True:
            missing = await store.missing_tokens(refs)
            ends = await consumer.end_offsets(tps)
            committed = await admin.list_consumer_group_offsets(scene.topics.processors_group)
            behind = [
                tp
                for tp in tps
                if ends[tp] and (committed.get(tp) is None or committed[tp].offset < ends[tp])
            ]
            if not missing and not behind:
                return
            assert time.monotonic() < deadline, (
                f"not settled: {len(missing)} requests missing, {behind} behind\n"
                f"{scene.worker.describe()}"
            )
            await asyncio.sleep(0.5)
    finally:
        await consumer.stop()
        await admin.close()
        await store.aclose()


@pytest.fixture(scope="module")
def scene(
    stack_endpoints: Any, module_db: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scene]:
    tag = uuid.uuid4().hex[:8]
    namespace = f"audit-{tag}"
    url = db_url(stack_endpoints.redis_url, module_db)
    servers = stack_endpoints.bootstrap_servers
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": servers,
        "REDIS_URL": url,
        "STREAMTALLY_NAMESPACE": namespace,
        "STREAMTALLY_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S),
    }
    topics = Topics.in_namespace(namespace)
    _flush(url)
    asyncio.run(ensure_topics(servers, topics.all))
    log_dir = tmp_path_factory.mktemp("audit")
    worker = WorkerProcess(log_dir / "worker-1.log", env).start()
    scene = Scene(tag, env, log_dir, worker, topics, servers, url)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)  # what the in-process `streamtally audit` reads
            worker.wait_until_ready(60)
            _produce(scene)
            asyncio.run(_settled(scene, SETTLE_S))
            yield scene
    finally:
        scene.worker.stop(timeout=30)
        _flush(url)


def audit(*args: str) -> tuple[int, dict[str, Any]]:
    result = cli("audit", "--json", *args)
    assert result.code in (0, 1), result.err
    assert "\r" not in result.err  # no progress line under --json
    return result.code, json.loads(result.out)


def split_matches_one(tmp_path: Path, *args: str, shares: tuple[str, ...] = ()) -> dict[str, Any]:
    """One snapshot audited as share 0/1 and as shares 0/2 and 1/2: the merged reports are
    the same bytes (JSON and CSV); and ``audit --workers 2`` (its own snapshot) reports what
    ``audit`` does but for the time each snapshot was taken.  `args` select (snapshot),
    `shares` go to every share and merge (``--prices``).  Returns the report."""
    snap = tmp_path / "snapshot.json"
    assert cli("audit", "snapshot", "--out", str(snap), *args).code == 0
    parts: dict[str, Path] = {}
    for share in ("0/1", "0/2", "1/2"):
        parts[share] = tmp_path / f"part-{share.replace('/', '-')}.json"
        done = cli(
            "audit",
            "run",
            "--snapshot",
            str(snap),
            "--share",
            share,
            "--out",
            str(parts[share]),
            *shares,
        )
        assert done.code == 0, done.err
    halves = [json.loads(parts[s].read_text())["raw_records"]["read"] for s in ("0/2", "1/2")]
    assert all(halves), halves  # each share replayed records of its own
    outputs = {}
    for name, names in (("one", ["0/1"]), ("two", ["1/2", "0/2"])):
        merged = cli(
            "audit",
            "merge",
            "--snapshot",
            str(snap),
            "--json",
            *(str(parts[s]) for s in names),
            *shares,
        )
        csv_out = tmp_path / f"{name}.csv"
        cli(
            "audit",
            "merge",
            "--snapshot",
            str(snap),
            "--out",
            str(csv_out),
            *(str(parts[s]) for s in names),
            *shares,
        )
        outputs[name] = (merged.code, merged.out, csv_out.read_bytes())
    assert outputs["two"] == outputs["one"]
    code, one = audit(*args, *shares)
    workers = cli("audit", "--json", "--workers", "2", *args, *shares)
    assert workers.code == code, workers.err
    two = json.loads(workers.out)
    for report in (one, two):
        del report["snapshot"]["taken_at"]
    assert two == one
    return json.loads(outputs["one"][1])


def _found(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    keys = ("kind", "request_id", "tenant", "model", "day", "field", "expected", "found")
    return sorted((tuple(d[k] for k in keys) for d in report["discrepancies"]), key=json.dumps)


def _rows(url: str, tenant: str | None = None) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        store = RedisStore.from_url(url, connect_timeout=5)
        try:
            return await store.usage_rows(tenant=tenant)
        finally:
            await store.aclose()

    return asyncio.run(read())


# --------------------------------------------------------------------------- clean


def test_a_clean_run_reports_no_discrepancy(scene: Scene, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code, report = audit("--out", str(out))
    assert code == 0, _found(report)
    assert split_matches_one(tmp_path)["discrepancies"] == []
    everything = scene.everything
    assert report["discrepancies"] == []
    r = report["requests"]
    assert r == {
        "replayed": len(everything),
        "amended": 0,
        "billed": len(everything),
        "matched": len(everything),
        "mismatched": 0,
        "missing_billing": 0,
        "unexpected_billing": 0,
        "conflicting_billing": 0,
        "partial": 0,
        "dead_lettered": 0,
    }
    rows = _rows(scene.url)
    assert report["usage_rows"] == {
        "checked": len(rows),
        "matched": len(rows),
        "mismatched": 0,
        "skipped": 0,
    }
    # Per tenant, the requests produced (not from Redis: from what this test sent).
    produced: dict[str, int] = {}
    for sent in everything:
        produced[sent.ref.tenant] = produced.get(sent.ref.tenant, 0) + 1
    assert {t: v["requests"] for t, v in report["totals"].items()} == produced
    for tenant, totals in report["totals"].items():
        mine = [row for row in rows if row["tenant"] == tenant]
        assert totals["output_tokens"] == sum(row["output_tokens"] for row in mine)
        assert Decimal(totals["cost"]) == sum(Decimal(row["cost"]) for row in mine)
    # The snapshot names what was read: every raw partition from 0 to its end.
    snap = report["snapshot"]
    for topic in scene.topics.raw:
        spans = snap["topics"][topic.name]
        assert sorted(spans) == [str(p) for p in range(topic.partitions)]
        assert all(s["start"] == 0 for s in spans.values())
    read = sum(s["end"] for t in scene.topics.raw for s in snap["topics"][t.name].values())
    assert snap["raw_records"]["read"] == read
    assert snap["raw_records"]["duplicates"] == 1  # the re-sent record
    assert json.loads(out.read_text()) == report


def test_the_text_output_is_a_summary(scene: Scene) -> None:
    result = cli("audit")
    assert result.code == 0, result.err
    text = result.out.decode()
    assert f"{len(scene.everything)} replayed" in text
    assert text.endswith("no discrepancies\n")


def test_prices_re_rate_each_request_at_its_receive_time(scene: Scene, tmp_path: Path) -> None:
    """A history whose second version (every rate doubled) starts at T: requests received
    before T re-rate at what they were billed, those after at twice that."""
    packaged = json.loads(
        (Path(__file__).parents[2] / "streamtally" / "billing" / "prices.json").read_text()
    )

    def doubled(entry: dict[str, str | None]) -> dict[str, str | None]:
        return {k: None if v is None else str(Decimal(v) * 2) for k, v in entry.items()}

    history = {
        "currency": packaged["currency"],
        "versions": [
            {"version": "as-billed", "unit": packaged["unit"], "models": packaged["models"]},
            {
                "version": "doubled",
                "effective_from": scene.t.isoformat(),
                "unit": packaged["unit"],
                "models": {name: doubled(e) for name, e in packaged["models"].items()},
            },
        ],
    }
    path = tmp_path / "doubled.json"
    path.write_text(json.dumps(history))
    acme = scene.tenant("acme")
    code, report = audit("--prices", str(path))
    assert code == 0, _found(report)
    rerating = report["rerating"]
    assert rerating["prices"] == str(path)
    tenants = rerating["tenants"]
    assert {t: v["requests"] for t, v in tenants.items()} == {
        t: v["requests"] for t, v in report["totals"].items()
    }
    for tenant, row in tenants.items():
        assert row["billed"] == report["totals"][tenant]["cost"]
        assert Decimal(row["difference"]) == Decimal(row["rerated"]) - Decimal(row["billed"])
    globex = tenants[scene.tenant("globex")]  # every request received before T
    assert globex["rerated"] == globex["billed"]
    assert globex["difference"] == "0.000000000000"
    # Split: each share re-rates its requests, the sums added up (--workers 2, and
    # audit run / merge --prices): the one process's report.
    split = split_matches_one(tmp_path, shares=("--prices", str(path)))
    assert split["rerating"] == rerating
    # acme's requests received after T are the late ones: the difference is their cost.
    _, late = audit("--since", scene.t.isoformat(), "--tenant", acme)
    assert late["requests"]["replayed"] == len(scene.late)
    assert tenants[acme]["difference"] == late["totals"][acme]["cost"]
    assert Decimal(late["totals"][acme]["cost"]) > 0
    assert late["rerating"] is None


def test_selections_cover_what_they_say(scene: Scene) -> None:
    acme = scene.tenant("acme")
    code, report = audit("--tenant", acme)
    assert code == 0, _found(report)
    mine = [s for s in scene.everything if s.ref.tenant == acme]
    assert report["requests"]["replayed"] == report["requests"]["matched"] == len(mine)
    assert report["requests"]["billed"] == len(mine)
    assert list(report["totals"]) == [acme]
    assert report["usage_rows"]["checked"] == len(_rows(scene.url, acme)) > 0

    two = ("--tenant", acme, "--tenant", scene.tenant("globex"))
    assert audit(*two)[1]["requests"]["replayed"] == len(
        [s for s in scene.everything if s.ref.tenant in {acme, scene.tenant("globex")}]
    )

    since = scene.t.isoformat().replace("+00:00", "Z")
    code, report = audit("--since", since)
    assert code == 0, _found(report)
    r = report["requests"]
    assert (r["replayed"], r["matched"], r["partial"]) == (len(scene.late), len(scene.late), 1)
    assert (r["missing_billing"], r["unexpected_billing"]) == (0, 0)
    assert report["snapshot"]["partial"] == {"straddles the start": 1}
    assert report["usage_rows"]["checked"] == 0  # no whole day after T

    code, report = audit("--until", since)
    assert code == 0, _found(report)
    r = report["requests"]
    assert (r["replayed"], r["matched"], r["partial"]) == (len(scene.early), len(scene.early), 1)
    assert report["snapshot"]["partial"] == {"open at the snapshot": 1}
    assert report["usage_rows"]["checked"] == 0

    today = datetime.now(UTC).date()
    code, report = audit("--since", today.isoformat())
    assert code == 0, _found(report)
    assert report["requests"]["matched"] == len(scene.everything)
    assert report["usage_rows"]["checked"] == len(_rows(scene.url))

    code, report = audit("--since", (today + timedelta(days=1)).isoformat())
    assert code == 0
    assert report["requests"]["replayed"] == report["requests"]["billed"] == 0


# --------------------------------------------------------------------------- tampering


async def _produce_billing(scene: Scene, event: BillingEvent) -> None:
    producer = idempotent_producer(scene.servers)
    await producer.start()
    try:
        partition = DefaultPartitioner()(
            encode_key(event.request_id),
            list(range(scene.topics.billing.partitions)),
            list(range(scene.topics.billing.partitions)),
        )
        ref = RequestRef(event.tenant, event.request_id)
        await producer.send_and_wait(
            scene.topics.billing.name,
            avro.encode_billing_event(event),
            key=output_key(ref),
            partition=partition,
        )
    finally:
        await producer.stop()


async def _billing_of(scene: Scene, ref: RequestRef) -> BillingEvent:
    async for record in read_topic(scene.servers, scene.topics.billing.name):
        assert record.value is not None
        event = avro.decode_billing_event(record.value)
        if (event.tenant, event.request_id) == ref:
            return event
    raise AssertionError(f"no billing event for {ref}")


#: The `raw_sha256` of the tampered bill of step 4.
TAMPERED_SHA256 = "0" * 64


async def _bill_behind_the_workers_back(scene: Scene, sent: Sent) -> BillingEvent:
    """Produce `sent` while no worker runs, write its outputs as a worker does (Tokens, row,
    close marker), but bill it with altered usage; return the true billing event."""
    await _send(scene.servers, scene.topics.namespace, [(sent, _records(sent))])
    processor = RequestProcessor(PriceTable.default(), timeout=REQUEST_TIMEOUT_S)
    completed = []
    async for record in read_topic(scene.servers, scene.topics.raw_sse.name):
        if record.key == sent.ref.request_id.encode():
            position = Position(
                record.topic, record.partition, record.offset, record.timestamp_ms / 1000
            )
            completed += processor.handle_sse(record.key, record.value, position).completed
    assert len(completed) == 1
    done = completed[0]
    store = RedisStore.from_url(scene.url, connect_timeout=5)
    try:
        sink = RedisBatch(store)
        sink.add(done.tokens, done.billing, closed=done.closed.marker(), records=done.records)
        assert await sink.flush() == [True]
    finally:
        await store.aclose()
    # Altered usage, and a hash that is not of the raw records the request was folded from.
    altered = dataclasses.replace(
        done.billing, input_tokens=done.billing.input_tokens + 100, raw_sha256=TAMPERED_SHA256
    )
    await _produce_billing(scene, altered)
    return done.billing


def test_each_tampering_is_reported_exactly(scene: Scene, tmp_path: Path) -> None:
    expected: list[tuple[Any, ...]] = []

    steps = iter(range(100))

    def check(**counts: int) -> dict[str, Any]:
        code, report = audit()
        assert code == 1
        assert _found(report) == sorted(expected, key=json.dumps)
        step = tmp_path / f"split-{next(steps)}"
        step.mkdir()
        assert _found(split_matches_one(step)) == _found(report)
        for name, value in counts.items():
            assert report["requests"][name] == value, name
        return report

    # 1. A usage row changed with HINCRBY.
    row = _rows(scene.url, scene.tenant("acme"))[0]
    client = redis.Redis.from_url(scene.url)
    try:
        # the row is the sum of its parts, one per shard holding its requests: change one
        day, tenant, model = row["day"], row["tenant"], row["model"]
        parts = [usage_key(shard, day, tenant, model) for shard in range(SHARDS)]
        client.hincrby(next(key for key in parts if client.exists(key)), "output_tokens", 5)
    finally:
        client.close()
    out = row["output_tokens"]
    expected.append(
        (
            "usage_row_mismatch",
            None,
            row["tenant"],
            row["model"],
            row["day"],
            "output_tokens",
            out,
            out + 5,
        )
    )
    report = check(matched=len(scene.everything))
    assert report["usage_rows"]["mismatched"] == 1

    # 2. A billing event for a request that never existed.
    forged_tenant = scene.tenant("globex")
    forged = BillingEvent(
        event_id=event_id(forged_tenant, f"forged-{scene.tag}"),
        request_id=f"forged-{scene.tag}",
        tenant=forged_tenant,
        model="gpt-4.1-mini",
        source=Source.OPENAI,
        finish_reason=FinishReason.STOP,
        input_tokens=10,
        output_tokens=20,
        cost=Decimal("0.000123000000"),
        price_table_version="forged",
        event_time=datetime.now(UTC),
    )
    asyncio.run(_produce_billing(scene, forged))
    expected.append(
        (
            "unexpected_billing",
            forged.request_id,
            forged_tenant,
            "gpt-4.1-mini",
            None,
            "cost",
            None,
            "0.000123000000",
        )
    )
    check(unexpected_billing=1, billed=len(scene.everything) + 1)

    # 3. A second, different billing event for an existing request.
    victim = next(s for s in scene.early if s.ref.tenant == scene.tenant("initech"))
    true = asyncio.run(_billing_of(scene, victim.ref))
    # What the worker wrote says what it was folded from (BillingEvent v3).
    assert true.has_provenance
    assert true.raw_topic in {scene.topics.raw_sse.name, scene.topics.raw_engine.name}
    assert true.first_offset is not None
    assert true.last_offset is not None
    assert true.first_offset <= true.last_offset
    assert true.raw_sha256 is not None
    assert len(true.raw_sha256) == 64
    asyncio.run(
        _produce_billing(scene, dataclasses.replace(true, output_tokens=true.output_tokens + 1))
    )
    expected.append(
        (
            "conflicting_billing",
            true.request_id,
            true.tenant,
            true.model,
            None,
            "output_tokens",
            true.output_tokens,
            true.output_tokens + 1,
        )
    )
    check(conflicting_billing=1, matched=len(scene.everything) - 1)

    # 4. A request billed with altered usage.
    scene.worker.stop(timeout=30)
    altered = Sent(
        RequestRef(scene.tenant("hooli"), f"altered-{scene.tag}"),
        Source.OPENAI,
        SAMPLES / "openai" / "text_usage.sse",
    )
    true = asyncio.run(_bill_behind_the_workers_back(scene, altered))
    scene.worker = WorkerProcess(scene.log_dir / "worker-2.log", scene.env).start()
    scene.worker.wait_until_ready(60)
    scene.late.append(altered)
    asyncio.run(_settled(scene, SETTLE_S))  # it skips the request: closed already
    expected.append(
        (
            "usage_mismatch",
            true.request_id,
            true.tenant,
            true.model,
            None,
            "input_tokens",
            true.input_tokens,
            true.input_tokens + 100,
        )
    )
    expected.append(
        (
            "provenance_mismatch",
            true.request_id,
            true.tenant,
            true.model,
            None,
            "raw_sha256",
            true.raw_sha256,
            TAMPERED_SHA256,
        )
    )
    report = check(mismatched=1, replayed=len(scene.everything), partial=0)
    assert report["usage_rows"]["mismatched"] == 1  # the row of step 1 only

    # Each tenant's audit holds that tenant's discrepancy alone.
    code, mine = audit("--tenant", scene.tenant("hooli"))
    assert code == 1
    assert [d["kind"] for d in mine["discrepancies"]] == ["provenance_mismatch", "usage_mismatch"]

    # The CSV of the discrepancies, and the table.
    out = tmp_path / "found.csv"
    result = cli("audit", "--out", str(out))
    assert result.code == 1
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert sorted(r["kind"] for r in rows) == sorted(e[0] for e in expected)
    by_kind = {r["kind"]: r for r in rows}
    assert by_kind["usage_mismatch"]["expected"] == str(true.input_tokens)
    assert by_kind["unexpected_billing"]["expected"] == ""
    text = result.out.decode()
    assert "5 discrepancies:" in text
    assert f"altered-{scene.tag}" in text


def test_the_audit_writes_nothing(scene: Scene) -> None:
    """No topic grows, Redis does not change and no consumer group appears."""

    async def ends() -> dict[Any, int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=scene.servers)
        await consumer.start()
        try:
            tps = [TopicPartition(t.name, p) for t in scene.topics.all for p in range(t.partitions)]
            return dict(await consumer.end_offsets(tps))
        finally:
            await consumer.stop()

    def dump() -> dict[bytes, Any]:
        client = redis.Redis.from_url(scene.url)
        try:
            return {key: client.dump(key) for key in sorted(client.scan_iter(count=1000))}
        finally:
            client.close()

    async def groups() -> tuple[set[str], dict[Any, int]]:
        """The consumer groups (others' tests add theirs) and the processors' offsets."""
        admin = AIOKafkaAdminClient(bootstrap_servers=scene.servers)
        await admin.start()
        try:
            names = {g[0] for g in await admin.list_consumer_groups()}
            offsets = await admin.list_consumer_group_offsets(scene.topics.processors_group)
            return names, {tp: m.offset for tp, m in offsets.items()}
        finally:
            await admin.close()

    before, state, known = asyncio.run(ends()), dump(), asyncio.run(groups())
    code, _ = audit()
    assert code in (0, 1)
    assert asyncio.run(ends()) == before
    assert dump() == state
    names, committed = asyncio.run(groups())
    assert committed == known[1]  # the processors' group untouched
    assert [n for n in names - known[0] if scene.tag in n or "audit" in n] == []


async def _corrections(scene: Scene) -> list[Any]:
    out = []
    async for record in read_topic(scene.servers, scene.topics.corrections.name):
        assert record.value is not None
        out.append(avro.decode_billing_correction(record.value))
    return out


async def _billing_records(scene: Scene) -> list[tuple[int, int, BillingEvent]]:
    out = []
    async for record in read_topic(scene.servers, scene.topics.billing.name):
        assert record.value is not None
        out.append((record.partition, record.offset, avro.decode_billing_event(record.value)))
    return sorted(out, key=lambda r: (r[0], r[1]))


#: The `created_at` of corrections compared (each run writes its own moment).
PLANNED_AT = datetime(2026, 11, 24, tzinfo=UTC)


async def _one_process_corrections(scene: Scene) -> CorrectionPlan:
    """What a one-process ``audit --correct`` would write now (planned, not written)."""
    settings = Settings.load()
    store = RedisStore.from_url(scene.url, connect_timeout=5)
    try:
        plan = await take_plan(settings, store, AuditOptions(), servers=scene.servers)
        done = await run_share(settings, store, plan, Share(), servers=scene.servers)
    finally:
        await store.aclose()
    merged = merge_parts([done.part])
    return audit_corrections(plan, merged, currency="USD", now=PLANNED_AT)[1]


def test_correct_writes_one_correction_per_discrepancy_and_the_next_audit_is_clean(
    scene: Scene,
) -> None:
    """After the tamperings: ``audit --workers 2 --correct`` appends the corrections one
    process would (the billing topic stays as written), once, from the merge; sets the Redis
    row right, and the audit after it is clean; a billing consumer applying the corrections
    gets the replay's totals; a second --correct (one process) writes nothing."""
    code, before = audit()
    assert code == 1
    found = before["discrepancies"]
    kinds = sorted(d["kind"] for d in found)
    assert kinds == sorted(
        [
            "usage_row_mismatch",
            "unexpected_billing",
            "conflicting_billing",
            "usage_mismatch",
            "provenance_mismatch",
        ]
    )
    billing_before = asyncio.run(_billing_records(scene))
    planned = asyncio.run(_one_process_corrections(scene))

    code, report = audit("--workers", "2", "--correct")
    assert code == 1  # there was something to correct
    assert _found(report) == _found(before)
    done = report["corrections"]
    assert done["topic"] == scene.topics.corrections.name
    assert (done["written"], done["rows_fixed"], done["rows_applied_before"]) == (len(found), 1, 0)
    # the report is the one process's (nothing has changed since), corrections aside
    for doc in (report, before):
        del doc["snapshot"]["taken_at"]
    assert {**report, "corrections": None} == before

    written = asyncio.run(_corrections(scene))
    assert len(written) == len(found)
    # written once, and what one process would have written (but for when)
    by_id = sorted(written, key=lambda c: c.correction_id)
    assert [dataclasses.replace(c, created_at=PLANNED_AT) for c in by_id] == sorted(
        planned.corrections, key=lambda c: c.correction_id
    )
    assert len(planned.row_fixes) == done["rows_fixed"]
    assert {c.audit_id for c in written} == {done["audit_id"]}
    assert sorted(c.reason for c in written) == kinds
    by_reason = {c.reason: c for c in written}
    # the forged bill is withdrawn, nothing stands for it
    void = by_reason["unexpected_billing"]
    forged = next(d for d in found if d["kind"] == "unexpected_billing")
    assert void.superseded_event_id == event_id(forged["tenant"], forged["request_id"])
    assert (void.corrected, void.requests, void.cost) == (None, 0, Decimal(0))
    # the conflicting and the altered bills are replaced by the replay's
    for reason in ("conflicting_billing", "usage_mismatch", "provenance_mismatch"):
        c = by_reason[reason]
        assert c.corrected is not None
        assert c.superseded_event_id == c.corrected.event_id
        assert (c.tenant, c.request_id) == (c.corrected.tenant, c.corrected.request_id)
        assert (c.input_tokens, c.cost) == (c.corrected.input_tokens, c.corrected.cost)
    altered = by_reason["usage_mismatch"]
    wrong = next(
        e
        for _, _, e in billing_before
        if e.event_id == altered.superseded_event_id and e.input_tokens != altered.input_tokens
    )
    assert wrong.input_tokens == altered.input_tokens + 100
    # the row: the whole row as the replay sums it, and Redis holds it again
    row = by_reason["usage_row_mismatch"]
    row_found = next(d for d in found if d["kind"] == "usage_row_mismatch")
    assert (row.request_id, row.day, row.field) == (None, row_found["day"], "output_tokens")
    assert row.output_tokens == row_found["expected"]
    [stored] = [
        r for r in _rows(scene.url, row.tenant) if (r["model"], r["day"]) == (row.model, row.day)
    ]
    assert stored["output_tokens"] == row_found["expected"]
    # nothing was rewritten: the billing topic is as it was
    assert asyncio.run(_billing_records(scene)) == billing_before

    code, after = audit()
    assert (code, after["discrepancies"]) == (0, [])
    assert after["corrections"] is None
    assert after["snapshot"]["correction_records"]["read"] == len(found)
    assert after["requests"]["unexpected_billing"] == after["requests"]["conflicting_billing"] == 0

    # A billing consumer applies the corrections to the bills it read: the replay's totals.
    log = CorrectionLog()
    for c in written:
        log.add(c)
    standing: dict[str, BillingEvent] = {}
    for partition, offset, event in billing_before:
        if not log.superseded(event, partition, offset):
            standing.setdefault(event.event_id, event)
    for bill in log.standing():
        standing[bill.event_id] = bill
    for tenant, totals in after["totals"].items():
        mine = [e for e in standing.values() if e.tenant == tenant]
        assert sum(e.input_tokens for e in mine) == totals["input_tokens"], tenant
        assert sum(e.output_tokens for e in mine) == totals["output_tokens"], tenant
        assert sum((e.cost for e in mine), Decimal(0)) == Decimal(totals["cost"]), tenant

    # Run again: nothing left to correct, nothing written.
    code, again = audit("--correct")
    assert code == 0
    assert (again["corrections"]["written"], again["corrections"]["rows_fixed"]) == (0, 0)
    assert len(asyncio.run(_corrections(scene))) == len(found)
