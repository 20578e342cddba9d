"""`streamtally.wire.kafka.read_topic` and `read_decoded`, against a stand-in consumer.

The stand-in serves fixed partitions (no broker): what is read, from where to
where, is decided by `read_ranges` and the read loop, which these tests pin.
The reads against a real broker are in the integration tier.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, ClassVar

import aiokafka
import pytest

from streamtally.errors import StackError
from streamtally.wire import kafka
from streamtally.wire.avro import AvroDecodeError
from streamtally.wire.kafka import (
    TopicRecord,
    read_decoded,
    read_ranges,
    read_topic,
    read_topic_batches,
)

TOPIC = "t"


@dataclass(frozen=True)
class _Record:
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int
    headers: tuple[tuple[str, bytes], ...] = ()


class _Cluster:
    def __init__(self, partitions: set[int]) -> None:
        self._partitions = partitions

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self._partitions if topic == TOPIC else None


class _Client:
    def __init__(self, partitions: set[int]) -> None:
        self._partitions = partitions

    async def fetch_all_metadata(self) -> _Cluster:
        return _Cluster(self._partitions)


class FakeConsumer:
    """Partitions of `TOPIC`: `begins[p]` is the first offset kept, `logs[p]` every value."""

    begins: ClassVar[dict[int, int]] = {}
    #: The values of each partition from offset 0; offsets below `begins` are deleted.
    logs: ClassVar[dict[int, list[bytes | None]]] = {}
    #: End offsets reported (default: the log's length); records past them exist already.
    ends: ClassVar[dict[int, int]] = {}
    #: Records one getmany returns per partition.
    batch = 2
    #: The consumer made last.
    last: ClassVar[FakeConsumer | None] = None

    def __init__(self, **config: Any) -> None:
        self.config = config
        self._client = _Client(set(self.logs))
        self.positions: dict[Any, int] = {}
        #: Records each getmany returned, in all.
        self.returned: list[int] = []
        FakeConsumer.last = self

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def assign(self, tps: list[Any]) -> None:
        self.positions = dict.fromkeys(tps, -1)

    async def end_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return {tp: self.ends.get(tp.partition, len(self.logs[tp.partition])) for tp in tps}

    async def beginning_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return {tp: self.begins.get(tp.partition, 0) for tp in tps}

    async def seek_to_beginning(self, *tps: Any) -> None:
        for tp in tps:
            self.positions[tp] = self.begins.get(tp.partition, 0)

    def seek(self, tp: Any, offset: int) -> None:
        self.positions[tp] = offset

    async def position(self, tp: Any) -> int:
        return self.positions[tp]

    async def getmany(
        self, *tps: Any, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[Any, list[_Record]]:
        self.returned.append(0)
        out = {}
        for tp in tps:
            first = self.positions[tp]
            assert first >= 0, "read before a seek"
            room = self.batch if max_records is None else max_records - self.returned[-1]
            values = self.logs[tp.partition][first : first + min(self.batch, room)]
            self.returned[-1] += len(values)
            if values:
                out[tp] = [
                    _Record(first + i, f"k{first + i}".encode(), v, 1000 + first + i)
                    for i, v in enumerate(values)
                ]
                self.positions[tp] = first + len(values)
        return out


@pytest.fixture
def consumer(monkeypatch: pytest.MonkeyPatch) -> type[FakeConsumer]:
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", FakeConsumer)
    monkeypatch.setattr(FakeConsumer, "logs", {0: [b"a0", b"a1", b"a2", b"a3", b"a4"], 1: []})
    monkeypatch.setattr(FakeConsumer, "begins", {})
    monkeypatch.setattr(FakeConsumer, "ends", {})
    return FakeConsumer


async def _read(**kwargs: Any) -> list[TopicRecord]:
    async with contextlib.aclosing(read_topic("fake:9092", TOPIC, **kwargs)) as records:
        return [record async for record in records]


async def _drain(reading: AsyncGenerator[Any, None]) -> None:
    async with contextlib.aclosing(reading) as items:
        async for _ in items:
            pass


def _positions(records: list[TopicRecord]) -> list[tuple[int, int]]:
    return [(r.partition, r.offset) for r in records]


# --------------------------------------------------------------------------- read_ranges


def test_ranges_default_to_beginning_and_current_end() -> None:
    assert read_ranges({0: 0, 1: 3, 2: 5}, {0: 4, 1: 9, 2: 5}) == {0: (0, 4), 1: (3, 9)}


def test_ranges_narrowed_by_start_and_end_per_partition() -> None:
    begins, ends = {0: 0, 1: 0, 2: 0}, {0: 10, 1: 10, 2: 10}
    assert read_ranges(begins, ends, start={0: 4}, end={1: 6}) == {
        0: (4, 10),
        1: (0, 6),
        2: (0, 10),
    }
    # nothing between start and end: the partition is left out
    assert read_ranges(begins, ends, start={0: 7, 1: 10}, end={0: 7}) == {2: (0, 10)}


def test_a_start_before_the_beginning_means_the_beginning() -> None:
    assert read_ranges({0: 5}, {0: 9}, start={0: 2}) == {0: (5, 9)}


def test_an_end_beyond_the_current_end_is_kept() -> None:
    assert read_ranges({0: 0}, {0: 3}, end={0: 8}) == {0: (0, 8)}


# --------------------------------------------------------------------------- read_topic


async def test_reads_every_record_from_the_beginning_to_the_end(
    consumer: type[FakeConsumer],
) -> None:
    records = await _read()
    assert _positions(records) == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    assert records[2] == TopicRecord(TOPIC, 0, 2, b"k2", b"a2", 1002)


async def test_takes_a_bounded_number_of_records_at_a_time(
    consumer: type[FakeConsumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer unpacks what it fetched a few records at a time, never all at once."""
    monkeypatch.setattr(consumer, "logs", {0: [b"a0", b"a1", b"a2"], 1: [b"b0", b"b1"]})
    monkeypatch.setattr(consumer, "batch", 10)
    monkeypatch.setattr(kafka, "READ_MAX_RECORDS", 3)
    records = await _read()
    assert sorted(_positions(records)) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert consumer.last is not None
    assert max(consumer.last.returned) == 3


