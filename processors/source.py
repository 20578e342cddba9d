"""The raw topics, read in bulk by a plain aiokafka consumer in the processors' group.

faust's own consumer hands records to an agent one at a time through several
tasks and queues per record: measured at about 100 µs of CPU per record,
several times the cost of normalising it.  `RawSource` fetches up to a batch
of records per call instead (`getmany`) and the worker passes each batch to
the processing agent as one event.  It also commits offsets itself, exactly
those `CommitGate` releases, so a committed offset never passes a record of
an open request.

Static membership (``STREAMTALLY_WORKER_INSTANCE_ID``, Kafka's
``group.instance.id``): the consumer joins as that instance, sends no LeaveGroup
when it stops, and a restart with the same id within the session timeout takes
its partitions back without a rebalance, reading from the committed offsets as
any new owner does.  Two live consumers with one id fence each other: the broker
hands the id to the later join and no longer knows the earlier one's member id.
aiokafka sends its heartbeats without the instance id (Heartbeat v0/v1), so the
earlier one hears "unknown member", not "fenced", and would join again, fencing
the later one in turn, each reading the same partitions for a heartbeat at a
time.  So a static member whose membership is lost never joins again: its
listener sees the revoke aiokafka starts with its member id gone, stops the
coordinator before it can send a JoinGroup, and reports `MembershipLost` (the
worker stops with that error; see `RawSource.on_lost`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from streamtally.connection import client_options
from streamtally.processors.stages import BatchTimes
from streamtally.settings import Settings
from streamtally.topics import Topics

__all__ = [
    "IDLE_FETCH_WAIT_MS",
    "FetchPace",
    "FetchedBatch",
    "MembershipLost",
    "RawMessage",
    "RawSource",
    "Revocations",
]

log = logging.getLogger(__name__)

#: A partition whose broker sent no fetch response for this long is not live (an outage).
LIVE_WINDOW_S = 1.0
#: Bytes one fetch takes of one partition, and of all of them: above the raw topics'
#: ``max.message.bytes`` (`streamtally.topics.RAW_MAX_MESSAGE_BYTES`), so that a batch of
#: the largest records comes in one fetch.
PARTITION_FETCH_BYTES = 8 << 20
FETCH_BYTES = 64 << 20
#: The longest interval between heartbeats (seconds): also how long a fenced static member
#: may read on before it hears that it was (a tenth of the session, at most this).
MAX_HEARTBEAT_S = 1.0
MIN_HEARTBEAT_S = 0.5


#: An idle worker's fetch (its last `getmany` returned nothing): the broker answers at
#: the first byte, or after this long.  A worker with no traffic asks twice a second
#: instead of at every `fetch_wait` (at 10 ms: 12 % of a core, against 4 % at 50 ms), and
#: the first record after a quiet spell is not held to fill a batch.
IDLE_FETCH_WAIT_MS: Final = 500


class FetchPace:
    """How long the broker holds a consumer's fetches, busy or idle; `fetched(consumer, n)`
    after each `getmany` that returned `n` records.

    Busy (records came): the settings' bytes or wait (`fetch_min_bytes`, `fetch_wait`),
    fewer and fuller batches under load.  Idle (none came): one byte or
    `IDLE_FETCH_WAIT_MS`.  aiokafka reads both from its fetcher (the private
    ``_fetcher._fetch_min_bytes`` and ``_fetch_max_wait_ms``) as it builds each fetch
    request, so the request after a change has the new pace;
    tests/unit/processors/test_raw_source.py pins that this is still so.
    """

    def __init__(self, min_bytes: int, wait_ms: int) -> None:
        self._busy = (min_bytes, wait_ms)
        #: Whether the fetches are idle ones now.
        self.idle = False

    def fetched(self, consumer: Any, records: int) -> None:
        idle = records == 0
        if idle == self.idle:
            return
        fetcher = getattr(consumer, "_fetcher", None)
        if fetcher is None:  # not started: nothing to pace yet
            return
        self.idle = idle
        min_bytes, wait_ms = (1, IDLE_FETCH_WAIT_MS) if idle else self._busy
        fetcher._fetch_min_bytes = min_bytes
        fetcher._fetch_max_wait_ms = wait_ms


def heartbeat_interval(session_timeout: float) -> float:
    """Seconds between heartbeats for a session of `session_timeout` seconds."""
    return max(MIN_HEARTBEAT_S, min(session_timeout / 10, MAX_HEARTBEAT_S))


class MembershipLost(Exception):
    """The static member's membership in the processors' group is gone: another worker
    joined with the same instance id (it holds the partitions now), or this one was silent
    longer than its session timeout.  The worker stops; it must not join again under an
    id another live worker may hold."""

    def __init__(self, instance_id: str, group: str) -> None:
        self.instance_id = instance_id
        self.group = group
        super().__init__(
            f"this worker lost its membership of group {group!r} as static member "
            f"{instance_id!r}: another worker joined with the same instance id "
            "(STREAMTALLY_WORKER_INSTANCE_ID or --instance-id: two live workers must never "
            "share one), or this one was silent longer than its session timeout. It stops "
            "without joining again; its partitions' records are read from the committed "
            "offsets by their owner"
        )


def member_id(consumer: Any) -> str | None:
    """The consumer's member id in its group ("" while it has none; None before it joins a
    group at all).

    aiokafka keeps it on its group coordinator (``consumer._coordinator.member_id``),
    not in its public API; tests/unit/test_raw_source.py pins that this is still where it
    is, so an upgrade that moves it fails a test instead of the fencing of static members.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    found = getattr(coordinator, "member_id", None)
    return found if isinstance(found, str) else None


