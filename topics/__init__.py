"""The Kafka topics of streamtally, declared as frozen data.

Keys: a raw record is keyed by its request id, encoded as the UTF-8 bytes of
the string (no Avro, no length prefix, no framing):
`encode_key("chatcmpl-1") == b"chatcmpl-1"`.  The outputs (chunks, Tokens,
billing events) are keyed by the request's identity, tenant and request id
(`output_key`: the UTF-8 bytes of `RequestRef.text`, ``acme:chatcmpl-1``), so
that two tenants reusing one provider id stay two requests, also on the
compacted Tokens topic.  Every record is partitioned by the murmur2 of its
request id (the default partitioner over `encode_key`; `partition_key`), so
all of a request's records are on one partition, in order, and topics with
the same number of partitions are co-partitioned (a request lands on the
same partition number everywhere).  The dead-letter topic keeps the key of
the record it holds.  Output records written by earlier versions, before keys
carried the tenant, are keyed by the request id alone.

Values: the topic's `value_schema` in Avro single-object encoding, or in the
Confluent wire format with ``STREAMTALLY_AVRO_FRAMING=confluent`` (subject
``<topic>-value``); readers read both (see `streamtally.wire.avro`,
`streamtally.wire.framing` and docs/avro-framing.md).

Names: each topic is declared with its name inside a namespace (``raw.sse``);
`Topics.in_namespace` gives the topics of one deployment, whose names carry
the namespace as a prefix (``streamtally.raw.sse`` by default, another with
``STREAMTALLY_NAMESPACE`` so that a test or a second deployment can share a
broker).  The processors' consumer group is named in the same namespace.

Sizes: ``max.message.bytes`` is declared where a record may pass the broker's
default of 1 MiB: the raw topics take `RAW_MAX_MESSAGE_BYTES` (a raw record of
`RAW_RECORD_BYTES` and its framing), the chunks and Tokens topics 8 MiB (a
chunk keeps 4 MiB of content, a Tokens `STREAMTALLY_MAX_TEXT_BYTES`), the
dead-letter topic 16 MiB.  `ensure_topics` creates topics with it and raises it on topics
that exist with less (never lowers it).

Replication: the declarations hold no broker count.  `ensure_topics`
(`streamtally.wire.kafka`) creates each topic with `Topic.on_cluster` of the
brokers it finds: as many copies as brokers, up to `MAX_REPLICATION_FACTOR`
(`replication_factor_for`), and on the topics the worker writes
``min.insync.replicas`` 2 once there are three copies (`Topic.min_insync`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final, Literal

from streamtally.core.identity import RequestRef
from streamtally.errors import InputError

__all__ = [
    "DAY_MS",
    "DECLARED",
    "DEFAULT_NAMESPACE",
    "FOREVER",
    "MAX_REPLICATION_FACTOR",
    "MIB",
    "OUTPUT_MIN_INSYNC",
    "RAW_MAX_MESSAGE_BYTES",
    "RAW_RECORD_BYTES",
    "Topic",
    "Topics",
    "decode_key",
    "encode_key",
    "kafka_config",
    "min_insync_for",
    "output_key",
    "replication_factor_for",
]

#: Prefix of every topic name (and of the worker's consumer group) unless the settings name another.
DEFAULT_NAMESPACE: Final = "streamtally"

DAY_MS: Final = 24 * 60 * 60 * 1000
#: `retention.ms` meaning "keep forever".
FOREVER: Final = -1
MIB: Final = 1024 * 1024

#: The largest value of one raw record: what a producer may write and the worker takes
#: (`streamtally.processors.limits.MAX_RECORD_BYTES`; the tap sends a larger event in
#: part records of 512 KiB, `streamtally.wire.records.PART_BYTES`).
RAW_RECORD_BYTES: Final = 4 * MIB
#: ``max.message.bytes`` of the raw topics: one record of `RAW_RECORD_BYTES` with its key,
#: its ``st-auth`` header and the record batch's framing, with room to spare (a producer
#: batches records up to 1 MiB; a larger record goes alone in its batch).
RAW_MAX_MESSAGE_BYTES: Final = RAW_RECORD_BYTES + 64 * 1024

#: Most copies of a partition streamtally asks for: with three, one broker can fail or
#: restart while writes with ``min.insync.replicas`` 2 go on and nothing is lost.
MAX_REPLICATION_FACTOR: Final = 3
#: ``min.insync.replicas`` of the topics the worker writes, once they have enough copies.
OUTPUT_MIN_INSYNC: Final = 2


def replication_factor_for(brokers: int) -> int:
    """The replication factor of streamtally's topics on a cluster of `brokers` brokers.

    One copy per broker, up to `MAX_REPLICATION_FACTOR`: 1 on a single broker, 3 on
    three brokers or more.
    """
    return max(1, min(MAX_REPLICATION_FACTOR, brokers))


def min_insync_for(replication_factor: int, wanted: int = OUTPUT_MIN_INSYNC) -> int:
    """``min.insync.replicas`` of `wanted` on `replication_factor` copies: at most one less
    than the copies (so that one broker can always be down), at least 1.
    """
    return max(1, min(wanted, replication_factor - 1))


CleanupPolicy = Literal["delete", "compact"]
TimestampType = Literal["CreateTime", "LogAppendTime"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Topic:
    """One Kafka topic: its name, layout, retention and what its records hold."""

    name: str
    partitions: int
    #: Copies of each partition, at least; `on_cluster` raises it to what the cluster
    #: can hold (`replication_factor_for`), which is what `ensure_topics` creates.
    replication_factor: int = 1
    retention_ms: int
    cleanup_policy: CleanupPolicy = "delete"
    #: What the key is: the request id as UTF-8 string bytes (`encode_key`), or on the
    #: output topics the request's identity (`OUTPUT_KEY`, `output_key`).
    key: str = "request_id (UTF-8 string bytes)"
    #: The Avro record (schemas/<value_schema>.avsc) of every value.
    value_schema: str
    description: str
    #: Largest record batch the topic accepts (`max.message.bytes`); None: broker default (1 MiB).
    max_message_bytes: int | None = None
    #: Whose clock a record's timestamp is (`message.timestamp.type`): the broker's
    #: `LogAppendTime` on the raw topics, the input clock by which quiet requests
    #: are closed (no producer can set it); None: the broker default (CreateTime).
    timestamp_type: TimestampType | None = None
    #: In-sync replicas an ``acks=all`` write needs (`min.insync.replicas`) once the topic
    #: has more copies than that; see `min_insync`.  2 on the topics the worker writes (a
    #: write then waits rather than rest on one broker), 1 on the raw topics (producers
    #: keep writing while one replica is left).
    min_insync_replicas: int = 1
    #: How long a segment stays open before it rolls (`segment.ms`); None: the broker
    #: default (7 days).  Retention deletes whole segments, so a record can be read for
    #: up to `retention_ms` + `segment_ms`: the raw topics roll daily, which bounds that
    #: to 8 days, the default state TTL of Redis (`Settings.state_ttl`).
    segment_ms: int | None = None

    def __post_init__(self) -> None:
        if not self.name or any(not (c.isalnum() or c in "._-") for c in self.name):
            raise ValueError(f"bad topic name {self.name!r}")
        if self.partitions < 1 or self.replication_factor < 1 or self.min_insync_replicas < 1:
            raise ValueError(
                f"{self.name}: partitions, replication_factor and min_insync_replicas must be >= 1"
            )
        if self.retention_ms < FOREVER or self.retention_ms == 0:
            raise ValueError(f"{self.name}: retention_ms must be -1 (forever) or > 0")
        if self.cleanup_policy not in ("delete", "compact"):
            raise ValueError(f"{self.name}: cleanup_policy must be delete or compact")
        if self.segment_ms is not None and self.segment_ms < 1:
            raise ValueError(f"{self.name}: segment_ms must be > 0")

    @property
    def min_insync(self) -> int:
        """The topic's ``min.insync.replicas``: `min_insync_for` its copies."""
        return min_insync_for(self.replication_factor, self.min_insync_replicas)

    def on_cluster(self, brokers: int) -> Topic:
        """This topic as created on a cluster of `brokers` brokers (`replication_factor_for`)."""
        wanted = max(self.replication_factor, replication_factor_for(brokers))
        return dataclasses.replace(self, replication_factor=wanted)

    def config(self) -> dict[str, str]:
        """The topic-level Kafka configs, as strings (what `kafka-topics --config` takes).

        ``min.insync.replicas`` is given only above the broker default of 1.
        """
        out = {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
        }
        if self.min_insync > 1:
            out["min.insync.replicas"] = str(self.min_insync)
        if self.max_message_bytes is not None:
            out["max.message.bytes"] = str(self.max_message_bytes)
        if self.timestamp_type is not None:
            out["message.timestamp.type"] = self.timestamp_type
        if self.segment_ms is not None:
            out["segment.ms"] = str(self.segment_ms)
        return out


