"""One call, one bill, through the real worker: two calls of one tenant with the same
provider id, one after the other, are two requests, two billing events, and the
tenant's usage row is their sum.

The worker runs in a topic namespace of its own (its own consumer group) against the
shared Redis, with a tenant of its own; its usage rows are forgotten afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from streamtally.billing.events import event_id
from streamtally.core.identity import RequestRef, call_request_id
from streamtally.core.models import Source
from streamtally.ops import worker_process
from streamtally.producers import RawProducer, raw_records
from streamtally.topics import Topics
from streamtally.wire import avro
from streamtally.wire.kafka import ensure_topics
from tests.integration.worker import REPO, SAMPLES, cli, forget_usage, wait_for_tokens

pytestmark = pytest.mark.integration

FILE = "openai/text_usage.sse"
PROVIDER_ID = "chatcmpl-st0001"  # the transcript's own id, as the producer keys it


@pytest.fixture
def namespace(stack_endpoints: Any, tmp_path: Path) -> Iterator[str]:
    name = f"calls-{uuid.uuid4().hex[:8]}"
    servers = stack_endpoints.bootstrap_servers
    asyncio.run(ensure_topics(servers, Topics.in_namespace(name).all))
    env = {
        **os.environ,
        **stack_endpoints.env(),
        "STREAMTALLY_NAMESPACE": name,
        "STREAMTALLY_WEB_PORT": "0",
        "STREAMTALLY_REQUEST_TIMEOUT": "30",
    }
    worker = worker_process.WorkerProcess(tmp_path / "worker.log", env, cwd=REPO).start()
    try:
        worker.wait_until_ready(60)
        yield name
        worker.check()
    finally:
        worker.stop(timeout=30)


def test_two_sequential_calls_with_one_provider_id_are_two_bills(
    stack_endpoints: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = f"calls-{uuid.uuid4().hex[:8]}"
    data = (SAMPLES / FILE).read_bytes()
    first_id, first = raw_records(Source.OPENAI, data, tenant=tenant, request_id=PROVIDER_ID)
    # The second call: the same stream, received an hour later (its own receive times).
    start = avro.decode_raw_sse_event(first[-1]).received_at + timedelta(hours=1)
    ticks = iter(start + timedelta(milliseconds=i) for i in range(len(first)))
    second_id, second = raw_records(
        Source.OPENAI, data, tenant=tenant, request_id=PROVIDER_ID, clock=lambda: next(ticks)
    )
    assert first_id == second_id == PROVIDER_ID

    async def send() -> None:
        async with RawProducer(stack_endpoints.bootstrap_servers, namespace=namespace) as raw:
            await raw.send_records(Source.OPENAI, PROVIDER_ID, first)
            await raw.send_records(Source.OPENAI, PROVIDER_ID, second)

    asyncio.run(send())
    new_id = call_request_id(PROVIDER_ID, start)
    refs = [RequestRef(tenant, PROVIDER_ID), RequestRef(tenant, new_id)]
    try:
        assert wait_for_tokens(stack_endpoints.redis_url, refs, timeout=90) == set()
        monkeypatch.setenv("STREAMTALLY_NAMESPACE", namespace)
        monkeypatch.setenv("REDIS_URL", stack_endpoints.redis_url)
        monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", stack_endpoints.bootstrap_servers)
        export = cli("billing", "export", "--json")
        assert export.code == 0, export.err
        events = [json.loads(line) for line in export.out.decode().splitlines()]
        mine = sorted((e for e in events if e["tenant"] == tenant), key=lambda e: e["event_time"])
        assert [e["request_id"] for e in mine] == [PROVIDER_ID, new_id]
        assert [e["event_id"] for e in mine] == [event_id(tenant, r) for r in (PROVIDER_ID, new_id)]
        assert [e["provider_request_id"] for e in mine] == [PROVIDER_ID, PROVIDER_ID]
        assert mine[0]["input_tokens"] == mine[1]["input_tokens"] > 0
        usage = cli("usage", "--tenant", tenant, "--json")
        assert usage.code == 0, usage.err
        rows = json.loads(usage.out)
        assert sum(r["requests"] for r in rows) == 2
        for name in ("input_tokens", "output_tokens"):
            assert sum(r[name] for r in rows) == mine[0][name] + mine[1][name]
        got = cli("tokens", "get", new_id, "--tenant", tenant)
        assert got.code == 0, got.err
        assert json.loads(got.out)["provider_request_id"] == PROVIDER_ID
    finally:
        forget_usage(stack_endpoints.redis_url, [tenant])