_tuple_new: Final[Any] = tuple.__new__


class RawMessage(NamedTuple):
    """One record of a raw topic, as Kafka gave it (a named tuple: one per raw record)."""

    topic: str
    partition: int
    offset: int
    #: The record's Kafka time, in seconds since the epoch.
    timestamp: float | None
    key: bytes | None
    #: None for a tombstone (dead-lettered: raw records are never deleted).
    value: bytes | None
    #: The record's Kafka headers, as aiokafka gives them (``st-auth``: a signed tenant
    #: claim, checked when the worker has a trust file).
    headers: Sequence[tuple[str, bytes]] = ()


class Revocations:
    """Which partitions were revoked after a batch was fetched (a fence for stale batches).

    `consumer.assignment()` keeps naming a revoked partition until the new
    assignment arrives, so a batch fetched before a revoke could be applied
    after the revoke dropped its partition's requests: requests re-opened on a
    partition this worker no longer owns, closed later by timeout or gap, a
    second, different billing event.  Each revoke moves the generation on; a
    batch remembers the generation in force when its fetch returned; its
    records of a partition revoked since are stale and never applied (the partition's next
    owner reads them from the committed offset).
    """

    def __init__(self) -> None:
        self.generation = 0
        self._revoked_at: dict[Hashable, int] = {}

    def revoke(self, tps: Iterable[Hashable]) -> None:
        self.generation += 1
        for tp in tps:
            self._revoked_at[tp] = self.generation

    def stale(self, tp: Hashable, fetched_in: int) -> bool:
        """Whether `tp` was revoked after a batch fetched in generation `fetched_in`."""
        return self._revoked_at.get(tp, 0) > fetched_in


