"""`WriteBehind`: one batch written while the next is applied, in order, failures told once."""

from __future__ import annotations

import asyncio

import pytest

from streamtally.core.identity import RequestRef
from streamtally.processors.outputs import Outputs
from streamtally.processors.stages import BatchTimes
from streamtally.processors.writes import Holds, WriteBehind

pytestmark = pytest.mark.timeout(10)


class Store:
    """A write that waits until the test lets it through, and logs what happened when."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: set[str] = set()

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def write(self, outputs: Outputs, holds: Holds, times: BatchTimes | None) -> None:
        del times
        name = str(holds[0][1]) if holds else "timer"
        self.log.append(f"start {name}")
        await self.gate(name).wait()
        if name in self.fail:
            raise RuntimeError(f"write {name} failed")
        self.log.append(f"done {name}")


def holds(offset: int) -> Holds:
    return [("raw/0", offset, RequestRef("acme", f"r-{offset}"))]


async def test_a_write_starts_only_after_the_one_before_is_done() -> None:
    store, failures = Store(), []
    writes = WriteBehind(store.write, failures.append)
    await writes.submit(Outputs(), holds(1))
    await asyncio.sleep(0)
    assert store.log == ["start 1"]
    second = asyncio.ensure_future(writes.submit(Outputs(), holds(2)))
    await asyncio.sleep(0.01)
    assert not second.done()  # waits for write 1: at most one batch waits to be written
    store.gate("1").set()
    await second
    store.gate("2").set()
    await writes.drain()
    assert store.log == ["start 1", "done 1", "start 2", "done 2"]
    assert not writes.pending
    assert failures == []


async def test_a_failed_write_is_told_once_and_raised_to_the_next_submit() -> None:
    store, failures = Store(), []
    writes = WriteBehind(store.write, failures.append)
    store.fail.add("1")
    await writes.submit(Outputs(), holds(1))
    store.gate("1").set()
    with pytest.raises(RuntimeError, match="write 1 failed"):
        await writes.submit(Outputs(), holds(2))
    assert [str(e) for e in failures] == ["write 1 failed"]
    assert "start 2" not in store.log  # nothing is written after a failure


async def test_settle_waits_for_a_failed_write_without_raising() -> None:
    store, failures = Store(), []
    writes = WriteBehind(store.write, failures.append)
    store.fail.add("1")
    await writes.submit(Outputs(), holds(1))
    store.gate("1").set()
    await writes.settle()
    assert len(failures) == 1
    assert not writes.pending


async def test_cancel_stops_the_write_in_flight() -> None:
    store, failures = Store(), []
    writes = WriteBehind(store.write, failures.append)
    await writes.submit(Outputs(), holds(1))
    await asyncio.sleep(0)
    await writes.cancel()
    assert store.log == ["start 1"]  # never done: its records are never held nor committed
    assert failures == []
    assert not writes.pending
