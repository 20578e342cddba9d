"""The faust application: the worker's task, agent and timers, wired to its batch loop.

`create_app` builds everything from the `Settings`: the `RequestProcessor`
(`processors.requests`), the `Pipeline` that holds the worker's state, and the
`BatchLoop` (`processors.loop`), whose named stages (fetch, decode, apply,
write, commit) the app runs:

- a task runs `BatchLoop.fetch`, which reads the raw topics in bulk
  (`RawSource`), decodes each batch and sends it to an in-memory channel;
- the agent `process-raw` runs `BatchLoop.run`: one batch at a time through
  `BatchLoop.apply`, its outputs written behind (`BatchLoop.write`) while the
  next is applied, what they release committed in the background
  (`BatchLoop.commit`);
- a timer closes requests that went quiet (`BatchLoop.close_quiet_requests`);
  another reads the input clocks four times a second
  (`BatchLoop.watch_input_clocks`);
- a second task serves the metrics (`processors.metrics`), and the sinks are
  closed once everything else has stopped (`BatchLoop.close_sinks`).

Why a batch's records are committed only once their requests' outputs are
durable, and why the first failure stops the worker, is in `processors.loop`.

A worker with an instance id (static membership, `processors.source`) that
loses its membership (another worker took its id, or its session expired)
stops as after a failed batch: nothing more is committed, it does not join
again, and the partitions' owner reads them from the committed offsets.  A
static member restarted in place is such an owner: it joins with the same id,
gets its partitions back without a rebalance, and, its memory empty, reads
from the committed offsets exactly as a new owner after a rebalance would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import faust
from faust.app.base import BootStrategy

from streamtally.billing.pricing import PriceTable
from streamtally.connection import faust_options
from streamtally.processors.content import content_policy
from streamtally.processors.loop import (
    LOST_WRITE_WAIT_S,
    WATCH_CLOCKS_S,
    BatchLoop,
    ExaminedBatch,
    Pipeline,
)
from streamtally.processors.metrics import WorkerMetrics, serve
from streamtally.processors.requests import Limits, RequestProcessor
from streamtally.processors.sinks import Sinks
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.tenant_keys import TenantTrust

__all__ = [
    "LOST_WRITE_WAIT_S",
    "WATCH_CLOCKS_S",
    "BatchLoop",
    "ExaminedBatch",
    "Pipeline",
    "create_app",
]


class _Boot(BootStrategy):
    """faust's own consumer and producer stay off (docs/architecture.md, "faust's role").

    `RawSource` reads the raw topics in bulk and commits what `CommitGate`
    releases; the sinks write through their own idempotent producer.  Without
    a consumer faust starts no topic conductor and no tables either, so there
    is no table recovery to wait for.
    """

    enable_kafka_consumer = False
    enable_kafka_producer = False


class _WorkerApp(faust.App):
    """The worker's faust app: `after_stop` runs once its agent, tasks and timers are stopped."""

    BootStrategy = _Boot

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.after_stop: list[Callable[[], Awaitable[None]]] = []

    async def on_shutdown(self) -> None:
        # mode calls `on_shutdown` after the app's children (the agent) and its futures
        # (the raw-topic task, the timer) have stopped: nothing can write any more.
        await super().on_shutdown()
        for hook in self.after_stop:
            await hook()


def create_app(
    settings: Settings,
    make_sinks: Callable[[faust.App], Sinks] | None = None,
    *,
    consume: bool = True,
    on_failure: Callable[[BaseException], None] | None = None,
) -> Pipeline:
    """The worker's faust app.

    `make_sinks` builds the sinks on first use (in the running loop); `consume`
    starts the raw-topic consumer with the worker (agent tests feed the agent
    themselves).

    A batch (or a timer's close) that raises leaves records consumed but not held by
    the commit gate: faust would restart the agent on the next batch, and a commit then
    would pass records never applied (requests never billed).  So the first failure
    breaks the pipeline for good: nothing is committed any more, also not at a revoke or
    at the shutdown, and `on_failure` is called (the worker stops itself: the partitions'
    next owner, or this worker restarted, re-reads them from the committed offset;
    `BatchLoop.fail`).
    """
    topics = Topics.in_namespace(settings.namespace)
    datadir = settings.state_dir / "faust" / topics.worker_app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = _WorkerApp(
        topics.worker_app_id,
        # faust's own clients stay off (`_Boot`); its broker settings match ours all the same.
        **faust_options(settings.kafka),
        store="memory://",
        topic_allow_declare=False,  # topics are declared by streamtally (topics/), not faust
        topic_disable_leader=True,
        web_enabled=False,
        stream_wait_empty=False,
        # faust keeps nothing there (no tables), but makes the folder: not in the cwd.
        datadir=str(datadir),
    )
    processor = RequestProcessor(
        PriceTable.load_or_default(settings.prices_path),
        timeout=settings.request_timeout,
        timeouts=settings.request_timeouts,
        limits=Limits.from_settings(settings),
    )
    if settings.tenant_keys_path is not None:  # a bad file: InputError, one line, exit 2
        processor.trust = TenantTrust.load(settings.tenant_keys_path)
    # What of the text the outputs keep; a bad content key: InputError, one line, exit 2.
    processor.content = content_policy(settings)
    processor.chunks_topic = settings.chunks_topic
    pipeline = Pipeline(
        app=app,
        processor=processor,
        agents={},
        metrics=WorkerMetrics(lambda: processor.counters, lambda: processor.open_requests),
    )
    # At most one decoded batch waits for the agent: decoding ahead overlaps the agent's
    # work; a second one waiting only queued records longer (with two, the p99 from END
    # to Redis at 20,000 raw events/s was 102-421 ms, median 279, over six runs; with
    # one 115-255 ms, median 158: docs/scaling.md).  The consumer cannot run ahead.
    batches = app.channel(maxsize=1)
    loop = BatchLoop(
        pipeline, settings, topics, batches, make_sinks=make_sinks, on_failure=on_failure
    )
    pipeline.agents["process-raw"] = app.agent(batches, name="process-raw")(loop.run)
    app.timer(interval=1.0, name="close-quiet-requests")(loop.close_quiet_requests)
    pipeline.timers["close-quiet-requests"] = loop.close_quiet_requests
    app.timer(interval=WATCH_CLOCKS_S, name="watch-input-clocks")(loop.watch_input_clocks)
    pipeline.timers["watch-input-clocks"] = loop.watch_input_clocks
    # Not on faust's `on_before_shutdown`: that fires before the agent stops, and a
    # batch in flight would meet a closed producer (and retry it forever).
    app.after_stop.append(loop.close_sinks)

    async def serve_metrics() -> None:
        await serve(
            pipeline.metrics,
            settings.web_host,
            settings.web_port,
            lambda: pipeline.source,
            lambda: pipeline.sinks,
        )

    if consume:
        app.task(loop.fetch)
        app.task(serve_metrics)
    return pipeline
