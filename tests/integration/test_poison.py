"""Fault injection: poison records among good ones, through the real stack.

(A record over the worker's 4 MiB raw-record limit: the raw topics take up
to 64 KiB more (their declared `max.message.bytes`, for the framing), and
the processor's own check is covered by the unit tier;
tests/integration/test_record_sizes.py puts a record at the topic's limit
through the broker.)

Each poison record is dead-lettered with its reason; every good request sent
in the same batches reaches Redis exactly as `fold` prints it; the counts
reconcile (raw records in = applied + duplicates + dead-lettered).  Before,
one such record made the worker's batch raise: the worker died on it at
every restart, or its batch-mates were lost.

Its own topic namespace and Redis database.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream, read_events
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.store import RedisStore
from tests.integration.worker import own_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
SAMPLE = (REPO / "samples" / "openai" / "text_usage.sse").read_bytes()


def _chunk(content: str) -> bytes:
    return (
        b'data: {"id":"p","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
        b'"delta":{"content":"' + content.encode() + b'"},"finish_reason":null}]}\n\n'
    )


#: Each poison request: its transcript and a piece of the dead letter's reason.
POISON = {
    "lone-surrogate": (_chunk("ok") + _chunk("bad \\ud800 here"), "lone surrogate"),
    "count-beyond-int64": (
        _chunk("ok")
        + b'data: {"id":"p","object":"chat.completion.chunk","model":"gpt-4o","choices":[],'
        b'"usage":{"prompt_tokens":9223372036854775808,"completion_tokens":1}}\n\n',
        "beyond a 64-bit count",
    ),
    "truncated-json": (_chunk("ok") + b'data: {"id":"p","choices":[\n\n', "not valid JSON"),
    "deep-nesting": (_chunk("ok") + b"data: " + b"[" * 100_000 + b"\n\n", "JSON"),
}


@pytest.fixture
def scene(stack_endpoints: Any, tmp_path: Path) -> Iterator[tuple[Settings, str]]:
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="poison",
        log=tmp_path / "worker.log",
        request_timeout=30,
    ) as (settings, worker):
        yield settings, worker.describe()
        worker.check()  # it never died on a poison record


async def _send(settings: Settings, batches: list[tuple[str, list[bytes]]]) -> None:
    """All records interleaved, so poison and good records share the worker's batches."""
    async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as producer:
        futures = []
        longest = max(len(records) for _, records in batches)
        for i in range(longest):
            for request_id, records in batches:
                if i < len(records):
                    futures.append(await producer.send(Source.OPENAI, request_id, records[i]))
        await asyncio.gather(*futures)


async def _outcome(settings: Settings, good: list[RequestRef], letters: int) -> dict[str, Any]:
    store = RedisStore.from_url(settings.redis_url)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            stats = await store.stats()
            if not await store.missing_tokens(good) and stats["dead_lettered"] >= letters:
                break
            await asyncio.sleep(0.2)
        return {
            "tokens": {ref: await store.tokens(ref) for ref in good},
            "stats": await store.stats(),
        }
    finally:
        await store.aclose()


def test_poison_records_touch_only_themselves(
    scene: tuple[Settings, str],
) -> None:
    settings, _ = scene
    good = [RequestRef("acme", f"good-{i}") for i in range(6)]
    # a good request of another tenant under a poison request's id is another request
    good.append(RequestRef("other", "lone-surrogate"))
    batches: list[tuple[str, list[bytes]]] = [
        (
            ref.request_id,
            raw_records(Source.OPENAI, SAMPLE, tenant=ref.tenant, request_id=ref.request_id)[1],
        )
        for ref in good
    ]
    for name, (transcript, _) in POISON.items():
        batches.append(
            (name, raw_records(Source.OPENAI, transcript, tenant="acme", request_id=name)[1])
        )
    sent = sum(len(records) for _, records in batches)
    asyncio.run(_send(settings, batches))

    outcome = asyncio.run(_outcome(settings, good, letters=len(POISON)))
    expected = fold_stream(
        Source.OPENAI, read_events(Source.OPENAI, io.BytesIO(SAMPLE)), request_id="x"
    ).to_json_dict()
    for ref in good:
        assert outcome["tokens"][ref] == {**expected, "request_id": ref.request_id}, ref
    stats = outcome["stats"]
    # one dead letter per poison record, nothing else
    assert stats["dead_lettered"] == len(POISON)
    # every raw record is accounted for (the poison requests still close on their END)
    assert stats["records"] + stats["duplicates"] + stats["dead_lettered"] == sent
