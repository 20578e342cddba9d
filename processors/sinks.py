"""Where a batch's outputs go: Kafka topics and Redis, behind one small interface.

A sink takes outputs with `add` and makes them durable with `flush`
(quix-streams style); `begin` first records what must be known before any
output leaves (the close decisions).  `Sinks.write` runs, for one batch:

1. every sink's `begin` (Redis: the close decision of each finished request),
2. every sink's `add`, then `flush` in order: Kafka (chunks, Tokens, billing
   events, dead letters; waits for the broker's acks), then Redis (Tokens,
   usage rows and record counts in one atomic, idempotent script).

Only then does the worker acknowledge the records of the finished requests,
so a crash at any point replays them, and a replay writes the same bytes
(every output is computed from the raw records alone) while Redis counts each
request once.

One close decision per request: a request whose close another owner of its
partition decided first (after a rebalance) gets none of its outputs written
here; `write` names it in `Written.elsewhere`.  Its records are not this
worker's to release on its own word: they may be committed only once that
other close is applied (its Tokens in Redis, `find_closed` says ``applied``),
never on the decision alone, which a worker that died before applying it
leaves behind (`processors.commits`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import redis.asyncio as aioredis
from aiokafka.errors import KafkaError, ProducerClosed
from redis.exceptions import RedisError

from streamtally.connection import KafkaConnection
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError
from streamtally.processors.amendable import Amendable
from streamtally.processors.requests import Closed, Outputs
from streamtally.processors.stages import BatchTimes
from streamtally.store import RedisBatch, RedisStore, amended_request
from streamtally.topics import Topics, encode_key, output_key
from streamtally.wire import avro
from streamtally.wire.framing import SINGLE_OBJECT, Framing
from streamtally.wire.kafka import KeyPartitioner, idempotent_producer

__all__ = ["KafkaSink", "RedisSink", "Sink", "Sinks", "Written", "retry"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Written:
    """What `Sinks.write` made durable, and which closes it left to another owner."""

    #: The outputs written: the batch's, less the completions of `elsewhere`.
    outputs: Outputs
    #: Requests whose close another owner decided first (a different close marker was
    #: there): nothing of their close is written here, and their records may be released
    #: only once that owner's close is applied (`CommitGate.elsewhere`).
    elsewhere: frozenset[RequestRef] = frozenset()


class Sink(Protocol):
    async def begin(self, outputs: Outputs) -> set[RequestRef] | None:
        """Record what must be known before any output leaves; return the requests whose
        close was decided otherwise already (their outputs are then not written)."""

    def add(self, outputs: Outputs) -> None: ...

    async def flush(self) -> None: ...


class KafkaSink:
    """Chunks, completed Tokens, billing events and dead letters onto their topics.

    It sends whole record batches per partition (`create_batch` / `send_batch`)
    with its own idempotent producer: one call per partition and flush instead of
    one per message. Partitions are chosen as the default partitioner does
    (murmur2 of the request id, `encode_key`), so a request keeps its partition number
    on every topic; the outputs' keys are the request's identity (`output_key`).
    """

    #: The step of a request's close its flush ends (`processors.stages`).
    stage: Final = "kafka"

    def __init__(
        self, kafka: KafkaConnection | str, topics: Topics, framing: Framing = SINGLE_OBJECT
    ) -> None:
        self._producer = idempotent_producer(kafka, linger_ms=0)
        self._topics = topics
        #: How the values leave (``STREAMTALLY_AVRO_FRAMING``): the processor encodes
        #: single-object messages (Redis keeps those), framed here as they are sent.
        self.framing = framing
        self._started = False
        #: murmur2 of the request id, as the default partitioner, kept per request: one
        #: request writes in many batches (`KeyPartitioner`).
        self._partitioner = KeyPartitioner()
        self._partitions = {t.name: list(range(t.partitions)) for t in topics.all}
        #: What to send, per (topic, partition): (key, value), in the order added.
        self._pending: dict[tuple[str, int], list[tuple[bytes | None, bytes]]] = {}

    async def begin(self, outputs: Outputs) -> set[RequestRef] | None:
        del outputs  # nothing to record before sending
        return None

    def add(self, outputs: Outputs) -> None:
        # Values were encoded by the processor as each output was made (a record that
        # cannot be encoded is dead-lettered there), so nothing here can fail on content.
        # Each record goes straight to its partition's list; a request's key and partition
        # are found once per batch and topic, and once per run of its chunks.
        pending, topics = self._pending, self._topics
        frame = None if self.framing.headers is None else self.framing.frame
        routes: dict[tuple[RequestRef, str], tuple[bytes, list[tuple[bytes | None, bytes]]]] = {}

        def route(ref: RequestRef, topic: str) -> tuple[bytes, list[tuple[bytes | None, bytes]]]:
            """The request's output key on `topic`, and the list of its partition there."""
            found = routes.get((ref, topic))
            if found is None:
                partitions = self._partitions[topic]
                number = self._partitioner(encode_key(ref.request_id), partitions, partitions)
                found = routes[ref, topic] = (
                    output_key(ref),
                    pending.setdefault((topic, number), []),
                )
            return found

        chunks = topics.chunks.name
        last: RequestRef | None = None
        key = b""
        target: list[tuple[bytes | None, bytes]] = []
        for value, ref in zip(outputs.chunk_values, outputs.chunk_refs, strict=True):
            if ref != last:
                key, target = route(ref, chunks)
                last = ref
            target.append((key, value if frame is None else frame(value)))
        for done in outputs.completed:
            for topic, value in (
                (topics.tokens.name, done.tokens_value),
                (topics.billing.name, done.billing_value),
            ):
                key, target = route(done.ref, topic)
                target.append((key, value if frame is None else frame(value)))
        for letter in outputs.dead_letters:
            value = avro.encode_dead_letter(letter)
            partitions = self._partitions[topics.deadletter.name]
            # Without a key, any partition, as the client does.
            number = self._partitioner(letter.key, partitions, partitions)
            pending.setdefault((topics.deadletter.name, number), []).append(
                (letter.key, value if frame is None else frame(value))
            )

    async def flush(self) -> None:
        """Send everything added and wait for the broker; on failure nothing is dropped."""
        if not self._pending:
            return
        if not self._started:
            await self._producer.start()
            self._started = True
        futures = []
        for (topic, partition), messages in self._pending.items():
            if not messages:
                continue
            batch = self._producer.create_batch()
            for key, value in messages:
                if batch.append(key=key, value=value, timestamp=None) is None:
                    futures.append(
                        await self._producer.send_batch(batch, topic, partition=partition)
                    )
                    batch = self._producer.create_batch()
                    if batch.append(key=key, value=value, timestamp=None) is None:
                        raise ValueError(f"a {topic} record of {len(value)} bytes fits no batch")
            futures.append(await self._producer.send_batch(batch, topic, partition=partition))
        await asyncio.gather(*futures)
        self._pending = {}

    async def stop(self) -> None:
        # Also when it never started (an idle worker): an unclosed producer is reported as
        # "Unclosed AIOKafkaProducer" at exit, an error line for a clean stop.
        await self._producer.stop()


