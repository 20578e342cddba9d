"""`CommitGate` (processors/commits.py): which raw offsets the worker may commit.

A record is committable only when it and every earlier record of its partition
are done (held without a request, or its request finished); the offset handed
out for a partition is the last such record's offset + 1.  The gate is keyed
by whatever the agent passes as the partition: aiokafka's `TopicPartition`; a
record waits on its request by `RequestRef` (tenant and request id), so two
tenants that reuse one request id are two requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from aiokafka import TopicPartition

from streamtally.core.identity import RequestRef
from streamtally.processors.commits import CommitGate, CommitOrderError

TP_A = TopicPartition("streamtally.raw.sse", 0)
TP_B = TopicPartition("streamtally.raw.sse", 1)
TP_C = TopicPartition("streamtally.raw.engine", 0)
R1 = RequestRef("acme", "r1")
R2 = RequestRef("acme", "r2")
R3 = RequestRef("globex", "r3")
NOBODY = RequestRef("acme", "nobody")


@dataclass
class Partitions:
    """Holds records at consecutive offsets per partition (from `start`)."""

    gate: CommitGate = field(default_factory=CommitGate)
    next_offset: dict[TopicPartition, int] = field(default_factory=dict)

    def hold(self, tp: TopicPartition, request: RequestRef | None) -> int:
        offset = self.next_offset.get(tp, 0)
        self.next_offset[tp] = offset + 1
        self.gate.hold(tp, offset, request)
        return offset

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.next_offset[tp] = offset


def test_done_records_are_committable_in_offset_order() -> None:
    parts = Partitions()
    gate = parts.gate
    for _ in range(4):
        parts.hold(TP_A, None)
    assert len(gate) == 4
    assert gate.committable() == {}  # holding never moves the commit point
    assert gate.release() == {TP_A: 4}
    assert gate.committable() == {TP_A: 4}
    assert len(gate) == 0
    assert gate.release() == {}  # nothing twice
    assert gate.committable() == {TP_A: 4}


def test_the_offset_handed_out_is_the_last_done_offset_plus_one() -> None:
    gate = CommitGate()
    # Offsets need not start at 0 nor be consecutive (tombstones are never held).
    gate.hold(TP_A, 40, None)
    gate.hold(TP_A, 41, None)
    gate.hold(TP_A, 45, None)
    assert gate.release() == {TP_A: 46}
    gate.hold(TP_A, 50, R1)
    gate.hold(TP_A, 52, None)
    assert gate.release() == {}
    gate.finished([R1])
    assert gate.release() == {TP_A: 53}
    assert gate.committable() == {TP_A: 53}


def test_records_of_an_open_request_wait_until_it_is_finished() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_A, R1)
    assert gate.release() == {}
    assert gate.committable() == {}
    assert len(gate) == 2
    gate.finished([R1])
    assert gate.committable() == {}  # finishing marks them done; release moves the point
    assert len(gate) == 2
    assert gate.release() == {TP_A: 2}
    assert gate.committable() == {TP_A: 2}
    assert len(gate) == 0


def test_a_done_record_behind_an_open_one_waits() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, None)  # 0 done
    parts.hold(TP_A, R1)  # 1 open
    parts.hold(TP_A, None)  # 2 done, behind 1
    parts.hold(TP_A, None)  # 3 done, behind 1
    assert gate.release() == {TP_A: 1}
    assert gate.release() == {}
    assert gate.committable() == {TP_A: 1}
    assert len(gate) == 3
    gate.finished([R1])
    assert gate.release() == {TP_A: 4}
    assert gate.committable() == {TP_A: 4}
    assert len(gate) == 0


def test_finishing_a_request_releases_its_records_and_the_done_ones_after_them() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)  # 0
    parts.hold(TP_A, None)  # 1
    parts.hold(TP_A, R2)  # 2
    parts.hold(TP_A, None)  # 3
    parts.hold(TP_A, R1)  # 4
    parts.hold(TP_A, None)  # 5
    assert gate.release() == {}
    gate.finished([R1])
    assert gate.release() == {TP_A: 2}  # 4 is done too, but behind r2's record 2
    assert len(gate) == 4
    gate.finished([R2])
    assert gate.release() == {TP_A: 6}
    assert len(gate) == 0


def test_finishing_requests_out_of_order_still_commits_in_offset_order() -> None:
    parts = Partitions()
    gate = parts.gate
    for ref in (R1, R2, R3, R2, R1, R3):
        parts.hold(TP_A, ref)
    gate.finished([R3])
    assert gate.release() == {}
    gate.finished([R2])
    assert gate.release() == {}
    assert gate.committable() == {}
    gate.finished([R1])
    assert gate.release() == {TP_A: 6}


def test_one_request_id_of_two_tenants_is_two_requests() -> None:
    acme, globex = RequestRef("acme", "shared"), RequestRef("globex", "shared")
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, acme)  # 0
    parts.hold(TP_A, globex)  # 1
    parts.hold(TP_A, acme)  # 2
    gate.finished([globex])  # finishes globex's record only, never acme's
    assert gate.release() == {}
    assert len(gate) == 3
    gate.finished([acme])
    assert gate.release() == {TP_A: 3}
    parts.hold(TP_A, acme)  # 3
    parts.hold(TP_A, globex)  # 4
    gate.drop(set(), [acme])  # forgetting acme's request keeps globex's
    gate.finished([globex])
    assert gate.release() == {}  # 3 (acme, forgotten) is never done
    assert len(gate) == 2


def test_partitions_are_independent() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_A, None)
    parts.hold(TP_B, None)
    parts.hold(TP_B, R2)
    parts.hold(TP_C, None)
    parts.hold(TP_C, None)
    assert gate.release() == {TP_B: 1, TP_C: 2}
    assert gate.committable() == {TP_B: 1, TP_C: 2}
    gate.finished([R2])
    assert gate.release() == {TP_B: 2}
    assert gate.committable() == {TP_B: 2, TP_C: 2}
    gate.finished([R1])
    assert gate.release() == {TP_A: 2}
    assert gate.committable() == {TP_A: 2, TP_B: 2, TP_C: 2}
    assert len(gate) == 0


def test_one_request_on_two_partitions_holds_both() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_B, R1)
    parts.hold(TP_B, None)
    assert gate.release() == {}
    gate.finished([R1])
    assert gate.release() == {TP_A: 1, TP_B: 2}


def test_release_reports_only_partitions_that_moved_and_committable_keeps_the_rest() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, None)
    parts.hold(TP_B, None)
    assert gate.release() == {TP_A: 1, TP_B: 1}
    parts.hold(TP_A, None)  # A moves again
    parts.hold(TP_B, R1)  # B is stuck behind r1
    parts.hold(TP_C, R2)  # C has never moved
    assert gate.release() == {TP_A: 2}
    assert gate.committable() == {TP_A: 2, TP_B: 1}
    gate.finished([R1])
    assert gate.release() == {TP_B: 2}
    assert gate.committable() == {TP_A: 2, TP_B: 2}
    assert gate.release() == {}
    assert gate.committable() == {TP_A: 2, TP_B: 2}


def test_committable_is_a_copy() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, None)
    gate.release()
    snapshot = gate.committable()
    snapshot[TP_A] = 99
    snapshot[TP_B] = 7
    assert gate.committable() == {TP_A: 1}


def test_partitions_match_by_equality_not_identity() -> None:
    # The agent builds a fresh TopicPartition per record; revocation hands in others.
    gate = CommitGate()
    gate.hold(TopicPartition("streamtally.raw.sse", 0), 0, None)
    gate.hold(TopicPartition("streamtally.raw.sse", 0), 1, R1)
    gate.hold(TopicPartition("streamtally.raw.sse", 0), 2, None)
    assert gate.release() == {TP_A: 1}
    gate.finished([R1])
    assert gate.release() == {TP_A: 3}
    gate.hold(TopicPartition("streamtally.raw.sse", 0), 3, R2)
    gate.drop({TopicPartition("streamtally.raw.sse", 0)}, [R2])
    assert gate.committable() == {}
    assert len(gate) == 0


def test_finishing_unknown_or_already_finished_requests_is_harmless() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    gate.finished([])
    gate.finished([NOBODY])
    assert gate.release() == {}
    gate.finished([R1, R1])
    gate.finished([R1])
    assert gate.release() == {TP_A: 1}
    assert gate.release() == {}
    assert len(gate) == 0


def test_finished_accepts_any_iterable_once() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_A, R2)
    gate.finished(ref for ref in (R1, R2))  # what the agent passes: a generator
    assert gate.release() == {TP_A: 2}


def test_drop_forgets_partitions_and_requests_without_handing_them_out() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_A, None)
    parts.hold(TP_B, R2)
    parts.hold(TP_B, None)
    gate.drop({TP_A}, [R1])
    assert len(gate) == 2
    assert gate.committable() == {}
    gate.finished([R1])  # too late: the next owner re-reads them
    assert gate.release() == {}
    gate.finished([R2])
    assert gate.release() == {TP_B: 2}
    assert gate.committable() == {TP_B: 2}


def test_drop_forgets_the_commit_point_of_the_partition() -> None:
    parts = Partitions()
    gate = parts.gate
    for _ in range(3):
        parts.hold(TP_A, None)
    parts.hold(TP_B, None)
    assert gate.release() == {TP_A: 3, TP_B: 1}
    gate.drop({TP_A}, [])
    assert gate.committable() == {TP_B: 1}
    assert gate.release() == {}
    assert gate.committable() == {TP_B: 1}


def test_a_record_held_out_of_its_partitions_order_is_refused() -> None:
    """What a batch of an earlier assignment applied after its partition was revoked and
    given back looks like: the stale records, then the partition re-read from the committed
    offset.  Held anyway, the stale ones would be released first and the gate would hand
    out an offset past records of open requests it never held (seen in a three-worker run:
    three requests never billed)."""
    gate = CommitGate()
    gate.hold(TP_A, 300, None)  # a stale batch: records 300.. of a request that closed
    with pytest.raises(CommitOrderError, match=r"record 0 of .* held after record 300"):
        gate.hold(TP_A, 0, R1)  # the partition re-read from 0: r1 opens at 0
    assert gate.release() == {TP_A: 301}  # what the refusal keeps from being committed late
    gate.hold(TP_B, 5, None)  # another partition has its own order
    with pytest.raises(CommitOrderError):
        gate.hold(TP_B, 5, None)  # the same offset twice is out of order too
    # after a drop (the revoke), the partition starts afresh, from any offset
    gate.drop({TP_A}, [])
    gate.hold(TP_A, 0, R1)
    assert gate.release() == {TP_B: 6}  # nothing of TP_A: r1 is open


def test_drop_also_forgets_done_records_and_the_partition_starts_afresh() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, None)  # 0
    assert gate.release() == {TP_A: 1}
    parts.hold(TP_A, R1)  # 1
    parts.hold(TP_A, None)  # 2: done, behind 1
    gate.drop({TP_A}, [R1])
    assert gate.release() == {}
    assert gate.committable() == {}
    assert len(gate) == 0
    # The partition comes back and is re-read from its committed offset (1):
    # its records are held anew and committed normally, nothing of before leaks.
    parts.seek(TP_A, 1)
    parts.hold(TP_A, None)  # 1
    parts.hold(TP_A, R1)  # 2: r1 is open again on this worker
    parts.hold(TP_A, None)  # 3
    assert len(gate) == 3
    assert gate.release() == {TP_A: 2}
    gate.finished([R1])
    assert gate.release() == {TP_A: 4}
    assert len(gate) == 0


def test_a_dropped_request_is_never_done_even_on_a_partition_that_stays() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_B, R1)  # 0: r1 also reached B, which this worker keeps
    parts.hold(TP_B, None)  # 1
    gate.drop({TP_A}, [R1])
    gate.finished([R1])  # forgotten: finishing it no longer marks anything done
    assert gate.release() == {}
    assert gate.committable() == {}
    assert len(gate) == 2


def test_drop_of_a_partition_but_not_its_request_keeps_the_request_elsewhere() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_B, R1)
    gate.drop({TP_A}, [])
    gate.finished([R1])
    assert gate.release() == {TP_B: 1}
    assert gate.committable() == {TP_B: 1}


def test_a_request_closed_elsewhere_holds_its_records_until_that_close_is_applied() -> None:
    """Another owner decided r1's close first: its records are released as that owner's,
    only once `finished` is told that close is applied; until then the partition commits
    nothing past r1, and the records after it wait."""
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, None)  # 0
    parts.hold(TP_A, R1)  # 1
    parts.hold(TP_A, R1)  # 2
    parts.hold(TP_A, None)  # 3: the record that closed r1 here
    parts.hold(TP_A, R2)  # 4
    gate.finished([R2])
    gate.elsewhere([R1, NOBODY])  # nobody holds nothing here: nothing to wait for
    assert gate.waiting_elsewhere() == [R1]
    assert gate.release() == {TP_A: 1}  # up to r1's first record, not past it
    parts.hold(TP_A, None)  # 5: later batches go on coming
    assert gate.release() == {}
    gate.finished([R1])  # r1's close is applied where it was decided
    assert gate.waiting_elsewhere() == []
    assert gate.release() == {TP_A: 6}


def test_drop_hands_back_the_requests_closed_elsewhere_it_stopped_waiting_for() -> None:
    """A revoke forgets the partition; the requests closed elsewhere on it, whose close was
    never applied, are handed back (the processor forgets their close: read again, they are
    asked about and closed where decided).  Those of partitions kept stay waited for."""
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, R1)
    parts.hold(TP_B, R2)
    parts.hold(TP_C, R3)
    gate.elsewhere([R1, R2])
    assert gate.drop({TP_A, TP_C}, [R3]) == [R1]
    assert gate.waiting_elsewhere() == [R2]
    gate.finished([R1])  # forgotten: harmless
    gate.finished([R2])
    assert gate.waiting_elsewhere() == []
    assert gate.release() == {TP_B: 1}


def test_drop_of_nothing_or_of_an_unknown_partition_is_harmless() -> None:
    parts = Partitions()
    gate = parts.gate
    parts.hold(TP_A, None)
    parts.hold(TP_A, R1)
    gate.drop(set(), [])
    gate.drop({TP_C}, [NOBODY])
    assert len(gate) == 2
    assert gate.release() == {TP_A: 1}
    gate.finished([R1])
    assert gate.release() == {TP_A: 2}


# -- random schedules against a model -------------------------------------------------


@dataclass
class Record:
    offset: int
    request: RequestRef | None


@dataclass
class Model:
    """What the gate should do, the slow and obvious way."""

    held: dict[TopicPartition, list[Record]] = field(default_factory=dict)
    released: dict[TopicPartition, int] = field(default_factory=dict)  # records let go
    point: dict[TopicPartition, int] = field(default_factory=dict)
    finished: set[RequestRef] = field(default_factory=set)
    forgotten: set[RequestRef] = field(default_factory=set)

    def done(self, record: Record) -> bool:
        return record.request is None or record.request in self.finished

    def release(self) -> dict[TopicPartition, int]:
        moved = {}
        for tp, records in self.held.items():
            i = self.released.get(tp, 0)
            while i < len(records) and self.done(records[i]):
                i += 1
            if i > self.released.get(tp, 0):
                self.released[tp] = i
                moved[tp] = self.point[tp] = records[i - 1].offset + 1
        return moved

    def drop(self, tps: set[TopicPartition], requests: list[RequestRef]) -> None:
        for tp in tps:
            self.held.pop(tp, None)
            self.released.pop(tp, None)
            self.point.pop(tp, None)
        self.forgotten.update(requests)

    def outstanding(self) -> int:
        return sum(len(r) - self.released.get(tp, 0) for tp, r in self.held.items())


def mint(n: int) -> RequestRef:
    """The n-th request of a schedule: each id comes twice, of acme and of globex."""
    return RequestRef(("acme", "globex")[n % 2], f"r{n // 2}")


@pytest.mark.parametrize("seed", range(25))
def test_random_schedules_match_the_model(seed: int) -> None:
    """Random holds, finishes, releases and drops over three partitions, checked each step."""
    rng = random.Random(seed)
    gate, model = CommitGate(), Model()
    tps = [TP_A, TP_B, TP_C]
    next_offset = dict.fromkeys(tps, 0)
    first_tp: dict[RequestRef, TopicPartition] = {}  # a request belongs to its first record's tp
    live = [mint(n) for n in range(5)]
    minted = len(live)
    highest: dict[TopicPartition, int] = {}  # the highest point ever handed out
    for _ in range(300):
        action = rng.random()
        released: dict[TopicPartition, int] | None = None
        if action < 0.55:
            tp = rng.choice(tps)
            offset = next_offset[tp]
            next_offset[tp] = offset + 1 + (rng.randrange(1, 4) if rng.random() < 0.2 else 0)
            ref = None if rng.random() < 0.3 else rng.choice(live)
            if ref is not None:
                first_tp.setdefault(ref, tp)
            gate.hold(tp, offset, ref)
            model.held.setdefault(tp, []).append(Record(offset, ref))
        elif action < 0.72:
            closing = rng.sample(live, rng.randint(1, 2))
            if rng.random() < 0.2:
                closing.append(NOBODY)
            if model.forgotten and rng.random() < 0.3:
                # Too late: a request a drop forgot stays not done on this worker.
                closing.append(rng.choice(sorted(model.forgotten)))
            gate.finished(iter(closing))
            for ref in closing:
                if ref in live:
                    live.remove(ref)
                    model.finished.add(ref)
            while len(live) < 5:
                live.append(mint(minted))
                minted += 1
        elif action < 0.97:
            released = gate.release()
            assert released == model.release()
        else:
            # A rebalance takes some partitions and the requests that started there
            # (what `RequestProcessor.drop_partitions` returns).
            taken = set(rng.sample(tps, rng.randint(1, 2)))
            dropped = [r for r in live if first_tp.get(r) in taken]
            gate.drop(taken, dropped)
            model.drop(taken, dropped)
            for ref in dropped:
                live.remove(ref)
            while len(live) < 5:
                live.append(mint(minted))
                minted += 1
            for tp in taken:
                # The partition comes back later, re-read from somewhere at or above
                # what was committed.
                floor = highest.get(tp, 0)
                next_offset[tp] = rng.randint(floor, max(floor, next_offset[tp]))

        # Invariants, after every single step.
        committable = gate.committable()
        assert committable == model.point
        assert len(gate) == model.outstanding()
        for tp, point in committable.items():
            # The commit point never passes an unfinished record...
            for record in model.held.get(tp, []):
                if record.offset < point:
                    assert model.done(record), (tp, record, point)
            # ... and never goes backwards, even across a drop and re-read.
            assert point >= highest.get(tp, 0)
            highest[tp] = point
        if released is not None:
            # Right after a release, each partition's first record left is open.
            for tp, records in model.held.items():
                left = records[model.released.get(tp, 0) :]
                if left:
                    assert not model.done(left[0])
                    assert left[0].request not in model.finished

    # Finish everything: each partition commits up to its last record, except
    # behind a record of a request that a drop forgot (the next run re-reads it).
    gate.finished(live)
    model.finished.update(live)
    assert gate.release() == model.release()
    assert gate.committable() == model.point
    assert len(gate) == model.outstanding()
    for tp, records in model.held.items():
        left = records[model.released.get(tp, 0) :]
        if left:
            assert left[0].request in model.forgotten
        else:
            assert gate.committable()[tp] == records[-1].offset + 1
