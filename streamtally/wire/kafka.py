"""Kafka plumbing shared by producers, the worker and the read commands.

`idempotent_producer` is the one producer configuration every writer uses;
`ensure_topics` creates the declared topics (and raises the
``max.message.bytes`` of existing ones declared higher); `read_topic` reads one topic
from its beginning to its current end, which is what the read commands
(`billing export`, `deadletter`, `rebuild`) do, or a given range of offsets
of it; `read_decoded` does the same and decodes each value (`read_decoded_at`: with
its partition and offset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, NamedTuple, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    NotControllerError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
    for_code,
)
from aiokafka.partitioner import DefaultPartitioner

from streamtally.connection import KafkaConnection, as_connection, client_options
from streamtally.errors import StackError
from streamtally.topics import Topic, kafka_config
from streamtally.wire.avro import AvroDecodeError

__all__ = [
    "MAX_REQUEST_BYTES",
    "STALL_TIMEOUT_S",
    "Decoded",
    "KeyPartitioner",
    "TopicRecord",
    "ensure_topics",
    "idempotent_producer",
    "raise_limit_configs",
    "read_decoded",
    "read_decoded_at",
    "read_topic",
    "read_topic_batches",
    "wait_served",
]

log = logging.getLogger(__name__)

#: Largest produce request a streamtally producer sends: above every topic's
#: ``max.message.bytes`` but the dead-letter topic's (the Tokens topic takes 8 MiB records,
#: the raw topics `RAW_MAX_MESSAGE_BYTES`).
MAX_REQUEST_BYTES: Final = 8 << 20
#: `DescribeConfigs` v1+: where a config's value comes from; this one is set on the topic.
_DYNAMIC_TOPIC_CONFIG: Final = 1
#: A resource's error code when its topic is not (yet) known to the broker asked.
_UNKNOWN_TOPIC: Final = 3
#: A resource's error code when the principal may not describe or alter its configs.
_AUTHORIZATION_FAILED: Final = frozenset({29, 31})  # TOPIC_, CLUSTER_AUTHORIZATION_FAILED

#: `read_topic` gives up when no partition has moved for this long while records remain.
STALL_TIMEOUT_S: Final = 30.0
#: Records `read_topic` takes from the consumer at a time.  The consumer still fetches
#: whole partitions' worth ahead, but unpacks only these: without a bound, one call
#: unpacked every fetched record at once (a few hundred thousand of a raw topic, 50 MiB
#: more at peak and slower for it, in `streamtally audit`).
READ_MAX_RECORDS: Final = 2000

#: What `read_topic` says when the topic does not exist, unless told otherwise.
_MISSING_HINT: Final = (
    "nothing was written there yet (`streamtally worker` creates the topics), "
    "or it is the wrong Kafka or namespace (STREAMTALLY_NAMESPACE)"
)


#: How long `ensure_topics` retries while a broker of the cluster is down.
BROKER_DOWN_WAIT_S: Final = 30.0
#: Seconds `ensure_topics` waits for the topics it created to be served (their partitions'
#: leaders elected and known to the broker asked).
SERVED_WAIT_S: Final = 60.0
#: What an admin request meets when the node it picked from the metadata is down.
_NODE_DOWN: Final = (NodeNotReadyError, NotControllerError, RequestTimedOutError)


#: Keys whose partition `KeyPartitioner` keeps (then it starts afresh).
PARTITION_CACHE_KEYS: Final = 65_536


class KeyPartitioner:
    """aiokafka's default partitioner (the murmur2 of the key, as Kafka's Java client; a
    record without a key to a random partition), its answer for a key kept: the records
    of one request share their key, so the hash (pure Python in aiokafka, a fifth of a
    sender's time) is computed once per request and partition count, not per record."""

    def __init__(self, max_keys: int = PARTITION_CACHE_KEYS) -> None:
        self.max_keys = max_keys
        self._default = DefaultPartitioner()
        self._known: dict[bytes, tuple[int, int]] = {}  # key -> (partitions, partition)

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if key is None:
            return int(self._default(key, all_partitions, available))
        count = len(all_partitions)
        known = self._known.get(key)
        if known is not None and known[0] == count:
            return known[1]
        partition = int(self._default(key, all_partitions, available))
        if len(self._known) >= self.max_keys:
            self._known.clear()
        self._known[key] = (count, partition)
        return partition


def idempotent_producer(kafka: KafkaConnection | str, *, linger_ms: int = 5) -> AIOKafkaProducer:
    """The producer every streamtally writer uses: idempotent, acks from all in-sync replicas.

    Its own retries never duplicate or reorder a record (``enable_idempotence``);
    a send completes only once every in-sync replica has the record (``acks=all``).
    `kafka` is the connection (servers and security; plain servers: PLAINTEXT).  Records
    are partitioned as by Kafka's default partitioner (`KeyPartitioner`).
    """
    return AIOKafkaProducer(
        **client_options(kafka),
        acks="all",
        enable_idempotence=True,
        linger_ms=linger_ms,
        max_batch_size=1 << 20,
        max_request_size=MAX_REQUEST_BYTES,
        partitioner=KeyPartitioner(),
    )


async def ensure_topics(
    kafka: KafkaConnection | str, wanted: tuple[Topic, ...], *, brokers: int | None = None
) -> list[str]:
    """Create the declared topics that do not exist yet; return the names created.

    Each is created as `Topic.on_cluster` of `brokers` (default: the brokers the
    cluster lists now): one copy per broker up to three, and on the topics the
    worker writes ``min.insync.replicas`` 2 once there are three.  Topics that
    exist already are left as they are, but for their ``max.message.bytes``: one
    lower than declared (a raw topic created before the raw topics declared theirs
    has the broker's 1 MiB) is raised to it (`raise_limit_configs`), never lowered.
    The topics it created are served when it returns (`wait_served`): a consumer started
    at once finds their leaders.
    """
    conn = as_connection(kafka)
    deadline = time.monotonic() + BROKER_DOWN_WAIT_S
    while True:
        try:
            created = await _ensure_once(conn, wanted, brokers)
            break
        except _NODE_DOWN as exc:
            # A broker of several just died: the metadata still names it until the
            # controller fences it (KRaft's broker session timeout, 9 s by default).
            if time.monotonic() > deadline:
                raise StackError(
                    f"Kafka at {conn} failed: {exc!r} for "
                    f"{BROKER_DOWN_WAIT_S:g} s: is a broker down?"
                ) from exc
            await asyncio.sleep(0.5)
    if created:
        await wait_served(conn, [t for t in wanted if t.name in created])
    return created


async def wait_served(
    kafka: KafkaConnection | str, topics: list[Topic], timeout: float = SERVED_WAIT_S
) -> None:
    """Return once the cluster answers the end offsets of every partition of `topics`.

    A topic is created before its partitions have leaders that every broker knows; a
    worker that starts on it in that moment gets ``NotLeaderForPartitionError`` (logged by
    aiokafka at ERROR level) or finds it missing from its metadata, and on a loaded broker
    that moment lasts seconds.  `StackError` after `timeout` seconds."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    conn = as_connection(kafka)
    consumer = AIOKafkaConsumer(**client_options(conn), request_timeout_ms=int(timeout * 1000))
    await consumer.start()
    try:
        partitions = [TopicPartition(t.name, p) for t in topics for p in range(t.partitions)]
        await asyncio.wait_for(consumer.end_offsets(partitions), timeout)
    except (TimeoutError, KafkaTimeoutError) as exc:
        names = ", ".join(t.name for t in topics)
        raise StackError(
            f"Kafka at {conn} does not serve the topics just created ({names}) "
            f"after {timeout:g} s: is the broker overloaded?"
        ) from exc
    finally:
        await consumer.stop()


async def _ensure_once(
    conn: KafkaConnection, wanted: tuple[Topic, ...], brokers: int | None
) -> list[str]:
    """`ensure_topics`, one attempt with a fresh admin client (fresh metadata)."""
    admin = AIOKafkaAdminClient(**client_options(conn), request_timeout_ms=15000)
    try:
        await admin.start()
    except KafkaConnectionError as exc:
        raise StackError(
            f"cannot reach Kafka at {conn.unreachable()}: start it with `streamtally stack up` "
            "or set KAFKA_BOOTSTRAP_SERVERS"
        ) from exc
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            if brokers is None:
                brokers = len((await admin.describe_cluster())["brokers"])
            created = [topic.on_cluster(brokers) for topic in missing]
            # Another process may create them concurrently: that is what we wanted.
            with contextlib.suppress(TopicAlreadyExistsError):
                response = await admin.create_topics(
                    [
                        NewTopic(
                            name=t.name,
                            num_partitions=t.partitions,
                            replication_factor=t.replication_factor,
                            topic_configs=kafka_config(t),
                        )
                        for t in created
                    ]
                )
                _raise_creation_errors(str(conn), brokers, response)
        present = [t for t in wanted if t.name in existing]
        if present:
            await raise_limit_configs(admin, present)
        return [t.name for t in missing]
    finally:
        await admin.close()


async def raise_limit_configs(admin: AIOKafkaAdminClient, topics: list[Topic]) -> list[str]:
    """Raise ``max.message.bytes`` of existing `topics` to what they declare, where it is
    lower; return the names of those raised.  Never lowers it.

    The broker's AlterConfigs sets a topic's whole configuration, so every config set on
    the topic is sent again with the new value.  A principal that may not describe or
    alter topic configs (DESCRIBE_CONFIGS, ALTER_CONFIGS) changes nothing: a warning
    names the command an operator runs instead.
    """
    declared = {t.name: t.max_message_bytes for t in topics if t.max_message_bytes is not None}
    if not declared:
        return []
    resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in declared]
    alters = []
    for response in await admin.describe_configs(resources):
        for resource in response.resources:
            code, message, _type, name, entries = resource[:5]
            if code in _AUTHORIZATION_FAILED:
                _cannot_raise(name, declared[name], f"not authorized ({message or code})")
                continue
            if code == _UNKNOWN_TOPIC:  # listed, not yet known to this broker: just created
                continue
            if code:
                raise StackError(f"describing the configs of topic {name} failed: {code} {message}")
            current, configs = _topic_configs(entries)
            wanted = declared[name]
            if current is not None and current >= wanted:
                continue
            configs["max.message.bytes"] = str(wanted)
            alters.append((name, current, ConfigResource(ConfigResourceType.TOPIC, name, configs)))
    if not alters:
        return []
    raised = []
    responses = await admin.alter_configs([resource for _, _, resource in alters])
    results = {row[3]: (row[0], row[1]) for r in responses for row in r.resources}
    for name, current, _ in alters:
        code, message = results.get(name, (0, None))
        if code in _AUTHORIZATION_FAILED:
            _cannot_raise(name, declared[name], f"not authorized ({message or code})")
        elif code:
            raise StackError(f"altering the configs of topic {name} failed: {code} {message}")
        else:
            log.warning(
                "topic %s: max.message.bytes raised from %s to %d (declared in streamtally.topics)",
                name,
                "the broker default" if current is None else current,
                declared[name],
            )
            raised.append(name)
    return raised


def _topic_configs(entries: list[Any]) -> tuple[int | None, dict[str, str]]:
    """A topic's ``max.message.bytes`` (None: not set on the topic) and every config set on
    it, from a DescribeConfigs answer (v0 says `is_default`, later versions the source)."""
    configs: dict[str, str] = {}
    for entry in entries:
        name, value, _read_only, default_or_source = entry[:4]
        if isinstance(default_or_source, bool):
            dynamic = not default_or_source
        else:
            dynamic = default_or_source == _DYNAMIC_TOPIC_CONFIG
        if dynamic and value is not None:
            configs[name] = value
        elif dynamic:  # a sensitive value is not shown: it could not be set again
            raise StackError(f"topic config {name} is hidden: set max.message.bytes by hand")
    current = configs.get("max.message.bytes")
    return (None if current is None else int(current)), configs


def _cannot_raise(name: str, wanted: int, why: str) -> None:
    log.warning(
        "topic %s: cannot check or raise its max.message.bytes to %d: %s; an operator runs "
        "kafka-configs.sh --bootstrap-server B --alter --entity-type topics --entity-name %s "
        "--add-config max.message.bytes=%d",
        name,
        wanted,
        why,
        name,
        wanted,
    )


def _raise_creation_errors(servers: str, brokers: int, response: object) -> None:
    """`StackError` naming each topic the broker did not create (existing ones aside)."""
    failed = []
    for error in getattr(response, "topic_errors", ()):
        name, code = error[0], error[1]
        if code in (0, TopicAlreadyExistsError.errno):
            continue
        message = error[2] if len(error) > 2 and error[2] else ""
        failed.append(f"{name}: {for_code(code).__name__} {message}".rstrip())
    if failed:
        raise StackError(
            f"Kafka at {servers} refused topics for a cluster of {brokers} broker(s): "
            + "; ".join(failed)
        )


class TopicRecord(NamedTuple):
    """One record as read from Kafka: where it is, its raw key and value, its time.

    A named tuple, not a frozen dataclass: a read makes one per record, and a tuple is
    made in a third of the time (0.6 against 1.8 µs, a second per 800,000 records).
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    #: None for a tombstone.
    value: bytes | None
    #: The record's Kafka timestamp, milliseconds since the Unix epoch.
    timestamp_ms: int
    #: The record's Kafka headers (a raw record's ``st-auth`` tenant claim).
    headers: tuple[tuple[str, bytes], ...] = ()


def read_ranges(
    begins: Mapping[int, int],
    ends: Mapping[int, int],
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
) -> dict[int, tuple[int, int]]:
    """What `read_topic` reads of each partition: `(first offset, offset to stop before)`.

    `begins` and `ends` are the partitions' current beginning and end
    offsets.  A partition absent from `start` is read from its beginning, and
    a `start` before the beginning (records deleted by retention) means the
    beginning; a partition absent from `end` is read to its current end.
    Partitions with nothing to read are left out.
    """
    ranges = {}
    for partition, begin in begins.items():
        first = max(begin, (start or {}).get(partition, begin))
        stop = (end or {}).get(partition, ends[partition])
        if stop > first:
            ranges[partition] = (first, stop)
    return ranges


async def read_topic(
    kafka: KafkaConnection | str,
    topic: str,
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    missing_hint: str = _MISSING_HINT,
    missing_ok: bool = False,
    stall_timeout: float = STALL_TIMEOUT_S,
) -> AsyncGenerator[TopicRecord, None]:
    """Every record of `topic`, one by one: `read_topic_batches`, whose docstring says
    what is read.  An async generator holding a consumer: close it when stopping early
    (``async with contextlib.aclosing(read_topic(...)) as records``)."""
    batches = read_topic_batches(
        kafka,
        topic,
        start=start,
        end=end,
        missing_hint=missing_hint,
        missing_ok=missing_ok,
        stall_timeout=stall_timeout,
    )
    async with contextlib.aclosing(batches):
        async for batch in batches:
            for record in batch:
                yield record


async def read_topic_batches(
    kafka: KafkaConnection | str,
    topic: str,
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    missing_hint: str = _MISSING_HINT,
    missing_ok: bool = False,
    stall_timeout: float = STALL_TIMEOUT_S,
    max_records: int | None = None,
) -> AsyncGenerator[list[TopicRecord], None]:
    """Every record of `topic`, from its beginning to its end offsets at the time of the call.

    The end offset of each partition is taken once, at start, so the read
    always terminates and never waits for new records; only committed
    records are read (isolation level read_committed).  No consumer group
    is used and no offsets are committed.  Records come in offset order
    within a partition; partitions are interleaved.  They come in batches of
    at most `max_records` (None: `READ_MAX_RECORDS`), each what one fetch
    returned (never empty), so a caller that works a batch at a time pays no
    step per record.

    `start` and `end` (partition to offset) narrow the read to the offsets
    `[start, end)` of the partitions they name, the others being read from
    their beginning and to their current end (`read_ranges`).  An `end`
    beyond a partition's current end waits for those records to be written.

    An async generator holding a consumer: close it when stopping early
    (``async with contextlib.aclosing(read_topic_batches(...)) as batches``).

    Raises `StackError` when Kafka cannot be reached (with the
    `streamtally stack up` hint), the topic does not exist (with
    `missing_hint`; with `missing_ok` a missing topic is read as empty: one of before
    it was declared), a read fails, or no partition moves for
    `stall_timeout` seconds before its end.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaError

    servers = as_connection(kafka)  # printed as its servers, credentials hidden
    consumer = AIOKafkaConsumer(
        **client_options(servers),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        request_timeout_ms=15000,
        max_partition_fetch_bytes=MAX_REQUEST_BYTES,  # above every topic's max.message.bytes
    )
    try:
        await consumer.start()
    except KafkaConnectionError as exc:
        await consumer.stop()
        raise StackError(
            f"cannot reach Kafka at {servers.unreachable()}: start the local stack with "
            "`streamtally stack up`, "
            "or pass --bootstrap-servers / set KAFKA_BOOTSTRAP_SERVERS"
        ) from exc
    except KafkaError as exc:
        await consumer.stop()
        raise StackError(f"connecting to Kafka at {servers} failed: {exc}") from exc
    try:
        # `consumer.topics()` fetches this very metadata but returns only the names.
        cluster = await consumer._client.fetch_all_metadata()
        partitions = cluster.partitions_for_topic(topic)
        if not partitions:
            if missing_ok:
                return
            raise StackError(f"topic {topic} does not exist on {servers}: {missing_hint}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        ends: dict[Any, int] = await consumer.end_offsets(tps)
        begins: dict[Any, int] = await consumer.beginning_offsets(tps)
        ranges = read_ranges(
            {tp.partition: begins[tp] for tp in tps},
            {tp.partition: ends[tp] for tp in tps},
            start,
            end,
        )
        remaining = {tp for tp in tps if tp.partition in ranges}
        positions = {tp: ranges[tp.partition][0] for tp in remaining}
        stops = {tp: ranges[tp.partition][1] for tp in remaining}
        # Each partition from its position, the beginning included: `seek_to_beginning`
        # would ask the broker again for offsets just read, and wait on its fetcher (about
        # 0.1 s); a beginning deleted by retention meanwhile is reset to the earliest
        # offset (auto_offset_reset), which is what the beginning is.
        for tp in remaining:
            consumer.seek(tp, positions[tp])
        limit = READ_MAX_RECORDS if max_records is None else max_records
        last_progress = time.monotonic()
        while remaining:
            fetched = await consumer.getmany(*remaining, timeout_ms=500, max_records=limit)
            batch = [
                TopicRecord(
                    topic,
                    tp.partition,
                    record.offset,
                    record.key,
                    record.value,
                    record.timestamp,
                    tuple(record.headers) if record.headers else (),
                )
                for tp, records in fetched.items()
                for record in records
                if record.offset < stops[tp]
            ]
            if batch:
                yield batch
            for tp in list(remaining):
                position = await consumer.position(tp)
                if position != positions[tp]:
                    positions[tp] = position
                    last_progress = time.monotonic()
                if position >= stops[tp]:
                    remaining.discard(tp)
            if remaining and time.monotonic() - last_progress > stall_timeout:
                stuck = ", ".join(f"{tp.partition}" for tp in sorted(remaining))
                raise StackError(
                    f"reading {topic} stalled for {stall_timeout:.0f} s before its end "
                    f"(partitions {stuck})"
                )
    except KafkaError as exc:
        raise StackError(f"reading {topic} from Kafka at {servers} failed: {exc}") from exc
    finally:
        await consumer.stop()


_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Decoded(Generic[_T]):
    """A decoded value with where its record is (`read_decoded_at`)."""

    partition: int
    offset: int
    value: _T


async def read_decoded_at(
    kafka: KafkaConnection | str,
    topic: str,
    decode: Callable[[bytes], _T],
    bad: list[tuple[int, int, str]],
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    missing_hint: str = _MISSING_HINT,
    missing_ok: bool = False,
) -> AsyncGenerator[Decoded[_T], None]:
    """`read_topic` (the same `start`, `end`, `missing_hint`, `missing_ok`), each value
    decoded with `decode` and yielded with its partition and offset; what does not
    decode goes to `bad`.

    A tombstone (no value) or a value `decode` refuses with `AvroDecodeError`
    is appended to `bad` as `(partition, offset, reason)` and skipped.  Close
    it when stopping early, as `read_topic`.
    """
    reading = read_topic(
        kafka, topic, start=start, end=end, missing_hint=missing_hint, missing_ok=missing_ok
    )
    async with contextlib.aclosing(reading) as records:
        async for record in records:
            if record.value is None:
                bad.append((record.partition, record.offset, "no value (tombstone)"))
                continue
            try:
                value = decode(record.value)
            except AvroDecodeError as exc:
                bad.append((record.partition, record.offset, str(exc)))
                continue
            yield Decoded(record.partition, record.offset, value)


async def read_decoded(
    kafka: KafkaConnection | str,
    topic: str,
    decode: Callable[[bytes], _T],
    bad: list[tuple[int, int, str]],
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    missing_hint: str = _MISSING_HINT,
    missing_ok: bool = False,
) -> AsyncGenerator[_T, None]:
    """`read_decoded_at`, the values alone."""
    reading = read_decoded_at(
        kafka,
        topic,
        decode,
        bad,
        start=start,
        end=end,
        missing_hint=missing_hint,
        missing_ok=missing_ok,
    )
    async with contextlib.aclosing(reading) as decoded:
        async for item in decoded:
            yield item.value
