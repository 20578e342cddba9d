"""Sinks: concurrent writers (the agent and the timer) never resend each other's batch."""

from __future__ import annotations

import asyncio
import gc
import warnings
from datetime import UTC, datetime
from typing import Any

from aiokafka.partitioner import DefaultPartitioner

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import Chunk, FinishReason, Source, Tokens, Usage
from streamtally.processors.requests import Closed, CloseReason, Completed, Outputs
from streamtally.processors.sinks import KafkaSink, RedisSink, Sinks
from streamtally.store import FinishedRequest, RedisStore, closed_key
from streamtally.topics import Topics, encode_key, output_key
from streamtally.wire import avro
from streamtally.wire.records import DeadLetter

TOPICS = Topics.in_namespace()


class FakeBatch:
    def __init__(self, room: int) -> None:
        self.keys: list[bytes | None] = []
        self.room = room

    def append(self, *, key: bytes | None, value: bytes, timestamp: None) -> object | None:
        if len(self.keys) >= self.room:
            return None
        self.keys.append(key)
        return object()


class SlowProducer:
    """Records what each sent batch holds; sends and acks yield to the event loop."""

    def __init__(self, room: int = 4, fail_on: int | None = None) -> None:
        self.sent: list[tuple[str, int, bytes | None]] = []
        self.room = room
        self.fail_on = fail_on
        self.batches = 0

    async def start(self) -> None:
        return None

    def create_batch(self) -> FakeBatch:
        return FakeBatch(self.room)

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        await asyncio.sleep(0)
        self.batches += 1
        if self.batches == self.fail_on:
            raise OSError("broker went away")
        self.sent.extend((topic, partition, key) for key in batch.keys)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.001, future.set_result, None)
        return future


def _sink(producer: SlowProducer) -> KafkaSink:
    sink = KafkaSink("127.0.0.1:1", TOPICS)
    sink._producer = producer
    sink._started = True
    return sink


def _outputs(request_id: str, n: int, tenant: str = "acme") -> Outputs:
    when = datetime(2026, 1, 1, tzinfo=UTC)
    chunks = [
        Chunk(request_id=request_id, seq=i, source=Source.OPENAI, text_delta="x", event_time=when)
        for i in range(n)
    ]
    return Outputs(
        chunks=chunks,
        chunk_values=[avro.encode_chunk(c) for c in chunks],
        chunk_refs=[RequestRef(tenant, request_id)] * n,
    )


async def test_concurrent_writes_send_every_output_exactly_once() -> None:
    producer = SlowProducer()
    sinks = Sinks(_sink(producer))
    await asyncio.gather(
        sinks.write(_outputs("a", 50)),
        sinks.write(_outputs("b", 30)),
        sinks.write(_outputs("c", 7)),
    )
    keys = sorted(key or b"" for _, _, key in producer.sent)
    assert keys == sorted([b"acme:a"] * 50 + [b"acme:b"] * 30 + [b"acme:c"] * 7)


async def test_a_request_keeps_one_partition_and_full_batches_split() -> None:
    producer = SlowProducer(room=4)
    await Sinks(_sink(producer)).write(_outputs("r", 10))
    partitions = {(topic, partition) for topic, partition, _ in producer.sent}
    assert len(partitions) == 1
    assert next(iter(partitions))[0] == TOPICS.chunks.name
    # Keyed by the request's identity, partitioned by its request id (as the raw records).
    ids = list(range(TOPICS.chunks.partitions))
    by_id = DefaultPartitioner()(encode_key("r"), ids, ids)
    assert next(iter(partitions))[1] == by_id
    assert {key for _, _, key in producer.sent} == {output_key(RequestRef("acme", "r"))}
    assert producer.batches == 3  # 4 + 4 + 2
    assert len(producer.sent) == 10


async def test_a_failed_flush_keeps_its_batch_for_the_retry() -> None:
    producer = SlowProducer(room=4, fail_on=2)
    await Sinks(_sink(producer)).write(_outputs("r", 6))
    # the first batch (4) went out before the failure; the retry resends all 6
    assert len(producer.sent) == 4 + 6


# --------------------------------------------------------------------------- Redis


