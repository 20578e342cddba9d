"""``streamtally audit --provider-usage`` on the real stack, with a real worker.

A namespace and Redis database of its own (`own_worker`).  Four OpenAI calls of one tenant go
through a worker; once the processors have committed them, the provider's usage is
written as OpenAI's organization Usage API would report it (a page of daily buckets,
grouped by model and API key id), and the key's id mapped to the tenant:

- a report that counts the four calls: the audit of their day (``--yesterday``'s shape:
  ``--since`` / ``--until`` a UTC day) is clean, and says one (day, model, tenant) matched;
- a report that counts three more calls, which never reached the topics: exit 1, and one
  ``provider_usage_mismatch`` per kind, the provider's count and ours three calls apart;
  the same report from two shares of a snapshot merged with ``audit merge
  --provider-usage`` (the comparison runs once, after the merge).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from streamtally.core.identity import RequestRef
from streamtally.ops.worker_process import WorkerProcess
from streamtally.settings import Settings
from streamtally.topics import Topics
from tests.integration.test_amendments import _records, _send, _wait_revision
from tests.integration.worker import Endpoints, cli, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CALLS: Final = 4
MISSING: Final = 3


@pytest.fixture
def scene(stack_endpoints: Endpoints, tmp_path: Path) -> Iterator[tuple[Settings, WorkerProcess]]:
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="provider",
        log=tmp_path / "worker.log",
        request_timeout=30.0,
    ) as (settings, worker):
        yield settings, worker


def _committed(settings: Settings, worker: WorkerProcess, timeout: float) -> None:
    """Every raw record committed by the processors (no request of the audit partial)."""

    async def wait() -> None:
        topics = Topics.in_namespace(settings.namespace)
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers)
        await admin.start()
        await consumer.start()
        tps = [TopicPartition(t.name, p) for t in topics.raw for p in range(t.partitions)]
        deadline = time.monotonic() + timeout
        try:
            while True:
                ends = await consumer.end_offsets(tps)
                done = await admin.list_consumer_group_offsets(topics.processors_group)
                behind = [
                    tp for tp in tps if ends[tp] and (tp not in done or done[tp].offset < ends[tp])
                ]
                if not behind:
                    return
                assert time.monotonic() < deadline, (behind, worker.describe())
                await asyncio.sleep(0.5)
        finally:
            await consumer.stop()
            await admin.close()

    asyncio.run(wait())


def _page(day: datetime, model: str, key_id: str, counts: dict[str, int]) -> dict[str, Any]:
    """One page of OpenAI's completions usage: one daily bucket, one result."""
    start = int(day.timestamp())
    result = {
        "object": "organization.usage.completions.result",
        "input_tokens": counts["input_tokens"],
        "output_tokens": counts["output_tokens"],
        "input_cached_tokens": counts["cached_tokens"],
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": counts["requests"],
        "project_id": "proj_streamtally",
        "user_id": None,
        "api_key_id": key_id,
        "model": model,
        "batch": False,
    }
    bucket = {"object": "bucket", "start_time": start, "end_time": start + 86400}
    return {
        "object": "page",
        "data": [{**bucket, "results": [result]}],
        "has_more": False,
        "next_page": None,
    }


