"""Fault injection: Redis, then Kafka, down for three request timeouts while requests are open.

Afterwards every request's Tokens equals `fold` of its transcript, the usage
rows equal the sum of the folds, and no request was closed as timed out.
(Before, an outage longer than the request timeout closed the open requests
as `error` once the stack was back, and their usage went unbilled.)

On the fault stack (`fault_stack`, tests/integration/heavy/conftest.py: a local stack
of the process's own, never the shared one), whose services the test stops and starts.
Its own topic namespace and Redis database.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, Source
from streamtally.core.normalize import fold_stream, read_events
from streamtally.ops.worker_process import WorkerProcess
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.stack import kafka, redis
from streamtally.stack.config import StackConfig
from streamtally.store import RedisStore
from tests.integration.worker import external_stack, own_worker

pytestmark = [pytest.mark.integration, pytest.mark.fault_stack, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "samples"
#: Seconds a request may stay quiet; each outage lasts three of them.  (8, not 5: with 5,
#: on 2026-11-24 the Kafka phase closed some requests as timed out in 4 of 12 runs, with
#: and without the compiled modules; the restarted broker then took up to 19 s to serve
#: fetches again, and the test's producer was still retrying NotLeaderForPartition.  What
#: the worker sees there is a producer gone quiet after the outage.)
TIMEOUT = 8.0
OUTAGE = 3 * TIMEOUT
FILES = [
    ("openai/text_usage.sse", Source.OPENAI, None),
    ("anthropic/text_end_turn.sse", Source.ANTHROPIC, None),
    ("gemini/thoughts_cached.sse", Source.GEMINI, None),
    ("openai-responses/text_cached.sse", Source.OPENAI_RESPONSES, None),
    ("vllm/delta_stop_cached.jsonl", Source.VLLM, "meta-llama/Meta-Llama-3.1-70B-Instruct"),
]


def _local_stack() -> StackConfig:
    if (external := external_stack()) is not None:
        pytest.skip(external)
    return StackConfig.from_settings(Settings.load())


class Request:
    def __init__(self, run: str, i: int, tenant: str) -> None:
        file, self.source, self.model = FILES[i % len(FILES)]
        self.request_id = f"outage-{run}-{i}"
        self.tenant = tenant
        self.ref = RequestRef(tenant, self.request_id)
        self.data = (SAMPLES / file).read_bytes()
        _, self.records = raw_records(
            self.source, self.data, tenant=tenant, request_id=self.request_id, model=self.model
        )

    def folded(self) -> dict[str, Any]:
        events = read_events(self.source, io.BytesIO(self.data))
        tokens = fold_stream(self.source, events, request_id=self.request_id, model=self.model)
        return tokens.to_json_dict()


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[tuple[StackConfig, Settings, WorkerProcess, str]]:
    cfg = _local_stack()
    try:
        with own_worker(
            cfg.local_bootstrap_servers(),
            cfg.local_redis_url(),
            prefix="outage",
            log=tmp_path / "worker.log",
            request_timeout=TIMEOUT,
        ) as (settings, worker):
            yield cfg, settings, worker, settings.namespace.removeprefix("outage-")
    finally:
        # whatever happened, the stack is left running for the tests after this one
        kafka.up(cfg, print)
        redis.up(cfg, print)


async def _send(settings: Settings, parts: list[tuple[Request, slice]]) -> None:
    async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as producer:
        for request, part in parts:
            await producer.send_records(request.source, request.request_id, request.records[part])


async def _wait_tokens(
    settings: Settings, refs: list[RequestRef], timeout: float
) -> dict[RequestRef, Any]:
    store = RedisStore.from_url(settings.redis_url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not await store.missing_tokens(refs):
                return {ref: await store.tokens(ref) for ref in refs}
            await asyncio.sleep(0.2)
        missing = await store.missing_tokens(refs)
        raise AssertionError(f"{len(missing)} requests never reached Redis: {missing[:5]}")
    finally:
        await store.aclose()


async def _usage(settings: Settings, tenant: str) -> dict[str, int]:
    store = RedisStore.from_url(settings.redis_url)
    try:
        rows = await store.usage_rows(tenant=tenant)
    finally:
        await store.aclose()
    totals: dict[str, int] = defaultdict(int)
    for row in rows:
        totals["requests"] += row["requests"]
        for field in USAGE_FIELDS:
            totals[field] += row[field]
    return dict(totals)


def _check(settings: Settings, requests: list[Request], tenant: str, worker: WorkerProcess) -> None:
    stored = asyncio.run(_wait_tokens(settings, [r.ref for r in requests], 60))
    timed_out = [ref for ref, t in stored.items() if "timed out" in ((t or {}).get("error") or "")]
    assert timed_out == [], (timed_out, worker.describe())
    for request in requests:
        assert stored[request.ref] == request.folded(), request.ref
    expected: dict[str, int] = defaultdict(int)
    for request in requests:
        expected["requests"] += 1
        for field in USAGE_FIELDS:
            expected[field] += request.folded()["usage"][field]
    assert asyncio.run(_usage(settings, tenant)) == dict(expected)


def test_redis_then_kafka_down_for_three_timeouts_bills_exactly(
    scene: tuple[StackConfig, Settings, WorkerProcess, str],
) -> None:
    cfg, settings, worker, run = scene

    # Redis down while requests are open and their events keep coming.
    tenant = f"outage-redis-{run}"
    requests = [Request(run, i, tenant) for i in range(10)]
    asyncio.run(_send(settings, [(r, slice(0, 1)) for r in requests]))
    time.sleep(0.5)  # the worker holds them open
    redis.down(cfg, print)
    asyncio.run(_send(settings, [(r, slice(1, 2)) for r in requests]))
    time.sleep(OUTAGE)
    redis.up(cfg, print)
    asyncio.run(_send(settings, [(r, slice(2, None)) for r in requests]))
    _check(settings, requests, tenant, worker)

    # Kafka down while requests are open; producers send the rest once it is back.
    tenant = f"outage-kafka-{run}"
    requests = [Request(run, 100 + i, tenant) for i in range(10)]
    asyncio.run(_send(settings, [(r, slice(0, 1)) for r in requests]))
    time.sleep(0.5)
    kafka.down(cfg, print)
    time.sleep(OUTAGE)
    kafka.up(cfg, print)
    asyncio.run(_send(settings, [(r, slice(1, None)) for r in requests]))
    _check(settings, requests, tenant, worker)
    worker.check()  # still running


def test_sigterm_during_a_redis_outage_stops_in_seconds_and_loses_nothing(
    scene: tuple[StackConfig, Settings, WorkerProcess, str],
) -> None:
    """A worker stuck retrying a write to a Redis that is down still stops on SIGTERM.

    Its batch stays unwritten and uncommitted, so the next worker applies it:
    the requests end exact.  Prints the seconds SIGTERM took (the figure; the
    bound asserted is the worker wrapper's own 30 s before SIGKILL).
    """
    cfg, settings, worker, run = scene
    tenant = f"outage-sigterm-{run}"
    requests = [Request(run, 200 + i, tenant) for i in range(6)]
    asyncio.run(_send(settings, [(r, slice(0, 1)) for r in requests]))
    time.sleep(0.5)  # the worker holds them open
    redis.down(cfg, print)
    try:
        asyncio.run(_send(settings, [(r, slice(1, None)) for r in requests]))  # ENDs included
        time.sleep(3.0)  # the worker now retries writing their outputs
        code, seconds = worker.stop(timeout=30)
        print(f"SIGTERM during a Redis outage: the worker stopped in {seconds:.2f} s")
        assert code == 0, worker.describe()
    finally:
        redis.up(cfg, print)
    worker.start()
    worker.wait_until_ready(60)
    _check(settings, requests, tenant, worker)
