"""The raw topics, read in bulk by a plain aiokafka consumer in the processors' group.

faust's own consumer hands records to an agent one at a time through several
tasks and queues per record: measured at about 100 µs of CPU per record,
several times the cost of normalising it.  `RawSource` fetches up to a batch
of records per call instead (`getmany`) and the worker passes each batch to
the processing agent as one event.  It also commits offsets itself, exactly
those `CommitGate` releases, so a committed offset never passes a record of
an open request.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.connection import client_options

__all__ = ["FetchedBatch", "RawMessage", "RawSource", "Revocations"]

log = logging.getLogger(__name__)

#: A partition whose broker sent no fetch response for this long is not live (an outage).
LIVE_WINDOW_S = 1.0
#: Bytes one fetch takes of one partition, and of all of them: above the raw topics'
#: ``max.message.bytes`` (`streamtally.topics.RAW_MAX_MESSAGE_BYTES`), so that a batch of
#: the largest records comes in one fetch.
PARTITION_FETCH_BYTES = 8 << 20
FETCH_BYTES = 64 << 20


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


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(
        self,
        revocations: Revocations,
        revoked: Callable[[set[TopicPartition]], Awaitable[None]],
    ) -> None:
        self._revocations = revocations
        self._revoked = revoked
        #: Told each assignment (possibly empty), as (topic, partition) pairs: the metrics.
        self.on_assigned: Callable[[set[tuple[str, int]]], None] | None = None

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self._revocations.revoke((tp.topic, tp.partition) for tp in revoked)
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
        self._consumer = AIOKafkaConsumer(
            **client_options(settings.kafka),
            group_id=topics.processors_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=settings.batch_size,
            fetch_max_bytes=FETCH_BYTES,
            fetch_max_wait_ms=50,  # the broker answers an idle fetch within a batch window
            max_partition_fetch_bytes=PARTITION_FETCH_BYTES,
            session_timeout_ms=int(settings.session_timeout * 1000),
            heartbeat_interval_ms=int(max(settings.session_timeout / 10, 0.5) * 1000),
        )
        self._revocations = revocations
        self._listener = _Listener(revocations, on_revoked)
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
            batch = tuple(
                RawMessage(
                    tp.topic,
                    tp.partition,
                    record.offset,
                    record.timestamp / 1000 if record.timestamp is not None else None,
                    record.key,
                    record.value,
                    record.headers,
                )
                for tp, records in fetched.items()
                for record in records
            )
            if batch:
                yield FetchedBatch(generation, batch)

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
