"""Agent tier: the faust agents, driven through `test_context()` (no broker).

The agents only move messages between topics and `RequestProcessor`; here the
sinks record what the agents hand them, and the raw records are real Avro
bytes produced by `producers.raw_records` from our own sample transcripts.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka import TopicPartition

from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream, read_events
from streamtally.processors.app import Pipeline, create_app
from streamtally.processors.clock import InputClock
from streamtally.processors.requests import Outputs
from streamtally.processors.sinks import Sinks
from streamtally.processors.source import FetchedBatch, RawMessage
from streamtally.producers import raw_records
from streamtally.settings import Settings
from streamtally.topics import Topics

TOPICS = Topics.in_namespace()

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples"


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[Outputs] = []
        self.flushes = 0

    async def begin(self, outputs: Outputs) -> None:
        return None

    def add(self, outputs: Outputs) -> None:
        self.batches.append(outputs)

    async def flush(self) -> None:
        self.flushes += 1

    @property
    def outputs(self) -> Outputs:
        total = Outputs()
        for batch in self.batches:
            total.extend(batch)
        return total


@pytest.fixture
def recording() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def pipeline(recording: RecordingSink) -> Pipeline:
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1",  # never contacted: test_context() needs no broker
        redis_url_setting="redis://127.0.0.1:1/0",
        batch_size=1,
    )

    def make_sinks(app: faust.App) -> Sinks:
        return Sinks(recording)

    return create_app(settings, make_sinks, consume=False)


_OFFSETS: dict[str, int] = {}


def _batch(topic: str, key: bytes | None, values: list[bytes]) -> tuple[RawMessage, ...]:
    """Raw messages as the consumer hands them to the agent, at the topic's next offsets."""
    start = _OFFSETS.get(topic, 0)
    _OFFSETS[topic] = start + len(values)
    return tuple(
        RawMessage(topic, 0, start + i, 1_790_000_000.0, key, value)
        for i, value in enumerate(values)
    )


def _topic(source: Source) -> str:
    return TOPICS.raw_sse.name if source.is_sse else TOPICS.raw_engine.name


async def _put_transcript(agent: Any, source: Source, name: str, request_id: str) -> None:
    _, records = raw_records(
        source, (SAMPLES / name).read_bytes(), tenant="acme", request_id=request_id
    )
    # split in two batches, as a consumer may
    half = len(records) // 2
    for part in (records[:half], records[half:]):
        await agent.put(_batch(_topic(source), request_id.encode(), part))


def _fold(source: Source, name: str, request_id: str) -> dict[str, Any]:
    with (SAMPLES / name).open("rb") as stream:
        return fold_stream(
            source, read_events(source, stream), request_id=request_id
        ).to_json_dict()


@pytest.mark.parametrize(
    ("source", "name"),
    [
        (Source.OPENAI, "openai/parallel_tool_calls_cached.sse"),
        (Source.ANTHROPIC, "anthropic/thinking_then_text.sse"),
        (Source.GEMINI, "gemini/error_raw_json_tail.sse"),
        (Source.OPENAI_RESPONSES, "openai-responses/reasoning_parallel_calls.sse"),
    ],
)
async def test_sse_agent_folds_a_request_like_the_fold_command(
    pipeline: Pipeline, recording: RecordingSink, source: Source, name: str
) -> None:
    async with pipeline.agents["process-raw"].test_context() as agent:
        await _put_transcript(agent, source, name, "req-1")
    out = recording.outputs
    assert len(out.completed) == 1
    done = out.completed[0]
    assert done.tokens.to_json_dict() == _fold(source, name, "req-1")
    assert done.billing.request_id == "req-1"
    assert done.billing.tenant == "acme"
    assert [c.seq for c in out.chunks] == list(range(len(out.chunks)))
    assert len(out.chunks) == done.tokens.chunks
    assert out.dead_letters == []


@pytest.mark.parametrize(
    ("source", "name"),
    [
        (Source.DYNAMO, "dynamo/eos_no_usage.jsonl"),
        (Source.VLLM, "vllm/cumulative_length.jsonl"),
        (Source.ATOMR, "atomr/parallel_tool_fragments.jsonl"),
    ],
)
async def test_engine_agent_folds_a_request_like_the_fold_command(
    pipeline: Pipeline, recording: RecordingSink, source: Source, name: str
) -> None:
    async with pipeline.agents["process-raw"].test_context() as agent:
        await _put_transcript(agent, source, name, "eng-1")
    (done,) = recording.outputs.completed
    assert done.tokens.to_json_dict() == _fold(source, name, "eng-1")