_RAW_SSE: Final = Topic(
    name="raw.sse",
    partitions=6,
    retention_ms=7 * DAY_MS,
    segment_ms=DAY_MS,
    timestamp_type="LogAppendTime",
    value_schema="RawSseEvent",
    max_message_bytes=RAW_MAX_MESSAGE_BYTES,
    description=(
        "Every server-sent event of every provider stream, as received, then an END marker "
        "per request. The audit record: chunks can be rebuilt from it for 7 days."
    ),
)

_RAW_ENGINE: Final = Topic(
    name="raw.engine",
    partitions=6,
    retention_ms=7 * DAY_MS,
    segment_ms=DAY_MS,
    timestamp_type="LogAppendTime",
    value_schema="RawEngineOutput",
    max_message_bytes=RAW_MAX_MESSAGE_BYTES,
    description=(
        "Every inference-engine output (Dynamo LLMEngineOutput, vLLM RequestOutput, "
        "atomr TokenChunk), as received, then an END marker per request."
    ),
)

#: The key of the output topics (`output_key`).
OUTPUT_KEY: Final = "tenant:request_id (RequestRef.text as UTF-8 bytes; partitioned by request_id)"

_CHUNKS: Final = Topic(
    name="chunks",
    partitions=6,
    retention_ms=7 * DAY_MS,
    key=OUTPUT_KEY,
    value_schema="Chunk",
    description=(
        "One normalised Chunk per raw event that carried anything, in request order (its "
        "content cut to 4 MiB: the chunk of an event joined from part records)."
    ),
    max_message_bytes=8 * MIB,
    min_insync_replicas=OUTPUT_MIN_INSYNC,
)

