"""Analytics consumers read the topics with their own tools (issue 25, items 3 and 4).

One small run of the real pipeline (a worker in a namespace and Redis database
of its own): two tenants, four requests of three sources, one of them amended
(billed at its timeout, revision 0, then again with the rest of its stream,
revision 1), a byte-identical copy of a billing record on the topic (a replay,
as an at-least-once writer leaves one), and a poison raw record (a dead
letter).  The topics are Confluent-framed, their schemas in a real registry
(the session's `schema_registry_url`: ``STREAMTALLY_SCHEMA_REGISTRY_URL``, else the stack's,
Apicurio's ``ccompat`` API as `streamtally stack up --registry` starts it).
Then:

- the official ``confluent-kafka`` client, its `SchemaRegistryClient` and
  `AvroDeserializer`, reads the billing topic equal to ``billing export --json``
  (every field, the cost an exact `Decimal`) and the Tokens topic equal to
  ``tokens get`` of each request;
- embedded ClickHouse (``chdb``) runs the DDL of docs/analytics.md as the doc
  prints it (the test reads it from there: only the broker, topic prefix,
  registry URL and consumer group names are replaced), and the usage query's rows
  equal ``streamtally usage --json`` exactly: the replay and revision 0 collapsed
  into the bill that stands; the Tokens, chunks and dead-letter tables hold
  what the pipeline wrote.

The worker runs with ``STREAMTALLY_AVRO_FRAMING=confluent``: it registers its
topics' schemas under ``<topic>-value`` and writes ``00`` + schema id + body;
the consumers read exactly what it wrote, and so do the read commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.ops.worker_process import WorkerProcess
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.wire.kafka import read_topic
from tests.integration.test_amendments import _wait_revision
from tests.integration.worker import REPO, SAMPLES, cli, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.registry, pytest.mark.timeout(300)]

DOC: Final = REPO / "docs" / "analytics.md"
#: What docs/analytics.md's ClickHouse DDL names, replaced by this run's.
DOC_BROKER, DOC_PREFIX, DOC_REGISTRY, DOC_GROUP = (
    "'127.0.0.1:9092'",
    "'streamtally.",
    "'http://127.0.0.1:8081/apis/ccompat/v7'",
    "'clickhouse-",
)
REQUEST_TIMEOUT_S: Final = 3.0
#: Records of the amended request's transcript sent before its timeout.
FIRST: Final = 3
#: (tenant index, source, transcript) of the requests, the last one amended.
REQUESTS: Final = (
    (0, Source.OPENAI, SAMPLES / "openai" / "text_usage.sse"),
    (0, Source.ANTHROPIC, SAMPLES / "anthropic" / "text_end_turn.sse"),
    (1, Source.GEMINI, SAMPLES / "gemini" / "thoughts_cached.sse"),
    (1, Source.OPENAI, SAMPLES / "openai" / "text_usage.sse"),
)
POISON: Final = b"\x01not avro at all"
#: The worker's output topics, by their name in a namespace.
OUTPUTS: Final = ("billing", "tokens", "chunks", "deadletter")


@dataclass(frozen=True)
class Run:
    settings: Settings
    worker: WorkerProcess
    refs: tuple[RequestRef, ...]
    #: The namespace of the Confluent-framed topics the consumers read.
    confluent_namespace: str
    #: Records of each Confluent-framed output topic, by its name in a namespace.
    records: dict[str, int]
    #: The schema registry's Confluent API (the session's `schema_registry_url`).
    registry: str

    @property
    def tenants(self) -> list[str]:
        return sorted({ref.tenant for ref in self.refs})

    def topic(self, name: str) -> str:
        return f"{self.confluent_namespace}.{name}"


def _send(settings: Settings, source: Source, ref: RequestRef, records: list[bytes]) -> None:
    async def send() -> None:
        async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as raw:
            await raw.send_records(source, ref.request_id, records)

    asyncio.run(send())


def _records(source: Source, path: Path, ref: RequestRef) -> list[bytes]:
    now = datetime.now(UTC)
    _, records = raw_records(
        source, path.read_bytes(), tenant=ref.tenant, request_id=ref.request_id, clock=lambda: now
    )
    return records


def _read_all(servers: str, topic: str) -> list[tuple[int, bytes | None, bytes | None]]:
    """(partition, key, value) of every record of `topic`, as written."""

    async def read() -> list[tuple[int, bytes | None, bytes | None]]:
        async with contextlib.aclosing(read_topic(servers, topic)) as records:
            return [(r.partition, r.key, r.value) async for r in records]

    return asyncio.run(read())


def _counts(settings: Settings) -> dict[str, int]:
    """Records of each output topic, checked Confluent-framed (``00`` + schema id)."""
    counts = {}
    for name in OUTPUTS:
        rows = _read_all(settings.bootstrap_servers, f"{settings.namespace}.{name}")
        assert all(value is None or value[:1] == b"\x00" for _, _, value in rows), name
        counts[name] = len(rows)
    return counts


@pytest.fixture(scope="module")
def run(
    stack_endpoints: Any, schema_registry_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    # A module fixture is made before the conftest's per-test registry hook runs: ask for
    # the session's registry here, so that the first test of a session starts it.
    tag = uuid.uuid4().hex[:6]
    tenants = (f"an-{tag}-a", f"an:{tag}%b")  # the second needs its key's escapes undone
    refs = tuple(
        RequestRef(tenants[t], f"req-{i}-{uuid.uuid4().hex[:8]}")
        for i, (t, _, _) in enumerate(REQUESTS)
    )
    with pytest.MonkeyPatch.context() as env:
        # The worker (a subprocess with this environment) writes every topic Confluent-framed.
        env.setenv("STREAMTALLY_AVRO_FRAMING", "confluent")
        env.setenv("STREAMTALLY_SCHEMA_REGISTRY_URL", schema_registry_url)
        yield from _run(stack_endpoints, schema_registry_url, tmp_path_factory, tag, refs)


def _run(
    stack_endpoints: Any,
    registry: str,
    tmp_path_factory: pytest.TempPathFactory,
    tag: str,
    refs: tuple[RequestRef, ...],
) -> Iterator[Run]:
    tenants = sorted({ref.tenant for ref in refs}, key=[r.tenant for r in refs].index)
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="analytics",
        log=tmp_path_factory.mktemp("analytics") / "worker.log",
        request_timeout=REQUEST_TIMEOUT_S,
    ) as (settings, worker):
        *plain, (_, amended_source, amended_path) = REQUESTS
        amended = refs[-1]
        late = _records(amended_source, amended_path, amended)
        _send(settings, amended_source, amended, late[:FIRST])
        for ref, (_, source, path) in zip(refs, plain, strict=False):
            _send(settings, source, ref, _records(source, path, ref))
        _send(settings, Source.OPENAI, RequestRef(tenants[0], f"poison-{tag}"), [POISON])
        for ref in refs:
            _wait_revision(settings, ref, 0, worker, timeout=60)
        time.sleep(REQUEST_TIMEOUT_S)  # quiet for twice the timeout in all
        _send(settings, amended_source, amended, late[FIRST:])
        _wait_revision(settings, amended, 1, worker, timeout=60)
        # A replay: the first billing record written once more, byte for byte.
        billing = f"{settings.namespace}.billing"
        partition, key, value = _read_all(settings.bootstrap_servers, billing)[0]
        replayer = Producer({"bootstrap.servers": settings.bootstrap_servers})
        replayer.produce(billing, key=key, value=value, partition=partition)
        assert replayer.flush(30) == 0
        deadline = time.monotonic() + 30
        while not _read_all(settings.bootstrap_servers, f"{settings.namespace}.deadletter"):
            assert time.monotonic() < deadline, worker.describe()
            time.sleep(0.2)
        worker.check()
        yield Run(settings, worker, refs, settings.namespace, _counts(settings), registry)


@pytest.fixture
def commands_env(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read commands (`cli`) read the run's topics and Redis database."""
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", run.settings.namespace)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", run.settings.bootstrap_servers)
    monkeypatch.setenv("REDIS_URL", run.settings.redis_url)
    monkeypatch.setenv("STREAMTALLY_SCHEMA_REGISTRY_URL", run.registry)


