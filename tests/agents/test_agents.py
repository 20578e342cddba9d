"""Agent tier: the faust agents, driven through `test_context()` (no broker).

The agents only move messages between topics and `RequestProcessor`; here the
sinks record what the agents hand them, and the raw records are real Avro
bytes produced by `producers.raw_records` from our own sample transcripts.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka import TopicPartition

from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream, read_events
from streamtally.processors.app import Pipeline, create_app
from streamtally.processors.clock import InputClock
from streamtally.processors.requests import (
    Closed,
    CloseReason,
    Completed,
    Outputs,
    Position,
    RequestProcessor,
)
from streamtally.processors.sinks import Sinks
from streamtally.processors.source import FetchedBatch, MembershipLost, RawMessage
from streamtally.processors.stages import BatchTimes, batch_summary, summarise
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
    prices = json.loads(resources.files("streamtally.billing").joinpath("prices.json").read_text())
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
    processor = pipeline.processor

    class Breaking:
        """The processor, but for its batch call.  (A stand-in, not a patched method: the
        processor's class may run compiled, and a compiled instance takes no new attribute.)"""

        def __getattr__(self, name: str) -> Any:
            return getattr(processor, name)

        def apply_batch(self, out: Outputs, messages: Any, raws: Any, *partitions: Any) -> Any:
            """A bug met at a request's first record, mid-way through the run: that record and
            the rest of its batch are never held by the gate, nothing of the request is open.
            (The batch's call is where a bug is met: `apply` itself may run compiled.)"""
            if any(
                r is not None and r.ref.request_id == "lost-2" and r.record.seq == 0 for r in raws
            ):
                raise RuntimeError("an impossible state")
            return processor.apply_batch(out, messages, raws, *partitions)

    pipeline.processor = Breaking()  # type: ignore[assignment]

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
        assert pipeline.committer is not None
        await pipeline.committer.settle()  # commits are sent in the background

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


async def test_a_lost_membership_stops_commits_and_applying_and_asks_the_worker_to_stop() -> None:
    """A static member fenced by another worker with its instance id (`MembershipLost`):
    the partitions are the other's now, so nothing more is applied or committed here, even
    of a batch fetched before, and the worker is told to stop (once)."""
    sink = RecordingSink()
    failures: list[BaseException] = []
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1",
        redis_url_setting="redis://127.0.0.1:1/0",
        worker_instance_id="worker-0",
    )
    pipeline = create_app(
        settings, lambda app: Sinks(sink), consume=False, on_failure=failures.append
    )
    source = _CommitLog()
    pipeline.source = source  # type: ignore[assignment]
    topic = TOPICS.raw_sse.name
    offset = 0

    def request(request_id: str) -> FetchedBatch:
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
        async def stream() -> Any:
            yield fetched

        await pipeline.agents["process-raw"].fun(stream())
        assert pipeline.committer is not None
        await pipeline.committer.settle()  # commits are sent in the background

    await feed(request("before"))
    assert [list(c.values()) for c in source.commits] == [[offset]]
    assert pipeline.lost is not None
    fenced = MembershipLost("worker-0", TOPICS.processors_group)
    pipeline.lost(fenced)
    pipeline.lost(MembershipLost("worker-0", TOPICS.processors_group))  # told once only
    await feed(request("after"))  # fetched before the fencing, still in the channel
    assert [c.tokens.request_id for c in sink.outputs.completed] == ["before"]
    assert len(source.commits) == 1
    assert failures == [fenced]
    assert pipeline.broken is fenced


class _HeldSink(RecordingSink):
    """A store that takes its time: each flush waits until the test lets it through."""

    def __init__(self) -> None:
        super().__init__()
        self.through = asyncio.Semaphore(0)

    async def flush(self) -> None:
        await self.through.acquire()
        await super().flush()


