"""How many copies streamtally's topics get: from the cluster's broker count, never per caller."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.admin import NewTopic
from aiokafka.errors import NodeNotReadyError

from streamtally.errors import StackError
from streamtally.topics import Topic, Topics, min_insync_for, replication_factor_for
from streamtally.wire import kafka as wire_kafka

T = Topics.in_namespace("repl")
OUTPUTS = (T.chunks, T.tokens, T.billing, T.deadletter)


@pytest.mark.parametrize(("brokers", "expected"), [(0, 1), (1, 1), (2, 2), (3, 3), (5, 3)])
def test_one_copy_per_broker_up_to_three(brokers: int, expected: int) -> None:
    assert replication_factor_for(brokers) == expected
    assert all(t.on_cluster(brokers).replication_factor == expected for t in T.all)


@pytest.mark.parametrize(("copies", "expected"), [(1, 1), (2, 1), (3, 2), (5, 2)])
def test_min_insync_leaves_one_broker_free_to_fail(copies: int, expected: int) -> None:
    assert min_insync_for(copies) == expected


def test_one_broker_changes_nothing() -> None:
    for topic in T.all:
        assert topic.on_cluster(1) == topic
        assert "min.insync.replicas" not in topic.config()


def test_three_brokers_give_outputs_two_in_sync_replicas() -> None:
    for topic in OUTPUTS:
        assert topic.on_cluster(3).config()["min.insync.replicas"] == "2"
        assert "min.insync.replicas" not in topic.on_cluster(2).config()
    for topic in T.raw:  # producers keep writing with one replica left
        assert "min.insync.replicas" not in topic.on_cluster(3).config()


class FakeAdmin:
    """An AIOKafkaAdminClient stand-in: `brokers` live brokers, records what it creates."""

    created: list[NewTopic]
    brokers = 3
    errors: list[tuple[str, int, str]]

    def __init__(self, **kwargs: Any) -> None:
        del kwargs

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def list_topics(self) -> list[str]:
        return [T.raw_sse.name]

    async def describe_cluster(self) -> dict[str, Any]:
        return {"brokers": [{"node_id": i} for i in range(self.brokers)], "cluster_id": "x"}

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        """The existing raw topic, created with its declared size (nothing to raise)."""
        size = str(T.raw_sse.max_message_bytes)
        entry = ("max.message.bytes", size, False, 1, False, [])
        rows = [(0, None, 2, r.name, [entry]) for r in resources]
        return [type("Response", (), {"resources": rows})()]

    async def create_topics(self, new_topics: list[NewTopic]) -> Any:
        FakeAdmin.created = new_topics

        class Response:
            topic_errors = FakeAdmin.errors

        return Response()


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch) -> type[FakeAdmin]:
    FakeAdmin.created = []
    FakeAdmin.errors = []
    FakeAdmin.brokers = 3
    monkeypatch.setattr(wire_kafka, "AIOKafkaAdminClient", FakeAdmin)
    served: list[list[str]] = []

    async def wait_served(conn: object, topics: list[Topic], timeout: float = 0) -> None:
        served.append([t.name for t in topics])  # (no broker: test_ensure_topics.py)

    monkeypatch.setattr(wire_kafka, "wait_served", wait_served)
    return FakeAdmin


async def test_ensure_topics_replicates_by_the_brokers_it_finds(admin: type[FakeAdmin]) -> None:
    created = await wire_kafka.ensure_topics("k:9092", T.all)
    assert created == [t.name for t in T.all if t is not T.raw_sse]
    by_name = {n.name: n for n in admin.created}
    assert {n.replication_factor for n in admin.created} == {3}
    assert by_name[T.billing.name].topic_configs["min.insync.replicas"] == "2"
    assert "min.insync.replicas" not in by_name[T.raw_engine.name].topic_configs


async def test_ensure_topics_on_one_broker_and_given_a_count(admin: type[FakeAdmin]) -> None:
    admin.brokers = 1
    await wire_kafka.ensure_topics("k:9092", (T.tokens,))
    assert [(n.replication_factor, n.topic_configs) for n in admin.created] == [
        (1, T.tokens.config())
    ]
    await wire_kafka.ensure_topics("k:9092", (T.tokens,), brokers=3)
    assert admin.created[0].replication_factor == 3


async def test_a_topic_the_broker_refuses_is_an_error(admin: type[FakeAdmin]) -> None:
    admin.errors = [
        (T.chunks.name, 0, ""),
        (T.tokens.name, 36, "exists"),  # created by another process meanwhile: fine
        (T.billing.name, 38, "Replication factor: 3 larger than available brokers: 2."),
    ]
    with pytest.raises(StackError, match="InvalidReplicationFactorError") as error:
        await wire_kafka.ensure_topics("k:9092", (T.chunks, T.tokens, T.billing))
    message = str(error.value)
    assert T.billing.name in message
    assert "larger than available brokers" in message
    assert T.chunks.name not in message
    assert T.tokens.name not in message


class AdminMeetingADeadBroker(FakeAdmin):
    """Its first `down` list_topics calls pick a broker that just died."""

    down = 2
    starts = 0

    async def start(self) -> None:
        AdminMeetingADeadBroker.starts += 1

    async def list_topics(self) -> list[str]:
        if AdminMeetingADeadBroker.down > 0:
            AdminMeetingADeadBroker.down -= 1
            raise NodeNotReadyError("Attempt to send a request to node which is not ready")
        return await super().list_topics()


async def test_a_broker_that_just_died_is_retried_with_fresh_metadata(
    admin: type[FakeAdmin], monkeypatch: pytest.MonkeyPatch
) -> None:
    AdminMeetingADeadBroker.down, AdminMeetingADeadBroker.starts = 2, 0
    monkeypatch.setattr(wire_kafka, "AIOKafkaAdminClient", AdminMeetingADeadBroker)
    created = await wire_kafka.ensure_topics("k:9092,k:9094,k:9096", (T.raw_sse, T.tokens))
    assert created == [T.tokens.name]
    assert AdminMeetingADeadBroker.starts == 3  # a new client (new metadata) per attempt


async def test_a_broker_down_for_too_long_is_an_error_naming_it(
    admin: type[FakeAdmin], monkeypatch: pytest.MonkeyPatch
) -> None:
    AdminMeetingADeadBroker.down = 10**6
    monkeypatch.setattr(wire_kafka, "AIOKafkaAdminClient", AdminMeetingADeadBroker)
    monkeypatch.setattr(wire_kafka, "BROKER_DOWN_WAIT_S", 0.0)
    with pytest.raises(StackError, match="is a broker down"):
        await wire_kafka.ensure_topics("k:9092", (T.tokens,))