# --------------------------------------------------------------------------- confluent-kafka


def _consume(run: Run, name: str) -> list[tuple[bytes | None, dict[str, Any] | None]]:
    """(key, value as `AvroDeserializer` reads it) of every record of a topic, in offset order
    per partition: a `Consumer` assigned every partition from its beginning to its end."""
    topic = run.topic(name)
    consumer = Consumer(
        {
            "bootstrap.servers": run.settings.bootstrap_servers,
            "group.id": f"analytics-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": run.registry}))
    context = SerializationContext(topic, MessageField.VALUE)
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in partitions
        }
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        left = {p for p, end in ends.items() if end > 0}
        found: list[tuple[bytes | None, dict[str, Any] | None]] = []
        deadline = time.monotonic() + 30
        while left:
            assert time.monotonic() < deadline, f"{topic}: partitions {sorted(left)} not read"
            message = consumer.poll(1.0)
            if message is None:
                continue
            assert message.error() is None, message.error()
            value = message.value()
            found.append((message.key(), None if value is None else deserialize(value, context)))
            if message.offset() + 1 >= ends[message.partition()]:
                left.discard(message.partition())
        return found
    finally:
        consumer.close()


def _symbol(value: str) -> str:
    """An Avro enum symbol as the commands print the value (``OPENAI_RESPONSES`` ->
    ``openai-responses``, ``PROVIDER_REPORTED`` -> ``provider_reported``)."""
    return value.lower()