def test_the_provider_report_against_the_ledger(
    scene: tuple[Settings, WorkerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, worker = scene
    tenant = f"pu-{uuid.uuid4().hex[:6]}"
    ids = [f"req-{uuid.uuid4().hex[:8]}" for _ in range(CALLS)]
    for request_id in ids:
        _send(settings, request_id, _records(tenant, request_id))
    for request_id in ids:
        _wait_revision(settings, RequestRef(tenant, request_id), 0, worker, timeout=60)
    _committed(settings, worker, timeout=60)
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", settings.namespace)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    exported = cli("billing", "export", "--ledger", "--json")
    assert exported.code == 0, exported.err
    bills = [json.loads(line) for line in exported.out.decode().splitlines()]
    bills = [b for b in bills if b["tenant"] == tenant]
    assert len(bills) == CALLS
    days = {b["event_time"][:10] for b in bills}
    if len(days) > 1:
        pytest.skip("the calls straddled midnight UTC; run again")
    (day_text,) = days
    (model,) = {b["model"] for b in bills}
    one = {k: bills[0][k] for k in ("input_tokens", "output_tokens", "cached_tokens")}
    assert all({k: b[k] for k in one} == one for b in bills)  # the same transcript
    assert one["input_tokens"] > 0
    assert one["output_tokens"] > 0
    ours = {"requests": CALLS, **{k: v * CALLS for k, v in one.items()}}
    day = datetime.fromisoformat(day_text).replace(tzinfo=UTC)
    key_id = f"key_{uuid.uuid4().hex[:12]}"
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"provider_ids": {key_id: tenant}}), encoding="utf-8")
    window = ["--since", day_text, "--until", (day + timedelta(days=1)).date().isoformat()]

    def audit(counts: dict[str, int], name: str) -> tuple[int, dict[str, Any], str]:
        usage = tmp_path / name
        usage.write_text(json.dumps(_page(day, model, key_id, counts)), encoding="utf-8")
        done = cli(
            "audit",
            *window,
            "--tenant",
            tenant,
            "--provider-usage",
            str(usage),
            "--provider-map",
            str(mapping),
            "--progress-lines",
            "--json",
        )
        assert done.code in (0, 1), done.err
        return done.code, json.loads(done.out), done.err

    # the provider counts what the topics hold: clean
    code, report, err = audit(ours, "matching.json")
    assert (code, report["discrepancies"]) == (0, []), report["discrepancies"]
    assert report["requests"]["replayed"] == CALLS
    (provider,) = report["provider_usage"]["providers"]
    assert provider["keys"] == {"matched": 1, "within_tolerance": 0, "mismatched": 0}
    assert provider["provider_totals"] == provider["ledger_totals"] == ours
    assert report["provider_usage"]["unmapped"] == []
    assert "partition" in err  # --progress-lines: a line per raw partition read
    assert "provider usage: openai, 1 file(s)" in err

    # the provider counts three calls the topics lack: each kind, both numbers
    more = {k: v + MISSING * (1 if k == "requests" else one[k]) for k, v in ours.items()}
    code, report, _ = audit(more, "three-more.json")
    assert code == 1
    found = {
        d["field"]: (d["kind"], d["tenant"], d["model"], d["day"], d["request_id"])
        for d in report["discrepancies"]
    }
    assert set(found.values()) == {("provider_usage_mismatch", tenant, model, day_text, None)}
    numbers = {d["field"]: (d["expected"], d["found"]) for d in report["discrepancies"]}
    assert numbers == {
        "requests": (CALLS + MISSING, CALLS),
        **{k: ((CALLS + MISSING) * v, CALLS * v) for k, v in one.items() if v},
    }
    assert report["provider_usage"]["providers"][0]["keys"]["mismatched"] == 1

    # on several machines: shares of one snapshot, the comparison once, at the merge
    snap = tmp_path / "snapshot.json"
    assert cli("audit", "snapshot", "--out", str(snap), *window, "--tenant", tenant).code == 0
    parts = []
    for share in ("0/2", "1/2"):
        part = tmp_path / f"part-{share[0]}.json"
        done = cli("audit", "run", "--snapshot", str(snap), "--share", share, "--out", str(part))
        assert done.code == 0, done.err
        parts.append(str(part))
    usage = ["--provider-usage", str(tmp_path / "three-more.json"), "--provider-map", str(mapping)]
    merged = cli("audit", "merge", "--snapshot", str(snap), *parts, *usage, "--json")
    assert merged.code == 1, merged.err
    split = json.loads(merged.out)
    for doc in (split, report):
        del doc["snapshot"]["taken_at"]
    assert split == report
    worker.check()