class RedisSink:
    """The worker's Redis sink: finished requests into Redis (Tokens, usage rows, counts),
    idempotently, through a `RedisBatch`; the close decisions and what the agent asks Redis.

    Given a client, it wraps it in a `RedisStore` (and closes it on `stop`).
    """

    #: The step of a request's close its flush ends: the Tokens is readable after it.
    stage: Final = "redis"

    def __init__(self, client: aioredis.Redis | RedisStore) -> None:
        self.store = client if isinstance(client, RedisStore) else RedisStore(client)
        self._sink = RedisBatch(self.store)
        self._dead: list[str] = []

    async def begin(self, outputs: Outputs) -> set[RequestRef] | None:
        firsts = {d.ref: d.closed.marker() for d in outputs.completed if not d.billing.revision}
        conflicts = await self.store.mark_closing(firsts)
        amending = {
            d.ref: (d.closed.marker(), d.supersedes_marker or "")
            for d in outputs.completed
            if d.billing.revision
        }
        conflicts.update(await self.store.mark_amending(amending))
        for ref, marker in conflicts.items():
            log.warning(
                "request %s of tenant %s was closed as %r already (by the partition's other "
                "owner): its close here is not written, its records are released once that "
                "close is applied",
                ascii(ref.request_id),
                ascii(ref.tenant),
                marker,
            )
        return set(conflicts)

    def add(self, outputs: Outputs) -> None:
        for done in outputs.completed:
            if done.supersedes is not None:  # an amendment: revision n over n - 1
                self._sink.amend(
                    amended_request(
                        done.tokens,
                        done.billing,
                        done.supersedes,
                        records=done.records,
                        duplicates=done.duplicates,
                        amendable=done.amendable,
                    )
                )
                continue
            self._sink.add(
                done.tokens,
                done.billing,
                closed=done.closed.marker(),
                records=done.records,
                duplicates=done.duplicates,
            )
            if done.amendable is not None:
                self._sink.keep(done.ref, done.amendable)
        self._dead.extend(
            self.store.position_of(letter.topic, letter.partition, letter.offset)
            for letter in outputs.dead_letters
        )

    async def probe(self) -> None:
        """Raise when Redis does not answer now (an outage with nothing to write)."""
        await self.store.ping()

    async def flush(self) -> None:
        await self._sink.flush()  # keeps its batch queued when it fails
        await self.store.count_dead_letters(self._dead)
        self._dead = []

    async def stop(self) -> None:
        await self.store.aclose()

    async def lookup(self, refs: list[RequestRef]) -> dict[RequestRef, Closed]:
        found = await self.store.closed_markers(refs)
        return {r: Closed.from_marker(m, applied=a) for r, (m, a) in found.items()}

    async def amendable(self, refs: list[RequestRef]) -> dict[RequestRef, Amendable | None]:
        """What each of `refs` keeps for its amendments; None: nothing (expired), or
        something that is not an amendable state (logged: the request is not amended)."""
        found = await self.store.amendable_states(refs)
        states: dict[RequestRef, Amendable | None] = {}
        for ref in refs:
            data = found.get(ref)
            if data is None:
                states[ref] = None
                continue
            try:
                states[ref] = Amendable.decode(data)
            except InputError as exc:
                log.error("the amendable state of %s is unreadable: %s", ref, exc)
                states[ref] = None
        return states


