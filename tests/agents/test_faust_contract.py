"""What the worker relies on in faust's private API, pinned (faust-streaming 0.15.3).

`streamtally.processors.app` and `streamtally.cli.worker` reach past faust's
public API in four places; each test here fails if a faust upgrade changes
what that code relies on (see docs/architecture.md, "faust's role"):

- `_Boot` sets `BootStrategy.enable_kafka_consumer = False`, so faust's own
  consumer, topic conductor and tables are never started (the worker's
  `RawSource` reads the raw topics instead), and with no tables start-up does
  not wait for a table recovery; and `enable_kafka_producer = False`, so
  faust's unused producer never connects (the sinks have their own);
- `BatchLoop.fetch` calls `app.flow_control.resume()`, because faust keeps
  every channel queue suspended until its own consumer gets partitions;
- `streamtally worker` sets `worker.spinner = None`, because faust's spinner
  switches the root logger to DEBUG.

No broker is contacted: the app is started exactly as the worker starts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import faust
import mode.utils.logging
import pytest
from faust.app.base import BootStrategy
from faust.utils.terminal import Spinner, SpinnerHandler

from streamtally.processors.app import Pipeline, _Boot, _WorkerApp, create_app
from streamtally.processors.requests import Outputs
from streamtally.processors.sinks import Sinks
from streamtally.processors.source import RawMessage
from streamtally.settings import Settings
from streamtally.topics import Topics

pytestmark = pytest.mark.timeout(10)

#: Long enough for any ready task to run; what must not happen is waited for this long.
SETTLE = 0.05
#: What must happen is waited for at most this long.
DEADLINE = 1.0


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[Outputs] = []

    async def begin(self, outputs: Outputs) -> None:
        return None

    def add(self, outputs: Outputs) -> None:
        self.batches.append(outputs)

    async def flush(self) -> None:
        return None


@pytest.fixture
def recording() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def settings() -> Settings:
    # Never contacted; given explicitly so that no environment leaks in.
    return Settings.load(
        {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:1/0"}
    )


@pytest.fixture
def pipeline(settings: Settings, recording: RecordingSink) -> Pipeline:
    return create_app(settings, lambda app: Sinks(recording), consume=False)


@pytest.fixture
async def started(
    pipeline: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Pipeline]:
    """The worker's app, started by faust as the worker starts it."""
    monkeypatch.chdir(tmp_path)  # nothing of faust's may land in the working directory
    app = pipeline.app
    ready = asyncio.Event()

    async def startup_finished() -> None:  # what faust.Worker hooks in to print "ready"
        ready.set()

    app.on_startup_finished = startup_finished
    await asyncio.wait_for(app.start(), DEADLINE)
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE)
        yield pipeline
    finally:
        await asyncio.wait_for(app.stop(), DEADLINE)


def _junk_batch(settings: Settings) -> tuple[RawMessage, ...]:
    """One raw record that is not Avro: the agent dead-letters it (no Redis lookup needed)."""
    topic = Topics.in_namespace(settings.namespace).raw_sse.name
    return (RawMessage(topic, 0, 0, 1_790_000_000.0, b"req-junk", b"\x00not avro"),)


# -- no tables: start-up does not wait for a recovery ----------------------------------


async def test_start_up_goes_on_to_the_timers_without_a_table_recovery(
    pipeline: Pipeline,
) -> None:
    """faust's `App.on_started` waits for table recovery only when there are tables."""
    app = pipeline.app
    assert isinstance(app, _WorkerApp)
    assert "_wait_for_table_recovery_completed" not in _WorkerApp.__dict__  # faust's own
    calls: list[str] = []

    async def start_tasks() -> None:  # would start the timers (app.timer, app.task)
        calls.append("tasks")

    async def startup_finished() -> None:
        calls.append("finished")

    app.on_started_init_extra_tasks = start_tasks
    app.on_startup_finished = startup_finished
    await asyncio.wait_for(app.on_started(), DEADLINE)
    assert calls == ["tasks", "finished"]


# -- _Boot: faust's consumer stays off --------------------------------------------------


def test_boot_strategy_leaves_faust_consumer_conductor_and_tables_out(
    pipeline: Pipeline,
) -> None:
    app = pipeline.app
    assert isinstance(app.boot_strategy, _Boot)
    assert issubclass(_Boot, BootStrategy)
    services = list(app.on_init_dependencies())  # what App.start() starts with the app
    assert app.agents in services  # the process-raw agent runs
    for off in (app.consumer, app.producer, app.topics, app.tables):
        assert off not in services, f"{type(off).__name__} would be started"


