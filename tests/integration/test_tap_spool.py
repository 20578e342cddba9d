"""A tapping process SIGKILLed mid-stream loses nothing: its spool is sent at restart.

`tests.integration.tap_child` taps ten requests of a 195-event transcript
through a `Tap` with a spool on disk and a slow sender (one record in
flight), printing each event once its append returned, each request begun once
the one before has appended 60 events.  It is SIGKILLed when the first request
has ended, while some are mid-stream and some not begun, so that the spool
holds records Kafka does not have.  A second process opened on the
same spool directory sends them.  Then, on the real stack:

- every record the killed process appended is in the raw topic, as a
  distinct (request, seq), and nothing else of its tenant is (at most the
  record whose append was under way at the kill); re-sent copies are
  allowed, as the worker drops them;
- before the restart some appended records were not in Kafka (the restart
  is what sent them);
- the real worker bills each request as `streamtally fold` folds what was
  appended: the whole transcript for the requests that ended, the events
  appended for those cut off (closed by the worker's request timeout).

Twice: with the tap's sender inline (in the gateway's event loop), and in a
sender process of its own (``Tap(sender_process=True)``, the proxy's default).
In the second, the sender process is SIGKILLed first, mid-stream (the tap starts
a new one, from the cursor), and the sender process there when the gateway is
SIGKILLed must exit by itself (no sender outlives its writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS
from streamtally.producers.spool import Spool
from streamtally.settings import Settings
from streamtally.wire.records import EventKind
from tests.integration.worker import (
    REPO,
    SAMPLES,
    WorkerProcess,
    as_called,
    cli,
    forget_usage,
    raw_sse_of,
    wait_for_tokens,
)

pytestmark = pytest.mark.integration

SAMPLE = "openai/long_text_bench.sse"
REQUESTS = 10
#: Lines read before the sender process alone is SIGKILLed (``process`` only).
KILL_SENDER_AFTER = 300


def children(pid: int) -> set[int]:
    """The pids of the children of process `pid` (Linux)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            out.update(int(child) for child in (task / "children").read_text().split())
    return out