class FakeStore(RedisStore):
    """A `RedisStore` that records what it is asked instead of talking to Redis."""

    def __init__(self) -> None:  # no client
        self.closing: list[dict[RequestRef, str]] = []
        self.applied: list[list[FinishedRequest]] = []
        self.positions: list[list[str]] = []
        self.closed = False

    async def mark_closing(self, markers: Any) -> dict[RequestRef, str]:
        self.closing.append(dict(markers))
        return {}

    async def apply_requests(self, batch: Any) -> list[bool]:
        self.applied.append(list(batch))
        return [True] * len(batch)

    async def count_dead_letters(self, positions: Any) -> int:
        self.positions.append(list(positions))
        return len(positions)

    async def closed_markers(self, refs: Any) -> dict[RequestRef, tuple[str, bool]]:
        return {
            r: ("7 timeout", r.request_id == "applied") for r in refs if r.request_id != "unknown"
        }

    async def aclose(self) -> None:
        self.closed = True


def _completed(request_id: str) -> Completed:
    tokens = Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model=None,
        text="x",
        reasoning="",
        tool_calls=(),
        usage=Usage(input_tokens=3, output_tokens=1),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=1,
    )
    prices = PriceTable.from_dict({"version": "t", "currency": "USD", "unit": 1, "models": {}})
    billing = bill(tokens, "acme", datetime(2026, 1, 1, tzinfo=UTC), prices)
    return Completed(tokens, billing, Closed(12, CloseReason.END), records=3, duplicates=1)


async def test_redis_outputs_mark_then_flush_requests_and_dead_letter_positions() -> None:
    store = FakeStore()
    redis = RedisSink(store)
    assert redis.store is store
    when = datetime(2026, 1, 1, tzinfo=UTC)
    letter = DeadLetter.from_exception(
        ValueError("bad"), topic="ns.raw.sse", partition=2, offset=41, key=None, value=b"", at=when
    )
    outputs = Outputs(completed=[_completed("r1")], dead_letters=[letter])
    await Sinks(redis).write(outputs)
    assert store.closing == [{RequestRef("acme", "r1"): "12 end"}]
    [[request]] = store.applied
    assert (request.closed_key, request.closed, request.records, request.duplicates) == (
        closed_key(RequestRef("acme", "r1")),
        "12 end",
        3,
        1,
    )
    assert store.positions == [["ns.raw.sse:2:41"]]
    await redis.flush()  # nothing new: the dead letters were counted once
    assert store.positions[-1] == []
    applied, pending, unknown = (RequestRef("acme", r) for r in ("applied", "pending", "unknown"))
    found = await redis.lookup([applied, pending, unknown])
    assert found == {
        applied: Closed(7, CloseReason.TIMEOUT, applied=True),
        pending: Closed(7, CloseReason.TIMEOUT, applied=False),
    }
    await redis.stop()
    assert store.closed


class DecidedSink:
    """A sink whose store holds another close decision for some requests."""

    def __init__(self, decided: set[RequestRef]) -> None:
        self.decided = decided
        self.added: list[Outputs] = []

    async def begin(self, outputs: Outputs) -> set[RequestRef]:
        return {c.ref for c in outputs.completed} & self.decided

    def add(self, outputs: Outputs) -> None:
        self.added.append(outputs)

    async def flush(self) -> None:
        return None


async def test_a_close_decided_otherwise_is_never_written_and_is_named_as_elsewhere() -> None:
    """One close decision per request: a second, different one writes no second bill, and
    the write names the request as closed elsewhere (its records wait for that close)."""
    from streamtally.billing.pricing import PriceTable
    from streamtally.processors.requests import Position, RequestProcessor
    from streamtally.producers import raw_records

    stream = (
        b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":'
        b'[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}]}\n\n'
    )
    processor = RequestProcessor(PriceTable.default())
    out = Outputs()
    for rid in ("mine", "theirs"):
        for offset, value in enumerate(
            raw_records(Source.OPENAI, stream, tenant="t", request_id=rid)[1]
        ):
            processor.handle_sse(
                rid.encode(), value, Position(TOPICS.raw_sse.name, 0, offset, 1.0), out
            )
    assert [c.tokens.request_id for c in out.completed] == ["mine", "theirs"]
    sink = DecidedSink({RequestRef("t", "theirs")})
    written = await Sinks(sink).write(out)
    assert [c.tokens.request_id for c in written.outputs.completed] == ["mine"]
    assert written.elsewhere == {RequestRef("t", "theirs")}
    assert [c.tokens.request_id for c in sink.added[0].completed] == ["mine"]


def test_an_idle_kafka_sink_closes_its_producer_on_stop() -> None:
    """A worker stopped before it wrote anything reports no unclosed producer at exit."""

    async def idle() -> Any:
        sink = KafkaSink("127.0.0.1:1", Topics.in_namespace("unit"))
        await sink.stop()  # never started: nothing was written
        return sink._producer

    producer = asyncio.run(idle())
    assert producer._closed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del producer
        gc.collect()
    assert not [w for w in caught if "Unclosed AIOKafkaProducer" in str(w.message)]
