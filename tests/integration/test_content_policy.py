"""The content policy on the real stack: no text leaves the worker under ``none`` or
``redacted``, and billing is the same as under ``full``.

The same raw records (one request whose text, reasoning and tool arguments
carry a distinctive phrase, an event whose malformed field quotes it, and a
late copy of the first record) go to three workers, each in its own topic
namespace and Redis database: ``full`` (the control: the phrase is found),
``none`` with the chunks topic off, and ``redacted``.  Then the phrase is
searched for in every value of the Tokens, chunks and dead-letter topics and
in every key and value of Redis; the billing events and usage rows must equal
``full``'s, field for field (the raw topic aside: its name carries the
namespace).  The read commands (`tokens get`, `deadletter`, `audit`, and
`rebuild` after Redis is lost) work on what ``none`` and ``redacted`` wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from streamtally.core.content import REDACTED_PREFIX, REMOVED_PREFIX
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.store import RedisStore
from streamtally.topics import Topics
from streamtally.wire.kafka import read_topic
from tests.integration.worker import cli, flush_db, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PHRASE = "marmot vellum 8093"
REQUEST = RequestRef("acme", "req-content")
T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
KEY_HEX = "3c" * 32
#: Each run: its policy and its chunks switch (its Redis database is leased, `own_worker`).
RUNS = {"full": ("full", "on"), "none": ("none", "off"), "redacted": ("redacted", "on")}


def _event(delta: str, finish: str = "null") -> bytes:
    return (
        b'data: {"id":"chatcmpl-ct","object":"chat.completion.chunk","model":"gpt-4o",'
        b'"choices":[{"index":0,"delta":'
        + delta.encode()
        + b',"finish_reason":'
        + finish.encode()
        + b"}]}\n\n"
    )


TRANSCRIPT = (
    _event(f'{{"role":"assistant","reasoning_content":"weighing the {PHRASE}"}}')
    + _event(f'{{"content":"Filed under {PHRASE}."}}')
    # malformed: the choice index is the phrase (dead-lettered, its reason quotes it)
    + b'data: {"id":"chatcmpl-ct","object":"chat.completion.chunk","model":"gpt-4o",'
    b'"choices":[{"index":"'
    + PHRASE.encode()
    + b'","delta":{"content":"x"}}]}\n\n'
    + _event(
        '{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":'
        f'{{"name":"file","arguments":"{{\\"shelf\\":\\"{PHRASE}\\"}}"}}}}]}}'
    )
    + _event("{}", '"tool_calls"')
    + b'data: {"id":"chatcmpl-ct","object":"chat.completion.chunk","model":"gpt-4o",'
    b'"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":17,"total_tokens":57}}\n\n'
    + b"data: [DONE]\n\n"
)


@contextlib.contextmanager
def _run(
    name: str, endpoints: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Settings]:
    """A ready worker with the run's policy; the read commands' environment is its own."""
    content, chunks = RUNS[name]
    key = tmp_path / "content.key"
    key.write_text(KEY_HEX + "\n")
    with monkeypatch.context() as env:
        env.setenv("STREAMTALLY_CONTENT", content)
        env.setenv("STREAMTALLY_CONTENT_KEY", str(key))
        env.setenv("STREAMTALLY_CHUNKS", chunks)
        with own_worker(
            endpoints.bootstrap_servers,
            endpoints.redis_url,
            prefix=f"content-{name}",
            log=tmp_path / f"worker-{name}.log",
            request_timeout=30,
        ) as (settings, worker):
            env.setenv("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
            env.setenv("REDIS_URL", settings.redis_url)
            env.setenv("STREAMTALLY_NAMESPACE", settings.namespace)
            yield settings
            worker.check()
    log = (tmp_path / f"worker-{name}.log").read_text(errors="replace")
    assert f"content policy: {content} (STREAMTALLY_CONTENT), chunks topic {chunks}" in log
    assert KEY_HEX not in log


async def _send_and_wait(settings: Settings, records: list[bytes]) -> dict[str, int]:
    async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as producer:
        # the request, then a late copy of its first record (dead-lettered with its bytes)
        await producer.send_records(Source.OPENAI, REQUEST.request_id, [*records, records[0]])
    store = RedisStore.from_url(settings.redis_url)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            stats = await store.stats()
            if not await store.missing_tokens([REQUEST]) and stats["dead_lettered"] >= 2:
                break
            await asyncio.sleep(0.2)
        return await store.stats()
    finally:
        await store.aclose()


async def _topic_values(settings: Settings, topic: str) -> list[bytes]:
    async with contextlib.aclosing(read_topic(settings.bootstrap_servers, topic)) as records:
        return [record.value or b"" async for record in records]


async def _redis_contents(url: str) -> list[bytes]:
    """Every key and every value of the database, whatever its type."""
    client = aioredis.from_url(url)
    found: list[bytes] = []
    try:
        async for key in client.scan_iter(count=500):
            found.append(key)
            kind = (await client.type(key)).decode()
            if kind == "string":
                found.append(await client.get(key) or b"")
            elif kind == "hash":
                for field, value in (await client.hgetall(key)).items():
                    found += [field, value]
            elif kind == "set":
                found += list(await client.smembers(key))
            elif kind == "list":
                found += list(await client.lrange(key, 0, -1))
            elif kind == "zset":
                found += list(await client.zrange(key, 0, -1))
            else:
                pytest.fail(f"Redis key {key!r} of type {kind} is not searched")
    finally:
        await client.aclose()
    return found


def _collect(settings: Settings) -> dict[str, Any]:
    topics = Topics.in_namespace(settings.namespace)

    async def read() -> dict[str, Any]:
        return {
            "tokens": await _topic_values(settings, topics.tokens.name),
            "chunks": await _topic_values(settings, topics.chunks.name),
            "deadletter": await _topic_values(settings, topics.deadletter.name),
            "redis": await _redis_contents(settings.redis_url),
        }

    found = asyncio.run(read())
    billing = cli("billing", "export", "--json")
    assert billing.code == 0, billing.err
    events = [json.loads(line) for line in billing.out.splitlines()]
    for event in events:  # the one field that names the namespace
        event["raw_topic"] = event["raw_topic"].removeprefix(settings.namespace)
    usage = cli("usage", "--json")
    assert usage.code == 0, usage.err
    tokens = cli("tokens", "get", REQUEST.request_id, "--tenant", REQUEST.tenant)
    assert tokens.code == 0, tokens.err
    letters = cli("deadletter", "--json")
    assert letters.code == 0, letters.err
    return {
        **found,
        "billing": events,
        "usage": json.loads(usage.out),
        "tokens_get": json.loads(tokens.out),
        "letters": [json.loads(line) for line in letters.out.splitlines()],
    }


def _holding(found: dict[str, Any], phrase: bytes) -> set[str]:
    """Where the phrase is: the stores whose values hold it."""
    stores = ("tokens", "chunks", "deadletter", "redis")
    return {store for store in stores if any(phrase in value for value in found[store])}


def test_no_text_leaves_the_worker_under_none_or_redacted_and_billing_is_the_same(
    stack_endpoints: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, records = raw_records(
        Source.OPENAI, TRANSCRIPT, tenant=REQUEST.tenant, request_id=REQUEST.request_id,
        clock=lambda: T0,
    )  # fmt: skip
    found: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        (tmp_path / name).mkdir()
        with _run(name, stack_endpoints, tmp_path / name, monkeypatch) as settings:
            stats = asyncio.run(_send_and_wait(settings, records))
            assert stats["dead_lettered"] == 2, (name, stats)
            assert stats["records"] + stats["dead_lettered"] == len(records) + 1
            found[name] = _collect(settings)
            if name == "redacted":  # Redis lost: rebuilt from the topics, markers and all
                flush_db(settings.redis_url)
                rebuilt = cli("rebuild", "--yes")
                assert rebuilt.code == 0, rebuilt.err
                again = cli("tokens", "get", REQUEST.request_id, "--tenant", REQUEST.tenant)
                assert json.loads(again.out) == found[name]["tokens_get"]
                assert json.loads(cli("usage", "--json").out) == found[name]["usage"]
            if name == "none":
                audit = cli("audit", "--json")
                assert audit.code == 0, audit.err
                report = json.loads(audit.out)
                assert report["discrepancies"] == []
                assert report["requests"]["matched"] == 1

    phrase = PHRASE.encode()
    full, removed, redacted = found["full"], found["none"], found["redacted"]
    # the control: under full the phrase is everywhere the worker writes text
    assert _holding(full, phrase) == {"tokens", "chunks", "deadletter", "redis"}
    assert PHRASE in full["tokens_get"]["text"]
    assert _holding(removed, phrase) == set()
    assert _holding(redacted, phrase) == set()
    assert removed["chunks"] == []  # STREAMTALLY_CHUNKS=off: the topic received nothing
    assert len(redacted["chunks"]) == len(full["chunks"]) > 0

    # billing: the same events and the same usage rows, cost included
    assert len(full["billing"]) == 1
    assert removed["billing"] == full["billing"] == redacted["billing"]
    assert removed["usage"] == full["usage"] == redacted["usage"]
    assert full["usage"][0]["cost"] == full["billing"][0]["cost"]

    # the read commands show the markers and the original sizes
    text = full["tokens_get"]["text"]
    assert removed["tokens_get"]["text"] == f"{REMOVED_PREFIX}{len(text.encode())}"
    assert redacted["tokens_get"]["text"].startswith(f"{REDACTED_PREFIX}{len(text.encode())}:")
    assert removed["tokens_get"]["usage"] == full["tokens_get"]["usage"]
    by_offset = {row["offset"]: row for row in full["letters"]}
    for row in removed["letters"]:
        original = by_offset[row["offset"]]
        assert row["value_size"] == original["value_size"] > 0
        assert row["error_type"] == original["error_type"]
    reasons = sorted(row["reason"] for row in full["letters"])
    assert any(PHRASE in reason for reason in reasons)  # the malformed field, quoted
