"""Plain records of the Kafka topics that are not a model: raw events, billing, dead letters.

They are frozen dataclasses that check their own invariants; `streamtally.wire.avro`
encodes and decodes them (`encode_raw_sse_event`, `decode_billing_event`, ...).
This module does not import fastavro.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from dataclasses import field as dataclass_field
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final

from streamtally.core.models import USAGE_FIELDS, FinishReason, Source, Usage, utc_now
from streamtally.core.money import COST_PRECISION, COST_SCALE, scaled_cost

__all__ = [
    "CANCELLED_END",
    "CORRECTION_REASONS",
    "COST_PRECISION",
    "COST_SCALE",
    "ENGINE_PAYLOAD_TYPES",
    "KEEPALIVE_EVENT",
    "PART_BYTES",
    "PART_EVENT",
    "BillingCorrection",
    "BillingEvent",
    "DeadLetter",
    "EventKind",
    "Provenance",
    "RawEngineOutput",
    "RawSseEvent",
    "UsageSource",
    "scaled_cost",
]


#: The Avro record each engine source's payload is (`RawEngineOutput.payload`).
ENGINE_PAYLOAD_TYPES: Final = MappingProxyType(
    {
        Source.DYNAMO: "LLMEngineOutput",
        Source.VLLM: "RequestOutput",
        Source.ATOMR: "TokenChunk",
    }
)


class EventKind(StrEnum):
    """What a raw record is: one event of the request, or its end-of-stream marker."""

    EVENT = "event"
    END = "end"


class UsageSource(StrEnum):
    """Where a billed request's usage came from (`BillingEvent.usage_source`, Avro `UsageSource`).

    `MISSING` is a request whose stream never reported usage: its counts are 0 because
    nothing was reported, which a request that used 0 tokens (`PROVIDER_REPORTED` or
    `ENGINE_COUNTED` with zeros) is not.  `UNKNOWN` is never written by the worker: it is
    what an event written before the field existed (BillingEvent v1, v2) reads as, and
    says that the event carries no provenance at all.
    """

    UNKNOWN = "unknown"
    #: Usage reported in the stream: an SSE usage object, Dynamo `completion_usage`, atomr
    #: `usage`.
    PROVIDER_REPORTED = "provider_reported"
    #: Counted by the engine adapter from the token ids the engine emitted (vLLM always,
    #: Dynamo while it reports no `completion_usage`).
    ENGINE_COUNTED = "engine_counted"
    #: No usage at all in the stream: the counts are 0 by absence.
    MISSING = "missing"
    #: Cancelled (its END marker says so: the client went away, the upstream was aborted)
    #: before the provider reported usage: billed with the counts it had, which are 0 for
    #: a provider stream and what the engine emitted for an engine stream (BillingEvent
    #: v4; a reader of an earlier version resolves it to UNKNOWN).
    ABORTED = "aborted"


_HEX: Final = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True, kw_only=True)
class Provenance:
    """What a billing event was folded from (`BillingEvent` version 3).

    The raw topic and partition of the request, the lowest and highest offsets of its
    applied raw records (None when none was applied), `raw_sha256` over those records'
    values (`streamtally.wire.provenance.raw_sha256`), and where its usage came from.
    """

    raw_topic: str
    raw_partition: int
    first_offset: int | None
    last_offset: int | None
    raw_sha256: str
    usage_source: UsageSource


#: The `event` of an SSE END marker that says the request was cancelled (its client went
#: away mid-stream): the worker closes it `cancelled` with the usage seen so far.  Plain END
#: markers carry "message".  No schema change: a reader that does not know it sees an END.
CANCELLED_END: Final = "cancelled"

#: The `event` of a part record: an SSE event too large for one raw record is sent as
#: several records with consecutive sequence numbers, each but the last one a part whose
#: `data` is the next slice of the event's data; the last one carries the event's own
#: name, id and its final slice.  The worker joins them into the one event (no schema
#: change: the name is reserved, no provider sends it).
PART_EVENT: Final = "streamtally.part"
#: UTF-8 bytes of data a part record carries at most (the tap's slice size): far below the
#: raw topics' ``max.message.bytes`` (`streamtally.topics`), so that a part always fits.
PART_BYTES: Final = 512 << 10
#: The `event` of an SSE keep-alive record: the tap sends one (``data`` empty) for a call
#: in flight that produced no record for a while, so that the worker does not take a call
#: waiting on a slow upstream (a reasoning model) for one whose producer died.  The worker
#: applies it in sequence order (counted, in the provenance, no chunk) and it moves the
#: request's quiet time; nothing else.  An engine keep-alive is an EVENT without a payload
#: (`RawEngineOutput.is_keepalive`).  No schema change: the name is reserved, no provider
#: sends it.  A worker older than it feeds an SSE keep-alive to the adapter, which makes
#: nothing of an event without data (the same bill); it refuses an engine one and then
#: waits for its sequence number (closed over the gap): upgrade workers first.
KEEPALIVE_EVENT: Final = "streamtally.keepalive"


def _check_common(request_id: str, seq: int, received_at: datetime) -> None:
    if not request_id:
        raise ValueError("request_id must not be empty")
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    _check_aware("received_at", received_at)


def _check_aware(name: str, value: datetime) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RawSseEvent:
    """One dispatched server-sent event of a provider stream (topic `streamtally.raw.sse`).

    `kind=END` is the end-of-stream marker the producer writes after the
    request's last event; it carries no event (`event="message"`, `data=""`).
    An END whose `event` is `CANCELLED_END` marks a request cancelled
    mid-stream (`RawSseEvent.end(..., cancelled=True)`, `cancelled`).
    """

    request_id: str
    seq: int
    source: Source
    tenant: str
    received_at: datetime
    kind: EventKind = EventKind.EVENT
    event: str = "message"
    data: str = ""
    sse_id: str | None = None

    def __post_init__(self) -> None:
        _check_common(self.request_id, self.seq, self.received_at)
        if not self.source.is_sse:
            raise ValueError(f"source {self.source.value!r} is not an SSE source")

    @property
    def cancelled(self) -> bool:
        """True for the END marker of a request cancelled mid-stream."""
        return self.kind is EventKind.END and self.event == CANCELLED_END

    @property
    def is_keepalive(self) -> bool:
        """True for a keep-alive record (`KEEPALIVE_EVENT`): the call is still in flight."""
        return self.kind is EventKind.EVENT and self.event == KEEPALIVE_EVENT

    @classmethod
    def keepalive(
        cls, *, request_id: str, seq: int, source: Source, tenant: str, received_at: datetime
    ) -> RawSseEvent:
        """A keep-alive record of a request in flight (`KEEPALIVE_EVENT`, no data)."""
        return cls(
            request_id=request_id,
            seq=seq,
            source=source,
            tenant=tenant,
            received_at=received_at,
            event=KEEPALIVE_EVENT,
        )

    @classmethod
    def end(
        cls,
        *,
        request_id: str,
        seq: int,
        source: Source,
        tenant: str,
        received_at: datetime,
        cancelled: bool = False,
    ) -> RawSseEvent:
        """The end-of-stream marker of a request; `cancelled`: its client went away."""
        return cls(
            request_id=request_id,
            seq=seq,
            source=source,
            tenant=tenant,
            received_at=received_at,
            kind=EventKind.END,
            event=CANCELLED_END if cancelled else "message",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RawEngineOutput:
    """One inference-engine output of a request (topic `streamtally.raw.engine`).

    `payload` is the engine's output as a plain dict, exactly what one JSON
    line of that engine parses to (fields streamtally does not keep are
    dropped on encoding; absent ones decode as their default): a Dynamo
    `LLMEngineOutput` for `dynamo`, a vLLM `RequestOutput` for `vllm`, an atomr
    `TokenChunk` for `atomr`.  It is None for the `END` marker, and for a keep-alive:
    an EVENT without a payload (`is_keepalive`, see `KEEPALIVE_EVENT`; no schema change,
    the payload is a union with null).  Being a dict, it makes the record unhashable.
    """

    request_id: str
    seq: int
    source: Source
    tenant: str
    received_at: datetime
    kind: EventKind = EventKind.EVENT
    payload: dict[str, Any] | None = field(default=None)
    #: The model the engine served (engine outputs do not say; the producer does).
    model: str | None = None
    #: An END marker of a request cancelled mid-stream (its client went away): the worker
    #: closes it `cancelled` with the usage seen so far (RawEngineOutput version 3).
    cancelled: bool = False

    def __post_init__(self) -> None:
        _check_common(self.request_id, self.seq, self.received_at)
        if self.source not in ENGINE_PAYLOAD_TYPES:
            raise ValueError(f"source {self.source.value!r} is not an engine source")
        if self.kind is EventKind.END and self.payload is not None:
            raise ValueError("an END marker carries no payload")
        if not isinstance(self.cancelled, bool) or (
            self.cancelled and self.kind is not EventKind.END
        ):
            raise ValueError("only an END marker can be cancelled (a bool)")

    @property
    def is_keepalive(self) -> bool:
        """True for a keep-alive record: an EVENT without a payload (`KEEPALIVE_EVENT`)."""
        return self.kind is EventKind.EVENT and self.payload is None

    @classmethod
    def keepalive(
        cls,
        *,
        request_id: str,
        seq: int,
        source: Source,
        tenant: str,
        received_at: datetime,
        model: str | None = None,
    ) -> RawEngineOutput:
        """A keep-alive record of a request in flight: an EVENT without a payload."""
        return cls(
            request_id=request_id,
            seq=seq,
            source=source,
            tenant=tenant,
            received_at=received_at,
            model=model,
        )

    @property
    def payload_type(self) -> str:
        """The Avro record of the payload: `LLMEngineOutput`, `RequestOutput` or `TokenChunk`."""
        return ENGINE_PAYLOAD_TYPES[self.source]

    @classmethod
    def end(
        cls,
        *,
        request_id: str,
        seq: int,
        source: Source,
        tenant: str,
        received_at: datetime,
        model: str | None = None,
        cancelled: bool = False,
    ) -> RawEngineOutput:
        """The end-of-stream marker of a request; `cancelled`: its client went away."""
        return cls(
            request_id=request_id,
            seq=seq,
            source=source,
            tenant=tenant,
            received_at=received_at,
            kind=EventKind.END,
            model=model,
            cancelled=cancelled,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BillingEvent:
    """The billable outcome of one request, priced (topic `streamtally.billing`).

    `cost` is an exact `Decimal` with at most 12 decimal places and 38 digits
    (Avro decimal(38, 12)); floats are refused.  `priced` is False when the
    request could not be priced (its model matches no price table entry, or
    its cost does not fit decimal(38, 12)); its cost is then 0, which is
    checked.  `event_id` is the deterministic idempotency key computed by
    whoever prices the request.
    """

    event_id: str
    request_id: str
    tenant: str
    model: str | None
    source: Source
    finish_reason: FinishReason
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    cost: Decimal
    #: False: the request is unpriced and `cost` is 0 (events older than the field read True).
    priced: bool = True
    currency: str = "USD"
    price_table_version: str
    event_time: datetime
    # -- provenance (BillingEvent v3; an older event reads as None / UNKNOWN: none) ----------
    #: The raw topic and partition the request was folded from.
    raw_topic: str | None = None
    raw_partition: int | None = None
    #: Lowest and highest offsets of the raw records applied to the request.
    first_offset: int | None = None
    last_offset: int | None = None
    #: `streamtally.wire.provenance.raw_sha256` of those records' values.
    raw_sha256: str | None = None
    #: Where the usage came from; UNKNOWN: an event with no provenance (before v3).
    usage_source: UsageSource = UsageSource.UNKNOWN
    #: The provider's own id of the call, as its stream named it (BillingEvent v4): the
    #: same as `request_id` when the producer keyed the request by it; None when the
    #: stream named none, and in events written before v4.  Not part of `event_id`.
    provider_request_id: str | None = None
    # -- revisions (BillingEvent v5; an older event reads as revision 0, superseding none) --
    #: 0: the bill made when the request first closed; n > 0: its n-th amendment (records
    #: that came after a close at its timeout or over a gap).  The highest revision of a
    #: request is the bill that stands (the rule, with corrections: `streamtally.billing.ledger`);
    #: each carries the whole usage, not a difference.
    revision: int = 0
    #: The `event_id` of revision ``revision - 1``, which this one replaces (None for 0).
    supersedes: str | None = None

    def __post_init__(self) -> None:
        if not self.event_id:
            raise ValueError("event_id must not be empty")
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if isinstance(self.revision, bool) or not isinstance(self.revision, int):
            raise ValueError(f"revision must be an int, got {self.revision!r}")
        if not 0 <= self.revision < 1 << 31:
            raise ValueError(f"revision must be in [0, 2**31), got {self.revision}")
        if (self.revision == 0) != (self.supersedes is None):
            raise ValueError(
                f"revision {self.revision} with supersedes={self.supersedes!r}: revision 0 "
                "supersedes nothing, and every later revision names the one it replaces"
            )
        if self.supersedes is not None and not isinstance(self.supersedes, str):
            raise ValueError(f"supersedes must be None or a str, got {self.supersedes!r}")
        if self.provider_request_id is not None and not isinstance(self.provider_request_id, str):
            raise ValueError(
                f"provider_request_id must be None or a str, got {self.provider_request_id!r}"
            )
        for name in USAGE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        scaled_cost(self.cost)
        if not isinstance(self.priced, bool):
            raise ValueError(f"priced must be a bool, got {self.priced!r}")
        if not self.priced and self.cost != 0:
            raise ValueError(f"an unpriced event has cost 0, got {self.cost}")
        _check_aware("event_time", self.event_time)
        self._check_provenance()

    def _check_provenance(self) -> None:
        if not isinstance(self.usage_source, UsageSource):
            raise ValueError(f"usage_source must be a UsageSource, got {self.usage_source!r}")
        for name in ("raw_partition", "first_offset", "last_offset"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        if (self.first_offset is None) != (self.last_offset is None):
            raise ValueError("first_offset and last_offset are both set or both None")
        if (
            self.first_offset is not None
            and self.last_offset is not None
            and self.first_offset > self.last_offset
        ):
            raise ValueError(
                f"first_offset {self.first_offset} is after last_offset {self.last_offset}"
            )
        digest = self.raw_sha256
        if digest is not None and (len(digest) != 64 or not _HEX.issuperset(digest)):
            raise ValueError(f"raw_sha256 must be 64 lower-case hex digits, got {digest!r}")

    @property
    def has_provenance(self) -> bool:
        """Whether the event says what it was folded from (False: written before v3)."""
        return self.usage_source is not UsageSource.UNKNOWN

    @property
    def usage(self) -> Usage:
        """The five usage fields as a `Usage`."""
        return Usage(**self.usage_counts())

    def usage_counts(self) -> dict[str, int]:
        """The five usage fields by name, in `USAGE_FIELDS` order."""
        return {name: getattr(self, name) for name in USAGE_FIELDS}


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """A record no processor could handle, with its original bytes (`streamtally.deadletter`)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    reason: str
    error_type: str
    source: str | None = None
    request_id: str | None = None
    dead_lettered_at: datetime

    def __post_init__(self) -> None:
        _check_aware("dead_lettered_at", self.dead_lettered_at)

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes,
        source: str | None = None,
        request_id: str | None = None,
        at: datetime | None = None,
    ) -> DeadLetter:
        """The dead letter of a record whose processing raised `exc`.

        `reason` is `str(exc)` and `error_type` its class name.  When no
        `request_id` is given it is taken from the key (a UTF-8 request id on
        every streamtally topic) if the key decodes.
        """
        if request_id is None and key:
            try:
                request_id = key.decode("utf-8")
            except UnicodeDecodeError:
                request_id = None
        return cls(
            topic=topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            reason=str(exc) or type(exc).__name__,
            error_type=type(exc).__name__,
            source=source,
            request_id=request_id,
            dead_lettered_at=at if at is not None else utc_now(),
        )