_TOKENS: Final = Topic(
    name="tokens",
    partitions=6,
    retention_ms=FOREVER,
    cleanup_policy="compact",
    key=OUTPUT_KEY,
    value_schema="Tokens",
    description=(
        "The final Tokens record of each request. Compacted: the latest record per request "
        "(tenant and request id) is kept forever; a tombstone (null value) deletes a request."
    ),
    max_message_bytes=8 * MIB,
    min_insync_replicas=OUTPUT_MIN_INSYNC,
)

_BILLING: Final = Topic(
    name="billing",
    partitions=6,
    retention_ms=FOREVER,
    key=OUTPUT_KEY,
    value_schema="BillingEvent",
    description=(
        "One priced BillingEvent per finished request; kept forever. Consumers drop "
        "replays by event_id (the deterministic idempotency key)."
    ),
    min_insync_replicas=OUTPUT_MIN_INSYNC,
)

_DEADLETTER: Final = Topic(
    name="deadletter",
    partitions=1,
    retention_ms=30 * DAY_MS,
    value_schema="DeadLetter",
    description=(
        "Records no processor could handle (bad Avro, unknown fingerprint, invalid event), "
        "with the original key and value bytes and the reason. Keyed by the original key."
    ),
    max_message_bytes=16 * MIB,
    min_insync_replicas=OUTPUT_MIN_INSYNC,
)

