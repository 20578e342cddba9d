"""`RawSource.batches()` stamps each batch with the revocation generation it belongs to.

aiokafka's `getmany` can wait through a whole rebalance (it returns nothing while
a reassignment is in progress) and then return records of the NEW assignment,
read again from the committed offset.  Those records must not count as stale:
dropped, their offsets would still be passed by the consumer's position, and a
later commit would skip their open requests, which would then never be billed.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition

from streamtally.errors import InputError
from streamtally.processors.source import (
    IDLE_FETCH_WAIT_MS,
    PARTITION_FETCH_BYTES,
    FetchPace,
    MembershipLost,
    RawSource,
    Revocations,
    heartbeat_interval,
    member_id,
)
from streamtally.settings import Settings
from streamtally.topics import Topics


@dataclass
class _Record:
    offset: int
    timestamp: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


class _ConsumerRebalancedDuringFetch:
    """Stands in for the consumer: the first fetch lives through a revoke of `tp`."""

    def __init__(self, source: RawSource, tp: TopicPartition) -> None:
        self._source, self._tp, self._calls = source, tp, 0

    async def getmany(self, **_: Any) -> dict[TopicPartition, list[_Record]]:
        self._calls += 1
        if self._calls == 1:
            # the revoke listener runs while getmany waits for the new assignment
            self._source.revocations.revoke([(self._tp.topic, self._tp.partition)])
            return {self._tp: [_Record(7, 1_700_000_000_000, b"k", b"v")]}
        # a later fetch, with no rebalance during it
        return {self._tp: [_Record(8, None, None, b"w")]}


async def _two_batches(topics: Topics, tp: TopicPartition) -> tuple[RawSource, list[Any]]:
    source = RawSource(
        Settings.load(), topics, on_revoked=lambda _: asyncio.sleep(0), revocations=Revocations()
    )
    source._consumer = _ConsumerRebalancedDuringFetch(source, tp)  # type: ignore[assignment]
    batches = []
    async for batch in source.batches():
        batches.append(batch)
        if len(batches) == 2:
            break
    return source, batches


def test_records_returned_after_a_revoke_are_of_the_new_assignment_not_stale() -> None:
    topics = Topics.in_namespace("unit")
    tp = TopicPartition(topics.raw_sse.name, 3)

    source, (first, second) = asyncio.run(_two_batches(topics, tp))

    key = (tp.topic, tp.partition)
    assert first.generation == 1  # the generation in force when getmany returned
    assert not source.revocations.stale(key, first.generation)
    assert [(m.offset, m.timestamp) for m in first.messages] == [(7, 1_700_000_000.0)]
    # each batch's times carry its size (the stages' batch count, `Stages.batch`)
    assert (first.times.messages, second.times.messages) == (1, 1)
    assert first.times is not second.times
    # a revoke after a batch was fetched still fences it
    assert second.generation == 1
    assert not source.revocations.stale(key, second.generation)
    source.revocations.revoke([key])
    assert source.revocations.stale(key, second.generation)
    assert source.revocations.stale(key, first.generation)


def test_the_listener_moves_on_the_fence_the_caller_checks_batches_against() -> None:
    """A revoke reaches the `Revocations` the worker fences batches with (its pipeline's),
    through the consumer's rebalance listener: once, the worker gave its source another
    object than the listener's, no batch was ever stale, and batches fetched before a
    revoke were applied after it (a second bill, and a commit past open requests)."""
    topics = Topics.in_namespace("unit")
    tp = TopicPartition(topics.raw_sse.name, 3)
    fence = Revocations()
    seen: list[set[TopicPartition]] = []

    async def revoked(tps: set[TopicPartition]) -> None:
        seen.append(tps)

    async def revoke_through_the_listener() -> RawSource:
        source = RawSource(Settings.load(), topics, revoked, fence)
        await source._listener.on_partitions_revoked({tp})
        return source

    fetched_in = fence.generation
    source = asyncio.run(revoke_through_the_listener())
    assert source.revocations is fence
    assert seen == [{tp}]
    assert fence.stale((tp.topic, tp.partition), fetched_in)  # the worker's own object
    assert not fence.stale((tp.topic, 4), fetched_in)
    # and it cannot be swapped behind the listener's back
    with pytest.raises(AttributeError):
        source.revocations = Revocations()  # type: ignore[misc]


# --------------------------------------------------------------------------- static membership


def _static_settings(**more: str) -> Settings:
    return Settings.load({"STREAMTALLY_WORKER_INSTANCE_ID": "worker-0", **more})


async def test_a_static_member_joins_with_its_id_and_a_session_that_outlasts_a_restart() -> None:
    topics = Topics.in_namespace("unit")
    static = RawSource(_static_settings(), topics, lambda _: asyncio.sleep(0), Revocations())
    assert static._consumer._group_instance_id == "worker-0"
    assert static._consumer._session_timeout_ms == 45_000
    # heartbeats every second at most: also how long a fenced member may read on
    assert static._consumer._heartbeat_interval_ms == 1_000
    dynamic = RawSource(Settings.load({}), topics, lambda _: asyncio.sleep(0), Revocations())
    assert dynamic._consumer._group_instance_id is None
    assert dynamic._consumer._session_timeout_ms == 10_000
    assert dynamic._consumer._heartbeat_interval_ms == 1_000


async def test_the_broker_gathers_a_fetch_until_its_bytes_or_its_wait() -> None:
    topics = Topics.in_namespace("unit")
    default = RawSource(Settings.load({}), topics, lambda _: asyncio.sleep(0), Revocations())
    assert default._consumer._fetch_min_bytes == 32 << 10
    assert default._consumer._fetch_max_wait_ms == 10
    settings = Settings.load({"STREAMTALLY_FETCH_MIN_BYTES": "1", "STREAMTALLY_FETCH_WAIT": "0.05"})
    eager = RawSource(settings, topics, lambda _: asyncio.sleep(0), Revocations())
    assert eager._consumer._fetch_min_bytes == 1
    assert eager._consumer._fetch_max_wait_ms == 50


def test_the_fetch_bytes_setting_is_bounded_by_a_partitions_fetch() -> None:
    # The setting's bound is a literal (settings cannot import the processors): a broker
    # waiting for more bytes than one partition's fetch returns would wait its full wait.
    most = Settings.load({"STREAMTALLY_FETCH_MIN_BYTES": str(PARTITION_FETCH_BYTES)})
    assert most.fetch_min_bytes == PARTITION_FETCH_BYTES
    with pytest.raises(InputError, match="STREAMTALLY_FETCH_MIN_BYTES"):
        Settings.load({"STREAMTALLY_FETCH_MIN_BYTES": str(PARTITION_FETCH_BYTES + 1)})


def test_the_heartbeat_is_a_tenth_of_the_session_within_bounds() -> None:
    assert heartbeat_interval(6.0) == 0.6
    assert heartbeat_interval(10.0) == 1.0
    assert heartbeat_interval(45.0) == 1.0
    assert heartbeat_interval(3.0) == 0.5


def test_aiokafka_keeps_the_member_id_where_member_id_reads_it() -> None:
    """`member_id` reads aiokafka's private ``_coordinator.member_id``: pinned here, so an
    upgrade that moves it fails this test rather than the fencing of static members."""
    from aiokafka.consumer import consumer as consumer_module
    from aiokafka.consumer.group_coordinator import GroupCoordinator
    from aiokafka.protocol.group import JoinGroupRequest

    assert "self._coordinator = GroupCoordinator(" in inspect.getsource(
        consumer_module.AIOKafkaConsumer.start
    )
    # "unknown member": the member id cleared, before the revoke of the join that follows
    assert JoinGroupRequest.UNKNOWN_MEMBER_ID == ""
    reset = inspect.getsource(GroupCoordinator.reset_generation)
    assert "self.member_id = JoinGroupRequest.UNKNOWN_MEMBER_ID" in reset
    assert member_id(SimpleNamespace(_coordinator=SimpleNamespace(member_id="w-0-1f"))) == "w-0-1f"
    assert member_id(SimpleNamespace(_coordinator=None)) is None


class _Coordinator:
    def __init__(self, member: str) -> None:
        self.member_id = member


async def _revoke_in_a_task(
    settings: Settings, member: str, revoked: set[TopicPartition]
) -> tuple[asyncio.Task[None], list[set[TopicPartition]], list[MembershipLost], Revocations]:
    """A revoke through the source's listener, in a task of its own (aiokafka's coordination
    task), with the coordinator's member id `member` at that moment."""
    seen: list[set[TopicPartition]] = []
    lost: list[MembershipLost] = []

    async def on_revoked(tps: set[TopicPartition]) -> None:
        seen.append(tps)

    fence = Revocations()
    source = RawSource(settings, Topics.in_namespace("unit"), on_revoked, fence)
    source._consumer = SimpleNamespace(_coordinator=_Coordinator(member))  # type: ignore[assignment]
    source.on_lost = lost.append
    task = asyncio.create_task(source._listener.on_partitions_revoked(revoked))
    await asyncio.wait([task])
    return task, seen, lost, fence


