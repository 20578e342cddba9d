"""One ledger, one rule (issue 24), on the real stack.

A tenant's request is billed at its timeout (revision 0: three records of an OpenAI
transcript, then quiet for twice the worker's request timeout) and amended by the rest
of its stream (revision 1); another request of the tenant is billed once.  Then:

- the billing and corrections topics, settled by the rule (`BillingLedger`, and the
  docs' SQL over ``billing export --json``), sum to the tenant's usage rows in Redis;
- ``billing export --ledger --json`` prints one bill per request, revision 1 for the
  amended one (the default export prints both revisions);
- ``streamtally rebuild`` into an empty Redis database writes the same usage rows.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

import pytest

from streamtally.billing.reading import read_ledger
from streamtally.core.identity import RequestRef
from streamtally.ops.worker_process import WorkerProcess
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.records import BillingEvent
from tests.integration.isolation import db_url
from tests.integration.test_amendments import FIRST, _records, _send, _wait_revision
from tests.integration.worker import REPO, Endpoints, cli, flush_db, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REQUEST_TIMEOUT_S: Final = 3.0
FIELDS: Final = (
    "requests",
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cached_tokens",
    "cache_write_tokens",
)


@pytest.fixture
def scene(stack_endpoints: Endpoints, tmp_path: Path) -> Iterator[tuple[Settings, WorkerProcess]]:
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="ledger",
        log=tmp_path / "worker.log",
        request_timeout=REQUEST_TIMEOUT_S,
    ) as (settings, worker):
        yield settings, worker


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests, the five usage fields and the cost summed: of usage rows, or of bills
    (which count one request each)."""
    totals: dict[str, Any] = {name: sum(int(r.get(name, 1)) for r in rows) for name in FIELDS}
    totals["cost"] = sum((Decimal(str(r["cost"])) for r in rows), Decimal(0))
    return totals


def _usage(monkeypatch: pytest.MonkeyPatch, url: str, tenant: str) -> list[dict[str, Any]]:
    monkeypatch.setenv("REDIS_URL", url)
    usage = cli("usage", "--tenant", tenant, "--json")
    assert usage.code == 0, usage.err
    rows: list[dict[str, Any]] = json.loads(usage.out)
    return rows


def _export(*args: str) -> list[dict[str, Any]]:
    done = cli("billing", "export", "--json", *args)
    assert done.code == 0, done.err
    return [json.loads(line) for line in done.out.decode().splitlines()]


def _readme_sql() -> str:
    """The docs' SQL for the standing bills (docs/billing.md, "One ledger, one rule")."""
    page = (REPO / "docs" / "billing.md").read_text()
    section = page.split("\n## One ledger, one rule\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```sql\n(.*?)```", section, re.DOTALL)
    assert found is not None, "docs/billing.md has no ```sql block under One ledger, one rule"
    return found.group(1)


def _standing_by_sql(records: list[dict[str, Any]]) -> list[str]:
    """The event ids the docs' SQL keeps of `billing export --json`'s records."""
    db = sqlite3.connect(":memory:")
    db.execute(
        "CREATE TABLE billing_events (event_id TEXT PRIMARY KEY, tenant TEXT, "
        "request_id TEXT, revision INTEGER, supersedes TEXT, output_tokens INTEGER, cost TEXT)"
    )
    db.executemany(
        "INSERT INTO billing_events VALUES (?, ?, ?, ?, ?, ?, ?)",
        [
            (
                r["event_id"],
                r["tenant"],
                r["request_id"],
                r["revision"],
                r["supersedes"],
                r["output_tokens"],
                r["cost"],
            )
            for r in records
        ],
    )
    db.executescript(_readme_sql())
    return sorted(row[0] for row in db.execute("SELECT event_id FROM standing_bills"))


def test_the_ledger_sums_to_the_usage_rows_and_rebuilds_them(
    scene: tuple[Settings, WorkerProcess], own_db: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, worker = scene
    tenant = f"lg-{uuid.uuid4().hex[:6]}"
    amended_id, plain_id = f"req-{uuid.uuid4().hex[:8]}", f"req-{uuid.uuid4().hex[:8]}"
    amended, plain = RequestRef(tenant, amended_id), RequestRef(tenant, plain_id)
    _send(settings, plain_id, _records(tenant, plain_id))
    _send(settings, amended_id, _records(tenant, amended_id)[:FIRST])
    _wait_revision(settings, amended, 0, worker, timeout=60)
    _wait_revision(settings, plain, 0, worker, timeout=60)
    time.sleep(REQUEST_TIMEOUT_S)  # quiet for twice the timeout in all
    _send(settings, amended_id, _records(tenant, amended_id)[FIRST:])
    _wait_revision(settings, amended, 1, worker, timeout=60)
    worker.check()
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", settings.namespace)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    rows = _usage(monkeypatch, settings.redis_url, tenant)
    expected = _totals(rows)
    assert expected["requests"] == 2

    # The rule applied to the billing and corrections topics: the usage rows' totals.
    topics = Topics.in_namespace(settings.namespace)
    bad: list[tuple[int, int, str]] = []
    ledger = asyncio.run(
        read_ledger(
            settings.bootstrap_servers,
            billing_topic=topics.billing.name,
            corrections_topic=topics.corrections.name,
            bad_billing=bad,
            bad_corrections=bad,
            missing_hint="",
        )
    )
    assert bad == []
    settled = ledger.settle()
    mine: list[BillingEvent] = [e for e in settled.events() if e.tenant == tenant]
    assert (settled.revised, settled.split) == (1, [])
    assert _totals([{**e.usage_counts(), "cost": e.cost} for e in mine]) == expected

    # billing export: every record (both revisions), or the ledger (one bill per request)
    records = [r for r in _export() if r["tenant"] == tenant]
    assert sorted((r["request_id"] == amended_id, r["revision"]) for r in records) == [
        (False, 0),
        (True, 0),
        (True, 1),
    ]
    bills = [b for b in _export("--ledger") if b["tenant"] == tenant]
    by_request = {b["request_id"]: b for b in bills}
    assert len(bills) == len(by_request) == 2
    assert by_request[amended_id]["revision"] == 1
    assert by_request[amended_id]["supersedes"] == next(
        r["event_id"] for r in records if r["request_id"] == amended_id and r["revision"] == 0
    )
    assert {b["correction_id"] for b in bills} == {None}
    assert _totals(bills) == expected
    # the docs' SQL over every record keeps the same bills
    assert _standing_by_sql(records) == sorted(b["event_id"] for b in bills)

    # rebuild into an empty Redis database (another of the test's own): the same usage rows
    rebuilt_url = db_url(settings.redis_url, own_db)
    flush_db(rebuilt_url)
    try:
        done = cli("rebuild", "--json", "--redis-url", rebuilt_url)
        assert done.code == 0, done.err
        summary = json.loads(done.out)
        assert summary["skipped"] == [], summary
        requests = len({bill.ref for bill in settled.bills})  # a readiness probe's too
        assert (summary["applied"], summary["billing_revised"]) == (requests, 1)
        assert _usage(monkeypatch, rebuilt_url, tenant) == rows
    finally:
        flush_db(rebuilt_url)