async def test_undecodable_message_is_dead_lettered_and_counted(
    pipeline: Pipeline, recording: RecordingSink
) -> None:
    async with pipeline.agents["process-raw"].test_context() as agent:
        await agent.put(_batch(TOPICS.raw_sse.name, b"bad-1", [b"\x00not avro at all"]))
        await _put_transcript(agent, Source.OPENAI, "openai/text_usage.sse", "good-1")
    out = recording.outputs
    (letter,) = out.dead_letters
    assert letter.value == b"\x00not avro at all"
    assert letter.key == b"bad-1"
    assert letter.reason
    assert len(out.completed) == 1
    counters = pipeline.processor.counters
    assert counters.received == counters.applied + counters.duplicates + counters.dead_lettered
    assert counters.dead_lettered == 1


async def test_a_resent_record_is_applied_once(
    pipeline: Pipeline, recording: RecordingSink
) -> None:
    _, records = raw_records(
        Source.OPENAI,
        (SAMPLES / "openai/text_usage.sse").read_bytes(),
        tenant="acme",
        request_id="dup-1",
    )
    async with pipeline.agents["process-raw"].test_context() as agent:
        # records 1 and 2 delivered twice
        await agent.put(_batch(TOPICS.raw_sse.name, b"dup-1", records[:3] + records[1:]))
    (done,) = recording.outputs.completed
    assert done.tokens.to_json_dict() == _fold(Source.OPENAI, "openai/text_usage.sse", "dup-1")
    assert pipeline.processor.counters.duplicates == 2


async def test_event_after_the_end_marker_is_dead_lettered(
    pipeline: Pipeline, recording: RecordingSink
) -> None:
    _, records = raw_records(
        Source.ANTHROPIC,
        (SAMPLES / "anthropic/text_end_turn.sse").read_bytes(),
        tenant="t",
        request_id="late-1",
    )
    # A re-sent first record keeps its receive time: late (a first record received after
    # the request's records would start a new call of the id instead).
    late = records[0]
    async with pipeline.agents["process-raw"].test_context() as agent:
        await agent.put(_batch(TOPICS.raw_sse.name, b"late-1", records))
        await agent.put(_batch(TOPICS.raw_sse.name, b"late-1", [late]))
    out = recording.outputs
    assert len(out.completed) == 1
    (letter,) = out.dead_letters
    assert "already closed" in letter.reason


def test_sample_prices_cover_every_sample_model() -> None:
    prices = json.loads(resources.files("streamtally.core").joinpath("prices.json").read_text())
    assert prices["models"]


async def test_a_batch_fetched_before_its_partition_was_revoked_is_never_applied(
    pipeline: Pipeline, recording: RecordingSink
) -> None:
    """The fence against double billing after a rebalance (see `processors.source.Revocations`).

    Before, a batch fetched before a revoke was applied after the revoke had
    dropped the partition's requests: the request was re-opened on a partition
    this worker no longer owned and later closed by timeout, while the new
    owner closed it at its END: two different billing events for one request.
    """
    _, records = raw_records(
        Source.OPENAI,
        (SAMPLES / "openai/text_usage.sse").read_bytes(),
        tenant="acme",
        request_id="fenced-1",
    )
    topic = TOPICS.raw_sse.name
    first = FetchedBatch(
        pipeline.revocations.generation,
        tuple(
            RawMessage(topic, 0, i, 1_790_000_000.0, b"fenced-1", v)
            for i, v in enumerate(records[:2])
        ),
    )
    pipeline.revocations.revoke([(topic, 0)])  # the rebalance comes while it waits
    rest = FetchedBatch(
        pipeline.revocations.generation,  # fetched after: partition 1 is still ours
        (RawMessage(topic, 1, 0, 1_790_000_000.0, b"other-1", records[0]),),
    )
    async with pipeline.agents["process-raw"].test_context() as agent:
        await agent.put(first)
        await agent.put(rest)
    assert not pipeline.processor.is_open(RequestRef("acme", "fenced-1"))  # nothing of p. 0
    assert pipeline.processor.counters.received == 1  # only the record of partition 1
    assert recording.outputs.chunks == []  # other-1's record has the wrong key: dead letter
    assert len(recording.outputs.dead_letters) == 1


class _CommitLog:
    """Stands in for the raw-topic consumer: keeps what the pipeline commits."""

    def __init__(self) -> None:
        self.commits: list[dict[Any, int]] = []

    async def commit(self, offsets: dict[Any, int]) -> None:
        self.commits.append(dict(offsets))