@dataclass(frozen=True, slots=True)
class FetchedBatch:
    """Records from one fetch, with the revocation generation they were fetched in."""

    generation: int
    messages: tuple[RawMessage, ...]
    #: When it was fetched and where it went since (`processors.stages`).
    times: BatchTimes = field(default_factory=BatchTimes)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(
        self,
        revocations: Revocations,
        revoked: Callable[[set[TopicPartition]], Awaitable[None]],
        lost: Callable[[], MembershipLost | None] | None = None,
    ) -> None:
        self._revocations = revocations
        self._revoked = revoked
        #: For a static member: the `MembershipLost` to stop with if its membership is gone
        #: at this revoke (None: still a member; a rebalance like any other).
        self._lost = lost
        #: Told each assignment (possibly empty), as (topic, partition) pairs: the metrics.
        self.on_assigned: Callable[[set[tuple[str, int]]], None] | None = None
        #: Told once a static member's membership is lost (the worker stops).
        self.on_lost: Callable[[MembershipLost], None] | None = None

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self._revocations.revoke((tp.topic, tp.partition) for tp in revoked)
        lost = self._lost() if self._lost is not None and revoked else None
        if lost is not None:
            # Nothing of these partitions is applied or committed here any more, and the
            # join aiokafka would send next must not go out: it would take the instance id
            # back from the worker that holds it now.  This runs in aiokafka's coordination
            # task, right before that join: cancelling the task stops the coordinator (no
            # join, no heartbeats once the consumer stops; fetches return nothing meanwhile,
            # the reassignment having begun).
            log.critical("%s", lost)
            if self.on_lost is not None:
                self.on_lost(lost)
            task = asyncio.current_task()
            if task is not None:
                task.cancel()
            await asyncio.sleep(0)  # the cancellation is raised here
            return
        await self._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("raw partitions assigned: %s", sorted((tp.topic, tp.partition) for tp in assigned))
        if self.on_assigned is not None:
            self.on_assigned({(tp.topic, tp.partition) for tp in assigned})


