"""`Batches`: per partition, the records queued while its last batch waited, in order,
each record settled.

The producer here is a stand-in with aiokafka's batch API (`partitions_for`,
`create_batch`, `send_batch`) that records what it is given; the real one is
exercised by the tap's integration tests (`test_tap_spool`, `test_tap_proxy`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from streamtally.producers.batches import Batches
from streamtally.wire.kafka import KeyPartitioner


class Builder:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: list[tuple[bytes, bytes, Any]] = []

    def append(self, *, timestamp: Any, key: bytes, value: bytes, headers: Any) -> Any:
        assert timestamp is None
        assert type(headers) is list  # aiokafka's C builder refuses a tuple
        if not isinstance(value, bytes):
            raise TypeError("value must be bytes")  # as aiokafka's builder refuses it
        if len(self.records) >= self.capacity:
            return None
        self.records.append((key, value, headers))
        return object()


class Producer:
    def __init__(self, partitions: int = 4, capacity: int = 100) -> None:
        self.partitions = partitions
        self.capacity = capacity
        self.sent: list[tuple[str, int, list[bytes]]] = []
        self.batches: list[asyncio.Future[Any]] = []
        #: When set, the first `send_batch` waits for it (an accumulator without room).
        self.gate: asyncio.Event | None = None
        #: Per partition: every `send_batch` to it waits for its event (room per partition).
        self.rooms: dict[int, asyncio.Event] = {}
        self.calls = 0
        self.fail_metadata: BaseException | None = None

    async def partitions_for(self, topic: str) -> set[int]:
        if self.fail_metadata is not None:
            raise self.fail_metadata
        return set(range(self.partitions))

    def create_batch(self) -> Builder:
        return Builder(self.capacity)

    async def send_batch(self, builder: Builder, topic: str, *, partition: int) -> Any:
        self.calls += 1
        if self.gate is not None and self.calls == 1:
            await self.gate.wait()
        room = self.rooms.get(partition)
        if room is not None:
            await room.wait()
        self.sent.append((topic, partition, [value for _, value, _ in builder.records]))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.batches.append(future)
        return future


def partition_of(key: bytes, partitions: int) -> int:
    every = list(range(partitions))
    return KeyPartitioner()(key, every, every)


async def turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_one_turn_is_one_batch_per_partition_in_queue_order() -> None:
    producer = Producer()
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    keys = [f"req-{n}".encode() for n in range(6)]
    futures = [batches.queue("raw", key, b"%d-%d" % (n, i)) for i in range(3) for n, key in
               enumerate(keys)]  # fmt: skip
    assert producer.sent == []  # nothing before the loop turns
    await turn()
    expected: dict[int, list[bytes]] = {}
    for i in range(3):
        for n, key in enumerate(keys):
            expected.setdefault(partition_of(key, 4), []).append(b"%d-%d" % (n, i))
    assert {p: values for _, p, values in producer.sent} == expected
    assert len(producer.sent) == len(expected)
    assert [p for _, p, _ in producer.sent] == list(expected)  # first queued, first sent
    for batch in producer.batches:
        batch.set_result("acked")
    assert await asyncio.gather(*futures) == ["acked"] * 18
    assert (batches.batches, batches.records) == (len(expected), 18)


async def test_a_full_batch_continues_in_the_next_one_of_its_partition() -> None:
    producer = Producer(partitions=1, capacity=2)
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    futures = [batches.queue("raw", b"k", b"%d" % n) for n in range(5)]
    await turn()
    assert producer.sent == [("raw", 0, [b"0", b"1"]), ("raw", 0, [b"2", b"3"]), ("raw", 0, [b"4"])]
    producer.batches[0].set_result("a")
    producer.batches[1].set_exception(KafkaTimeoutError())
    producer.batches[2].set_result("c")
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert results[:2] == ["a", "a"]
    assert results[4] == "c"
    assert all(isinstance(r, KafkaTimeoutError) for r in results[2:4])


async def test_a_later_turn_never_overtakes_an_earlier_one() -> None:
    producer = Producer(partitions=1)
    producer.gate = asyncio.Event()  # the first turn's send_batch waits (a full accumulator)
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    batches.queue("raw", b"k", b"first")
    await turn()
    batches.queue("raw", b"k", b"second")
    await turn()
    assert producer.sent == []
    producer.gate.set()
    await turn()
    assert [values for _, _, values in producer.sent] == [[b"first"], [b"second"]]


async def test_a_record_over_the_request_limit_fails_alone_at_once() -> None:
    producer = Producer(partitions=1)
    batches = Batches(producer, max_request_bytes=1000)  # type: ignore[arg-type]
    small = batches.queue("raw", b"k", b"x" * 100)
    large = batches.queue("raw", b"k", b"x" * 1000)
    assert large.done()
    assert isinstance(large.exception(), MessageSizeTooLargeError)
    await turn()
    assert producer.sent == [("raw", 0, [b"x" * 100])]
    producer.batches[0].set_result("ok")
    assert await small == "ok"


async def test_no_metadata_fails_every_record_of_the_turn() -> None:
    producer = Producer()
    producer.fail_metadata = KafkaTimeoutError()
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    futures = [batches.queue("raw", b"k%d" % n, b"v") for n in range(3)]
    await turn()
    for future in futures:
        with pytest.raises(KafkaTimeoutError):
            await future
    assert producer.sent == []


async def test_drain_submits_what_is_queued_without_a_turn() -> None:
    producer = Producer(partitions=2)
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    batches.queue("raw", b"a", b"1", [("st-auth", b"sig")])
    await batches.drain()
    assert [values for _, _, values in producer.sent] == [[b"1"]]
    await turn()
    assert len(producer.sent) == 1  # the turn's own submit found nothing left


async def test_records_queued_while_a_batch_waits_go_in_the_next_one_together() -> None:
    """Batch size follows the load: a turn's records do not make a batch of their own
    while their partition's previous batch still waits for room in the accumulator."""
    producer = Producer(partitions=1)
    producer.gate = asyncio.Event()
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    futures = [batches.queue("raw", b"k", b"first")]
    await turn()
    for n in range(4):  # four turns, one record each, while the first batch waits
        futures.append(batches.queue("raw", b"k", b"%d" % n))
        await turn()
    assert producer.sent == []
    producer.gate.set()
    await turn()
    assert [values for _, _, values in producer.sent] == [[b"first"], [b"0", b"1", b"2", b"3"]]
    assert (batches.batches, batches.records) == (2, 5)
    for batch in producer.batches:
        batch.set_result("acked")
    assert await asyncio.gather(*futures) == ["acked"] * 5