def alive(pid: int) -> bool:
    """Process `pid` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def raw_records(servers: str, namespace: str, tenant: str) -> list[tuple[str, int, EventKind]]:
    """(request id, seq, kind) of every raw SSE record of `tenant`, copies included."""
    return [(r.request_id, r.seq, r.kind) for r in raw_sse_of(servers, namespace, [tenant])]


def sse_blocks(path: Path) -> list[bytes]:
    return [block + b"\n\n" for block in path.read_bytes().split(b"\n\n") if block.strip()]


def folded(path: Path) -> dict[str, Any] | None:
    """`fold` of the transcript at `path`; None when its events carry no content (a request
    cut after its role chunk), which `fold` refuses."""
    done = cli("fold", "--source", "openai", str(path))
    if done.code != 0 and "no openai content in" in done.err:
        return None
    assert done.code == 0, done.err
    return dict(json.loads(done.out))


@pytest.mark.parametrize("sender", ["inline", "process"])
def test_a_sigkilled_tap_resends_its_spool_and_every_appended_record_is_billed(
    worker: WorkerProcess, bootstrap_servers: str, redis_url: str, tmp_path: Path, sender: str
) -> None:
    run = "spool-" + uuid.uuid4().hex[:10]
    tenant = f"t-{run}"
    namespace = Settings.load().namespace
    spool_dir = tmp_path / "spool"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers, "PYTHONUNBUFFERED": "1"}
    child = [sys.executable, "-m", "tests.integration.tap_child"]
    try:
        gateway = subprocess.Popen(
            [
                *child,
                "stream",
                str(spool_dir),
                namespace,
                tenant,
                run,
                SAMPLE,
                str(REQUESTS),
                sender,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert gateway.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        killed_sender: int | None = None
        while not lines or not lines[-1].startswith("END "):  # killed at the first END
            assert time.monotonic() < deadline, f"no request ended in 120 s: {lines[-3:]}"
            line = gateway.stdout.readline()
            assert line, f"the child ended early (code {gateway.poll()}): {lines[-3:]}"
            lines.append(line.strip())
            if sender == "process" and len(lines) == KILL_SENDER_AFTER:
                (killed_sender,) = children(gateway.pid)
                os.kill(killed_sender, signal.SIGKILL)
        assert "DONE" not in lines
        senders = children(gateway.pid)
        if sender == "process":
            assert killed_sender is not None
            assert len(senders) == 1
            assert killed_sender not in senders, "a new sender process was started"
        gateway.send_signal(signal.SIGKILL)
        lines += [line.strip() for line in gateway.stdout.read().splitlines()]
        assert gateway.wait(10) == -signal.SIGKILL
        orphans = time.monotonic() + 15
        while any(alive(pid) for pid in senders) and time.monotonic() < orphans:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in senders), "no sender outlives its writer"

        appended: set[tuple[str, int]] = set()
        ended: dict[str, int] = {}
        for line in lines:
            kind, rid, seq = line.split()
            appended.add((rid, int(seq)))
            if kind == "END":
                ended[rid] = int(seq)
        started = {rid for rid, _ in appended}
        assert ended, "some requests ended before the kill"
        assert started - set(ended), "some were cut off mid-stream"
        assert len(started) < REQUESTS, "some had not begun"

        before = {(rid, seq) for rid, seq, _ in raw_records(bootstrap_servers, namespace, tenant)}
        assert appended - before, "the spool held records Kafka did not have at the kill"
        spool = Spool(spool_dir)  # (and the lock was the killed process's only)
        left = spool.unsent_records
        asyncio.run(spool.close())
        assert left > 0

        resumed = subprocess.run(
            [*child, "resume", str(spool_dir), namespace, sender],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.split() == ["SENT", str(left)]

        records = raw_records(bootstrap_servers, namespace, tenant)
        keys = Counter((rid, seq) for rid, seq, _ in records)
        assert appended <= set(keys), sorted(appended - set(keys))[:5]
        last = {rid: max(seq for r, seq in appended if r == rid) for rid in started}
        extra = set(keys) - appended
        assert all(seq == last.get(rid, -1) + 1 for rid, seq in extra), sorted(extra)[:5]
        ends = {rid: seq for rid, seq, kind in records if kind is EventKind.END}

        # The worker bills every request as the fold of what was appended.
        blocks = sse_blocks(SAMPLES / SAMPLE)
        requests = {rid for rid, _ in keys}
        refs = {rid: RequestRef(tenant, rid) for rid in requests}
        missing = wait_for_tokens(redis_url, refs.values(), timeout=150, worker=worker)
        assert not missing, f"no Tokens for {missing}"
        total = dict.fromkeys(USAGE_FIELDS, 0)
        for rid in sorted(requests):
            events = sum(1 for r, _ in keys if r == rid) - (rid in ends)
            prefix = tmp_path / f"{rid}.sse"
            prefix.write_bytes(b"".join(blocks[:events]))
            fold = folded(prefix)
            got = cli("tokens", "get", rid, "--tenant", tenant)
            assert got.code == 0, got.err
            tokens = json.loads(got.out)
            if fold is None:  # cut before any content: closed by the timeout, with nothing
                assert rid not in ends, rid
                assert tokens["text"] == "", rid
                assert not any(tokens["usage"][name] for name in USAGE_FIELDS), rid
                continue
            want = as_called(fold, rid)
            if rid in ends:
                assert events == len(blocks)
                assert tokens == want, rid
            else:  # closed by the worker's timeout: what came, no finish
                assert (tokens["text"], tokens["usage"]) == (want["text"], want["usage"]), rid
            for name in USAGE_FIELDS:
                total[name] += tokens["usage"][name] or 0
        rows = cli("usage", "--tenant", tenant, "--json")
        assert rows.code == 0, rows.err
        [row] = json.loads(rows.out)
        assert row["requests"] == len(requests)
        assert {name: row[name] for name in USAGE_FIELDS} == total
    finally:
        forget_usage(redis_url, [tenant])
