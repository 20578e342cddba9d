"""Static membership on the real stack: a worker restarted in place with its instance id
(SIGTERM then start, SIGKILL then start) in the middle of open requests keeps its
partitions without a rebalance and loses and counts nothing twice; a second worker started
with the same instance id fences the first, which stops (exit 78) instead of taking the id
back, and the second alone reads on.

Each test has a topic namespace (so its own consumer group) and tenants of its own on the
shared stack; it deletes its tenants' usage rows afterwards (`forget_usage`).  The pauses
themselves are measured by ``python -m benchmarks.restart_pause`` (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.cli.worker import EX_MEMBERSHIP_LOST
from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS
from streamtally.core.normalize import fold_stream, read_events
from streamtally.producers import raw_records
from streamtally.store import RedisStore
from streamtally.topics import Topics
from streamtally.wire import avro
from streamtally.wire.kafka import ensure_topics, read_topic
from tests.integration.chaos import produce_interleaved, wait_all
from tests.integration.worker import (
    PROBE_FILE,
    PROBE_SOURCE,
    SAMPLES,
    Endpoints,
    WorkerProcess,
    assert_stopped_cleanly,
    forget_usage,
    run_streamtally,
    wait_for_tokens,
)

pytestmark = pytest.mark.integration

#: Requests produced around the two restarts, and the seconds their records take to send.
REQUESTS = 160
PRODUCE_S = 14.0
#: What a fenced worker logs (critical) before it stops.
LOST = "lost its membership of group"
_JOINED = re.compile(r"Joined group '[^']*' \(generation (\d+)\)")


@pytest.fixture
def namespace(stack_endpoints: Endpoints, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """A topic namespace of the test's own (its topics made), also this process's (the
    producers read it from the environment), and a tag for its ids and tenants."""
    tag = uuid.uuid4().hex[:8]
    name = f"static-{tag}"
    asyncio.run(ensure_topics(stack_endpoints.bootstrap_servers, Topics.in_namespace(name).all))
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", name)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", stack_endpoints.bootstrap_servers)
    monkeypatch.setenv("REDIS_URL", stack_endpoints.redis_url)
    return name, tag


def _worker(
    endpoints: Endpoints, namespace: str, instance_id: str, log: Path, timeout: float = 60
) -> WorkerProcess:
    env = {
        **endpoints.env(),
        "STREAMTALLY_NAMESPACE": namespace,
        "STREAMTALLY_WORKER_INSTANCE_ID": instance_id,
        "STREAMTALLY_WEB_PORT": "0",
    }
    worker = WorkerProcess(log, env).start()
    worker.wait_for_log("raw partitions assigned", timeout)
    return worker


def _generations(worker: WorkerProcess) -> list[int]:
    return [int(g) for g in _JOINED.findall(worker.log_text())]


def _requests(tag: str) -> list[dict[str, Any]]:
    """`REQUESTS` requests of our sample transcripts, of two tenants of this test's own."""
    from streamtally.cli.produce import read_manifest

    entries = [
        e for e in read_manifest(SAMPLES / "manifest.jsonl") if "long_text_bench" not in e.file.name
    ]
    return [
        {
            "request_id": f"static-{tag}-{i}",
            "source": entries[i % len(entries)].source,
            "file": entries[i % len(entries)].file,
            "tenant": f"static-{tag}-{i % 2}",
        }
        for i in range(REQUESTS)
    ]


async def _billing_events(topic: str) -> dict[RequestRef, set[bytes]]:
    servers = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    found: dict[RequestRef, set[bytes]] = defaultdict(set)
    async with contextlib.aclosing(read_topic(servers, topic)) as records:
        async for record in records:
            if record.value is not None:
                event = avro.decode_billing_event(record.value)
                found[RequestRef(event.tenant, event.request_id)].add(record.value)
    return found


async def _books(requests: list[dict[str, Any]], url: str, namespace: str) -> dict[str, Any]:
    """What the books say against the folds of the transcripts: requests whose Tokens in
    Redis differ from their fold (or are missing), usage per tenant, billing events."""
    prices = PriceTable.default()
    epoch = datetime(2026, 1, 1, tzinfo=UTC)  # the event time sets the day only
    refs = [RequestRef(r["tenant"], r["request_id"]) for r in requests]
    truth: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    wrong: list[str] = []
    store = RedisStore.from_url(url)
    try:
        stored = await store.tokens_texts(refs)
        for req, ref, text in zip(requests, refs, stored, strict=True):
            with req["file"].open("rb") as stream:
                tokens = fold_stream(
                    req["source"], read_events(req["source"], stream), request_id=req["request_id"]
                )
            if text is None or json.loads(text) != tokens.to_json_dict():
                wrong.append(ref.text)
            row = truth[req["tenant"]]
            row["requests"] += 1
            for name, count in zip(USAGE_FIELDS, tokens.usage.counts(), strict=True):
                row[name] += count
            row["cost"] += bill(tokens, req["tenant"], epoch, prices).cost
        got: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
        for tenant in truth:
            for row_ in await store.usage_rows(tenant=tenant):
                for name in ("requests", *USAGE_FIELDS, "cost"):
                    got[tenant][name] += Decimal(row_[name])
    finally:
        await store.aclose()
    billing = await _billing_events(Topics.in_namespace(namespace).billing.name)
    return {
        "tokens_wrong_or_missing": wrong,
        "usage_expected": {t: {k: str(v) for k, v in row.items()} for t, row in truth.items()},
        "usage_got": {t: {k: str(v) for k, v in row.items()} for t, row in got.items()},
        "unbilled": sorted(ref.text for ref in refs if ref not in billing),
        "billed_twice_differently": sorted(r.text for r, v in billing.items() if len(v) != 1),
        "billed_not_ours": sorted(r.text for r in billing if r not in set(refs)),
    }