_CORRECTIONS: Final = Topic(
    name="billing.corrections",
    partitions=1,
    retention_ms=FOREVER,
    key="tenant:request_id of the request corrected (as the billing topic), or the usage row",
    value_schema="BillingCorrection",
    description=(
        "Append-only corrections of the billing topic, written only by `streamtally audit "
        "--correct`: one per discrepancy, naming the event_id it supersedes and the bill that "
        "stands. One partition: corrections apply in the order written. Kept forever."
    ),
    min_insync_replicas=OUTPUT_MIN_INSYNC,
)

#: Every topic as declared (names inside a namespace), in pipeline order.
DECLARED: Final = (_RAW_SSE, _RAW_ENGINE, _CHUNKS, _TOKENS, _BILLING, _DEADLETTER, _CORRECTIONS)


@dataclass(frozen=True, slots=True)
class Topics:
    """The topics of one namespace (one deployment), with their full names."""

    namespace: str
    raw_sse: Topic
    raw_engine: Topic
    chunks: Topic
    tokens: Topic
    billing: Topic
    deadletter: Topic
    corrections: Topic

    @classmethod
    def in_namespace(cls, namespace: str = DEFAULT_NAMESPACE) -> Topics:
        """The declared topics, named ``{namespace}.{name}``."""
        if not namespace or any(not (c.isalnum() or c in "._-") for c in namespace):
            raise ValueError(f"bad namespace {namespace!r}: letters, digits, '.', '_', '-'")
        named = [dataclasses.replace(t, name=f"{namespace}.{t.name}") for t in DECLARED]
        return cls(namespace, *named)

    @property
    def all(self) -> tuple[Topic, ...]:
        """Every topic, in pipeline order."""
        return (
            self.raw_sse,
            self.raw_engine,
            self.chunks,
            self.tokens,
            self.billing,
            self.deadletter,
            self.corrections,
        )

    @property
    def raw(self) -> tuple[Topic, Topic]:
        """The two topics producers write and the processors read."""
        return (self.raw_sse, self.raw_engine)

    @property
    def outputs(self) -> tuple[Topic, Topic, Topic, Topic]:
        """The topics the worker writes."""
        return (self.chunks, self.tokens, self.billing, self.deadletter)

    @property
    def processors_group(self) -> str:
        """The processors' consumer group."""
        return f"{self.namespace}.processors"

    @property
    def worker_app_id(self) -> str:
        """The faust app id of the worker."""
        return f"{self.namespace}.worker"

    def by_name(self, name: str) -> Topic:
        """The topic called `name` (its full name)."""
        for topic in self.all:
            if topic.name == name:
                return topic
        known = ", ".join(t.name for t in self.all)
        raise KeyError(f"no topic {name!r}; known: {known}")


def kafka_config(topic: Topic) -> dict[str, str]:
    """The topic-level Kafka configs of `topic` (`cleanup.policy`, `retention.ms`, ...)."""
    return topic.config()


def encode_key(request_id: str) -> bytes:
    """The Kafka key of a request's records: its id as UTF-8 bytes."""
    if not request_id:
        raise ValueError("a request id must not be empty")
    return request_id.encode("utf-8")


def output_key(ref: RequestRef) -> bytes:
    """The Kafka key of a request's outputs: its identity (`RequestRef.text`) as UTF-8 bytes.

    Partition them by `encode_key` of the request id, as the raw records are.
    """
    if not ref.request_id:
        raise ValueError("a request id must not be empty")
    return ref.text.encode("utf-8")


def decode_key(key: bytes | None) -> str:
    """The request id a Kafka key holds; `InputError` if there is none or it is not UTF-8."""
    if not key:
        raise InputError("record has no key (the request id)")
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"record key is not UTF-8: {key[:32]!r}") from exc
