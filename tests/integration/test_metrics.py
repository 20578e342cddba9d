"""The worker's /metrics, /health and /ready, scraped while real traffic goes through it.

A worker in a topic namespace and Redis database of its own, on a port of its
own, gets a few sample transcripts (SSE and engine) and one garbage record;
its counters must say exactly that: every record received, the samples'
records applied, one record dead-lettered as undecodable, one billing event
(one of them unpriced) and one closed request per sample.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from streamtally.core.models import Source
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.topics import Topics
from tests.integration.worker import SAMPLES, own_worker

pytestmark = pytest.mark.integration

#: (file, source, request id, model) of the requests sent.
SENT = [
    ("openai/text_usage.sse", Source.OPENAI, "m-openai-1", None),
    ("anthropic/text_end_turn.sse", Source.ANTHROPIC, "m-anthropic-1", None),
    ("gemini/thoughts_cached.sse", Source.GEMINI, "m-gemini-1", None),
    # a model the price table does not name: billed unpriced
    ("dynamo/eos_no_usage.jsonl", Source.DYNAMO, "m-dynamo-1", "no-such-model"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = _get(f"{base}/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


#: A worker logs this once its server listens; faust's "Ready" line can come first, as the
#: server is one of the app's tasks.
LISTENING = "metrics, health and readiness on http://127.0.0.1:{port}/"
#: It logs this instead when the port is taken (another process took the free port first).
NOT_STARTED = "metrics server not started on 127.0.0.1:{port}"


def _listening(worker: Any, port: int, timeout: float) -> bool:
    """Whether the worker's server came up on `port`: False if the port was taken."""
    started = LISTENING.format(port=port)
    return worker.wait_for_any((started, NOT_STARTED.format(port=port)), timeout) == started


@pytest.fixture
def scene(
    stack_endpoints: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Settings, str]]:
    for attempt in range(3):
        port = _free_port()
        monkeypatch.setenv("STREAMTALLY_WEB_PORT", str(port))
        with own_worker(
            stack_endpoints.bootstrap_servers,
            stack_endpoints.redis_url,
            prefix="metrics",
            log=tmp_path / f"worker-{attempt}.log",
            request_timeout=30,
        ) as (settings, worker):
            if not _listening(worker, port, 30):
                continue
            yield settings, f"http://127.0.0.1:{port}"
            worker.check()
            return
    pytest.fail("three free ports were taken before the worker could listen on them")


async def _send(settings: Settings) -> int:
    """The samples' raw records and one garbage record; returns how many records were sent."""
    sent = 0
    async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as producer:
        for file, source, request_id, model in SENT:
            _, records = raw_records(
                source,
                (SAMPLES / file).read_bytes(),
                tenant="acme",
                request_id=request_id,
                model=model,
            )
            await producer.send_records(source, request_id, records)
            sent += len(records)
    garbage = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers)
    await garbage.start()
    try:
        topic = Topics.in_namespace(settings.namespace).raw_sse.name
        await garbage.send_and_wait(topic, b"not an avro record", key=b"m-garbage")
    finally:
        await garbage.stop()
    return sent + 1


def test_metrics_count_what_was_sent_and_ready_says_so(scene: tuple[Settings, str]) -> None:
    settings, base = scene
    assert _get(f"{base}/health")[0] == 200
    deadline = time.monotonic() + 60
    while (ready := _get(f"{base}/ready"))[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ready[0] == 200, ready
    doc = json.loads(ready[1])
    assert doc["ready"] is True
    assert doc["partitions"] == 12  # both raw topics, one worker

    sent = asyncio.run(_send(settings))
    deadline = time.monotonic() + 90
    while True:
        samples = _scrape(base)
        billed = _total(samples, "streamtally_billing_events_total")
        dead = _total(samples, "streamtally_records_dead_lettered_total")
        if (billed >= len(SENT) and dead >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    assert _total(samples, "streamtally_records_received_total") == sent
    assert _total(samples, "streamtally_records_applied_total") == sent - 1
    assert _total(samples, "streamtally_records_duplicate_total") == 0
    assert samples["streamtally_records_dead_lettered_total", (("reason", "undecodable"),)] == 1
    assert dead == 1
    assert samples["streamtally_billing_events_total", (("priced", "true"),)] == len(SENT) - 1
    assert samples["streamtally_billing_events_total", (("priced", "false"),)] == 1
    assert samples["streamtally_requests_unpriced_total", ()] == 1
    assert billed == len(SENT)
    closed = _total(samples, "streamtally_requests_closed_total")
    assert closed == len(SENT)
    by = (("closed_by", "end"), ("finish_reason", "stop"))  # every sample ends with a stop
    assert samples["streamtally_requests_closed_total", by] == len(SENT)
    assert samples["streamtally_requests_open", ()] == 0
    assert _total(samples, "streamtally_batch_seconds_count") >= 1
    assert samples["streamtally_partitions_assigned", ()] == 12
    assert samples["streamtally_rebalances_total", (("event", "assigned"),)] >= 1
    assert samples["streamtally_ready", ()] == 1
    # lag per partition (refreshed once a second): every raw partition, nothing left to fetch
    deadline = time.monotonic() + 10
    while True:
        lags = {
            labels: v for (n, labels), v in _scrape(base).items() if n == "streamtally_consumer_lag"
        }
        if set(lags.values()) == {0.0} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(lags) == 12
    assert set(lags.values()) == {0.0}
