"""The worker stops within seconds, even while a sink is down, and closes its sinks last.

Before: the sinks were closed on faust's `on_before_shutdown`, which fires
before the agent stops, so a batch in flight met a closed producer, and
`retry` took `ProducerClosed` for an outage and retried it forever (a worker
that never exits keeps its partitions from the rest of the group).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.errors import ProducerClosed
from redis.exceptions import ConnectionError as RedisConnectionError

from streamtally.processors.app import Pipeline, create_app
from streamtally.processors.requests import Outputs
from streamtally.processors.sinks import Sinks, retry
from streamtally.processors.source import RawMessage
from streamtally.settings import Settings
from streamtally.topics import Topics

pytestmark = pytest.mark.timeout(20)


class DownSink:
    """A sink whose store is unreachable: every flush fails as an outage does."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def begin(self, outputs: Outputs) -> None:
        del outputs

    def add(self, outputs: Outputs) -> None:
        del outputs

    async def flush(self) -> None:
        self.events.append("flush")
        raise RedisConnectionError("Redis is down")

    async def stop(self) -> None:
        self.events.append("stop")


@pytest.fixture
async def stalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Pipeline, DownSink]]:
    monkeypatch.chdir(tmp_path)
    settings = Settings.load(
        {
            "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "REDIS_URL": "redis://127.0.0.1:1/0",
            "STREAMTALLY_STATE_DIR": str(tmp_path / "state"),
        }
    )
    sink = DownSink()
    pipeline = create_app(settings, lambda app: Sinks(sink), consume=False)
    app = pipeline.app
    ready = asyncio.Event()

    async def startup_finished() -> None:
        ready.set()

    app.on_startup_finished = startup_finished
    await asyncio.wait_for(app.start(), 5)
    await asyncio.wait_for(ready.wait(), 5)
    app.flow_control.resume()  # as the worker's raw-topic task does
    yield pipeline, sink
    if not app.should_stop:
        await app.stop()


async def test_stop_during_an_outage_takes_seconds_and_closes_the_sinks_last(
    stalled: tuple[Pipeline, DownSink],
) -> None:
    pipeline, sink = stalled
    topic = Topics.in_namespace().raw_sse.name
    junk = (RawMessage(topic, 0, 0, 1_790_000_000.0, b"r-1", b"\x00not avro"),)
    await pipeline.agents["process-raw"].send(value=junk)  # a dead letter to write
    deadline = time.monotonic() + 5
    while sink.events.count("flush") < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sink.events.count("flush") >= 2  # the write is being retried: Redis is "down"

    started = time.monotonic()
    await asyncio.wait_for(pipeline.app.stop(), 10)
    assert time.monotonic() - started < 10
    # the sinks were closed once, after the last write attempt: nothing wrote after it
    assert sink.events[-1] == "stop"
    assert sink.events.count("stop") == 1


async def test_a_closed_producer_is_not_an_outage() -> None:
    calls = 0

    async def send() -> None:
        nonlocal calls
        calls += 1
        raise ProducerClosed()

    with pytest.raises(ProducerClosed):
        await asyncio.wait_for(retry(send, "kafka"), 2)
    assert calls == 1


async def test_an_outage_is_retried_until_it_ends() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise RedisConnectionError("down")
        return "written"

    assert await asyncio.wait_for(retry(flaky, "redis"), 5) == "written"
    assert calls == 3