class _Backlog:
    """The agent's stream as faust's: it never ends, so the agent writes each batch behind
    while it applies the next, or waits for one (the test cancels the agent)."""

    def __init__(self, batches: list[FetchedBatch]) -> None:
        self.batches = batches

    async def __aiter__(self) -> Any:
        for batch in self.batches:
            yield batch
        await asyncio.Event().wait()


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
    assert pipeline.writes is not None
    await asyncio.wait_for(pipeline.writes.drain(), 5)
    run.cancel()
    assert pipeline.committer is not None
    await pipeline.committer.settle()
    assert source.commits[-1] == {TopicPartition(topic, 0): offset}
    assert {c.tokens.request_id for c in sink.outputs.completed} == {"wb-1", "wb-2"}


async def test_a_fenced_worker_finishes_its_write_in_flight_before_it_stops() -> None:
    """A worker whose static membership is lost stops; a write of its in flight (close
    decisions of requests the partitions' new owner reads too) is finished first, not cut
    half way: an unapplied decision would keep that owner waiting for an apply that never
    comes.  Nothing of it is committed."""
    sink = _HeldSink()
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1",
        redis_url_setting="redis://127.0.0.1:1/0",
        worker_instance_id="worker-0",
    )
    pipeline = create_app(settings, lambda app: Sinks(sink), consume=False)
    source = _CommitLog()
    pipeline.source = source  # type: ignore[assignment]
    topic = TOPICS.raw_sse.name
    _, records = raw_records(
        Source.OPENAI,
        (SAMPLES / "openai/text_usage.sse").read_bytes(),
        tenant="acme",
        request_id="in-flight",
    )
    batch = FetchedBatch(
        pipeline.revocations.generation,
        tuple(
            RawMessage(topic, 0, i, 1_790_000_000.0, b"in-flight", v) for i, v in enumerate(records)
        ),
    )
    run = asyncio.ensure_future(pipeline.agents["process-raw"].fun(_Backlog([batch])))
    while pipeline.processor.counters.received < len(records):  # applied ...
        await asyncio.sleep(0.001)
    assert pipeline.writes is not None
    assert pipeline.writes.pending  # ... and its write waits on the store
    assert pipeline.lost is not None
    pipeline.lost(MembershipLost("worker-0", TOPICS.processors_group))
    stopping = asyncio.ensure_future(pipeline.app.on_shutdown())  # runs close_sinks
    await asyncio.sleep(0.05)
    assert not stopping.done()  # the write is waited for, not cancelled
    sink.through.release()
    await asyncio.wait_for(stopping, 5)
    assert [c.tokens.request_id for c in sink.outputs.completed] == ["in-flight"]
    assert sink.flushes == 1
    assert source.commits == []
    run.cancel()


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
    while pipeline.batch_lock.locked():  # the agent submitted the second batch's write
        await asyncio.sleep(0.001)
    assert pipeline.writes is not None
    await asyncio.wait_for(pipeline.writes.drain(), 5)
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
    run.cancel()


class _SharedRedis:
    """A sink and a lookup over what Redis holds for two owners of one partition: close
    decisions (write-once, as ``mark_closing``) and which closes were applied (Tokens).

    The other owner's decisions are put in by the test (`decided`, `applied`); this worker's
    go through `begin`, and its flush applies what it wrote."""

    def __init__(self) -> None:
        self.decided: dict[RequestRef, Closed] = {}
        self.applied: set[RequestRef] = set()
        #: The latest revision applied per request (its Tokens written).
        self.revisions: dict[RequestRef, int] = {}
        self.written: list[Completed] = []
        self._added: list[Completed] = []

    async def begin(self, outputs: Outputs) -> set[RequestRef]:
        conflicts = set()
        for done in outputs.completed:
            if done.billing.revision:  # an amendment: over its superseded revision's marker
                current = self.decided.get(done.ref)
                if current is not None and current.marker() == done.supersedes_marker:
                    self.decided[done.ref] = done.closed
                elif current is None or current.marker() != done.closed.marker():
                    conflicts.add(done.ref)
                continue
            first = self.decided.setdefault(done.ref, done.closed)
            if first.marker() != done.closed.marker():
                conflicts.add(done.ref)
        return conflicts

    def add(self, outputs: Outputs) -> None:
        self._added.extend(outputs.completed)

    async def flush(self) -> None:
        for done in self._added:
            revision = done.billing.revision
            if self._applied_revision(done.ref) == revision - 1:  # each once, in order: the
                self.revisions[done.ref] = revision  # first Tokens written wins
                self.applied.add(done.ref)
                self.written.append(done)
        self._added = []

    def _applied_revision(self, ref: RequestRef) -> int:
        return self.revisions.get(ref, 0 if ref in self.applied else -1)

    async def lookup(self, refs: list[RequestRef]) -> dict[RequestRef, Closed]:
        found = {}
        for ref in refs:
            if ref in self.decided:
                decided = self.decided[ref]
                applied = self._applied_revision(ref) >= decided.revision
                found[ref] = Closed.from_marker(decided.marker(), applied=applied)
        return found


