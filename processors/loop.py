"""The worker's batch loop: a batch of raw records through its named stages.

`BatchLoop` is what the faust app (`processors.app.create_app`) runs; each
stage is a method, in the order a batch passes them (the stages' timings are
`processors.stages`'s):

- `fetch`, the raw-topic task: `RawSource` reads the raw topics in bulk, each
  batch is decoded (`decode`) and sent to an in-memory channel (at most one
  batch waits there: the consumer cannot run ahead);
- `decode`: each message decoded and checked at the edge
  (`RequestProcessor.examine_batch`: pure, so done here, while the agent waits
  for the writes of the batch before);
- `run`, the agent `process-raw`: one batch at a time, under the batch lock,
  through `apply`;
- `apply`: the records counted in (each names its request: tenant and request
  id), Redis asked about the requests it has not seen (`lookup_closed`: closed
  by an earlier run?) and the amendable states it needs (`lookup_amendable`),
  each record handed to `RequestProcessor`, and the outputs to `WriteBehind`,
  which writes them while the agent takes the next batch (it does not wait for a
  write before it takes a batch, only before it starts the next write);
- `write`: the outputs made durable through the sinks, then the batch's records
  held by `CommitGate` and the requests written (or closed elsewhere once Redis
  says applied: `closed_elsewhere`) finished; what the gate releases goes to the
  `Committer`;
- `commit`: the released offsets committed, in the background
  (`processors.writes`).

Beside them: a timer closes requests that went quiet (`close_quiet_requests`);
another reads the input clocks (`processors.clock`) four times a second, without
waiting for a batch, so that a write hanging through an outage is never taken
for quiet time (`watch_input_clocks`); a rebalance's revoke (`revoked`), a lost
static membership (`lost`), the first failure (`fail`) and the stop
(`close_sinks`).

Committing is what makes a crash harmless: a record is committed only when its
request is closed and its outputs are durable, and only with every record
before it in its partition (`CommitGate`), so a restarted worker re-reads every
record of every request that was open, and nothing of the requests it had
finished.  A request whose close the partition's other owner decided first
(after a rebalance; `Sinks.write` writes nothing of it here) counts as closed
once that close is applied, which the worker asks Redis at every write until it
is; never on the decision alone (`processors.commits`).

A batch (or a timer's close) that raises leaves records consumed but not held by
the commit gate: faust would restart the agent on the next batch, and a commit
then would pass records never applied (requests never billed).  So the first
failure breaks the pipeline for good: nothing is committed any more, also not at
a revoke or at the shutdown, and `on_failure` is called (the worker stops itself:
the partitions' next owner, or this worker restarted, re-reads them from the
committed offset).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import faust
from aiokafka import TopicPartition

from streamtally.core.identity import RequestRef
from streamtally.errors import StreamtallyError
from streamtally.processors.commits import CommitGate
from streamtally.processors.metrics import WorkerMetrics
from streamtally.processors.requests import Outputs, RawRecord, Refused, RequestProcessor
from streamtally.processors.sinks import Sinks
from streamtally.processors.source import (
    FetchedBatch,
    MembershipLost,
    RawMessage,
    RawSource,
    Revocations,
)
from streamtally.processors.stages import BatchTimes
from streamtally.processors.writes import Committer, Holds, WriteBehind
from streamtally.settings import Settings
from streamtally.topics import Topics, encode_key
from streamtally.wire.framing import learn_ids

__all__ = ["LOST_WRITE_WAIT_S", "WATCH_CLOCKS_S", "BatchLoop", "ExaminedBatch", "Pipeline"]

#: The worker's logger, named after the module that wires it (`processors.app`).
log = logging.getLogger("streamtally.processors.app")

#: How long a worker whose static membership is lost lets its write in flight finish before
#: it stops (seconds; see `BatchLoop.close_sinks`).
LOST_WRITE_WAIT_S = 10.0

#: How often the input clocks are read apart from the batches and closes (seconds): well
#: within `processors.source.LIVE_WINDOW_S`, so an outage freezes them within a second.
WATCH_CLOCKS_S = 0.25


@dataclass(frozen=True, slots=True)
class ExaminedBatch:
    """A fetched batch with each message decoded and checked at the edge (`examined[i]` is
    what `RequestProcessor.examine_sse` or `examine_engine` made of `messages[i]`).

    Examining changes no state, so the raw-topic task does it for the next batch while
    the agent waits for the writes of the one before; the agent then only admits the
    records, in order, and applies them.
    """

    fetched: FetchedBatch
    examined: list[RawRecord | Refused]


@dataclass(slots=True)
class Pipeline:
    app: faust.App
    processor: RequestProcessor
    agents: dict[str, Any]
    gate: CommitGate = field(default_factory=CommitGate)
    #: Set on first use; the worker's factory builds them once the producer exists.
    sinks: Sinks | None = None
    #: The raw-topic consumer, while the worker runs (absent in agent tests).
    source: RawSource | None = None
    #: Which partitions were revoked since a batch was fetched (the consumer's, shared).
    revocations: Revocations = field(default_factory=Revocations)
    #: Held while a batch (or the timer's closes) is applied and written; a revoke waits.
    batch_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Served on /metrics (`processors.metrics`); create_app reads the processor's counters.
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    #: The error that broke a batch or a close: from then on nothing is committed (see
    #: `BatchLoop.fail`).
    broken: BaseException | None = None
    #: The batch written while the next is applied (`processors.writes`); set by the loop.
    writes: WriteBehind | None = None
    #: Commits what the gate releases, off the batches' path (`processors.writes`).
    committer: Committer | None = None
    #: The app's timers by name (create_app registers them with faust): what they run.
    timers: dict[str, Callable[[], Awaitable[None]]] = field(default_factory=dict)
    #: What the consumer's rebalance listener calls with the partitions revoked (set by
    #: create_app; agent tests call it as a rebalance would).
    revoked: Callable[[set[TopicPartition]], Awaitable[None]] | None = None
    #: What the source calls once this static member's membership is lost (set by
    #: create_app; agent tests call it as a fencing would).
    lost: Callable[[MembershipLost], None] | None = None


def _times_of(batch: ExaminedBatch | FetchedBatch) -> BatchTimes:
    return batch.fetched.times if isinstance(batch, ExaminedBatch) else batch.times


def _end_timestamps(outputs: Outputs, messages: Sequence[RawMessage]) -> list[float]:
    """The Kafka timestamps of the records that closed `outputs.completed` (their END
    markers): one pass over the batch, only for a batch that closed requests."""
    closing = {(encode_key(d.ref.request_id), d.closed.offset) for d in outputs.completed}
    offsets = {offset for _, offset in closing}
    return [
        m.timestamp
        for m in messages
        if m.offset in offsets and m.timestamp is not None and (m.key, m.offset) in closing
    ]


class BatchLoop:
    """A batch's stages, and what runs beside them; see the module docstring.

    `batches` is the channel `fetch` sends each decoded batch to, and `run` reads.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        settings: Settings,
        topics: Topics,
        batches: Any,
        *,
        make_sinks: Callable[[faust.App], Sinks] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.topics = topics
        self.batches = batches
        self.make_sinks = make_sinks
        self.on_failure = on_failure
        self.processor = pipeline.processor
        self.gate = pipeline.gate
        self.metrics = pipeline.metrics
        self.sse_topic = topics.raw_sse.name
        #: The batches' partitions as aiokafka names them, made once each.
        self._tps: dict[tuple[str, int], TopicPartition] = {}
        self.writes = pipeline.writes = WriteBehind(self.write, self.fail)
        self.committer = pipeline.committer = Committer(self.commit, committed=self._committed)
        pipeline.lost = self.lost
        pipeline.revoked = self.revoked
        # Wall time counts towards a request's quiet time only while writes succeed.
        self.processor.input_clock.healthy = self.writing

    def writing(self) -> bool:
        """Whether the sinks write (not failing, or not built yet): the input clocks run."""
        sinks = self.pipeline.sinks
        return sinks is None or not sinks.failing

    def sinks(self) -> Sinks:
        """The sinks, built on first use (in the running loop)."""
        pipeline = self.pipeline
        if pipeline.sinks is None:
            if self.make_sinks is None:
                raise RuntimeError("the pipeline has no sinks")
            pipeline.sinks = self.make_sinks(pipeline.app)
            pipeline.sinks.on_error = self.metrics.sink_error
        return pipeline.sinks

    # -- the stages, in a batch's order ---------------------------------------------------

    async def fetch(self) -> None:
        """The raw-topic task: read batches, decode each, send it to the agent."""
        pipeline, processor = self.pipeline, self.processor
        source = RawSource(self.settings, self.topics, self.revoked, pipeline.revocations)
        source.on_assigned = self.metrics.assigned
        source.on_commit_error = lambda exc: self.metrics.sink_error("kafka", exc, False)
        source.on_lost = self.lost
        await source.start()
        pipeline.source = source
        processor.live = source.is_live  # a partition's clock runs only while caught up
        try:
            # faust holds stream queues until its own consumer gets partitions; it has none.
            pipeline.app.flow_control.resume()
            async for batch in source.batches():
                if pipeline.broken is not None:
                    break  # stopping: a lost membership's last fetch is not applied
                # Decoded here, not in the agent: this task runs while the agent waits
                # for the previous batch's writes, so decoding fills that wait.  The
                # schema ids of Confluent-framed values the process does not know yet are
                # asked of the registry first, from a thread (`learn_ids`).
                try:
                    await learn_ids(m.value for m in batch.messages)
                except StreamtallyError as exc:  # the registry is unreachable: stop
                    self.fail(exc)
                    raise
                examined = self.decode(batch)
                batch.times.decoded = time.perf_counter()
                await self.batches.send(value=examined)
        except Exception as exc:
            # The consumer's fatal errors (a session timeout the broker refuses, a group
            # it may not join, a fenced instance id at a join): nothing more is read.
            self.fail(exc)
            raise
        finally:
            processor.live = None
            # What was released and not yet committed (stopping: at once, no interval).
            await self.committer.settle()
            pipeline.source = None
            await source.stop()

    def decode(self, fetched: FetchedBatch) -> ExaminedBatch:
        """Decode and check a batch's messages: pure, so done ahead (see `ExaminedBatch`)."""
        return ExaminedBatch(
            fetched, self.processor.examine_batch(fetched.messages, self.sse_topic)
        )

    async def run(self, stream: Any) -> None:
        """The agent `process-raw`: each batch applied under the batch lock, in order."""
        pipeline, metrics = self.pipeline, self.metrics
        async for fetched in stream:
            if isinstance(pipeline.broken, MembershipLost):
                continue  # another worker holds these partitions now: nothing more applied
            async with pipeline.batch_lock:  # a revoke waits for the batch in flight
                started = time.perf_counter()
                if isinstance(fetched, ExaminedBatch | FetchedBatch):
                    _times_of(fetched).started = started
                try:
                    # Its write starts once the write before it is done and goes on behind:
                    # the agent takes the next batch at once, also when none waits yet (an
                    # idle worker's write ends by itself, its records committed by the
                    # `Committer`; a batch that comes meanwhile is applied meanwhile).
                    await self.apply(fetched)
                except Exception as exc:
                    self.fail(exc)
                    raise
                metrics.batch_seconds.observe(time.perf_counter() - started)
        # A stream that ends (agent tests; faust's never does): its last write is finished.
        try:
            await self.writes.drain()
        except Exception as exc:
            self.fail(exc)
            raise

    async def apply(self, fetched: ExaminedBatch | FetchedBatch | Sequence[RawMessage]) -> None:
        """Apply a batch: its records admitted, Redis asked, each applied; its outputs
        submitted to be written behind."""
        processor = self.pipeline.processor  # read at each batch (a test stands one in)
        fence = self.pipeline.revocations
        if not isinstance(fetched, ExaminedBatch | FetchedBatch):
            # Handed over directly (agent tests): fetched now, so nothing is fenced.
            fetched = FetchedBatch(fence.generation, tuple(fetched))
        if isinstance(fetched, FetchedBatch):  # agent tests hand fetched batches over
            await learn_ids(m.value for m in fetched.messages)
            fetched = self.decode(fetched)
        generation, messages = fetched.fetched.generation, fetched.fetched.messages
        examined = fetched.examined
        times = fetched.fetched.times
        if fence.generation != generation:
            # Records of a partition revoked since the fetch are another worker's now.
            pairs = [
                (m, seen)
                for m, seen in zip(messages, examined, strict=True)
                if not fence.stale((m.topic, m.partition), generation)
            ]
            if len(pairs) < len(messages):
                log.info(
                    "fenced %d records of partitions revoked since their fetch "
                    "(their next owner reads them from the committed offset)",
                    len(messages) - len(pairs),
                )
                messages = tuple(m for m, _ in pairs)
                examined = [seen for _, seen in pairs]
        outputs = Outputs()
        # A record's request is (tenant, request id), known only from its body.
        raws = processor.admit_batch(messages, examined, outputs)
        looked_up = time.perf_counter()
        await self.lookup_closed(processor.requests_of(raws))
        await self.lookup_amendable(processor.amendable_to_fetch(raws))
        times.lookup = time.perf_counter() - looked_up
        holds = processor.apply_batch(outputs, messages, raws, self._tps, TopicPartition)
        if outputs.completed:
            times.ends = _end_timestamps(outputs, messages)
        times.applied = time.perf_counter()
        # Written while the next batch is applied; its records are held once it is durable.
        await self.writes.submit(outputs, holds, times)

    async def lookup_closed(self, refs: set[RequestRef]) -> None:
        """Ask Redis which of the batch's requests (and new calls) an earlier run closed."""
        processor = self.processor
        unknown = sorted(processor.unknown(refs))
        if unknown:
            found = await self.sinks().find_closed(unknown)
            for ref, closed in found.items():
                processor.closed_earlier(ref, closed)

    async def lookup_amendable(self, refs: set[RequestRef]) -> None:
        """Ask Redis what the batch's late records need to amend their requests with."""
        if refs:
            found = await self.sinks().find_amendable(sorted(refs))
            # Their records are decoded again as they are re-applied: any schema id first.
            await learn_ids(k.value for s in found.values() if s is not None for k in s.records)
            for ref, state in found.items():
                self.processor.amendable_fetched(ref, state)

    async def write(self, outputs: Outputs, holds: Holds, times: BatchTimes | None) -> None:
        """Write the outputs, then hold the batch's records and commit those now done."""
        gate, pipeline = self.gate, self.pipeline
        written = await self.sinks().write(outputs, times)
        self.metrics.written(written.outputs)
        # Only now, with the batch's outputs durable, may its records be released.
        gate.hold_all(holds)
        completed = written.outputs.completed
        gate.finished(
            [done.ref for done in completed], {done.ref: done.closed.offset for done in completed}
        )
        # A request whose close another owner decided first: its records are released as
        # that owner's, once its close is applied (asked at every write until it is).
        gate.elsewhere(written.elsewhere)
        if written.elsewhere or gate.waiting_elsewhere():
            await self.closed_elsewhere(written.elsewhere)
        # Committed off this path (`Committer`): the next batch's write does not wait for it.
        stored = [times.stored] * len(times.ends) if times is not None and times.stored else []
        if gate.release() and pipeline.source is not None and pipeline.broken is None:
            self.committer.request(gate.committable(), stored)
        if times is not None:
            times.record(self.metrics.stages)

    async def closed_elsewhere(self, new: frozenset[RequestRef]) -> None:
        """Ask Redis about the requests whose close another owner decided first (`new`:
        those of this write): release the records of those whose close is applied, their
        outputs being durable there.

        A decision not (yet) applied keeps its request's records held: its owner may be
        mid-write, or may have died between the decision and the apply, and a commit past
        them would bill the request nowhere.  The processor takes the decision as the
        request's close either way (`RequestProcessor.closed_elsewhere`).
        """
        gate, processor = self.gate, self.processor
        waiting = gate.waiting_elsewhere()
        found = await self.sinks().find_closed(sorted(new.union(waiting)))
        for ref in new:  # also one none of whose records waits here (none is held)
            if ref in found:
                processor.closed_elsewhere(ref, found[ref])
        applied: dict[RequestRef, int] = {}
        for ref in waiting:
            closed = found.get(ref)
            if closed is not None and closed.applied:
                processor.closed_elsewhere(ref, closed)
                applied[ref] = closed.offset
            elif ref in new:
                log.warning(
                    "the close of request %s of tenant %s decided by another owner (%s) is "
                    "not applied yet: its records stay uncommitted until it is (should that "
                    "owner have died, the rebalance its leaving starts re-reads the "
                    "partition, and the request is closed where it decided)",
                    ascii(ref.request_id),
                    ascii(ref.tenant),
                    "its marker is gone" if closed is None else repr(closed.marker()),
                )
        if applied:
            gate.finished(list(applied), applied)

    async def commit(self, offsets: Mapping[Any, int]) -> None:
        """One commit of released offsets, unless the pipeline broke since they were."""
        source = self.pipeline.source
        if source is not None and self.pipeline.broken is None:
            await source.commit(offsets)

    def _committed(self, waits: list[float]) -> None:
        for wait in waits:
            self.metrics.stages.observe("commit", wait)

    # -- beside the stages ----------------------------------------------------------------

    async def close_quiet_requests(self) -> None:
        """The timer's closes: the requests quiet past their timeout, written as a batch."""
        pipeline, writes = self.pipeline, self.writes
        if self.make_sinks is not None:
            await self.sinks().probe()  # an outage with nothing to write stops the clocks too
        async with pipeline.batch_lock:
            started = time.perf_counter()
            try:
                # The write in flight first (an idle agent leaves its last one behind): a
                # write that hangs holds the closes back, as it holds the batches.
                await writes.drain()
                await writes.submit(self.processor.expire(), ())
                await writes.drain()
            except Exception as exc:
                self.fail(exc)
                raise
            self.metrics.close_seconds.observe(time.perf_counter() - started)

    async def watch_input_clocks(self) -> None:
        """Read the input clocks (the timer's, four times a second)."""
        # Not under the batch lock: a write that hangs (Kafka stopped, not failing) holds
        # it, and a clock read only after the hang would take all of it for quiet time
        # (`InputClock.tick` judges an interval by what is true at its end).  Read every
        # quarter second, the clocks see the partitions stop answering and freeze.
        processor = self.processor
        processor.input_clock.tick(processor.live)

    async def revoked(self, tps: set[TopicPartition]) -> None:
        """Partitions go to another worker: commit what is done, forget the rest.

        Waits for the batch in flight (it may hold records of these partitions),
        so nothing of theirs is applied after their requests are dropped.
        """
        self.metrics.revoked()
        async with self.pipeline.batch_lock:
            await self._revoke(tps)

    async def _revoke(self, tps: set[TopicPartition]) -> None:
        pipeline, gate = self.pipeline, self.gate
        # The batch written behind: its records held, what is done committed (a write that
        # failed broke the pipeline: nothing is committed below).
        await self.writes.settle()
        await self.committer.settle()  # no commit of the background committer in flight with it
        if pipeline.source is not None and pipeline.broken is None:
            await pipeline.source.commit(
                {tp: o for tp, o in gate.committable().items() if tp in tps}
            )
        processor = self.processor
        dropped = processor.drop_partitions({(tp.topic, tp.partition) for tp in tps})
        # The next owner re-reads them; a close decided elsewhere and not applied is
        # forgotten, so that, read again here, it is asked about and closed where decided.
        processor.forget_closed(gate.drop(tps, dropped))

    def fail(self, exc: BaseException) -> None:
        """The first failure of a batch or a close: commit nothing more, and stop."""
        pipeline = self.pipeline
        if pipeline.broken is not None:
            return
        pipeline.broken = exc
        log.critical(
            "a batch failed, or the raw-topic consumer; this worker commits nothing more and "
            "stops: its partitions' records are read again from the committed offset (%s: %s)",
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        if self.on_failure is not None:
            self.on_failure(exc)

    def lost(self, exc: MembershipLost) -> None:
        """This static member's membership is gone (logged by the source): it reads and
        commits nothing more, and stops."""
        pipeline = self.pipeline
        if pipeline.broken is None:
            pipeline.broken = exc
            if self.on_failure is not None:
                self.on_failure(exc)

    async def close_sinks(self) -> None:
        """After the agent, tasks and timers have stopped: the write in flight, the sinks."""
        pipeline, writes = self.pipeline, self.writes
        # Fenced: the worker that has the partitions now may be reading the requests this
        # write closes.  Stopped half way, a close decision it wrote would stay unapplied,
        # and that worker, its own close refused, would wait for the apply with no rebalance
        # to come and end the wait (a static member that stops does not leave the group).
        # So the write finishes first, within a bound: its outputs are those any owner would
        # write, and nothing of it is committed.
        fenced = isinstance(pipeline.broken, MembershipLost)
        if fenced and not await writes.finish_within(LOST_WRITE_WAIT_S):
            log.warning(
                "the write in flight did not finish within %g s; stopping it", LOST_WRITE_WAIT_S
            )
        # A write still in flight is stopped (as faust stops the agent's batch): nothing of
        # it is committed.
        await writes.cancel()
        if pipeline.sinks is not None:
            await pipeline.sinks.close()