# --- the corrections topic -------------------------------------------------

#: The discrepancy kinds a correction can be for (`streamtally.audit.Kind` values).
CORRECTION_REASONS: Final = frozenset(
    {
        "missing_billing",
        "unexpected_billing",
        "conflicting_billing",
        "usage_mismatch",
        "cost_mismatch",
        "provenance_mismatch",
        "usage_row_mismatch",
        "unbilled_amendment",
    }
)


def _is_id(text: str) -> bool:
    return len(text) == 32 and _HEX.issuperset(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class BillingCorrection:
    """One correction (value of ``<namespace>.billing.corrections``): its meaning and how a
    billing consumer applies it are in `streamtally.billing.corrections`."""

    correction_id: str
    audit_id: str
    reason: str
    field: str | None = None
    tenant: str
    request_id: str | None = None
    model: str | None = None
    day: str | None = None
    #: The discrepancy's expected and found values as JSON text (None: absent).
    expected: str | None = None
    found: str | None = None
    superseded_event_id: str | None = None
    #: Billing partition -> its end offset at the audit's snapshot.
    billing_before: Mapping[int, int] = dataclass_field(
        default_factory=lambda: MappingProxyType({})
    )
    corrected: BillingEvent | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    requests: int = 0
    cost: Decimal = Decimal(0)
    currency: str = "USD"
    created_at: datetime

    def __post_init__(self) -> None:
        for name in ("correction_id", "audit_id"):
            if not _is_id(getattr(self, name)):
                raise ValueError(f"{name} must be 32 lower-case hex digits")
        if self.reason not in CORRECTION_REASONS:
            raise ValueError(f"unknown correction reason {self.reason!r}")
        if not self.tenant:
            raise ValueError("tenant must not be empty")
        row = self.request_id is None
        if row and (self.day is None or self.corrected is not None):
            raise ValueError("a usage row correction names its day and carries no bill")
        if not row and self.day is not None:
            raise ValueError("a request correction names no day")
        if self.superseded_event_id is None and self.corrected is None and not row:
            raise ValueError("a request correction supersedes a bill, or carries one")
        for name in (*USAGE_FIELDS, "requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        scaled_cost(self.cost)
        for partition, offset in self.billing_before.items():
            if partition < 0 or offset < 0:
                raise ValueError("billing_before holds partitions and offsets >= 0")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")

    def supersedes(self, event_id: str, partition: int, offset: int) -> bool:
        """Whether the billing event `event_id` at (`partition`, `offset`) is superseded."""
        return event_id == self.superseded_event_id and self.covers(partition, offset)

    def covers(self, partition: int, offset: int) -> bool:
        """Whether the audit saw the billing record at (`partition`, `offset`): below
        `billing_before` (a record at or past it was written after the audit)."""
        return offset < self.billing_before.get(partition, 0)

    @property
    def names(self) -> str | None:
        """The event id this correction decides: `superseded_event_id`, or for a missing
        bill its `corrected` bill's id; None for a usage row correction."""
        if self.superseded_event_id is not None:
            return self.superseded_event_id
        return None if self.corrected is None else self.corrected.event_id
