"""Record sizes on the real broker: the raw topics' declared ``max.message.bytes``.

The raw topics take one record of `RAW_MAX_MESSAGE_BYTES` (a raw record of
4 MiB with its framing), not the broker's default 1 MiB; `ensure_topics`
creates them so, and raises the limit of raw topics created before it was
declared (keeping every other config of theirs), never lowering it.  Each
test works in a namespace of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import MessageSizeTooLargeError

from streamtally.topics import RAW_MAX_MESSAGE_BYTES, Topics
from streamtally.wire.kafka import ensure_topics, idempotent_producer, read_topic

pytestmark = pytest.mark.integration

#: Seconds a created topic may take to be known to the broker that is asked.
KNOWN_TIMEOUT_S = 30.0


def namespace() -> str:
    return f"sizes-{uuid.uuid4().hex[:10]}"


#: DescribeConfigs' error code for a topic the broker asked does not know yet.
UNKNOWN_TOPIC_OR_PARTITION = 3


async def configs_of(servers: str, names: list[str]) -> dict[str, dict[str, str]]:
    """The topics' configs, once the broker asked knows every one of them (a topic created
    a moment before may take a while on a loaded machine; `KNOWN_TIMEOUT_S`)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    deadline = asyncio.get_running_loop().time() + KNOWN_TIMEOUT_S
    try:
        while True:
            found: dict[str, dict[str, str]] = {}
            unknown = []
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
            )
            for response in responses:
                for resource in response.resources:
                    if resource[0] == UNKNOWN_TOPIC_OR_PARTITION:
                        unknown.append(resource[:4])
                        continue
                    assert resource[0] == 0, resource[:4]
                    found[resource[3]] = {entry[0]: entry[1] for entry in resource[4]}
            if not unknown:
                return found
            assert asyncio.get_running_loop().time() < deadline, unknown
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def settled(servers: str, names: list[str], wanted: str) -> dict[str, dict[str, str]]:
    """The configs once every broker applied the change (the controller's metadata reaches
    them a moment after AlterConfigs answers), or as they are after 30 s."""
    for _ in range(300):
        found = await configs_of(servers, names)
        if all(found[name]["max.message.bytes"] == wanted for name in names):
            break
        await asyncio.sleep(0.1)
    return found


async def create_as_before(servers: str, topics: Topics, max_message_bytes: int | None) -> None:
    """The raw topics as `ensure_topics` created them before they declared a size."""
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        new = []
        for topic in topics.raw:
            config = topic.config()
            del config["max.message.bytes"]
            if max_message_bytes is not None:
                config["max.message.bytes"] = str(max_message_bytes)
            new.append(NewTopic(topic.name, topic.partitions, 1, topic_configs=config))
        await admin.create_topics(new)
    finally:
        await admin.close()
    # Until the broker knows them (its metadata follows the controller; on a broker busy
    # with a parallel run's topics, seconds later).
    await configs_of(servers, [t.name for t in topics.raw])


def test_ensure_topics_raises_the_raw_topics_limit_and_keeps_their_configs(
    bootstrap_servers: str,
) -> None:
    async def run() -> None:
        topics = Topics.in_namespace(namespace())
        names = [t.name for t in topics.raw]
        await create_as_before(bootstrap_servers, topics, None)
        before = await configs_of(bootstrap_servers, names)
        assert {before[n]["max.message.bytes"] for n in names} == {str(1024 * 1024 + 12)}
        await ensure_topics(bootstrap_servers, topics.all)
        after = await settled(bootstrap_servers, names, str(RAW_MAX_MESSAGE_BYTES))
        for name, topic in zip(names, topics.raw, strict=True):
            assert after[name]["max.message.bytes"] == str(RAW_MAX_MESSAGE_BYTES)
            for key, value in topic.config().items():  # every declared config kept
                assert after[name][key] == value, key
        # created with it: nothing to raise there
        fresh = Topics.in_namespace(namespace())
        await ensure_topics(bootstrap_servers, fresh.all)
        made = await configs_of(bootstrap_servers, [t.name for t in fresh.all])
        assert made[fresh.raw_sse.name]["max.message.bytes"] == str(RAW_MAX_MESSAGE_BYTES)
        assert made[fresh.tokens.name]["max.message.bytes"] == str(8 << 20)

    asyncio.run(run())


def test_ensure_topics_never_lowers_a_larger_limit(bootstrap_servers: str) -> None:
    async def run() -> None:
        topics = Topics.in_namespace(namespace())
        larger = RAW_MAX_MESSAGE_BYTES * 2
        await create_as_before(bootstrap_servers, topics, larger)
        await ensure_topics(bootstrap_servers, topics.all)
        after = await configs_of(bootstrap_servers, [t.name for t in topics.raw])
        assert {c["max.message.bytes"] for c in after.values()} == {str(larger)}

    asyncio.run(run())


def test_a_record_just_under_the_declared_limit_goes_through_kafka(
    bootstrap_servers: str,
) -> None:
    """One record whose batch is just under ``max.message.bytes`` is written and read back;
    one just over is refused by the broker: the declared limit is the one in force."""

    async def run() -> None:
        topics = Topics.in_namespace(namespace())
        await ensure_topics(bootstrap_servers, topics.all)
        topic = topics.raw_sse.name
        key = b"req-at-the-limit"
        header = [("st-auth", b"x" * 100)]
        # a record batch of one record: 61 bytes of batch header, about 20 of record framing
        under = b"u" * (RAW_MAX_MESSAGE_BYTES - 61 - 40 - len(key) - 120)
        over = b"o" * (RAW_MAX_MESSAGE_BYTES + 1)
        producer = idempotent_producer(bootstrap_servers)
        await producer.start()
        try:
            sent = await producer.send_and_wait(topic, under, key=key, headers=header)
            with pytest.raises(MessageSizeTooLargeError):
                await producer.send_and_wait(topic, over, key=key)
        finally:
            await producer.stop()
        reading = read_topic(bootstrap_servers, topic)
        async with contextlib.aclosing(reading) as records:
            got = [r async for r in records]
        assert [(r.partition, r.offset, r.key, r.value) for r in got] == [
            (sent.partition, sent.offset, key, under)
        ]
        assert got[0].headers == tuple(header)

    asyncio.run(run())
