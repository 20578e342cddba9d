"""`AckGate` (processors/app.py): records are acked once done, in offset order per partition.

The gate sees faust events only through `event.message.tp`,
`event.message.incref()` and `event.ack()`; the fakes below record those calls.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from processors.app import AckGate

TP_A = ("streamtally.raw.sse", 0)
TP_B = ("streamtally.raw.sse", 1)
TP_C = ("streamtally.raw.engine", 0)


@dataclass(eq=False)
class FakeMessage:
    tp: tuple[str, int]
    offset: int
    increfs: int = 0

    def incref(self) -> None:
        self.increfs += 1


@dataclass(eq=False)
class FakeEvent:
    message: FakeMessage
    log: list[tuple[tuple[str, int], int]]
    acks: int = 0

    def ack(self) -> None:
        self.acks += 1
        self.log.append((self.message.tp, self.message.offset))


@dataclass
class Partitions:
    """Makes events at consecutive offsets per partition and logs every ack in order."""

    log: list[tuple[tuple[str, int], int]] = field(default_factory=list)
    next_offset: dict[tuple[str, int], int] = field(default_factory=dict)
    events: list[FakeEvent] = field(default_factory=list)

    def event(self, tp: tuple[str, int]) -> FakeEvent:
        offset = self.next_offset.get(tp, 0)
        self.next_offset[tp] = offset + 1
        event = FakeEvent(FakeMessage(tp, offset), self.log)
        self.events.append(event)
        return event

    def acked(self, tp: tuple[str, int]) -> list[int]:
        return [offset for t, offset in self.log if t == tp]


def hold(gate: AckGate, parts: Partitions, tp: tuple[str, int], request_id: str | None) -> None:
    gate.hold(parts.event(tp), request_id)


def test_done_records_are_acked_in_offset_order() -> None:
    gate, parts = AckGate(), Partitions()
    for _ in range(4):
        hold(gate, parts, TP_A, None)
    assert parts.log == []  # holding never acks
    assert len(gate) == 4
    assert gate.release() == 4
    assert parts.acked(TP_A) == [0, 1, 2, 3]
    assert len(gate) == 0
    assert gate.release() == 0  # nothing twice
    assert all(e.acks == 1 for e in parts.events)


def test_records_of_an_open_request_wait_until_it_is_finished() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")
    hold(gate, parts, TP_A, "r1")
    assert gate.release() == 0
    assert parts.log == []
    gate.finished(["r1"])
    assert parts.log == []  # finishing marks them done; release acks them
    assert gate.release() == 2
    assert parts.acked(TP_A) == [0, 1]


def test_a_done_record_behind_an_open_one_waits() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, None)  # 0 done
    hold(gate, parts, TP_A, "r1")  # 1 open
    hold(gate, parts, TP_A, None)  # 2 done, behind 1
    hold(gate, parts, TP_A, None)  # 3 done, behind 1
    assert gate.release() == 1
    assert parts.acked(TP_A) == [0]
    assert gate.release() == 0
    assert len(gate) == 3
    gate.finished(["r1"])
    assert gate.release() == 3
    assert parts.acked(TP_A) == [0, 1, 2, 3]


def test_finishing_a_request_releases_up_to_the_next_open_record() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")  # 0
    hold(gate, parts, TP_A, None)  # 1
    hold(gate, parts, TP_A, "r2")  # 2
    hold(gate, parts, TP_A, None)  # 3
    hold(gate, parts, TP_A, "r1")  # 4
    hold(gate, parts, TP_A, None)  # 5
    gate.finished(["r1"])
    assert gate.release() == 2
    assert parts.acked(TP_A) == [0, 1]  # 4 is done too, but behind r2's record 2
    gate.finished(["r2"])
    assert gate.release() == 4
    assert parts.acked(TP_A) == [0, 1, 2, 3, 4, 5]
    assert len(gate) == 0


def test_finishing_requests_out_of_order_still_acks_in_offset_order() -> None:
    gate, parts = AckGate(), Partitions()
    for rid in ("r1", "r2", "r3", "r2", "r1", "r3"):
        hold(gate, parts, TP_A, rid)
    gate.finished(["r3"])
    assert gate.release() == 0
    gate.finished(["r2"])
    assert gate.release() == 0
    gate.finished(["r1"])
    assert gate.release() == 6
    assert parts.acked(TP_A) == [0, 1, 2, 3, 4, 5]


def test_partitions_are_independent() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")
    hold(gate, parts, TP_A, None)
    hold(gate, parts, TP_B, None)
    hold(gate, parts, TP_B, "r2")
    hold(gate, parts, TP_C, None)
    hold(gate, parts, TP_C, None)
    assert gate.release() == 3
    assert parts.acked(TP_A) == []
    assert parts.acked(TP_B) == [0]
    assert parts.acked(TP_C) == [0, 1]
    gate.finished(["r2"])
    assert gate.release() == 1
    assert parts.acked(TP_A) == []
    assert parts.acked(TP_B) == [0, 1]
    gate.finished(["r1"])
    assert gate.release() == 2
    assert parts.acked(TP_A) == [0, 1]


def test_one_request_on_two_partitions_holds_both() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")
    hold(gate, parts, TP_B, "r1")
    hold(gate, parts, TP_B, None)
    assert gate.release() == 0
    gate.finished(["r1"])
    assert gate.release() == 3


def test_finishing_unknown_or_already_finished_requests_is_harmless() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")
    gate.finished([])
    gate.finished(["nobody"])
    assert gate.release() == 0
    gate.finished(["r1", "r1"])
    gate.finished(["r1"])
    assert gate.release() == 1
    assert gate.release() == 0
    assert [e.acks for e in parts.events] == [1]


def test_finished_accepts_any_iterable_once() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")
    hold(gate, parts, TP_A, "r2")
    gate.finished(rid for rid in ("r1", "r2"))  # what the agent passes: a generator
    assert gate.release() == 2


def test_drop_forgets_without_acking() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")
    hold(gate, parts, TP_A, None)
    hold(gate, parts, TP_B, "r2")
    hold(gate, parts, TP_B, None)
    gate.drop({TP_A}, ["r1"])
    assert parts.log == []
    assert len(gate) == 2
    gate.finished(["r1"])  # too late: the next owner re-reads them
    assert gate.release() == 0
    assert parts.acked(TP_A) == []
    gate.finished(["r2"])
    assert gate.release() == 2
    assert parts.acked(TP_B) == [0, 1]
    assert parts.acked(TP_A) == []


def test_drop_also_forgets_done_records_and_the_partition_starts_afresh() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, "r1")
    hold(gate, parts, TP_A, None)
    gate.drop({TP_A}, ["r1"])
    assert gate.release() == 0
    assert len(gate) == 0
    # The partition comes back: its records are held anew and acked normally.
    hold(gate, parts, TP_A, None)
    hold(gate, parts, TP_A, "r1")
    assert gate.release() == 1
    gate.finished(["r1"])
    assert gate.release() == 1
    assert parts.acked(TP_A) == [2, 3]
    assert all(e.acks <= 1 for e in parts.events)


def test_drop_of_nothing_or_of_an_unknown_partition_is_harmless() -> None:
    gate, parts = AckGate(), Partitions()
    hold(gate, parts, TP_A, None)
    gate.drop(set(), [])
    gate.drop({TP_C}, ["nobody"])
    assert gate.release() == 1


def test_hold_increfs_every_event_exactly_once() -> None:
    gate, parts = AckGate(), Partitions()
    for i, rid in enumerate(["r1", None, "r2", None, "r1"]):
        hold(gate, parts, (TP_A, TP_B)[i % 2], rid)
    assert [e.message.increfs for e in parts.events] == [1] * 5
    gate.finished(["r1", "r2"])
    gate.release()
    gate.release()
    gate.drop({TP_A, TP_B}, ["r1", "r2"])
    assert [e.message.increfs for e in parts.events] == [1] * 5
    assert [e.acks for e in parts.events] == [1] * 5


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_ack_each_record_once_in_offset_order_once_done(seed: int) -> None:
    """Random holds, finishes and releases over three partitions, checked after each step."""
    rng = random.Random(seed)
    gate, parts = AckGate(), Partitions()
    tps = [TP_A, TP_B, TP_C]
    request_of: dict[int, str | None] = {}  # id(event) -> its request (None: done at once)
    finished: set[str] = set()
    live = [f"r{i}" for i in range(6)]
    for _ in range(200):
        action = rng.random()
        if action < 0.6:
            tp = rng.choice(tps)
            rid = None if rng.random() < 0.3 or not live else rng.choice(live)
            event = parts.event(tp)
            request_of[id(event)] = rid
            gate.hold(event, rid)
        elif action < 0.75 and live:
            rid = live.pop(rng.randrange(len(live)))
            finished.add(rid)
            gate.finished([rid])
            live.append(f"r{len(finished) + len(live) + 10}")
        else:
            gate.release()
        released = action >= 0.75 or (action >= 0.6 and not live)
        # Invariants: per partition, the acked offsets are a prefix 0..k-1 of the held
        # ones and every acked record is done; right after a release, the first
        # record left is one of an open request.
        for tp in tps:
            held = [e for e in parts.events if e.message.tp == tp]
            acked = parts.acked(tp)
            assert acked == list(range(len(acked)))
            for event in held[: len(acked)]:
                rid = request_of[id(event)]
                assert rid is None or rid in finished
                assert event.acks == 1
            assert all(e.acks == 0 for e in held[len(acked) :])
            if released and len(held) > len(acked):
                head = request_of[id(held[len(acked)])]
                assert head is not None
                assert head not in finished
    # Finish everything: every record is acked exactly once, in order.
    gate.finished(live)
    gate.release()
    for tp in tps:
        assert parts.acked(tp) == list(range(parts.next_offset.get(tp, 0)))
    assert all(e.acks == 1 and e.message.increfs == 1 for e in parts.events)
    assert len(gate) == 0
