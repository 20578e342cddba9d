"""The Kafka topics of streamtally, declared as frozen data.

Keys: every record on every topic is keyed by its request id, encoded as the
UTF-8 bytes of the string (no Avro, no length prefix, no framing):
`encode_key("chatcmpl-1") == b"chatcmpl-1"`.  Keying by request id puts all
of a request's records on one partition, in order, and since every topic
uses the default partitioner over the same key, topics with the same number
of partitions are co-partitioned (a request lands on the same partition
number everywhere).  The dead-letter topic keeps the key of the record it
holds.

Values: Avro single-object encoding of the topic's `value_schema` (see
`streamtally.wire.avro` and docs/avro-framing.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final, Literal

from streamtally.errors import InputError

__all__ = [
    "ALL_TOPICS",
    "BILLING",
    "CHUNKS",
    "DAY_MS",
    "DEADLETTER",
    "FOREVER",
    "MIB",
    "NAMESPACE",
    "RAW_ENGINE",
    "RAW_SSE",
    "TOKENS",
    "Topic",
    "by_name",
    "decode_key",
    "encode_key",
    "kafka_config",
]

#: Prefix of every topic name (and the worker's consumer group).  Read once from
#: `STREAMTALLY_NAMESPACE` so that a test or a second deployment can share a broker.
NAMESPACE: Final = os.environ.get("STREAMTALLY_NAMESPACE", "streamtally")

DAY_MS: Final = 24 * 60 * 60 * 1000
#: `retention.ms` meaning "keep forever".
FOREVER: Final = -1
MIB: Final = 1024 * 1024

CleanupPolicy = Literal["delete", "compact"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Topic:
    """One Kafka topic: its name, layout, retention and what its records hold."""

    name: str
    partitions: int
    replication_factor: int = 1
    retention_ms: int
    cleanup_policy: CleanupPolicy = "delete"
    #: What the key is: always the request id as UTF-8 string bytes (`encode_key`).
    key: str = "request_id (UTF-8 string bytes)"
    #: The Avro record (schemas/<value_schema>.avsc) of every value.
    value_schema: str
    description: str
    #: Largest record batch the topic accepts (`max.message.bytes`); None: broker default (1 MiB).
    max_message_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.name or any(not (c.isalnum() or c in "._-") for c in self.name):
            raise ValueError(f"bad topic name {self.name!r}")
        if self.partitions < 1 or self.replication_factor < 1:
            raise ValueError(f"{self.name}: partitions and replication_factor must be >= 1")
        if self.retention_ms < FOREVER or self.retention_ms == 0:
            raise ValueError(f"{self.name}: retention_ms must be -1 (forever) or > 0")
        if self.cleanup_policy not in ("delete", "compact"):
            raise ValueError(f"{self.name}: cleanup_policy must be delete or compact")

    def config(self) -> dict[str, str]:
        """The topic-level Kafka configs, as strings (what `kafka-topics --config` takes)."""
        out = {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
        }
        if self.max_message_bytes is not None:
            out["max.message.bytes"] = str(self.max_message_bytes)
        return out


RAW_SSE: Final = Topic(
    name=f"{NAMESPACE}.raw.sse",
    partitions=6,
    retention_ms=7 * DAY_MS,
    value_schema="RawSseEvent",
    description=(
        "Every server-sent event of every provider stream, as received, then an END marker "
        "per request. The audit record: chunks can be rebuilt from it for 7 days."
    ),
)

RAW_ENGINE: Final = Topic(
    name=f"{NAMESPACE}.raw.engine",
    partitions=6,
    retention_ms=7 * DAY_MS,
    value_schema="RawEngineOutput",
    description=(
        "Every inference-engine output (Dynamo LLMEngineOutput, vLLM RequestOutput, "
        "atomr TokenChunk), as received, then an END marker per request."
    ),
)

CHUNKS: Final = Topic(
    name=f"{NAMESPACE}.chunks",
    partitions=6,
    retention_ms=7 * DAY_MS,
    value_schema="Chunk",
    description="One normalised Chunk per raw event that carried anything, in request order.",
)

TOKENS: Final = Topic(
    name=f"{NAMESPACE}.tokens",
    partitions=6,
    retention_ms=FOREVER,
    cleanup_policy="compact",
    value_schema="Tokens",
    description=(
        "The final Tokens record of each request. Compacted: the latest record per request id "
        "is kept forever; a tombstone (null value) deletes a request."
    ),
    max_message_bytes=8 * MIB,
)

BILLING: Final = Topic(
    name=f"{NAMESPACE}.billing",
    partitions=6,
    retention_ms=FOREVER,
    value_schema="BillingEvent",
    description=(
        "One priced BillingEvent per finished request; kept forever. Consumers drop "
        "replays by event_id (the deterministic idempotency key)."
    ),
)

DEADLETTER: Final = Topic(
    name=f"{NAMESPACE}.deadletter",
    partitions=1,
    retention_ms=30 * DAY_MS,
    value_schema="DeadLetter",
    description=(
        "Records no processor could handle (bad Avro, unknown fingerprint, invalid event), "
        "with the original key and value bytes and the reason. Keyed by the original key."
    ),
    max_message_bytes=16 * MIB,
)

#: Every topic, in pipeline order.
ALL_TOPICS: Final = (RAW_SSE, RAW_ENGINE, CHUNKS, TOKENS, BILLING, DEADLETTER)

_BY_NAME: Final = {t.name: t for t in ALL_TOPICS}


def by_name(name: str) -> Topic:
    """The topic called `name`."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no topic {name!r}; known: {', '.join(_BY_NAME)}") from None


def kafka_config(topic: Topic) -> dict[str, str]:
    """The topic-level Kafka configs of `topic` (`cleanup.policy`, `retention.ms`, ...)."""
    return topic.config()


def encode_key(request_id: str) -> bytes:
    """The Kafka key of a request's records: its id as UTF-8 bytes."""
    if not request_id:
        raise ValueError("a request id must not be empty")
    return request_id.encode("utf-8")


def decode_key(key: bytes | None) -> str:
    """The request id a Kafka key holds; `InputError` if there is none or it is not UTF-8."""
    if not key:
        raise InputError("record has no key (the request id)")
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"record key is not UTF-8: {key[:32]!r}") from exc