async def test_a_failed_batch_stops_every_commit_and_asks_the_worker_to_stop() -> None:
    """A batch that raises mid-way leaves records consumed but never held by the commit gate;
    faust would restart the agent, and the next batch's commit would pass them (never billed).
    The first failure breaks the pipeline: nothing is committed any more, and the worker is
    told to stop (its partitions are read again from the committed offset)."""
    sink = RecordingSink()
    failures: list[BaseException] = []
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1",
        redis_url_setting="redis://127.0.0.1:1/0",
        batch_size=1,
    )
    pipeline = create_app(
        settings, lambda app: Sinks(sink), consume=False, on_failure=failures.append
    )
    source = _CommitLog()
    pipeline.source = source  # type: ignore[assignment]
    topic = TOPICS.raw_sse.name
    offset = 0
    arrive_batch = pipeline.processor.arrive_batch

    def arrive_or_break(out: Outputs, messages: Any, raws: Any, *partitions: Any) -> Any:
        """A bug met at a request's first record, mid-way through the run: that record and
        the rest of its batch are never held by the gate, nothing of the request is open.
        (The batch's call is where a bug is met: `arrive` itself may run compiled.)"""
        if any(r is not None and r.ref.request_id == "lost-2" and r.record.seq == 0 for r in raws):
            raise RuntimeError("an impossible state")
        return arrive_batch(out, messages, raws, *partitions)

    pipeline.processor.arrive_batch = arrive_or_break  # type: ignore[method-assign]

    def request(request_id: str) -> FetchedBatch:
        """One whole request (events and END) at the partition's next offsets."""
        nonlocal offset
        _, records = raw_records(
            Source.OPENAI,
            (SAMPLES / "openai/text_usage.sse").read_bytes(),
            tenant="acme",
            request_id=request_id,
        )
        first, offset = offset, offset + len(records)
        return FetchedBatch(
            pipeline.revocations.generation,
            tuple(
                RawMessage(topic, 0, first + i, 1_790_000_000.0, request_id.encode(), value)
                for i, value in enumerate(records)
            ),
        )

    async def feed(fetched: FetchedBatch) -> None:
        """The agent's own function over one batch (faust would log, and restart it)."""

        async def stream() -> Any:
            yield fetched

        await pipeline.agents["process-raw"].fun(stream())

    await feed(request("ok-1"))  # closed and flushed: its records committed
    committed = list(source.commits)
    assert [list(c.values()) for c in committed] == [[offset]]
    with pytest.raises(RuntimeError, match="impossible"):
        await feed(request("lost-2"))  # consumed, never written: must be read again
    await feed(request("ok-3"))  # what faust's restarted agent would apply next
    done = {c.tokens.request_id for c in sink.outputs.completed}
    assert "ok-3" in done  # ok-3 was applied and written ...
    assert source.commits == committed  # ... but nothing committed past lost-2
    assert [type(e) for e in failures] == [RuntimeError]  # told once
    assert isinstance(pipeline.broken, RuntimeError)


class _HeldSink(RecordingSink):
    """A store that takes its time: each flush waits until the test lets it through."""

    def __init__(self) -> None:
        super().__init__()
        self.through = asyncio.Semaphore(0)

    async def flush(self) -> None:
        await self.through.acquire()
        await super().flush()


class _Backlog:
    """The agent's stream with another batch always waiting in its channel (a backlog):
    the agent writes each batch behind, while it applies the next."""

    def __init__(self, batches: list[FetchedBatch]) -> None:
        self.batches = batches
        self.channel = self

    def empty(self) -> bool:
        return False

    async def __aiter__(self) -> Any:
        for batch in self.batches:
            yield batch


