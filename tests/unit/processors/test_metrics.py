"""The worker's metrics (`processors.metrics`): their counts, /ready's judgement, the handlers."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from datetime import UTC, datetime

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ConnectionError as RedisConnectionError

from streamtally.billing.pricing import PriceTable
from streamtally.core.models import Source
from streamtally.processors import metrics as m
from streamtally.processors.requests import Outputs, Position, RequestProcessor
from streamtally.processors.sinks import Sinks
from streamtally.producers import raw_records
from streamtally.topics import Topics
from streamtally.wire.records import DeadLetter

TOPIC = Topics.in_namespace().raw_sse.name


def _stream(model: str, finish: str) -> bytes:
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","model":"' + model.encode() + b'",'
        b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"'
        + finish.encode()
        + b'"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _letter(reason: str, error_type: str = "InputError") -> DeadLetter:
    return DeadLetter(
        topic=TOPIC,
        partition=0,
        offset=0,
        key=b"k",
        value=b"v",
        reason=reason,
        error_type=error_type,
        source=None,
        request_id=None,
        dead_lettered_at=datetime(2026, 11, 24, tzinfo=UTC),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- counting


@pytest.mark.parametrize(
    ("reason", "error_type", "label"),
    [
        ("a tombstone (a record with no value) on a raw topic", "InputError", "tombstone"),
        ("record has no key: a raw record is keyed by its request id", "InputError", "no_key"),
        ("record of 5000000 bytes exceeds the 4194304-byte limit", "InputError", "oversized"),
        ("event for request acme:r-1, which is already closed", "InputError", "late"),
        ("event seq 9 of request acme:r-1 after its end marker", "InputError", "late"),
        ("end marker of request acme:r-1, which has no events", "InputError", "lone_end"),
        ("... the limit (STREAMTALLY_MAX_OPEN_PER_TENANT=3)", "InputError", "tenant_limit"),
        (
            "request acme:r changed source mid-stream (openai → gemini)",
            "InputError",
            "source_switch",
        ),
        ("not a single-object encoding", "AvroDecodeError", "undecodable"),
        ("chunk 3: not valid JSON", "InputError", "invalid_event"),
    ],
)
def test_dead_letter_reasons_are_a_few_words_never_the_request(
    reason: str, error_type: str, label: str
) -> None:
    assert m.dead_letter_reason(_letter(reason, error_type)) == label


def test_counts_come_from_the_processor_and_the_written_batches() -> None:
    processor = RequestProcessor(PriceTable.default())
    metrics = m.WorkerMetrics(lambda: processor.counters, lambda: processor.open_requests)
    out = Outputs()
    for i, (model, finish) in enumerate(
        [("gpt-4o", "stop"), ("gpt-4o", "length"), ("no-such-model", "stop")]
    ):
        rid = f"r-{i}"
        for j, value in enumerate(
            raw_records(Source.OPENAI, _stream(model, finish), tenant="acme", request_id=rid)[1]
        ):
            processor.handle_sse(rid.encode(), value, Position(TOPIC, 0, 10 * i + j, 1.0), out)
    processor.handle_sse(b"junk", b"not avro", Position(TOPIC, 0, 99, 1.0), out)
    # a request left open
    first = raw_records(Source.OPENAI, _stream("gpt-4o", "stop"), tenant="acme", request_id="o")
    processor.handle_sse(b"o", first[1][0], Position(TOPIC, 1, 0, 1.0), out)
    metrics.written(out)

    got = _samples(metrics.exposition().decode())
    c = processor.counters
    assert got["streamtally_records_received_total", ()] == c.received == 8
    assert got["streamtally_records_applied_total", ()] == c.applied == 7
    assert got["streamtally_records_dead_lettered_total", (("reason", "undecodable"),)] == 1
    assert got["streamtally_requests_open", ()] == 1
    stop = (("closed_by", "end"), ("finish_reason", "stop"))
    length = (("closed_by", "end"), ("finish_reason", "length"))
    assert got["streamtally_requests_closed_total", stop] == 2
    assert got["streamtally_requests_closed_total", length] == 1
    assert got["streamtally_billing_events_total", (("priced", "true"),)] == 2
    assert got["streamtally_billing_events_total", (("priced", "false"),)] == 1
    assert got["streamtally_requests_unpriced_total", ()] == 1
    assert got["streamtally_ready", ()] == 0  # nothing assigned, nothing answered


def test_rebalances_lag_and_sink_errors() -> None:
    metrics = m.WorkerMetrics()
    metrics.assigned({("t", 0), ("t", 1)})
    metrics.revoked()
    metrics.assigned({("t", 1)})
    metrics.set_lag({("t", 0): 5, ("t", 1): 0})
    metrics.set_lag({("t", 1): 3})  # a revoked partition's lag is not kept
    metrics.sink_error("redis", RedisConnectionError("down"), True)
    metrics.sink_error("kafka", OSError("down"), False)
    got = _samples(metrics.exposition().decode())
    assert got["streamtally_rebalances_total", (("event", "assigned"),)] == 2
    assert got["streamtally_rebalances_total", (("event", "revoked"),)] == 1
    assert got["streamtally_partitions_assigned", ()] == 1
    lags = {k: v for k, v in got.items() if k[0] == "streamtally_consumer_lag"}
    assert lags == {("streamtally_consumer_lag", (("partition", "1"), ("topic", "t"))): 3}
    redis_error = (("error", "ConnectionError"), ("store", "redis"))
    assert got["streamtally_sink_errors_total", redis_error] == 1
    assert got["streamtally_sink_errors_total", (("error", "OSError"), ("store", "kafka"))] == 1
    assert got["streamtally_sink_retries_total", (("store", "redis"),)] == 1
    assert ("streamtally_sink_retries_total", (("store", "kafka"),)) not in got


# --------------------------------------------------------------------------- readiness


def test_ready_needs_an_assignment_and_fresh_answers_from_kafka_and_redis() -> None:
    clock = Clock()
    health = m.Health(window=5.0, clock=clock)
    ok, doc = health.ready()
    assert not ok
    assert "no partition assignment" in doc["reason"]
    assert "kafka has not answered yet" in doc["reason"]
    health.partitions = frozenset()  # the group has none to give: still ready
    health.kafka_at = health.redis_at = 99.0
    ok, doc = health.ready()
    assert ok
    assert doc == {
        "ready": True,
        "partitions": 0,
        "kafka_answered_s_ago": 1.0,
        "redis_answered_s_ago": 1.0,
    }
    clock.now = 110.0
    health.kafka_at = 109.0
    ok, doc = health.ready()
    assert not ok
    assert doc["reason"] == "redis has not answered for 11.0s"


# --------------------------------------------------------------------------- the handlers


async def test_the_endpoints() -> None:
    clock = Clock()
    metrics = m.WorkerMetrics(health=m.Health(clock=clock))
    async with TestClient(TestServer(m.web_app(metrics))) as client:
        health = await client.get("/health")
        assert health.status == 200
        assert await health.json() == {"alive": True}
        not_ready = await client.get("/ready")
        assert not_ready.status == 503
        assert "reason" in await not_ready.json()
        metrics.assigned({("t", 0)})
        metrics.health.kafka_at = metrics.health.redis_at = clock.now
        ready = await client.get("/ready")
        assert ready.status == 200
        assert (await ready.json())["partitions"] == 1
        page = await client.get("/metrics")
        assert page.status == 200
        assert page.headers["Content-Type"].startswith("text/plain")
        got = _samples(await page.text())
        assert got["streamtally_ready", ()] == 1
        assert (await client.get("/nothing")).status == 404


class FakeSource:
    def __init__(self, age: float | None) -> None:
        self.age = age
        self.pings = 0

    def fetch_age(self) -> float | None:
        return self.age

    async def ping(self) -> None:
        self.pings += 1

    async def lag(self) -> dict[tuple[str, int], int]:
        return {("t", 0): 7}


class FakeStores:
    answered_at: float | None = 42.0


@pytest.mark.parametrize(("age", "pings"), [(0.1, 0), (None, 1)])
async def test_the_watcher_reads_fetches_pings_kafka_without_them_and_sets_lag(
    age: float | None, pings: int
) -> None:
    clock = Clock()
    metrics = m.WorkerMetrics(health=m.Health(clock=clock))
    source = FakeSource(age)
    watch = asyncio.create_task(m._watch(metrics, lambda: source, FakeStores))
    await asyncio.sleep(0.05)
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch
    assert metrics.health.redis_at == 42.0
    assert metrics.health.kafka_at == (clock.now - age if age is not None else clock.now)
    assert source.pings == pings
    assert (
        _samples(metrics.exposition().decode())[
            "streamtally_consumer_lag", (("partition", "0"), ("topic", "t"))
        ]
        == 7
    )


async def test_serve_port_0_serves_nothing_and_a_taken_port_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = m.WorkerMetrics()
    await asyncio.wait_for(m.serve(metrics, "127.0.0.1", 0, lambda: None, lambda: None), 1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger=m.__name__):
            await asyncio.wait_for(
                m.serve(metrics, "127.0.0.1", port, lambda: None, lambda: None), 5
            )
    assert f"metrics server not started on 127.0.0.1:{port}" in caplog.text


# --------------------------------------------------------------------------- the sinks' side


class FlakySink:
    def __init__(self, failures: int) -> None:
        self.failures = failures

    async def begin(self, outputs: Outputs) -> None:
        del outputs

    def add(self, outputs: Outputs) -> None:
        del outputs

    async def flush(self) -> None:
        if self.failures:
            self.failures -= 1
            raise RedisConnectionError("down")

    async def probe(self) -> None:
        if self.failures:
            raise RedisConnectionError("down")


async def test_sinks_report_each_failure_and_when_they_last_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    sink = FlakySink(failures=2)
    sinks = Sinks(sink)
    seen: list[tuple[str, str, bool]] = []
    sinks.on_error = lambda store, exc, retried: seen.append((store, type(exc).__name__, retried))
    await sinks.probe()
    assert seen == [("FlakySink", "ConnectionError", False)]
    assert sinks.answered_at is None
    out = Outputs(dead_letters=[_letter("x")])
    await sinks.write(out)
    assert seen[1:] == [("FlakySink", "ConnectionError", True)] * 2
    assert sinks.answered_at is not None
    answered = sinks.answered_at
    await sinks.probe()
    assert sinks.answered_at >= answered


_real_sleep = asyncio.sleep


async def _no_sleep(delay: float) -> None:
    del delay
    await _real_sleep(0)


def test_the_ready_document_is_json() -> None:
    ok, doc = m.Health().ready()
    assert not ok
    assert json.loads(json.dumps(doc)) == doc