async def test_started_app_has_no_consumer_and_asks_for_no_partitions(
    started: Pipeline,
) -> None:
    app = started.app
    assert app.agents.started
    assert started.agents["process-raw"].started
    assert not app.consumer.started  # never joins the group: no partitions asked for
    assert not app.topics.started  # the conductor that would subscribe the agents' topics
    assert not app.tables.started
    assert app.topics.acking_topics == set()  # nothing faust would ack and commit


# -- app.flow_control.resume() ----------------------------------------------------------


async def test_flow_control_starts_suspended_and_start_up_does_not_resume_it(
    started: Pipeline,
) -> None:
    """Without faust's consumer nothing resumes the flow: the worker must (`resume()`)."""
    assert not started.app.flow_control.is_active()


async def test_channel_send_waits_while_suspended_and_reaches_the_agent_after_resume(
    started: Pipeline, recording: RecordingSink, settings: Settings
) -> None:
    app = started.app
    batches = started.agents["process-raw"].channel  # what BatchLoop.fetch sends to
    send = asyncio.ensure_future(batches.send(value=_junk_batch(settings)))
    try:
        await asyncio.sleep(SETTLE)
        assert not send.done(), "a send went through while flow control was suspended"
        assert recording.batches == []

        app.flow_control.resume()
        await asyncio.wait_for(send, DEADLINE)
        for _ in range(int(DEADLINE / 0.01)):
            if recording.batches:
                break
            await asyncio.sleep(0.01)
    finally:
        send.cancel()
    (outputs,) = recording.batches
    (letter,) = outputs.dead_letters
    assert letter.key == b"req-junk"
    assert started.processor.counters.dead_lettered == 1


async def test_batches_sent_after_resume_are_all_processed_in_order(
    started: Pipeline, recording: RecordingSink, settings: Settings
) -> None:
    """Once resumed, nothing in faust drops channel events (no generation or flow skips)."""
    started.app.flow_control.resume()
    batches = started.agents["process-raw"].channel
    topic = Topics.in_namespace(settings.namespace).raw_sse.name
    for offset in range(5):
        message = RawMessage(topic, 0, offset, 1_790_000_000.0, f"r{offset}".encode(), b"\x00")
        await asyncio.wait_for(batches.send(value=(message,)), DEADLINE)
    for _ in range(int(DEADLINE / 0.01)):
        if len(recording.batches) == 5:
            break
        await asyncio.sleep(0.01)
    keys = [letter.key for out in recording.batches for letter in out.dead_letters]
    assert keys == [f"r{offset}".encode() for offset in range(5)]


# -- worker.spinner = None -----------------------------------------------------------


def _probe_logger() -> logging.Logger:
    logger = logging.Logger("streamtally-probe", logging.WARNING)
    logger.addHandler(logging.NullHandler())
    return logger


def test_worker_has_a_spinner_and_it_turns_the_root_logger_to_debug(
    pipeline: Pipeline,
) -> None:
    """The cost `worker.spinner = None` avoids: with a spinner every DEBUG line is formatted."""
    worker = faust.Worker(pipeline.app, loglevel="WARNING", quiet=True)
    assert isinstance(worker.spinner, Spinner)
    logger = _probe_logger()
    worker.on_setup_root_logger(logger, logging.WARNING)
    assert logger.level == logging.DEBUG
    assert any(isinstance(h, SpinnerHandler) for h in logger.handlers)


def test_worker_without_spinner_leaves_the_root_logger_alone(pipeline: Pipeline) -> None:
    worker = faust.Worker(pipeline.app, loglevel="WARNING", quiet=True)
    worker.spinner = None  # as streamtally.cli.worker does
    logger = _probe_logger()
    worker.on_setup_root_logger(logger, logging.WARNING)
    assert logger.level == logging.WARNING
    assert not any(isinstance(h, SpinnerHandler) for h in logger.handlers)


def test_worker_logging_setup_goes_through_the_spinner_hook(
    pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up path (`_setup_logging`) calls the hook above with the root logger."""
    seen: dict[str, Any] = {}

    def setup_logging(**options: Any) -> int:  # leaves the real logging configuration be
        seen["loglevel"] = options.get("loglevel")
        return logging.WARNING

    monkeypatch.setattr(mode.utils.logging, "setup_logging", setup_logging)
    worker = faust.Worker(pipeline.app, loglevel="WARNING", quiet=True)
    worker.redirect_stdouts = False
    hooked: list[tuple[logging.Logger, int]] = []
    worker.on_setup_root_logger = lambda logger, level: hooked.append((logger, level))
    worker._setup_logging()
    assert seen == {"loglevel": "WARNING"}
    assert hooked == [(logging.root, logging.WARNING)]