async def test_a_waiting_partition_holds_up_no_other() -> None:
    producer = Producer(partitions=2)
    blocked = asyncio.Event()
    keys = {partition_of(b"k%d" % n, 2): b"k%d" % n for n in range(20)}
    producer.rooms[0] = blocked
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    batches.queue("raw", keys[0], b"p0")
    batches.queue("raw", keys[1], b"p1-a")
    await turn()
    batches.queue("raw", keys[1], b"p1-b")
    await turn()
    assert producer.sent == [("raw", 1, [b"p1-a"]), ("raw", 1, [b"p1-b"])]
    blocked.set()
    await turn()
    assert producer.sent[-1] == ("raw", 0, [b"p0"])


async def test_drain_waits_until_every_lane_has_submitted() -> None:
    producer = Producer(partitions=1)
    producer.gate = asyncio.Event()
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    batches.queue("raw", b"k", b"first")
    await turn()
    batches.queue("raw", b"k", b"second")
    draining = asyncio.ensure_future(batches.drain())
    await turn()
    assert not draining.done()  # the first batch still waits for room
    producer.gate.set()
    await asyncio.wait_for(draining, 1)
    assert [values for _, _, values in producer.sent] == [[b"first"], [b"second"]]


async def test_a_record_the_builder_cannot_take_fails_with_those_behind_it() -> None:
    producer = Producer(partitions=1)
    batches = Batches(producer, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    bad = batches.queue("raw", b"k", "not bytes")  # type: ignore[arg-type]
    await turn()
    with pytest.raises(TypeError):
        await bad
    ok = batches.queue("raw", b"k", b"fine")
    await turn()
    producer.batches[-1].set_result("acked")
    assert await ok == "acked"