async def test_batches_are_what_each_fetch_returned_never_empty_and_bounded(
    consumer: type[FakeConsumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read_topic_batches`: the records of `read_topic`, in its order, a list per fetch of
    at most `max_records`; a fetch that returns nothing past the end makes no batch."""
    monkeypatch.setattr(consumer, "logs", {0: [b"a0", b"a1", b"a2", b"a3"], 1: [b"b0", b"b1"]})
    monkeypatch.setattr(consumer, "batch", 10)
    consumer.ends = {0: 3}  # a3 comes after the end offsets were taken
    reading = read_topic_batches("fake:9092", TOPIC, max_records=2)
    async with contextlib.aclosing(reading) as batches:
        got = [batch async for batch in batches]
    # five records, at most two a fetch; a3, fetched past the end, is left out of its batch
    assert sorted(len(batch) for batch in got) == [1, 2, 2]
    assert consumer.last is not None
    assert max(consumer.last.returned) == 2  # the fetches asked for two at most
    flat = [record for batch in got for record in batch]
    assert sorted(_positions(flat)) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert sorted(flat) == sorted(await _read())  # what read_topic reads, one by one


async def test_stops_at_the_end_offsets_taken_at_the_call(consumer: type[FakeConsumer]) -> None:
    consumer.ends = {0: 3}  # two more records are written after the end offsets were taken
    assert _positions(await _read()) == [(0, 0), (0, 1), (0, 2)]


async def test_starts_at_the_beginning_left_by_retention(consumer: type[FakeConsumer]) -> None:
    consumer.begins = {0: 2}
    assert _positions(await _read()) == [(0, 2), (0, 3), (0, 4)]


async def test_reads_from_given_start_offsets(consumer: type[FakeConsumer]) -> None:
    consumer.logs = {0: [b"a0", b"a1", b"a2"], 1: [b"b0", b"b1", b"b2", b"b3"]}
    records = await _read(start={1: 3})
    assert sorted(_positions(records)) == [(0, 0), (0, 1), (0, 2), (1, 3)]


async def test_reads_to_given_end_offsets(consumer: type[FakeConsumer]) -> None:
    consumer.logs = {0: [b"a0", b"a1", b"a2"], 1: [b"b0", b"b1", b"b2", b"b3"]}
    records = await _read(start={0: 1, 1: 1}, end={0: 2, 1: 3})
    assert sorted(_positions(records)) == [(0, 1), (1, 1), (1, 2)]


async def test_nothing_to_read_between_start_and_end(consumer: type[FakeConsumer]) -> None:
    assert await _read(start={0: 5}) == []
    assert await _read(start={0: 2}, end={0: 2}) == []


async def test_an_end_never_reached_stalls(consumer: type[FakeConsumer]) -> None:
    with pytest.raises(StackError, match=r"stalled for 0 s before its end \(partitions 0\)"):
        await _read(end={0: 9}, stall_timeout=0.0)


async def test_a_missing_topic_is_a_stack_error(consumer: type[FakeConsumer]) -> None:
    reading = read_topic("fake:9092", "other", missing_hint="a hint")
    with pytest.raises(StackError, match="topic other does not exist on fake:9092: a hint"):
        await _drain(reading)


# --------------------------------------------------------------------------- read_decoded


def _decode(value: bytes) -> str:
    if value.startswith(b"bad"):
        raise AvroDecodeError(f"not a record: {value!r}")
    return value.decode().upper()


async def test_read_decoded_reports_what_does_not_decode(consumer: type[FakeConsumer]) -> None:
    consumer.logs = {0: [b"a0", None, b"bad2", b"a3"]}
    bad: list[tuple[int, int, str]] = []
    async with contextlib.aclosing(read_decoded("fake:9092", TOPIC, _decode, bad)) as values:
        got = [value async for value in values]
    assert got == ["A0", "A3"]
    assert bad == [(0, 1, "no value (tombstone)"), (0, 2, "not a record: b'bad2'")]


async def test_read_decoded_passes_the_missing_hint(consumer: type[FakeConsumer]) -> None:
    del consumer
    reading = read_decoded("fake:9092", "other", _decode, [], missing_hint="billed nothing")
    with pytest.raises(StackError, match="does not exist on fake:9092: billed nothing"):
        await _drain(reading)


async def _collect(reading: AsyncGenerator[Any, None]) -> list[Any]:
    async with contextlib.aclosing(reading) as items:
        return [item async for item in items]


async def test_a_missing_topic_read_with_missing_ok_is_empty(
    consumer: type[FakeConsumer],
) -> None:
    """What the rebuild reads the corrections topic with: a deployment of before it has none."""
    del consumer
    assert await _collect(read_topic("fake:9092", "other", missing_ok=True)) == []
    bad: list[tuple[int, int, str]] = []
    reading = read_decoded("fake:9092", "other", _decode, bad, missing_ok=True)
    assert await _collect(reading) == []
    assert bad == []


async def test_read_decoded_reads_the_given_range(consumer: type[FakeConsumer]) -> None:
    consumer.logs = {0: [b"a0", b"a1", b"a2", b"a3"]}
    bad: list[tuple[int, int, str]] = []
    reading = read_decoded("fake:9092", TOPIC, _decode, bad, start={0: 1}, end={0: 3})
    assert await _collect(reading) == ["A1", "A2"]