def test_a_static_worker_restarted_in_place_keeps_its_partitions_and_the_books_exact(
    stack_endpoints: Endpoints, namespace: tuple[str, str], tmp_path: Path
) -> None:
    name, tag = namespace
    requests = _requests(tag)
    tenants = sorted({r["tenant"] for r in requests})
    records = sum(
        len(raw_records(r["source"], r["file"].read_bytes(), tenant=r["tenant"])[1])
        for r in requests
    )
    instance = f"worker-{tag}"
    runs = [_worker(stack_endpoints, name, instance, tmp_path / "run-0.log")]
    restarts: list[str] = []

    def restart(done: float) -> None:
        """SIGTERM at a third of the records, SIGKILL at two thirds; each time the same
        command again at once, as a supervisor restarts a service in place."""
        if (done >= 1 / 3 and not restarts) or (done >= 2 / 3 and len(restarts) == 1):
            worker = runs[-1]
            if not restarts:
                code, _ = worker.stop(timeout=30)
                assert code == 0, worker.describe()
                restarts.append("sigterm")
            else:
                worker.wait_for_log("raw partitions assigned", 30)  # it has joined
                worker.kill()
                restarts.append("sigkill")
            log = tmp_path / f"run-{len(runs)}.log"
            runs.append(WorkerProcess(log, dict(worker.env or {})).start())

    try:
        _, duplicates = asyncio.run(
            produce_interleaved(requests, random.Random(28), records / PRODUCE_S, restart)
        )
        assert restarts == ["sigterm", "sigkill"]
        store = RedisStore.from_url(stack_endpoints.redis_url)
        refs = [RequestRef(r["tenant"], r["request_id"]) for r in requests]
        waiting = asyncio.run(_wait(store, refs))
        assert waiting == [], f"{len(waiting)} never finished\n{runs[-1].describe()}"
        books = asyncio.run(_books(requests, stack_endpoints.redis_url, name))
        assert_stopped_cleanly(runs[-1])
    finally:
        for run in runs:
            run.kill()
        forget_usage(stack_endpoints.redis_url, tenants)
    context = "\n".join(run.describe(10) for run in runs)
    assert duplicates > 0  # some records were sent twice, as a retrying producer would
    # the restarts were in place: each start took the partitions back in the generation
    # the group had (a rebalance would have begun a new one), none of them fenced
    generations = [_generations(run) for run in runs]
    assert generations == [[1], [1], [1]], f"{generations}\n{context}"
    assert all(LOST not in run.log_text() for run in runs), context
    # the books: nothing lost, nothing counted twice
    assert books["tokens_wrong_or_missing"] == [], context
    assert books["usage_got"] == books["usage_expected"], context
    assert books["unbilled"] == []
    assert books["billed_twice_differently"] == [], context
    assert books["billed_not_ours"] == []


async def _wait(store: RedisStore, refs: list[RequestRef]) -> list[RequestRef]:
    try:
        return list(await wait_all(store, refs, timeout=90))
    finally:
        await store.aclose()


def test_a_second_worker_with_the_same_instance_id_fences_the_first_which_stops(
    stack_endpoints: Endpoints, namespace: tuple[str, str], tmp_path: Path
) -> None:
    name, tag = namespace
    instance = f"worker-{tag}"
    tenant = f"fenced-{tag}"
    first = _worker(stack_endpoints, name, instance, tmp_path / "first.log")
    second: WorkerProcess | None = None
    try:
        second = _worker(stack_endpoints, name, instance, tmp_path / "second.log")
        deadline = time.monotonic() + 30
        while first.returncode is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.returncode == EX_MEMBERSHIP_LOST, first.describe()
        said = first.log_text()
        assert f"[CRITICAL] streamtally.processors.source: this worker {LOST}" in said, said
        assert f"as static member {instance!r}: another worker joined" in said
        # it did not join again (which would have fenced the second in turn)
        assert _generations(first) == [1], first.describe()
        assert said.count("raw partitions assigned") == 1, first.describe()
        time.sleep(3.0)  # a few heartbeats: the second is still the member, undisturbed
        assert second.returncode is None, second.describe()
        assert LOST not in second.log_text(), second.describe()
        assert "Revoking previously assigned partitions frozenset" not in second.log_text()
        # and it alone reads the partitions: a request goes through
        request_id = f"after-fencing-{tag}"
        sent = run_streamtally(
            "produce", "--source", PROBE_SOURCE, "--tenant", tenant, "--request-id", request_id,
            str(PROBE_FILE), env={**stack_endpoints.env(), "STREAMTALLY_NAMESPACE": name},
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr.decode(errors="replace")
        ref = RequestRef(tenant, request_id)
        assert not wait_for_tokens(stack_endpoints.redis_url, [ref], 30, second), second.describe()
        assert_stopped_cleanly(second)
    finally:
        first.kill()
        if second is not None:
            second.kill()
        forget_usage(stack_endpoints.redis_url, [tenant])
