"""`RawSource.batches()` stamps each batch with the revocation generation it belongs to.

aiokafka's `getmany` can wait through a whole rebalance (it returns nothing while
a reassignment is in progress) and then return records of the NEW assignment,
read again from the committed offset.  Those records must not count as stale:
dropped, their offsets would still be passed by the consumer's position, and a
later commit would skip their open requests, which would then never be billed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition

from streamtally.processors.source import RawSource, Revocations
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