class _TwoOwners:
    """One raw partition read by this worker (a pipeline with `_SharedRedis`), whose
    request ``r`` another owner closes first, by timeout, before its END."""

    def __init__(self) -> None:
        self.redis = _SharedRedis()
        settings = Settings(
            kafka_bootstrap_servers="127.0.0.1:1",
            redis_url_setting="redis://127.0.0.1:1/0",
            request_timeout=30.0,
        )
        redis = self.redis
        self.pipeline = create_app(
            settings, lambda app: Sinks(redis, lookup=redis.lookup), consume=False
        )
        self.source = _CommitLog()
        self.pipeline.source = self.source  # type: ignore[assignment]
        self.topic = TOPICS.raw_sse.name
        self.tp = TopicPartition(self.topic, 0)
        transcript = (SAMPLES / "openai/text_usage.sse").read_bytes()
        self.records = {
            rid: raw_records(Source.OPENAI, transcript, tenant="acme", request_id=rid)[1]
            for rid in ("before", "r", "s", "t")
        }
        self.r = RequestRef("acme", "r")
        self.log: list[RawMessage] = []  # the partition as written, offset = index

    def messages(self, rid: str, part: slice = slice(None)) -> tuple[RawMessage, ...]:
        """Records of `rid` appended to the partition (at its next offsets)."""
        appended = tuple(
            RawMessage(self.topic, 0, len(self.log) + i, 1_790_000_000.0, rid.encode(), v)
            for i, v in enumerate(self.records[rid][part])
        )
        self.log.extend(appended)
        return appended

    async def feed(self, *messages: RawMessage) -> None:
        """One batch through the agent's own function, its write finished."""
        fetched = FetchedBatch(self.pipeline.revocations.generation, messages)

        async def stream() -> Any:
            yield fetched

        await self.pipeline.agents["process-raw"].fun(stream())
        assert self.pipeline.committer is not None
        await self.pipeline.committer.settle()  # commits are sent in the background

    def other_owner_times_out_r(self, first: int) -> Completed:
        """Another owner read r's records up to (not with) its END, from offset `first`,
        and closed it by timeout: its close (`.closed`: its decision, as it writes it)."""
        wall = _Wall()
        other = RequestProcessor(PriceTable.default(), timeout=1.0, clock=wall)
        out = Outputs()
        for m in self.log[first : first + len(self.records["r"]) - 1]:
            other.handle_sse(m.key, m.value, Position(m.topic, 0, m.offset, m.timestamp), out)
        wall.now += 10
        [theirs] = other.expire().completed
        assert theirs.closed.reason is CloseReason.TIMEOUT
        return theirs

    async def settle(self) -> None:
        """The background committer's commit sent and done."""
        assert self.pipeline.committer is not None
        await self.pipeline.committer.settle()

    def committed(self) -> int | None:
        return self.source.commits[-1][self.tp] if self.source.commits else None


async def test_records_of_a_request_closed_and_applied_by_another_owner_are_released() -> None:
    """After a rebalance another owner closed r first (by timeout) and applied its close; this
    worker's close of r at its END is not written.  r's records are released as that owner's:
    the partition goes on committing past r.  (Before, they stayed held: the partition
    committed nothing more until a rebalance or restart.)"""
    two = _TwoOwners()
    await two.feed(*two.messages("before"))
    end_of_before = len(two.log)
    assert two.committed() == end_of_before
    await two.feed(*two.messages("r", slice(-1)))  # r is open here
    assert two.committed() == end_of_before
    two.redis.decided[two.r] = two.other_owner_times_out_r(end_of_before).closed
    two.redis.applied.add(two.r)  # ... and applied: its Tokens, usage and bill are durable
    await two.feed(*two.messages("r", slice(-1, None)), *two.messages("s"))
    assert two.committed() == len(two.log)  # past r and s
    await two.feed(*two.messages("t"))
    assert two.committed() == len(two.log)
    assert [done.ref.request_id for done in two.redis.written] == ["before", "s", "t"]
    assert two.pipeline.processor.counters.requests_completed == 4  # r closed here too
    assert len(two.pipeline.gate) == 0


