"""Chaos: SIGKILLed workers, a restarted broker and re-sent records lose nothing and count
nothing twice.  The run itself is `tests/integration/chaos.py` (see its docstring).

On the fault stack (`fault_stack`, tests/integration/heavy/conftest.py: a local stack of
the process's own), whose broker and Redis the run stops and starts (skipped when
``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` name another stack, as `test_outage` is)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.isolation import db_url
from tests.integration.worker import external_stack

REPO = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.integration, pytest.mark.fault_stack]


def test_chaos_run_loses_nothing_and_counts_nothing_twice(redis_url: str, own_db: int) -> None:
    if (external := external_stack()) is not None:  # as test_outage: the broker is restarted
        pytest.skip(external)
    requests = int(os.environ.get("STREAMTALLY_CHAOS_REQUESTS", "2000"))
    env = dict(os.environ)
    env["STREAMTALLY_NAMESPACE"] = f"chaos-{uuid.uuid4().hex[:8]}"
    env["REDIS_URL"] = db_url(redis_url, own_db)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.chaos", "--requests", str(requests)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=2))  # the figures, for docs/figures.md and the log
    context = f"worker log: {report['worker_log']}"
    assert report["worker_kills"] >= 3
    assert report["broker_restarts"] == 1
    assert report["redis_restarts"] == 1
    assert report["never_finished_count"] == 0, context
    assert report["tokens_mismatches"] == [], context
    assert report["usage_mismatches"] == {}, context
    assert report["billing_export_mismatch_count"] == 0, report["billing_export_mismatches"]
    assert report["billing_requests"] == requests
    assert report["requests_without_billing"] == []
    assert report["requests_with_two_different_billing_events"] == []
    # every request id was sent by two tenants: two requests, each billed once
    assert report["request_ids_of_two_tenants"] == requests // 2
    stats = report["stats"]
    assert stats["requests"] == requests
    # every raw record is applied once, dropped as a re-sent duplicate, or dead-lettered
    assert report["raw_records_in"] == report["raw_messages_sent"]
    assert report["raw_records_in"] == (
        stats["records"] + stats["duplicates"] + stats["dead_lettered"]
    ), report
    assert stats["dead_lettered"] == report["dead_letter_messages"]
    assert report["duplicates_sent"] > 0
    assert report["worker_exit_code"] == 0, context