async def _no_amendable(refs: list[RequestRef]) -> dict[RequestRef, Amendable | None]:
    return dict.fromkeys(refs)  # no memory beyond this process


async def _no_lookup(refs: list[RequestRef]) -> dict[RequestRef, Closed]:
    del refs  # no memory beyond this process
    return {}


class Sinks:
    """The sinks of a worker, written in order, plus where closed requests are looked up."""

    def __init__(
        self, *sinks: Sink, lookup: Any = _no_lookup, amendable: Any = _no_amendable
    ) -> None:
        self._sinks = sinks
        self.lookup = lookup
        #: Where the amendable states of requests closed at their timeout are looked up.
        self.amendable = amendable
        self._write_failing = False
        self._probe_failing = False
        #: Monotonic time the stores last all answered (a write, a lookup or a probe).
        self.answered_at: float | None = None
        #: Told of every failed step: (store, exception, retried) (the metrics).
        self.on_error: Callable[[str, BaseException, bool], None] | None = None
        # The agents (raw SSE, raw engine) and the timer share the sinks: one write
        # at a time, or a flush would send another writer's half-added batch.
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        """Release the sinks' connections (every write has already completed)."""
        async with self._lock:
            for sink in self._sinks:
                stop = getattr(sink, "stop", None)
                if stop is not None:
                    await stop()

    async def write(self, outputs: Outputs, times: BatchTimes | None = None) -> Written:
        """Make the outputs durable, retrying each step until it succeeds.

        Every step is idempotent, so a retry after a lost reply is harmless;
        a broker or Redis that is down stalls the worker instead of losing data.
        The completions of requests whose close was decided otherwise already (by the
        partition's other owner) are left out and named in `Written.elsewhere`: the
        caller must not take them for done before that close is applied.

        `times` (`processors.stages`) is stamped as the steps end: the close decisions
        (``begun``), Kafka's acks (``produced``), Redis' script (``stored``).
        """
        if not outputs:
            return Written(outputs)
        async with self._lock:
            decided_otherwise: set[RequestRef] = set()
            for sink in self._sinks:
                found = await retry(
                    functools.partial(sink.begin, outputs),
                    type(sink).__name__,
                    self._health,
                    self._failed(sink),
                )
                decided_otherwise |= found or set()
            if times is not None:
                times.begun = times.now()
            if decided_otherwise:  # one close decision per request, whoever made it first
                outputs = outputs.without(decided_otherwise)
            for sink in self._sinks:
                sink.add(outputs)
            for sink in self._sinks:
                await retry(sink.flush, type(sink).__name__, self._health, self._failed(sink))
                if times is not None:
                    _stamp(times, sink)
        return Written(outputs, frozenset(decided_otherwise))

    async def find_closed(self, refs: list[RequestRef]) -> dict[RequestRef, Closed]:
        """The lookup of closed requests, retried as the writes are: per request that has
        a close marker, the decision and whether it was applied (`Closed.applied`)."""
        found: dict[RequestRef, Closed] = await retry(
            lambda: self.lookup(refs), "closed-request lookup", self._health, self._failed("redis")
        )
        return found

    async def find_amendable(self, refs: list[RequestRef]) -> dict[RequestRef, Amendable | None]:
        """The lookup of amendable states (`processors.amendable`), retried as the writes are."""
        found: dict[RequestRef, Amendable | None] = await retry(
            lambda: self.amendable(refs),
            "amendable-state lookup",
            self._health,
            self._failed("redis"),
        )
        return found

    @property
    def failing(self) -> bool:
        """True while a write, a lookup or the last probe fails (an outage): clocks stop."""
        return self._write_failing or self._probe_failing

    async def probe(self) -> None:
        """Ask every sink that can whether its store answers now (one try each, no retry).

        Between writes an outage would go unseen; the worker probes once a
        second, so the input clocks stop as soon as a store stops answering.
        """
        failing = False
        for sink in self._sinks:
            check = getattr(sink, "probe", None)
            if check is None:
                continue
            try:
                await check()
            except _TRANSIENT as exc:
                if not self._probe_failing:
                    log.warning("%s does not answer (%s): clocks stopped", type(sink).__name__, exc)
                failing = True
                if self.on_error is not None:
                    self.on_error(_store(sink), exc, False)
        self._probe_failing = failing
        if not failing:
            self.answered_at = time.monotonic()

    def _health(self, ok: bool) -> None:
        self._write_failing = not ok
        if ok:
            self.answered_at = time.monotonic()

    def _failed(self, sink: object) -> Callable[[BaseException], None] | None:
        """What `retry` tells of each failure of `sink`'s step (None without a listener)."""
        hook = self.on_error
        if hook is None:
            return None
        store = sink if isinstance(sink, str) else _store(sink)
        return lambda exc: hook(store, exc, True)


