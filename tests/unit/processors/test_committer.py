"""`Committer`: released offsets committed off the batches' path, coalesced, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping

import pytest

from streamtally.processors.writes import Committer

pytestmark = pytest.mark.timeout(10)


class Broker:
    def __init__(self) -> None:
        self.commits: list[dict[Hashable, int]] = []
        self.through = asyncio.Event()
        self.through.set()

    async def commit(self, offsets: Mapping[Hashable, int]) -> None:
        await self.through.wait()
        self.commits.append(dict(offsets))


async def test_offsets_released_during_a_commit_are_coalesced_into_the_next() -> None:
    broker, waits = Broker(), []
    committer = Committer(broker.commit, interval=0.0, committed=waits.extend)
    broker.through.clear()
    committer.request({"p0": 10}, [0.0])
    await asyncio.sleep(0.01)  # in flight, held by the broker
    committer.request({"p0": 20})
    committer.request({"p0": 30, "p1": 5}, [0.0])
    broker.through.set()
    await committer.settle()
    assert broker.commits == [{"p0": 10}, {"p0": 30, "p1": 5}]  # one commit for both
    assert len(waits) == 2
    assert not committer.pending


async def test_commits_wait_for_the_interval_unless_settled() -> None:
    broker = Broker()
    committer = Committer(broker.commit, interval=5.0)
    committer.request({"p0": 1})
    await asyncio.sleep(0.01)
    assert broker.commits == [{"p0": 1}]  # the first goes at once
    committer.request({"p0": 2})
    await asyncio.sleep(0.05)
    assert broker.commits == [{"p0": 1}]  # the next waits for the interval ...
    await asyncio.wait_for(committer.settle(), 1.0)  # ... unless a revoke or a stop hurries it
    assert broker.commits == [{"p0": 1}, {"p0": 2}]


async def test_a_cancelled_committer_commits_nothing_more() -> None:
    broker = Broker()
    committer = Committer(broker.commit, interval=5.0)
    committer.request({"p0": 1})
    await asyncio.sleep(0.01)
    committer.request({"p0": 2})
    await committer.cancel()
    await asyncio.sleep(0.01)
    assert broker.commits == [{"p0": 1}]
    assert not committer.pending
