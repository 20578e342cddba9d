"""Kafka plumbing shared by producers, the worker and the read commands."""

from __future__ import annotations

import contextlib

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from streamtally.errors import StackError
from topics import ALL_TOPICS, Topic, kafka_config

__all__ = ["ensure_topics"]


async def ensure_topics(
    bootstrap_servers: str, wanted: tuple[Topic, ...] = ALL_TOPICS
) -> list[str]:
    """Create the declared topics that do not exist yet; return the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=15000)
    try:
        await admin.start()
    except KafkaConnectionError as exc:
        raise StackError(
            f"cannot reach Kafka at {bootstrap_servers}: start it with `streamtally stack up` "
            "or set KAFKA_BOOTSTRAP_SERVERS"
        ) from exc
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            # Another process may create them concurrently: that is what we wanted.
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [
                        NewTopic(
                            name=t.name,
                            num_partitions=t.partitions,
                            replication_factor=t.replication_factor,
                            topic_configs=kafka_config(t),
                        )
                        for t in missing
                    ]
                )
        return [t.name for t in missing]
    finally:
        await admin.close()
