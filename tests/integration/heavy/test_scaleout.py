"""Scale-out: three workers in one consumer group through a clean leave, joins and a SIGKILL,
every one of them in the middle of open requests, stay exact; and how long a rebalance pauses
the group.  The run itself is `tests/integration/scaleout.py` (see its docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from streamtally.settings import ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL, Settings

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.integration


def test_three_workers_through_leaves_joins_and_a_kill_stay_exact(
    redis_url: str, bootstrap_servers: str, own_db: int
) -> None:
    requests = int(os.environ.get("STREAMTALLY_SCALEOUT_REQUESTS", "400"))
    env = dict(os.environ)
    env["STREAMTALLY_NAMESPACE"] = f"scaleout-{uuid.uuid4().hex[:8]}"
    env[ENV_REDIS_URL] = redis_url  # the program switches to its own database, --db
    env[ENV_BOOTSTRAP_SERVERS] = bootstrap_servers
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.scaleout", "--requests", str(requests),
         "--db", str(own_db)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=2))  # the figures, for the log
    context = f"worker logs: {report['worker_logs']}"
    changes = report["changes"]
    pauses = {f"{c['kind']} {c['worker']}": (c["pause_s"], c["until_assigned_s"]) for c in changes}
    print(
        f"rebalance pause (group stopped, s): max {report['max_rebalance_pause_s']}; per change "
        f"(pause, until all partitions assigned): {pauses}; largest gap in billing output "
        f"{report['max_output_gap_s']} s at {report['max_output_gap_at_s']} s; records fenced "
        f"(fetched before a revoke, dropped after it): {report['fenced_records']}"
    )

    # the schedule ran, each membership change in the middle of open requests
    kinds = [c["kind"] for c in changes]
    assert kinds.count("join") == 5, changes  # three at first, two later
    assert kinds.count("sigterm") == 1, changes
    assert kinds.count("sigkill") == 1, changes
    assert report["settle_timeouts"] == [], context
    for change in changes:
        assert change["produced"] < 1.0, f"{change} after the last record was produced"
        assert change["request_ids_open"] > 0, f"{change}: no request open"
        assert change["generation"] is not None, f"{change} led to no completed rebalance"
    # each generation held every partition once; only the one the SIGKILL cut short may
    # show fewer (the killed member died before it logged its share), never one twice
    cut_short = []
    for number, generation in report["generations"].items():
        assert not generation["partitions_twice"], f"generation {number}: {generation}"
        if generation["cut_short_by"] is None:
            assert generation["every_partition_once"], f"generation {number}: {generation}"
        elif not generation["every_partition_once"]:
            cut_short.append(generation["cut_short_by"])
    assert cut_short in ([], ["w1"]), report["generations"]
    # a clean leave hands its partitions over at once, not after the session timeout
    session_timeout = Settings.load().session_timeout
    leave = next(c for c in changes if c["kind"] == "sigterm")
    assert leave["until_assigned_s"] < session_timeout, leave
    # every worker that got SIGTERM left cleanly (the one mid-run, the three at the end)
    stops = report["clean_stops"]
    assert len(stops) == 4
    assert all(s["exit_code"] == 0 for s in stops), f"{stops}\n{context}"
    assert report["worker_error_lines"] == [], context

    # nobody else emptied or wrote the run's database meanwhile (else its figures mean nothing)
    assert report["redis_db_claimed_throughout"], f"Redis db {report['redis_db']} was taken"
    # exact: every request in Redis, equal to its fold; usage per tenant; one bill each
    # `stuck`: where a missing request's records are and what the group committed there
    assert report["never_finished_count"] == 0, f"{json.dumps(report['stuck'])}\n{context}"
    assert report["tokens_mismatches"] == [], context
    assert report["usage_mismatches"] == {}, context
    assert report["billing_export_mismatch_count"] == 0, report["billing_export_mismatches"]
    assert report["billing_requests"] == requests
    assert report["billing_event_ids"] == requests
    assert report["requests_without_billing"] == []
    assert report["requests_with_two_different_billing_events"] == [], context
    assert report["event_ids_with_two_payloads"] == [], context
    assert report["request_ids_of_two_tenants"] == requests // 2
    # every raw record applied once, dropped as a re-sent duplicate, or dead-lettered
    stats = report["stats"]
    assert stats["requests"] == requests
    assert report["duplicates_sent"] > 0
    assert report["raw_records_in"] == report["raw_messages_sent"]
    assert report["raw_records_in"] == (
        stats["records"] + stats["duplicates"] + stats["dead_lettered"]
    ), report
    assert stats["dead_lettered"] == report["dead_letter_messages"]
