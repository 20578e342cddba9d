"""`KeyPartitioner` (wire/kafka.py): Kafka's default partitioning, the hash kept per key."""

from __future__ import annotations

import aiokafka.partitioner
import pytest
from aiokafka.partitioner import DefaultPartitioner

from streamtally.wire.kafka import KeyPartitioner, idempotent_producer


@pytest.mark.parametrize("count", [1, 3, 12])
def test_a_keyed_record_goes_where_the_default_partitioner_sends_it(count: int) -> None:
    partitions = list(range(count))
    default = DefaultPartitioner()
    cached = KeyPartitioner()
    keys = [f"call-{n:06d}".encode() for n in range(2000)]
    for key in keys * 2:  # the second time from what it kept
        assert cached(key, partitions, partitions) == default(key, partitions, partitions)


def test_the_hash_is_computed_once_per_key_and_partition_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed: list[bytes] = []
    murmur2 = aiokafka.partitioner.murmur2

    def counting(data: bytes) -> int:
        hashed.append(bytes(data))
        return int(murmur2(data))

    monkeypatch.setattr(aiokafka.partitioner, "murmur2", counting)
    partitioner = KeyPartitioner(max_keys=2)
    for _ in range(100):
        partitioner(b"a", [0, 1, 2], [0, 1, 2])
    assert hashed == [b"a"]
    partitioner(b"a", [0, 1, 2, 3], [0, 1, 2, 3])  # partitions added: hashed again
    assert hashed == [b"a", b"a"]
    partitioner(b"b", [0, 1, 2, 3], [])
    partitioner(b"c", [0, 1, 2, 3], [])  # past max_keys: it starts afresh
    partitioner(b"a", [0, 1, 2, 3], [])
    assert hashed == [b"a", b"a", b"b", b"c", b"a"]


def test_a_record_without_a_key_goes_to_an_available_partition() -> None:
    partitioner = KeyPartitioner()
    assert {partitioner(None, [0, 1, 2], [2]) for _ in range(20)} == {2}


async def test_every_idempotent_producer_partitions_with_it() -> None:
    producer = idempotent_producer("127.0.0.1:1")
    assert isinstance(producer._partitioner, KeyPartitioner)