def test_a_static_member_whose_membership_is_gone_stops_instead_of_joining_again() -> None:
    """aiokafka heartbeats without the instance id: fenced by a later worker with the same
    id, a member hears "unknown member", clears its member id, revokes and would join
    again, taking the id back (the two would take turns, each reading the partitions).
    The revoke with the member id gone stops it: the worker is told, the partitions are
    fenced and not handed to the worker's revoke (no commit), and aiokafka's task that
    would send the join is cancelled."""
    tp = TopicPartition("unit.raw.sse", 2)
    task, seen, lost, fence = asyncio.run(_revoke_in_a_task(_static_settings(), "", {tp}))
    assert task.cancelled()  # the coordination task: no JoinGroup goes out
    assert seen == []  # no commit of the partitions another worker owns now
    assert [(e.instance_id, e.group) for e in lost] == [("worker-0", "unit.processors")]
    assert "another worker joined with the same instance id" in str(lost[0])
    assert fence.stale(("unit.raw.sse", 2), 0)  # batches fetched before it are not applied


@pytest.mark.parametrize(
    ("settings", "member", "revoked"),
    [
        # a rebalance of the group (a member joins or leaves): the member id stays
        (_static_settings(), "worker-0-5d87f833", {TopicPartition("unit.raw.sse", 2)}),
        # the first join: nothing to revoke yet, no member id yet
        (_static_settings(), "", set()),
        # a dynamic member that is told "unknown member" joins again as a new one
        (Settings.load({}), "", {TopicPartition("unit.raw.sse", 2)}),
    ],
)
def test_any_other_revoke_is_a_rebalance_as_before(
    settings: Settings, member: str, revoked: set[TopicPartition]
) -> None:
    task, seen, lost, _ = asyncio.run(_revoke_in_a_task(settings, member, revoked))
    assert not task.cancelled()
    assert task.exception() is None
    assert seen == [revoked]
    assert lost == []


