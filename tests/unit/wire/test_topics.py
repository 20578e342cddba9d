"""The topic declarations."""

from __future__ import annotations

import dataclasses

import pytest

from streamtally import topics
from streamtally.errors import InputError
from streamtally.settings import DEFAULT_STATE_TTL_S
from streamtally.topics import DAY_MS, Topic, Topics
from streamtally.wire import avro

T = Topics.in_namespace()
ALL_TOPICS = T.all


def test_names_are_unique_and_namespaced() -> None:
    names = [t.name for t in ALL_TOPICS]
    assert len(names) == len(set(names))
    assert all(name.startswith("streamtally.") for name in names)
    assert set(names) >= {
        "streamtally.raw.sse",
        "streamtally.raw.engine",
        "streamtally.chunks",
        "streamtally.tokens",
        "streamtally.billing",
        "streamtally.deadletter",
        "streamtally.billing.corrections",
    }


@pytest.mark.parametrize("topic", ALL_TOPICS, ids=lambda t: t.name)
def test_every_value_schema_exists(topic: Topic) -> None:
    assert topic.value_schema in avro.RECORD_NAMES
    assert avro.current(topic.value_schema).fingerprint
    assert topic.description
    assert "request_id" in topic.key


@pytest.mark.parametrize("topic", ALL_TOPICS, ids=lambda t: t.name)
def test_configs_render(topic: Topic) -> None:
    config = topics.kafka_config(topic)
    assert config == topic.config()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in config.items())
    assert config["cleanup.policy"] in ("delete", "compact")
    assert int(config["retention.ms"]) == topic.retention_ms
    if topic.max_message_bytes is not None:
        assert int(config["max.message.bytes"]) == topic.max_message_bytes


def test_layout_and_retention() -> None:
    assert T.raw_sse.value_schema == "RawSseEvent"
    assert T.raw_engine.value_schema == "RawEngineOutput"
    assert T.chunks.value_schema == "Chunk"
    assert T.tokens.value_schema == "Tokens"
    assert T.billing.value_schema == "BillingEvent"
    assert T.deadletter.value_schema == "DeadLetter"
    assert T.corrections.value_schema == "BillingCorrection"
    # corrections apply in the order written (one partition), and are kept like the bills
    assert T.corrections.partitions == 1
    assert T.corrections.config() == {"cleanup.policy": "delete", "retention.ms": "-1"}
    for topic in (T.raw_sse, T.raw_engine, T.chunks):
        assert topic.partitions == 6
        assert topic.retention_ms == 7 * DAY_MS
        assert topic.config()["cleanup.policy"] == "delete"
    assert T.tokens.config()["cleanup.policy"] == "compact"
    assert T.billing.config() == {"cleanup.policy": "delete", "retention.ms": "-1"}
    for raw in T.raw:  # the broker's clock: what quiet requests are timed by
        assert raw.config() == {
            "cleanup.policy": "delete",
            "retention.ms": "604800000",
            "message.timestamp.type": "LogAppendTime",
            "segment.ms": "86400000",  # daily: a record is readable at most 7 + 1 days
            "max.message.bytes": str(4 * 1024 * 1024 + 64 * 1024),  # a 4 MiB record, framed
        }
    # no replay of the raw topics outlives the state Redis keeps for it (the state TTL)
    readable_s = max((t.retention_ms + (t.segment_ms or 0)) // 1000 for t in T.raw)
    assert readable_s == DEFAULT_STATE_TTL_S == 8 * 24 * 3600
    # every topic a request's records flow through is co-partitioned by request id
    keyed = {t.partitions for t in ALL_TOPICS if t not in (T.deadletter, T.corrections)}
    assert keyed == {6}
    assert all(t.replication_factor == 1 for t in ALL_TOPICS)


def test_topics_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        T.chunks.partitions = 3  # type: ignore[misc]


def test_by_name() -> None:
    assert T.by_name("streamtally.tokens") is T.tokens
    with pytest.raises(KeyError, match="no topic"):
        T.by_name("nope")


def test_a_namespace_prefixes_every_name_and_the_group() -> None:
    other = Topics.in_namespace("tenant-b")
    assert [t.name for t in other.all] == [
        "tenant-b.raw.sse",
        "tenant-b.raw.engine",
        "tenant-b.chunks",
        "tenant-b.tokens",
        "tenant-b.billing",
        "tenant-b.deadletter",
        "tenant-b.billing.corrections",
    ]
    assert other.processors_group == "tenant-b.processors"
    assert other.worker_app_id == "tenant-b.worker"
    # only the names differ from the declarations
    for declared, named in zip(T.all, other.all, strict=True):
        assert dataclasses.replace(named, name=declared.name) == declared


@pytest.mark.parametrize("namespace", ["", "a b", "a/b", "a:b"])
def test_a_bad_namespace_is_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="bad namespace"):
        Topics.in_namespace(namespace)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": "bad name"}, "bad topic name"),
        ({"name": ""}, "bad topic name"),
        ({"partitions": 0}, "partitions"),
        ({"replication_factor": 0}, "replication_factor"),
        ({"retention_ms": 0}, "retention_ms"),
        ({"retention_ms": -2}, "retention_ms"),
        ({"cleanup_policy": "compact,delete"}, "cleanup_policy"),
    ],
)
def test_bad_topics_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(T.chunks, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("request_id", ["chatcmpl-abc", "msg_✓", "a" * 300])
def test_keys_are_utf8_request_ids(request_id: str) -> None:
    key = topics.encode_key(request_id)
    assert key == request_id.encode("utf-8")
    assert topics.decode_key(key) == request_id


def test_bad_keys() -> None:
    with pytest.raises(ValueError, match="empty"):
        topics.encode_key("")
    for key in (None, b"", b"\xff\xfe"):
        with pytest.raises(InputError):
            topics.decode_key(key)


def test_the_record_sizes_agree() -> None:
    """Every writer, topic and reader agrees on how large a record can be (issue 22)."""
    from streamtally.processors.limits import MAX_RECORD_BYTES
    from streamtally.processors.source import FETCH_BYTES, PARTITION_FETCH_BYTES
    from streamtally.wire.kafka import MAX_REQUEST_BYTES
    from streamtally.wire.records import PART_BYTES

    framing = 64 * 1024  # key, st-auth header, batch and record headers: far less
    for raw in T.raw:
        # the worker takes any record the topic takes, but those it dead-letters as too big
        assert raw.max_message_bytes == MAX_RECORD_BYTES + framing
        # the worker fetches the largest at once
        assert raw.max_message_bytes <= PARTITION_FETCH_BYTES <= FETCH_BYTES
        # a part record (512 KiB of data, its Avro framing) is far below
        assert 4 * PART_BYTES + framing <= raw.max_message_bytes
    # the producer's request takes the largest record of every topic the producers write
    for topic in (*T.raw, T.chunks, T.tokens):
        assert topic.max_message_bytes is not None
        assert topic.max_message_bytes <= MAX_REQUEST_BYTES