async def test_a_close_decided_elsewhere_is_committed_past_only_once_it_is_applied() -> None:
    """The other owner decided r's close but has not applied it (mid-write, or dead): this
    worker commits nothing past r's first record, and asks Redis at every write; once the
    close is applied (here: seen by the next timer pass) the partition commits on."""
    two = _TwoOwners()
    await two.feed(*two.messages("before"))
    r_first = len(two.log)
    await two.feed(*two.messages("r", slice(-1)))
    two.redis.decided[two.r] = two.other_owner_times_out_r(r_first).closed  # not applied
    await two.feed(*two.messages("r", slice(-1, None)), *two.messages("s"))
    await two.feed(*two.messages("t"))
    assert two.committed() == r_first  # s and t done, but behind r
    assert two.pipeline.gate.waiting_elsewhere() == [two.r]
    await two.pipeline.timers["close-quiet-requests"]()
    await two.settle()
    assert two.committed() == r_first  # still not applied: still held
    two.redis.applied.add(two.r)  # the other owner's write goes through
    await two.pipeline.timers["close-quiet-requests"]()
    await two.settle()
    assert two.committed() == len(two.log)
    assert two.pipeline.gate.waiting_elsewhere() == []
    assert [done.ref.request_id for done in two.redis.written] == ["before", "s", "t"]


async def test_a_close_decided_elsewhere_and_never_applied_is_closed_where_decided() -> None:
    """The other owner died between its decision and its apply: r's records stay held.  Its
    leaving rebalances the group: the partition is revoked, read again from the committed
    offset (r's first record), and r, asked about again, is closed where the other owner
    decided (same offset, same reason, same marker) and applied here: billed once, and the
    partition commits on."""
    two = _TwoOwners()
    await two.feed(*two.messages("before"))
    r_first = len(two.log)
    await two.feed(*two.messages("r", slice(-1)))
    theirs = two.other_owner_times_out_r(r_first)
    two.redis.decided[two.r] = theirs.closed
    await two.feed(*two.messages("r", slice(-1, None)), *two.messages("s"))
    assert two.committed() == r_first
    assert two.pipeline.revoked is not None
    await two.pipeline.revoked({two.tp})
    assert two.pipeline.gate.waiting_elsewhere() == []
    await two.feed(*two.log[r_first:])  # read again from the committed offset
    assert two.committed() == len(two.log)
    # r closed as the other owner decided (revision 0); its END, after that close, amends
    # it (revision 1: the whole stream).
    r_bill, r_amended = [done for done in two.redis.written if done.ref == two.r]
    assert r_bill.closed.marker() == theirs.closed.marker()
    assert (r_bill.tokens, r_bill.billing_value) == (theirs.tokens, theirs.billing_value)
    assert (r_amended.billing.revision, r_amended.billing.supersedes) == (
        1,
        theirs.billing.event_id,
    )
    assert r_amended.tokens.finish_reason.value == "stop"
    assert [done.ref.request_id for done in two.redis.written] == ["before", "s", "r", "r"]