def _bill_json(datum: dict[str, Any]) -> dict[str, Any]:
    """A BillingEvent as AvroDeserializer gives it, in the shape of ``billing export --json``."""
    cost = datum["cost"]
    assert isinstance(cost, Decimal), cost  # the logical type read as a Decimal, not a float
    event_time = datum["event_time"]
    assert isinstance(event_time, datetime)
    assert event_time.utcoffset() is not None
    return {
        **datum,
        "source": _symbol(datum["source"]).replace("_", "-"),
        "finish_reason": _symbol(datum["finish_reason"]),
        "usage_source": _symbol(datum["usage_source"]),
        "cost": format(cost, "f"),
        "event_time": event_time.isoformat(),
    }


def _tokens_json(datum: dict[str, Any]) -> dict[str, Any]:
    """A Tokens as AvroDeserializer gives it, in the shape `tokens get` prints."""
    out = {
        **datum,
        "source": _symbol(datum["source"]).replace("_", "-"),
        "finish_reason": _symbol(datum["finish_reason"]),
        "choices": [
            {**choice, "finish_reason": _symbol(choice["finish_reason"])}
            for choice in datum["choices"]
        ],
    }
    if not out["choices"]:
        del out["choices"]
    if not out["truncated"]:
        del out["truncated"]
    if out["provider_request_id"] in (None, out["request_id"]):
        del out["provider_request_id"]
    return out


def test_confluent_kafka_reads_the_billing_and_tokens_topics_as_the_commands_print_them(
    run: Run, commands_env: None
) -> None:
    records = _consume(run, "billing")
    assert len(records) == run.records["billing"] == len(run.refs) + 2  # revision 1, a replay
    bills: dict[str, dict[str, Any]] = {}
    for _, datum in records:
        assert datum is not None
        bill = _bill_json(datum)
        assert bills.setdefault(bill["event_id"], bill) == bill  # the replay, equal
    export = cli("billing", "export", "--json")
    assert export.code == 0, export.err
    exported = [json.loads(line) for line in export.out.decode().splitlines()]
    assert sorted(bills.values(), key=lambda b: b["event_id"]) == sorted(
        exported, key=lambda b: b["event_id"]
    )
    assert {b["revision"] for b in exported} == {0, 1}
    assert any(Decimal(b["cost"]) != 0 for b in exported)

    latest: dict[bytes | None, dict[str, Any] | None] = dict(_consume(run, "tokens"))
    assert len(latest) == len(run.refs)
    for ref in run.refs:
        datum = latest[ref.text.encode()]
        assert datum is not None
        got = cli("tokens", "get", ref.request_id, "--tenant", ref.tenant)
        assert got.code == 0, got.err
        assert _tokens_json(datum) == json.loads(got.out)


# --------------------------------------------------------------------------- ClickHouse


def clickhouse_sql() -> tuple[list[str], str]:
    """docs/analytics.md's ClickHouse section: its DDL statements, and the usage query."""
    doc = DOC.read_text()
    section = re.search(r"^## ClickHouse\n(.*?)^## ", doc, re.DOTALL | re.MULTILINE)
    assert section is not None, f"{DOC} has no section ## ClickHouse"
    blocks = re.findall(r"```sql\n(.*?)```", section.group(1), re.DOTALL)
    statements = [s.strip() for b in blocks for s in re.split(r";\s*\n", b) if s.strip()]
    ddl = [s for s in statements if re.search(r"^CREATE ", s, re.MULTILINE)]
    queries = [s for s in statements if s not in ddl]
    assert len(queries) == 1, queries
    return ddl, queries[0]