class RawSource:
    """Batches of raw records from both raw topics, and commits of what is done."""

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        on_revoked: Callable[[set[TopicPartition]], Awaitable[None]],
        revocations: Revocations,
    ) -> None:
        """`revocations` is THE fence: the rebalance listener moves it on, `batches` stamps
        each fetch with it, and the caller checks each batch against it before applying
        it.  One object for all three, given here, so the three cannot drift apart."""
        self.settings = settings
        self._topics = topics
        wait_ms = round(settings.fetch_wait * 1000)
        self._consumer = AIOKafkaConsumer(
            **client_options(settings.kafka),
            group_id=topics.processors_group,
            group_instance_id=settings.worker_instance_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=settings.batch_size,
            fetch_max_bytes=FETCH_BYTES,
            # The broker answers once it has this many bytes, or the wait is over.
            fetch_min_bytes=settings.fetch_min_bytes,
            fetch_max_wait_ms=wait_ms,
            max_partition_fetch_bytes=PARTITION_FETCH_BYTES,
            session_timeout_ms=int(settings.session_timeout * 1000),
            heartbeat_interval_ms=int(heartbeat_interval(settings.session_timeout) * 1000),
        )
        self._pace = FetchPace(settings.fetch_min_bytes, wait_ms)
        self._revocations = revocations
        static = settings.worker_instance_id is not None
        self._listener = _Listener(revocations, on_revoked, self._lost if static else None)
        #: Told of each failed commit (the metrics).
        self.on_commit_error: Callable[[BaseException], None] | None = None

    @property
    def revocations(self) -> Revocations:
        """The fence this source's listener moves on and its batches are stamped with.

        Read-only: rebinding it would leave the listener moving another object on, and
        no batch would ever be stale (a money-losing bug once: batches fetched before a
        revoke were applied after it, and a returning partition committed past open
        requests).
        """
        return self._revocations

    def _lost(self) -> MembershipLost | None:
        """A static member's lost membership, at a revoke: aiokafka clears the member id
        before it revokes to join again after "unknown member" (fenced, or its session
        expired); a rebalance of the group keeps it."""
        instance_id = self.settings.worker_instance_id
        if instance_id is None or member_id(self._consumer) != "":
            return None
        return MembershipLost(instance_id, self._topics.processors_group)

    @property
    def on_lost(self) -> Callable[[MembershipLost], None] | None:
        """Told once if this static member's membership is lost (the worker must stop)."""
        return self._listener.on_lost

    @on_lost.setter
    def on_lost(self, hook: Callable[[MembershipLost], None] | None) -> None:
        self._listener.on_lost = hook

    @property
    def on_assigned(self) -> Callable[[set[tuple[str, int]]], None] | None:
        return self._listener.on_assigned

    @on_assigned.setter
    def on_assigned(self, hook: Callable[[set[tuple[str, int]]], None] | None) -> None:
        self._listener.on_assigned = hook

    async def start(self) -> None:
        await self._consumer.start()
        self._consumer.subscribe([t.name for t in self._topics.raw], listener=self._listener)

    async def stop(self) -> None:
        await self._consumer.stop()

    def is_live(self, tp: Hashable, next_offset: int) -> bool:
        """Whether partition `tp` ((topic, partition)) is caught up and its broker answering.

        Caught up: the records before `next_offset` are all there is (the
        highwater of the last fetch response).  Answering: a fetch response
        for it came within `LIVE_WINDOW_S`.  Before the first fetch of a
        partition neither is known, and it is not live.
        """
        if not isinstance(tp, tuple) or len(tp) != 2:
            return False
        key = TopicPartition(*tp)
        if key not in self._consumer.assignment():
            return False
        highwater = self._consumer.highwater(key)
        polled_ms = self._consumer.last_poll_timestamp(key)
        if highwater is None or polled_ms is None:
            return False
        fresh = time.time() * 1000 - polled_ms < LIVE_WINDOW_S * 1000
        return bool(fresh and next_offset >= highwater)

    async def batches(self) -> AsyncIterator[FetchedBatch]:
        """Batches of records in arrival order (per partition: offset order), forever."""
        timeout_ms = int(self.settings.batch_within * 1000)
        while True:
            fetched = await self._consumer.getmany(
                timeout_ms=timeout_ms, max_records=self.settings.batch_size
            )
            # Read AFTER the fetch, with no await in between.  aiokafka marks a
            # reassignment as begun before it calls the revoke listener, and getmany
            # returns nothing while one is in progress: records it returns after a
            # revoke are of the new assignment, read from the committed offset.
            # Stamped with the generation from before the fetch, they were dropped as
            # stale while the consumer's position moved past them, and a later commit
            # skipped their open requests (never billed).
            generation = self._revocations.generation
            times = BatchTimes(fetched=time.perf_counter(), fetched_wall=time.time())
            # `RawMessage(...)` without its generated `__new__` (an interpreted frame per
            # record): the same tuple, made by `tuple.__new__` at once.
            batch = tuple(
                _tuple_new(
                    RawMessage,
                    (
                        tp.topic,
                        tp.partition,
                        record.offset,
                        record.timestamp / 1000 if record.timestamp is not None else None,
                        record.key,
                        record.value,
                        record.headers,
                    ),
                )
                for tp, records in fetched.items()
                for record in records
            )
            self._pace.fetched(self._consumer, len(batch))
            if batch:
                times.messages = len(batch)
                yield FetchedBatch(generation, batch, times)

    async def commit(self, offsets: Mapping[Any, int]) -> None:
        """Commit these offsets of partitions this consumer still owns."""
        owned = self._consumer.assignment()
        wanted = {tp: offset for tp, offset in offsets.items() if tp in owned}
        if not wanted:
            return
        try:
            await self._consumer.commit(wanted)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance in flight: the records stay uncommitted and are re-read, which
            # the processor recognises as replays.
            log.warning("offset commit failed (%s); records will be re-read", exc)
            if self.on_commit_error is not None:
                self.on_commit_error(exc)

    # -- for the metrics and /ready (processors.metrics), never on the hot path ------------

    def fetch_age(self) -> float | None:
        """Seconds since a fetch response last came for an assigned partition (None: never)."""
        polled = [self._consumer.last_poll_timestamp(tp) for tp in self._consumer.assignment()]
        latest = max((ms for ms in polled if ms is not None), default=None)
        return None if latest is None else max(0.0, time.time() - latest / 1000)

    async def ping(self) -> None:
        """Ask the cluster for its metadata: raises when Kafka does not answer."""
        await self._consumer.topics()

    async def lag(self) -> dict[tuple[str, int], int]:
        """Per assigned partition: its highwater minus the consumer's position."""
        found = {}
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            if highwater is None:
                continue
            position = await self._consumer.position(tp)
            found[tp.topic, tp.partition] = max(0, highwater - position)
        return found
