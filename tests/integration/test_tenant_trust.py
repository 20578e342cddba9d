"""Tenant trust on the real stack: a worker with a trust file bills signed claims only.

Key A may bill tenant acme.  Through `streamtally produce`: key A producing
for acme is billed; key A claiming globex is dead-lettered (globex is never
billed); an unsigned producer is dead-lettered.  The counts reconcile.

Its own topic namespace and Redis database.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.producers import raw_records
from streamtally.settings import Settings
from streamtally.store import RedisStore
from tests.integration.worker import cli, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "samples" / "openai" / "text_usage.sse"
SECRET_A = "5f" * 32


@pytest.fixture
def scene(
    stack_endpoints: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Settings, Path]]:
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps({"keys": {"gw-a": {"secret": SECRET_A, "tenants": ["acme"]}}}))
    key_a = tmp_path / "gw-a.json"
    key_a.write_text(json.dumps({"key_id": "gw-a", "secret": SECRET_A}))
    # The worker's environment is this process's (own_worker copies it).
    monkeypatch.setenv("STREAMTALLY_TENANT_KEYS", str(trust))
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="trust",
        log=tmp_path / "worker.log",
        request_timeout=30,
    ) as (settings, worker):
        monkeypatch.delenv("STREAMTALLY_TENANT_KEYS")
        for name, value in (
            ("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers),
            ("REDIS_URL", settings.redis_url),
            ("STREAMTALLY_NAMESPACE", settings.namespace),
        ):
            monkeypatch.setenv(name, value)
        yield settings, key_a
        worker.check()
        log = (tmp_path / "worker.log").read_text(errors="replace")
        assert "tenant trust: 1 producer keys" in log
        assert SECRET_A not in log


async def _wait(settings: Settings, billed: RequestRef, letters: int) -> dict[str, Any]:
    store = RedisStore.from_url(settings.redis_url)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            stats = await store.stats()
            if not await store.missing_tokens([billed]) and stats["dead_lettered"] >= letters:
                break
            await asyncio.sleep(0.2)
        return {
            "stats": await store.stats(),
            "missing": await store.missing_tokens(
                [billed, RequestRef("globex", "claim-1"), RequestRef("acme", "unsigned-1")]
            ),
        }
    finally:
        await store.aclose()


def test_a_key_bills_its_tenants_only_and_unsigned_records_are_dead_lettered(
    scene: tuple[Settings, Path],
) -> None:
    settings, key_a = scene
    sample = str(SAMPLE)
    runs = [
        ("acme", "ok-1", ["--key-file", str(key_a)]),
        ("globex", "claim-1", ["--key-file", str(key_a)]),
        ("acme", "unsigned-1", []),
    ]
    for tenant, request_id, signing in runs:
        sent = cli("produce", "--source", "openai", "--tenant", tenant,
                   "--request-id", request_id, *signing, sample)  # fmt: skip
        assert sent.code == 0, sent.err
    per_request = len(raw_records(Source.OPENAI, SAMPLE.read_bytes(), tenant="x")[1])

    outcome = asyncio.run(_wait(settings, RequestRef("acme", "ok-1"), 2 * per_request))
    assert outcome["missing"] == [RequestRef("globex", "claim-1"), RequestRef("acme", "unsigned-1")]
    stats = outcome["stats"]
    assert stats["dead_lettered"] == 2 * per_request
    assert stats["records"] + stats["duplicates"] + stats["dead_lettered"] == 3 * per_request

    usage = cli("usage", "--json")
    assert usage.code == 0, usage.err
    rows = json.loads(usage.out)
    assert {row["tenant"] for row in rows} == {"acme"}
    assert sum(row["requests"] for row in rows) == 1
    billing = cli("billing", "export", "--json")
    events = [json.loads(line) for line in billing.out.splitlines()]
    assert [(e["tenant"], e["request_id"]) for e in events] == [("acme", "ok-1")]

    letters = cli("deadletter", "--json")
    assert letters.code == 0, letters.err
    reasons = {
        (row["request_id"], row["error_type"], row["reason"])
        for row in map(json.loads, letters.out.splitlines())
    }
    assert reasons == {
        ("claim-1", "TenantNotAllowed", "st-auth key 'gw-a' may not bill tenant 'globex'"),
        (
            "unsigned-1",
            "UnsignedRecord",
            "record has no st-auth header: this worker bills signed records only "
            "(STREAMTALLY_TENANT_KEYS)",
        ),
    }
