"""The faust application: its settings, source topics and agents.

`create_app` builds everything from `WorkerSettings`; the agents stay thin:
they hand each message to `RequestProcessor` and its outputs to the sinks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import faust

from processors.requests import Outputs, Position, RequestProcessor
from processors.settings import WorkerSettings
from processors.sinks import Sinks
from streamtally.pricing import PriceTable
from topics import RAW_ENGINE, RAW_SSE

__all__ = ["Pipeline", "create_app"]


@dataclass(slots=True)
class Pipeline:
    app: faust.App
    processor: RequestProcessor
    agents: dict[str, Any]
    #: Set once the producer runs; the worker installs the real sinks there.
    sinks: Sinks | None = None


def _broker_url(bootstrap_servers: str) -> str:
    return ";".join(f"kafka://{server.strip()}" for server in bootstrap_servers.split(","))


def create_app(
    settings: WorkerSettings,
    make_sinks: Callable[[faust.App], Sinks] | None = None,
) -> Pipeline:
    """The worker's faust app.  `make_sinks` builds the sinks once the app's producer exists."""
    app = faust.App(
        "streamtally",
        broker=_broker_url(settings.bootstrap_servers),
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        topic_allow_declare=False,  # topics are declared by streamtally (topics/), not faust
        topic_disable_leader=True,
        web_enabled=False,
        producer_acks=-1,
        producer_linger_ms=5,
        producer_max_batch_size=1 << 20,
        consumer_auto_offset_reset="earliest",
        broker_commit_every=settings.batch_size,
        broker_commit_interval=0.5,
        stream_wait_empty=False,
    )
    processor = RequestProcessor(PriceTable.load(settings.prices), timeout=settings.request_timeout)
    pipeline = Pipeline(app=app, processor=processor, agents={})
    raw_sse = app.topic(RAW_SSE.name, key_type=bytes, value_type=bytes)
    raw_engine = app.topic(RAW_ENGINE.name, key_type=bytes, value_type=bytes)

    async def write(outputs: Outputs) -> None:
        if pipeline.sinks is None:
            if make_sinks is None:
                raise RuntimeError("the pipeline has no sinks")
            pipeline.sinks = make_sinks(app)
        await pipeline.sinks.write(outputs)

    def agent_for(handle: Callable[[bytes | None, bytes, Position], Outputs]) -> Any:
        async def run(stream: Any) -> None:
            async for events in stream.take_events(
                settings.batch_size, within=settings.batch_within
            ):
                outputs = Outputs()
                for event in events:
                    message = event.message
                    position = Position(message.topic, message.partition, message.offset)
                    outputs.extend(handle(message.key, message.value, position))
                await write(outputs)

        return run

    pipeline.agents["normalize-sse"] = app.agent(raw_sse, name="normalize-sse")(
        agent_for(processor.handle_sse)
    )
    pipeline.agents["normalize-engine"] = app.agent(raw_engine, name="normalize-engine")(
        agent_for(processor.handle_engine)
    )

    async def close_quiet_requests() -> None:
        await write(processor.expire())

    app.timer(interval=1.0)(close_quiet_requests)

    return pipeline