def _rows(session: Any, sql: str) -> list[dict[str, Any]]:
    text = str(
        session.query(sql + " SETTINGS output_format_json_quote_decimals = 1", "JSONEachRow")
    )
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _read(session: Any) -> dict[str, int]:
    """Messages each Kafka engine table has read, by its topic's name in a namespace."""
    rows = _rows(
        session,
        "SELECT table, sum(num_messages_read) AS n FROM system.kafka_consumers GROUP BY table",
    )
    return {r["table"].removesuffix("_queue"): int(r["n"]) for r in rows}


def exact(row: dict[str, Any]) -> dict[str, Any]:
    """A usage row with its cost as a `Decimal` (ClickHouse drops trailing zeros)."""
    return {**row, "cost": Decimal(row["cost"])}


def _printed_tokens(run: Run) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(input tokens, output tokens, chunks) of each request, as `tokens get` prints them."""
    printed = {}
    for ref in run.refs:
        got = cli("tokens", "get", ref.request_id, "--tenant", ref.tenant)
        assert got.code == 0, got.err
        usage = json.loads(got.out)["usage"]
        printed[(ref.tenant, ref.request_id)] = (
            usage["input_tokens"],
            usage["output_tokens"],
            json.loads(got.out)["chunks"],
        )
    return printed


def _clickhouse_says(db: Any, usage_query: str, run: Run) -> tuple[Any, ...]:
    """The usage rows of the run's tenants, each request's (input, output, chunks) from the
    Tokens table, its rows in the chunks table, and the dead letters' values."""
    usage = [exact(r) for r in _rows(db, usage_query) if r["tenant"] in run.tenants]
    tokens = _rows(
        db,
        "SELECT tenant, request_id, usage.input_tokens AS input, usage.output_tokens AS output, "
        "chunks FROM tokens FINAL",
    )
    chunks = _rows(
        db,
        "SELECT tenant, request_id, count() AS n FROM chunks FINAL GROUP BY tenant, request_id",
    )
    per_ref = {(r["tenant"], r["request_id"]): int(r["n"]) for r in chunks}
    by_ref = {
        (r["tenant"], r["request_id"]): (int(r["input"]), int(r["output"]), int(r["chunks"]))
        for r in tokens
    }
    letters = _rows(db, "SELECT hex(value) AS value, reason FROM deadletter WHERE reason != ''")
    return sorted(usage, key=str), by_ref, per_ref, [bytes.fromhex(r["value"]) for r in letters]


def test_clickhouse_sums_the_billing_topic_into_the_usage_rows(
    run: Run, commands_env: None, tmp_path: Path
) -> None:
    from chdb import session as chdb_session

    ddl, usage_query = clickhouse_sql()
    group = f"'analytics-{uuid.uuid4().hex[:8]}-"
    replaced = [
        s.replace(DOC_BROKER, f"'{run.settings.bootstrap_servers}'")
        .replace(DOC_PREFIX, f"'{run.confluent_namespace}.")
        .replace(DOC_REGISTRY, f"'{run.registry}'")
        .replace(DOC_GROUP, group)
        for s in ddl
    ]
    db = chdb_session.Session(str(tmp_path / "clickhouse"))
    try:
        for statement in replaced:
            db.query(statement)
        deadline = time.monotonic() + 60
        while any(_read(db).get(name, 0) < run.records[name] for name in OUTPUTS):
            if time.monotonic() > deadline:
                errors = _rows(db, "SELECT table, exceptions.text FROM system.kafka_consumers")
                pytest.fail(f"ClickHouse did not read every record: {errors}")
            time.sleep(0.5)

        usage = cli("usage", "--json")
        assert usage.code == 0, usage.err
        expected_usage = [exact(r) for r in json.loads(usage.out) if r["tenant"] in run.tenants]
        assert len(expected_usage) == 4  # two models per tenant, the amended request once
        tokens = _printed_tokens(run)
        chunks = {ref: n for ref, (_, _, n) in tokens.items()}
        expected = (sorted(expected_usage, key=str), tokens, chunks, [POISON])
        found = _clickhouse_says(db, usage_query, run)
        while found != expected and time.monotonic() < deadline:  # the views' inserts
            time.sleep(0.5)
            found = _clickhouse_says(db, usage_query, run)
        assert found == expected
    finally:
        db.close()
