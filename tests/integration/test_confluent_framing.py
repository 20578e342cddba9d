"""The Confluent framing on the real stack, with a real schema registry.

A worker with ``STREAMTALLY_AVRO_FRAMING=confluent`` reads a raw topic holding
both framings: one request whose records alternate single-object and
Confluent, one all single-object, one all Confluent (the same transcript each),
and a record of a schema id the registry never gave.  The three requests bill
alike, every value the worker wrote is Confluent-framed with the id of its
subject, the unknown id is dead-lettered with the reason, the subjects hold the
project's schemas (the canonical form of `schemas/history/`) at compatibility
BACKWARD, and `billing export` and the audit read what was written whole.

Needs a registry (marker ``registry``): the session's `schema_registry_url`,
``STREAMTALLY_SCHEMA_REGISTRY_URL`` or else the stack's (Apicurio's ``ccompat`` API, as
``streamtally stack up --registry`` starts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.store import RedisStore
from streamtally.topics import Topics
from streamtally.wire import avro
from streamtally.wire.framing import register_topics, registered_schema
from streamtally.wire.kafka import read_topic
from streamtally.wire.registry import SchemaRegistry, subject_of
from tests.integration.worker import cli, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.registry, pytest.mark.timeout(300)]

HISTORY = Path(avro.SCHEMA_DIR) / "history"
TRANSCRIPT = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":"Hello"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":" there"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":[],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14}}\n\n'
    b"data: [DONE]\n\n"
)
#: An id no registry of this test gave (the largest a registry can).
UNKNOWN_ID = 2**31 - 1


async def _send_and_wait(
    settings: Settings, requests: dict[RequestRef, list[bytes]], stray: bytes
) -> dict[str, int]:
    async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as producer:
        for ref, values in requests.items():
            futures = [await producer.send(Source.OPENAI, ref.request_id, v) for v in values]
            await asyncio.gather(*futures)
        await (await producer.send(Source.OPENAI, "req-stray", stray))
    store = RedisStore.from_url(settings.redis_url)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            stats = await store.stats()
            if not await store.missing_tokens(list(requests)) and stats["dead_lettered"] >= 1:
                break
            await asyncio.sleep(0.2)
        return await store.stats()
    finally:
        await store.aclose()


async def _values(settings: Settings, topic: str) -> list[bytes]:
    async with contextlib.aclosing(read_topic(settings.bootstrap_servers, topic)) as records:
        return [record.value or b"" async for record in records]


def test_a_confluent_worker_reads_both_framings_and_writes_confluent(
    stack_endpoints: Any, schema_registry_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:10]}"
    refs = {name: RequestRef(tenant, f"req-{name}") for name in ("mixed", "single", "confluent")}
    monkeypatch.setenv("STREAMTALLY_AVRO_FRAMING", "confluent")
    monkeypatch.setenv("STREAMTALLY_SCHEMA_REGISTRY_URL", schema_registry_url)
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="confluent",
        log=tmp_path / "worker.log",
        request_timeout=30,
    ) as (settings, worker):
        topics = Topics.in_namespace(settings.namespace)
        registry = SchemaRegistry(schema_registry_url)
        # A producer of the raw topics in each framing.
        confluent = register_topics(registry, topics.raw)
        requests: dict[RequestRef, list[bytes]] = {}
        for name, ref in refs.items():
            _, records = raw_records(
                Source.OPENAI, TRANSCRIPT, tenant=tenant, request_id=ref.request_id
            )
            if name == "mixed":
                records = [confluent.frame(v) if i % 2 else v for i, v in enumerate(records)]
            elif name == "confluent":
                records = [confluent.frame(v) for v in records]
            requests[ref] = records
        stray = avro.to_confluent(requests[refs["single"]][0], UNKNOWN_ID)
        stats = asyncio.run(_send_and_wait(settings, requests, stray))
        assert stats["dead_lettered"] == 1, stats
        raw = asyncio.run(_values(settings, topics.raw_sse.name))
        assert {v[:1] for v in raw} == {b"\x00", b"\xc3"}  # the raw topic holds both

        monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
        monkeypatch.setenv("REDIS_URL", settings.redis_url)
        monkeypatch.setenv("STREAMTALLY_NAMESPACE", settings.namespace)
        billing = cli("billing", "export", "--json")
        assert billing.code == 0, billing.err
        events = {
            json.loads(line)["request_id"]: json.loads(line) for line in billing.out.splitlines()
        }
        assert set(events) == {ref.request_id for ref in refs.values()}
        same = {"input_tokens", "output_tokens", "cost", "model", "priced", "usage_source"}
        shown = [{k: e[k] for k in same if k in e} for e in events.values()]
        assert shown[0] == shown[1] == shown[2], shown
        assert events["req-single"]["input_tokens"] == 12

        letters = cli("deadletter", "--json")
        assert letters.code == 0, letters.err
        (letter,) = [json.loads(line) for line in letters.out.splitlines()]
        assert f"schema id {UNKNOWN_ID} (Confluent framing)" in letter["reason"]

        audit = cli("audit", "--json")
        assert audit.code == 0, audit.err
        report = json.loads(audit.out)
        assert report["discrepancies"] == []
        assert report["requests"]["matched"] == 3
        worker.check()

        # Every value the worker wrote: Confluent, with the id of its topic's subject.
        for topic in topics.outputs:
            values = asyncio.run(_values(settings, topic.name))
            assert values, topic.name
            subject = subject_of(topic.name)
            version = avro.current(topic.value_schema)
            schema_id = registry.lookup(subject, registered_schema(version))
            assert schema_id is not None, subject
            assert {v[:5] for v in values} == {avro.confluent_header(schema_id)}, topic.name
            # The subject holds the project's schema: the canonical form of its history file.
            latest = max(HISTORY.joinpath(topic.value_schema).glob("*.avsc"), key=_number)
            released = json.loads(latest.read_text(encoding="utf-8"))
            held = json.loads(registry.schema(schema_id))
            assert avro.canonical_form(held) == avro.canonical_form(released)
            config_url = f"{schema_registry_url}/config/{subject}"
            with urllib.request.urlopen(config_url, timeout=5) as answer:
                config = json.loads(answer.read())
            level = config.get("compatibilityLevel") or config.get("compatibility")
            assert level == "BACKWARD", config
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "avro framing: confluent (STREAMTALLY_AVRO_FRAMING)" in log


def _number(path: Path) -> int:
    return int(path.stem)