async def test_a_fetched_batch_counts_its_stages_once_per_request_it_closed() -> None:
    """The worker times a batch's way (`processors.stages`): a fetched batch that closes a
    request adds each stage once, from its END record's Kafka timestamp to the sink that
    ends the Tokens' write; a batch that closes none adds no span, but both are counted
    as batches with their messages."""

    class RedisLike(RecordingSink):
        stage = "redis"  # its flush ends the request's write, as RedisSink' does

    sink = RedisLike()
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1", redis_url_setting="redis://127.0.0.1:1/0"
    )
    pipeline = create_app(settings, lambda app: Sinks(sink), consume=False)
    _, records = raw_records(
        Source.OPENAI,
        (SAMPLES / "openai/text_usage.sse").read_bytes(),
        tenant="acme",
        request_id="timed",
    )
    produced = time.time() - 0.25  # the END record was produced 250 ms before the fetch
    messages = tuple(
        RawMessage(TOPICS.raw_sse.name, 0, i, produced, b"timed", value)
        for i, value in enumerate(records)
    )

    def fetched(part: tuple[RawMessage, ...]) -> FetchedBatch:
        times = BatchTimes(
            fetched=time.perf_counter(), fetched_wall=time.time(), messages=len(part)
        )
        return FetchedBatch(pipeline.revocations.generation, part, times)

    async def stream() -> Any:
        yield fetched(messages[:-1])  # no request closed: nothing counted
        yield fetched(messages[-1:])  # its END

    await pipeline.agents["process-raw"].fun(stream())
    summary = summarise(pipeline.metrics.stages.snapshot())
    assert [c.tokens.request_id for c in sink.outputs.completed] == ["timed"]
    for stage in ("fetch", "decode", "queue", "apply", "lookup", "write_wait", "total"):
        assert summary[stage]["requests"] == 1, stage
    assert 250 <= summary["fetch"]["p50_ms"] < 400
    assert summary["total"]["p50_ms"] >= summary["fetch"]["p50_ms"]
    assert b'streamtally_stage_seconds_count{stage="total"} 1.0' in (pipeline.metrics.exposition())
    # Both batches were paid for, the one that closed nothing too.
    assert batch_summary(pipeline.metrics.stages.snapshot())["batches"] == 2
    assert batch_summary(pipeline.metrics.stages.snapshot())["messages"] == len(messages)


async def test_an_idle_agent_leaves_its_write_behind_and_applies_the_next_batch_at_once() -> None:
    """No batch waits when a write starts (an idle worker): the agent does not wait for the
    write before it takes the next batch, which comes while the store still writes; it is
    applied at once (its own write waits for the one before, and nothing is committed before
    its outputs are durable)."""
    sink = _HeldSink()
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1", redis_url_setting="redis://127.0.0.1:1/0"
    )
    pipeline = create_app(settings, lambda app: Sinks(sink), consume=False)
    source = _CommitLog()
    pipeline.source = source  # type: ignore[assignment]
    topic = TOPICS.raw_sse.name
    transcript = (SAMPLES / "openai/text_usage.sse").read_bytes()
    batches, offset = [], 0
    for request_id in ("idle-1", "idle-2"):
        _, records = raw_records(Source.OPENAI, transcript, tenant="acme", request_id=request_id)
        batches.append(
            FetchedBatch(
                pipeline.revocations.generation,
                tuple(
                    RawMessage(topic, 0, offset + i, 1_790_000_000.0, request_id.encode(), v)
                    for i, v in enumerate(records)
                ),
            )
        )
        offset += len(records)
    later = asyncio.Event()

    async def stream() -> Any:
        yield batches[0]
        await later.wait()  # nothing waits in the channel: the worker is idle
        yield batches[1]
        await asyncio.Event().wait()

    run = asyncio.ensure_future(pipeline.agents["process-raw"].fun(stream()))
    first = len(batches[0].messages)
    while pipeline.processor.counters.received < first:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    assert pipeline.writes is not None
    assert pipeline.writes.pending  # the first batch's write waits on the store ...
    later.set()
    while pipeline.processor.counters.received < offset:  # ... and the next is applied
        await asyncio.sleep(0.001)
    assert sink.flushes == 0
    assert pipeline.processor.counters.requests_completed == 2
    assert source.commits == []
    sink.through.release()
    sink.through.release()
    while pipeline.batch_lock.locked():
        await asyncio.sleep(0.001)
    await asyncio.wait_for(pipeline.writes.drain(), 5)
    assert pipeline.committer is not None
    await pipeline.committer.settle()
    assert source.commits[-1] == {TopicPartition(topic, 0): offset}
    run.cancel()