async def test_a_batch_written_behind_commits_nothing_before_its_outputs_are_durable() -> None:
    """The agent applies the next batch while one is written; the written batch's records
    reach the commit gate only once its outputs are durable, so a crash meanwhile commits
    nothing of it (its requests' closes would be lost otherwise)."""
    sink = _HeldSink()
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1", redis_url_setting="redis://127.0.0.1:1/0"
    )
    pipeline = create_app(settings, lambda app: Sinks(sink), consume=False)
    source = _CommitLog()
    pipeline.source = source  # type: ignore[assignment]
    topic = TOPICS.raw_sse.name
    batches, offset = [], 0
    for request_id in ("wb-1", "wb-2"):
        _, records = raw_records(
            Source.OPENAI,
            (SAMPLES / "openai/text_usage.sse").read_bytes(),
            tenant="acme",
            request_id=request_id,
        )
        messages = tuple(
            RawMessage(topic, 0, offset + i, 1_790_000_000.0, request_id.encode(), v)
            for i, v in enumerate(records)
        )
        offset += len(records)
        batches.append(FetchedBatch(pipeline.revocations.generation, messages))
    first_end = len(batches[0].messages)
    run = asyncio.ensure_future(pipeline.agents["process-raw"].fun(_Backlog(batches)))
    while pipeline.processor.counters.received < offset:  # both batches applied ...
        await asyncio.sleep(0.001)
    assert pipeline.processor.counters.requests_completed == 2
    assert len(pipeline.gate) == 0  # ... but nothing of the first is held: not yet durable
    assert source.commits == []
    sink.through.release()  # the first batch's outputs are durable
    while not source.commits:
        await asyncio.sleep(0.001)
    assert source.commits == [{TopicPartition(topic, 0): first_end}]
    sink.through.release()
    await asyncio.wait_for(run, 5)
    assert pipeline.writes is not None
    await pipeline.writes.drain()
    assert source.commits[-1] == {TopicPartition(topic, 0): offset}
    assert {c.tokens.request_id for c in sink.outputs.completed} == {"wb-1", "wb-2"}


class _Wall:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_write_hanging_through_an_outage_is_not_taken_for_quiet_time() -> None:
    """Kafka stops while a batch is written: the write hangs (it does not fail) and the agent
    holds the batch lock behind it, so no close runs until Kafka is back.  The input clocks
    are still read (the ``watch-input-clocks`` timer needs no lock): they see the partition
    stop answering and freeze.  Once Kafka answers again, a request that was quiet through
    the whole outage, three times the request timeout, is not closed as timed out; read only
    after the hang, the clock would have taken all of it for quiet time."""
    sink = _HeldSink()
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1",
        redis_url_setting="redis://127.0.0.1:1/0",
        request_timeout=8.0,
    )
    pipeline = create_app(settings, lambda app: Sinks(sink), consume=False)
    pipeline.source = _CommitLog()  # type: ignore[assignment]
    processor = pipeline.processor
    wall = _Wall()
    processor.input_clock = InputClock(wall, processor.input_clock.healthy)
    broker = {"answers": True}
    processor.live = lambda tp, next_offset: broker["answers"]
    topic = TOPICS.raw_sse.name
    transcript = (SAMPLES / "openai/text_usage.sse").read_bytes()
    records = {
        request_id: raw_records(Source.OPENAI, transcript, tenant="acme", request_id=request_id)[1]
        for request_id in ("done", "quiet", "other")
    }
    # The first batch: a whole request (its close must be written) and another's first record.
    first = [(b"done", value) for value in records["done"]] + [(b"quiet", records["quiet"][0])]
    batches = [
        FetchedBatch(
            pipeline.revocations.generation,
            tuple(
                RawMessage(topic, 0, offset + i, 1_790_000_000.0, key, value)
                for i, (key, value) in enumerate(pairs)
            ),
        )
        for offset, pairs in ((0, first), (len(first), [(b"other", records["other"][0])]))
    ]
    received = len(first) + 1
    watch = pipeline.timers["watch-input-clocks"]
    close_quiet = pipeline.timers["close-quiet-requests"]
    run = asyncio.ensure_future(pipeline.agents["process-raw"].fun(_Backlog(batches)))
    while processor.counters.received < received:  # the first write hangs, the agent waits
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    assert pipeline.batch_lock.locked()
    assert processor.open_requests == 2
    assert processor.counters.requests_completed == 1
    # The outage: 24 s; the broker stops answering fetches, the write in flight hangs.
    for step in range(96):
        wall.now += 0.25
        broker["answers"] = step < 2
        await watch()
    broker["answers"] = True  # back: the write goes through, then the next one
    sink.through.release()
    sink.through.release()
    await asyncio.wait_for(run, 5)
    for _ in range(4):
        wall.now += 0.25
        await watch()
    await close_quiet()
    assert processor.counters.requests_timed_out == 0
    assert processor.open_requests == 2
    assert {c.tokens.request_id for c in sink.outputs.completed} == {"done"}
    # The clocks run again: quiet past the timeout from now on, both requests close.
    for _ in range(40):
        wall.now += 0.25
        await watch()
    await close_quiet()
    assert processor.counters.requests_timed_out == 2