def _fetcher(min_bytes: int = 32 << 10, wait_ms: int = 10) -> SimpleNamespace:
    return SimpleNamespace(_fetch_min_bytes=min_bytes, _fetch_max_wait_ms=wait_ms)


def test_an_idle_consumer_fetches_at_the_first_byte_or_after_the_idle_wait() -> None:
    pace = FetchPace(32 << 10, 10)
    consumer = SimpleNamespace(_fetcher=_fetcher())
    pace.fetched(consumer, 120)  # busy, as it was built
    assert (consumer._fetcher._fetch_min_bytes, consumer._fetcher._fetch_max_wait_ms) == (
        32 << 10,
        10,
    )
    pace.fetched(consumer, 0)
    assert pace.idle
    assert (consumer._fetcher._fetch_min_bytes, consumer._fetcher._fetch_max_wait_ms) == (
        1,
        IDLE_FETCH_WAIT_MS,
    )
    pace.fetched(consumer, 0)  # still idle: nothing to change
    assert pace.idle
    pace.fetched(consumer, 3)  # records again: the settings' pace
    assert not pace.idle
    assert (consumer._fetcher._fetch_min_bytes, consumer._fetcher._fetch_max_wait_ms) == (
        32 << 10,
        10,
    )


def test_a_consumer_not_started_is_paced_once_it_has_a_fetcher() -> None:
    pace = FetchPace(32 << 10, 10)
    pace.fetched(SimpleNamespace(_fetcher=None), 0)
    assert not pace.idle  # nothing paced: tried again at the next empty fetch
    consumer = SimpleNamespace(_fetcher=_fetcher())
    pace.fetched(consumer, 0)
    assert pace.idle
    assert consumer._fetcher._fetch_max_wait_ms == IDLE_FETCH_WAIT_MS


class _QuietThenBusy:
    """A consumer whose first fetch returns nothing and whose second returns a record; it
    notes its fetcher's pace as each call begins."""

    def __init__(self, tp: TopicPartition) -> None:
        self._tp = tp
        self._fetcher = _fetcher()
        self.seen: list[tuple[int, int]] = []

    async def getmany(self, **_: Any) -> dict[TopicPartition, list[_Record]]:
        self.seen.append((self._fetcher._fetch_min_bytes, self._fetcher._fetch_max_wait_ms))
        if len(self.seen) == 1:
            return {}
        return {self._tp: [_Record(len(self.seen), None, None, b"v")]}


async def test_the_source_paces_its_fetches_by_what_the_last_one_returned() -> None:
    topics = Topics.in_namespace("unit")
    consumer = _QuietThenBusy(TopicPartition(topics.raw_sse.name, 0))
    source = RawSource(Settings.load({}), topics, lambda _: asyncio.sleep(0), Revocations())
    source._consumer = consumer  # type: ignore[assignment]
    batches = source.batches()
    first = await anext(batches)
    second = await anext(batches)
    await batches.aclose()
    assert [m.offset for m in (*first.messages, *second.messages)] == [2, 3]
    # busy at first; idle after the empty fetch; busy again after the records
    assert consumer.seen == [(32 << 10, 10), (1, IDLE_FETCH_WAIT_MS), (32 << 10, 10)]


def test_aiokafka_builds_each_fetch_request_from_the_fetchers_pace() -> None:
    """`FetchPace` sets aiokafka's private ``_fetcher._fetch_min_bytes`` and
    ``_fetch_max_wait_ms``: pinned here, so an upgrade that reads them elsewhere (or once)
    fails this test instead of leaving an idle worker's fetches at the busy pace."""
    from aiokafka.consumer import consumer as consumer_module
    from aiokafka.consumer.fetcher import Fetcher

    assert "self._fetcher = Fetcher(" in inspect.getsource(consumer_module.AIOKafkaConsumer.start)
    built = inspect.getsource(Fetcher._get_actions_per_node)
    assert "FetchRequest(\n                self._fetch_max_wait_ms,\n" in built
    assert "self._fetch_min_bytes," in built
