"""The topic declarations."""

from __future__ import annotations

import dataclasses

import pytest

from streamtally import topics
from streamtally.errors import InputError
from streamtally.topics import ALL_TOPICS, DAY_MS, Topic
from streamtally.wire import avro


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
    assert topics.RAW_SSE.value_schema == "RawSseEvent"
    assert topics.RAW_ENGINE.value_schema == "RawEngineOutput"
    assert topics.CHUNKS.value_schema == "Chunk"
    assert topics.TOKENS.value_schema == "Tokens"
    assert topics.BILLING.value_schema == "BillingEvent"
    assert topics.DEADLETTER.value_schema == "DeadLetter"
    for topic in (topics.RAW_SSE, topics.RAW_ENGINE, topics.CHUNKS):
        assert topic.partitions == 6
        assert topic.retention_ms == 7 * DAY_MS
        assert topic.config()["cleanup.policy"] == "delete"
    assert topics.TOKENS.config()["cleanup.policy"] == "compact"
    assert topics.BILLING.config() == {"cleanup.policy": "delete", "retention.ms": "-1"}
    assert topics.RAW_SSE.config() == {"cleanup.policy": "delete", "retention.ms": "604800000"}
    # every topic a request's records flow through is co-partitioned by request id
    keyed = {t.partitions for t in ALL_TOPICS if t is not topics.DEADLETTER}
    assert keyed == {6}
    assert all(t.replication_factor == 1 for t in ALL_TOPICS)


def test_topics_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        topics.CHUNKS.partitions = 3  # type: ignore[misc]


def test_by_name() -> None:
    assert topics.by_name("streamtally.tokens") is topics.TOKENS
    with pytest.raises(KeyError, match="no topic"):
        topics.by_name("nope")


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
        dataclasses.replace(topics.CHUNKS, **changes)  # type: ignore[arg-type]


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