def _stamp(times: BatchTimes, sink: object) -> None:
    """Stamp `times` with the end of `sink`'s flush, by the step its `stage` names:
    ``kafka`` (the acks), ``redis`` (the Tokens script); none: nothing."""
    store = getattr(sink, "stage", None)
    if store == "kafka":
        times.produced = times.now()
    elif store == "redis":
        times.stored = times.now()
        times.stored_wall = time.time()


def _store(sink: object) -> str:
    """The store a sink writes to, as the metrics name it."""
    name = type(sink).__name__
    return {"KafkaSink": "kafka", "RedisSink": "redis"}.get(name, name)


_TRANSIENT = (RedisError, KafkaError, OSError, asyncio.TimeoutError)
#: Kafka errors no retry cures: a closed producer stays closed.
_FINAL = (ProducerClosed,)


async def retry(
    step: Callable[[], Awaitable[Any]],
    what: str,
    health: Callable[[bool], None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> Any:
    """Run `step` until it succeeds, retrying transient failures with capped backoff.

    Cancellation (the worker stopping) ends the wait at once; the step's
    outputs stay unwritten and their records uncommitted, so nothing is lost.
    """
    delay = 0.1
    while True:
        try:
            result = await step()
        except _FINAL:
            raise
        except _TRANSIENT as exc:
            if health is not None:
                health(False)
            if on_error is not None:
                on_error(exc)
            log.warning(
                "%s failed (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        else:
            if health is not None:
                health(True)
            return result
