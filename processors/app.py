"""The faust application: its settings, source topics and agents.

`create_app` builds everything from `WorkerSettings`.  The agents stay thin:
per batch they ask the sinks' lookup about request ids they have not seen
(closed by an earlier run?), hand each message to `RequestProcessor`, write
the outputs, and release records to faust only when they are finished.

Acknowledgement is what makes a crash harmless.  Kafka keeps one committed
offset per partition, so a record may only count as done when every earlier
record of its partition is done too; `AckGate` holds each record and releases
(acks) them strictly in offset order, each once its request is closed and its
outputs are durable.  A restarted worker therefore re-reads every record of
every request that was open, and nothing of the requests it had finished.
(faust's own commit logic tolerates a hole at the head of the acked offsets,
so out-of-order acks could commit past a held record: hence the gate.)
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import faust

from processors.requests import Outputs, Position, RequestProcessor
from processors.settings import WorkerSettings
from processors.sinks import Sinks, retry
from streamtally.pricing import PriceTable
from topics import NAMESPACE, RAW_ENGINE, RAW_SSE

__all__ = ["AckGate", "Pipeline", "create_app"]


class _Held:
    __slots__ = ("done", "event")

    def __init__(self, event: Any, done: bool) -> None:
        self.event = event
        self.done = done


class AckGate:
    """Holds every record and acks them in offset order per partition once each is done."""

    def __init__(self) -> None:
        self._queues: defaultdict[Any, deque[_Held]] = defaultdict(deque)
        self._open: defaultdict[str, list[_Held]] = defaultdict(list)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def hold(self, event: Any, request_id: str | None) -> None:
        """Hold `event`; it is done now unless `request_id` names an open request."""
        event.message.incref()  # faust's own ack after the batch is then not the last
        held = _Held(event, done=request_id is None)
        self._queues[event.message.tp].append(held)
        if request_id is not None:
            self._open[request_id].append(held)

    def finished(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            for held in self._open.pop(request_id, ()):
                held.done = True

    def release(self) -> int:
        """Ack every done record that has no unfinished record before it; return how many."""
        released = 0
        for queue in self._queues.values():
            while queue and queue[0].done:
                queue.popleft().event.ack()
                released += 1
        return released

    def drop(self, tps: set[Any], request_ids: Iterable[str]) -> None:
        """A rebalance took these partitions: forget their records without acking them."""
        for tp in tps:
            self._queues.pop(tp, None)
        for request_id in request_ids:
            self._open.pop(request_id, None)


@dataclass(slots=True)
class Pipeline:
    app: faust.App
    processor: RequestProcessor
    agents: dict[str, Any]
    #: Set on first use; the worker's factory builds them once the producer exists.
    sinks: Sinks | None = None
    #: Records held unacknowledged until they and every record before them are done.
    gate: AckGate = field(default_factory=AckGate)


def _broker_url(bootstrap_servers: str) -> str:
    return ";".join(f"kafka://{server.strip()}" for server in bootstrap_servers.split(","))


def create_app(
    settings: WorkerSettings,
    make_sinks: Callable[[faust.App], Sinks] | None = None,
) -> Pipeline:
    """The worker's faust app.  `make_sinks` builds the sinks once the app's producer exists."""
    app = faust.App(
        NAMESPACE,  # the consumer group
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
        producer_max_request_size=8 << 20,
        consumer_auto_offset_reset="earliest",
        broker_commit_every=settings.batch_size,
        broker_commit_interval=0.5,
        broker_session_timeout=settings.session_timeout,
        broker_heartbeat_interval=max(settings.session_timeout / 10, 0.5),
        stream_wait_empty=False,
    )
    processor = RequestProcessor(PriceTable.load(settings.prices), timeout=settings.request_timeout)
    pipeline = Pipeline(app=app, processor=processor, agents={})
    raw_sse = app.topic(RAW_SSE.name, key_type=bytes, value_type=bytes)
    raw_engine = app.topic(RAW_ENGINE.name, key_type=bytes, value_type=bytes)

    def sinks() -> Sinks:
        if pipeline.sinks is None:
            if make_sinks is None:
                raise RuntimeError("the pipeline has no sinks")
            pipeline.sinks = make_sinks(app)
        return pipeline.sinks

    async def finish(outputs: Outputs) -> None:
        """Write the outputs, then release the records that are now done."""
        await sinks().write(outputs)
        pipeline.gate.finished(done.tokens.request_id for done in outputs.completed)
        pipeline.gate.release()

    async def learn(events: Sequence[Any]) -> None:
        ids = {r for e in events if (r := processor.request_id_of(e.message.key))}
        unknown = sorted(processor.unknown(ids))
        if unknown:
            found = await retry(lambda: sinks().lookup(unknown), "closed-request lookup")
            for request_id, closed in found.items():
                processor.learn_closed(request_id, closed)

    def agent_for(handle: Callable[[bytes | None, bytes, Position], Outputs]) -> Any:
        async def run(stream: Any) -> None:
            async for events in stream.take_events(
                settings.batch_size, within=settings.batch_within
            ):
                await learn(events)
                outputs = Outputs()
                for event in events:
                    message = event.message
                    position = Position(
                        message.topic, message.partition, message.offset, message.timestamp
                    )
                    outputs.extend(handle(message.key, message.value, position))
                    request_id = processor.request_id_of(message.key)
                    open_ = request_id is not None and processor.is_open(request_id)
                    pipeline.gate.hold(event, request_id if open_ else None)
                await finish(outputs)

        return run

    pipeline.agents["normalize-sse"] = app.agent(raw_sse, name="normalize-sse")(
        agent_for(processor.handle_sse)
    )
    pipeline.agents["normalize-engine"] = app.agent(raw_engine, name="normalize-engine")(
        agent_for(processor.handle_engine)
    )

    async def close_quiet_requests() -> None:
        await finish(processor.expire())

    app.timer(interval=1.0)(close_quiet_requests)

    async def on_revoked(_sender: Any, revoked: Any, **_: Any) -> None:
        dropped = processor.drop_partitions({(tp.topic, tp.partition) for tp in revoked})
        pipeline.gate.drop(set(revoked), dropped)  # the next owner re-reads them

    app.on_partitions_revoked.connect(on_revoked)  # type: ignore[arg-type]
    return pipeline
