"""`streamtally worker` as a process: SIGTERM, a restart mid-request, and `tokens get` misses.

Each test starts its own worker (`start_worker`), which has joined the
consumer group and put a probe request through before the test goes on.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from streamtally.cli import main
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.producers import RawProducer
from streamtally.producers.raw import raw_records
from streamtally.settings import ENV_REDIS_URL, Settings
from streamtally.topics import Topics
from tests.integration.worker import (
    PROBE_FILE,
    PROBE_SOURCE,
    READY_LINE,
    SAMPLES,
    Endpoints,
    WorkerProcess,
    assert_stopped_cleanly,
    cli,
    forget_usage,
    run_streamtally,
    wait_for_tokens,
)

pytestmark = pytest.mark.integration

#: What the worker logs (info level) once it has got SIGTERM.
STOPPING = "[^Worker]: Stopping..."
#: A longer transcript (many SSE events), split in two around a worker restart.
SPLIT_FILE = SAMPLES / "anthropic" / "thinking_then_text.sse"
SPLIT_SOURCE = Source.ANTHROPIC


def _after_ready(worker: WorkerProcess) -> str:
    text = worker.log_text()
    return text[text.index(READY_LINE) :]


def test_sigterm_stops_the_worker_cleanly(start_worker: Callable[..., WorkerProcess]) -> None:
    worker = start_worker("sigterm")
    took = assert_stopped_cleanly(worker, timeout=30)
    after = _after_ready(worker)
    assert STOPPING in after, worker.describe()
    assert "Traceback" not in worker.log_text(), worker.describe()
    assert "[ERROR]" not in worker.log_text(), worker.describe()
    assert took < 30


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_sigterm_while_the_worker_starts_is_a_clean_stop(
    stack_endpoints: Endpoints, tmp_path: Path
) -> None:
    """Before faust takes SIGTERM over (here: the worker waits for a Redis that does not
    answer), a SIGTERM stops the start-up: exit 0 and one line, not a death by signal."""
    env = {**stack_endpoints.env(), ENV_REDIS_URL: f"redis://127.0.0.1:{_closed_port()}/0"}
    worker = WorkerProcess(tmp_path / "starting.log", env).start()
    try:
        worker.wait_for_log("does not answer", timeout=60)
        code, took = worker.stop(timeout=20)
    finally:
        if worker.running:
            worker.kill()
    assert code == 0, worker.describe()
    assert took < 20
    log = worker.log_text()
    assert "streamtally worker: SIGTERM while starting: stopped before reading anything" in log
    assert "Traceback" not in log, worker.describe()
    assert READY_LINE not in log


async def _partitions(servers: str, topic: str) -> list[int]:
    producer = AIOKafkaProducer(bootstrap_servers=servers)
    await producer.start()
    try:
        return sorted(await producer.partitions_for(topic))
    finally:
        await producer.stop()


def _same_partition_id(prefix: str, other: str, partitions: list[int]) -> str:
    """A fresh request id whose records land on the partition of `other`'s (default partitioner)."""

    def partition(key: str) -> int:
        return int(DefaultPartitioner()(key.encode(), partitions, partitions))

    target = partition(other)
    while True:
        candidate = f"{prefix}-{uuid.uuid4().hex}"
        if partition(candidate) == target:
            return candidate


async def _send(servers: str, source: Source, request_id: str, records: list[bytes]) -> None:
    async with RawProducer(servers, namespace=Settings.load().namespace) as producer:
        await producer.send_records(source, request_id, records)


def _fold(source: Source, path: Path, request_id: str) -> bytes:
    result = cli("fold", "--source", source.value, "--request-id", request_id, str(path))
    assert result.code == 0, result.err
    return result.out


def test_a_request_open_across_a_sigterm_is_finished_by_the_next_worker(
    start_worker: Callable[..., WorkerProcess], stack_endpoints: Endpoints
) -> None:
    """Records of a request still open at SIGTERM are read again by the next worker.

    The first half of a request goes to the first worker; a complete request
    behind it on the same partition proves the worker has consumed (and could
    have committed) that half.  After SIGTERM and a new worker, the second half
    follows: the Tokens must be the fold of the whole transcript.
    """
    tag = uuid.uuid4().hex
    split_id, tenant = f"split-{tag}", f"split-{tag}"
    split = RequestRef(tenant, split_id)
    _, records = raw_records(
        SPLIT_SOURCE, SPLIT_FILE.read_bytes(), tenant=tenant, request_id=split_id
    )
    assert len(records) >= 6, "need a transcript with several events"
    half = len(records) // 2
    servers, url = stack_endpoints.bootstrap_servers, stack_endpoints.redis_url
    raw_topic = Topics.in_namespace(Settings.load().namespace).raw_sse.name
    partitions = asyncio.run(_partitions(servers, raw_topic))
    behind = _same_partition_id(f"behind-{tag}", split_id, partitions)
    _, behind_records = raw_records(
        Source(PROBE_SOURCE), PROBE_FILE.read_bytes(), tenant=tenant, request_id=behind
    )
    try:
        first = start_worker("before-sigterm")
        asyncio.run(_send(servers, SPLIT_SOURCE, split_id, records[:half]))
        asyncio.run(_send(servers, Source(PROBE_SOURCE), behind, behind_records))
        assert not wait_for_tokens(url, [RequestRef(tenant, behind)], 30, first), first.describe()
        time.sleep(1.5)  # past the worker's commit interval (0.5 s)
        assert_stopped_cleanly(first)
        # still open: a worker that stops must not close it with half of its events
        assert wait_for_tokens(url, [split], 0) == {split}, first.describe()

        second = start_worker("after-sigterm")
        asyncio.run(_send(servers, SPLIT_SOURCE, split_id, records[half:]))
        missing = wait_for_tokens(url, [split], 30, second)
        assert not missing, second.describe()
        stored = run_streamtally(
            "tokens", "get", split_id, "--tenant", tenant, env=stack_endpoints.env()
        )
        assert stored.returncode == 0, stored.stderr.decode(errors="replace")
        folded = json.loads(_fold(SPLIT_SOURCE, SPLIT_FILE, split_id))
        got = json.loads(stored.stdout)
        differ = {k: (got.get(k), v) for k, v in folded.items() if got.get(k) != v}
        assert not differ, f"stored != fold in {sorted(differ)}: {differ}\n{second.describe()}"
        assert_stopped_cleanly(second)
    finally:
        forget_usage(url, [tenant])


def test_tokens_get_of_an_unknown_request_exits_2(
    stack_endpoints: Endpoints, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    missing = f"unknown-{uuid.uuid4().hex}"
    proc = run_streamtally("tokens", "get", missing, env=stack_endpoints.env(), timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == b""
    assert proc.stderr.decode() == (
        f"streamtally tokens: {missing} not found (unknown, or still streaming)\n"
    )
    # the same in-process, against the same Redis
    assert main(["tokens", "get", missing, "--redis-url", stack_endpoints.redis_url]) == 2
    assert capsysbinary.readouterr().out == b""
    # and of a tenant: an unknown (tenant, request id)
    tenant = f"unknown-{uuid.uuid4().hex}"
    argv = ["tokens", "get", missing, "--tenant", tenant, "--redis-url", stack_endpoints.redis_url]
    assert main(argv) == 2
    captured = capsysbinary.readouterr()
    assert captured.out == b""
    assert captured.err.decode() == (
        f"streamtally tokens: {missing} of tenant {tenant} not found "
        "(unknown, or still streaming)\n"
    )
