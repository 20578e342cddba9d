"""Rebuilding the Redis state from Kafka: the Tokens topic joined with the billing topic.

Redis holds, per finished request, its Tokens JSON and its share of a usage
row (``st:usage:{day}:{tenant}:{model}``).  Kafka holds the same facts for
ever: the compacted Tokens topic keeps the latest `Tokens` of every request,
the billing topic every `BillingEvent` (tenant, event time, cost).  So when
Redis is lost, `streamtally rebuild` reads both topics to their current end,
joins them by request (`join`, a pure function), a request being its tenant
and its request id together (`RequestRef`), and writes each request through
the worker's own sink (`apply`: `streamtally.store.RedisSink`, one atomic,
idempotent script call per batch).

Join rules (`join`):

* Tokens records name their request by their key.  A record is keyed by
  `RequestRef.text` (``acme:chatcmpl-1``, written since keys carry the
  tenant: "v2") or, when written by an earlier version ("v1"), by the request
  id alone, the tenant unknown.  A record whose key equals its value's
  request id is v1; any other key must parse as a `RequestRef` of the value's
  request id, or the record is undecodable ("keyed X but holds Y").  A
  tombstone or a value that does not decode is v2 when its key parses as a
  `RequestRef`, else v1.
* Tokens: the latest record per key wins (what compaction keeps); a
  tombstone (null value) deletes the request, a record that does not decode
  makes it unknown; both are reported and skipped.
* A v1 record of request id R belongs to the one tenant whose billing events
  name R: it joins that tenant's events, unless a later v2 record of the same
  request supersedes it (an earlier v2 record is superseded by it).  A v1
  record of an id no tenant was billed for is reported with its tenant
  unknown; one of an id billed to several tenants is reported and skipped
  (`SkipReason.AMBIGUOUS`): nothing says whose it is (unless every one of
  those tenants has a later v2 record, which supersedes it whichever it was).
* Billing: every event names its own request (``tenant``, ``request_id``).
  Events are deduplicated by ``event_id`` (the first one wins, as every
  billing consumer does); a request with several distinct events is
  reported and skipped.
* A request with Tokens but no billing event, or the reverse, is reported and
  skipped (the worker sends both in one flush, so this is a request caught
  mid-flush, or a topic truncated by hand); so is one whose billing event
  does not match its Tokens (model or usage).

What is rebuilt and what is not:

* ``st:tokens:{ref}``, the usage rows and ``st:usage:rows``: exactly as the
  worker wrote them (same Tokens JSON, same row, same cost, and the row's
  ``unpriced_requests`` from each billing event's ``priced``), and
  ``st:stats`` ``requests`` (+1 per request applied).  A billing event
  written before ``priced`` existed (BillingEvent v1) reads as priced, so a
  request billed unpriced by such an old worker (cost 0) is not counted in
  ``unpriced_requests`` by the rebuild: the event cannot tell.
* ``st:closed`` field ``{ref}``: the worker's closing marker ("offset
  reason") names the offset of the request's last raw record, which neither
  topic carries; the rebuild writes ``"0 end"`` (`CLOSED_MARKER`).  A request
  is never counted twice whatever its marker (its Tokens key is the
  idempotency marker), but should the worker read a raw record of a rebuilt
  request again (its consumer group reset to earlier offsets), that record is
  dead-lettered as late instead of being dropped as a replay.
* ``st:stats`` ``records``, ``duplicates`` and ``dead_lettered`` and the set
  ``st:deadletter:seen`` count raw records; they cannot be rebuilt from these
  topics and are not restored (the rebuild adds 0 to them).

``{ref}`` is `RequestRef.text` (Redis layout version 2,
`streamtally.store.layout`).  `apply` first makes sure Redis is of that
layout (`RedisStore.ensure_layout`: it claims an empty Redis and raises
`LayoutError` on data of layout version 1, which ``streamtally migrate``
converts first).

Both topics are read to their end before anything is written, and held in
memory: the latest Tokens of every request and every billing event.

Requests already in Redis are left untouched (the sink skips a request whose
Tokens key exists), so a rebuild is safe to run at any time, also next to a
running worker, and running it twice changes nothing the second time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from streamtally.core.identity import RequestRef
from streamtally.core.models import Tokens
from streamtally.errors import InputError
from streamtally.store import RedisSink, RedisStore
from streamtally.topics import decode_key
from streamtally.wire.avro import AvroDecodeError, decode_billing_event, decode_tokens
from streamtally.wire.kafka import read_topic
from streamtally.wire.records import BillingEvent

__all__ = [
    "BATCH_SIZE",
    "CLOSED_MARKER",
    "Applied",
    "Inputs",
    "Plan",
    "Request",
    "SkipReason",
    "Skipped",
    "TokensRecord",
    "apply",
    "join",
    "read_inputs",
]

#: The closing marker ("offset reason") written for every rebuilt request.
CLOSED_MARKER: Final = "0 end"
#: Requests per sink flush (one Lua script call each).
BATCH_SIZE: Final = 500

#: The detail of a skipped v1 Tokens record whose tenant nothing tells.
_V1_RECORD: Final = "v1 record, keyed by the request id alone: tenant unknown"


class SkipReason(StrEnum):
    """Why a request was not rebuilt."""

    NO_BILLING = "tokens without billing event"
    NO_TOKENS = "billing event without tokens"
    DELETED = "deleted (tombstone on the tokens topic)"
    MISMATCH = "billing event does not match tokens"
    CONFLICT = "several distinct billing events"
    AMBIGUOUS = "v1 tokens record, several tenants billed this id"
    UNDECODABLE = "record does not decode"
    REFUSED = "refused by the sink"


@dataclass(frozen=True, slots=True)
class Skipped:
    """A request the rebuild left out, and why.

    `request_id` is None for a record whose request is unknown (no usable
    key); `tenant` is None when the request's tenant is unknown (a v1 Tokens
    record, keyed by the request id alone, that no single tenant's billing
    event claims).
    """

    request_id: str | None
    reason: SkipReason
    detail: str = ""
    tenant: str | None = None

    @classmethod
    def of(cls, ref: RequestRef, reason: SkipReason, detail: str = "") -> Skipped:
        """The request `ref` skipped for `reason`."""
        return cls(ref.request_id, reason, detail, ref.tenant)

    @property
    def ref(self) -> RequestRef | None:
        """The skipped request, when both its tenant and its request id are known."""
        if self.request_id is None or self.tenant is None:
            return None
        return RequestRef(self.tenant, self.request_id)


@dataclass(frozen=True, slots=True)
class TokensRecord:
    """One Tokens topic record, in topic order: its key and the Tokens, a tombstone or bad bytes."""

    #: The record's key as text: `RequestRef.text` (v2), or the request id alone (v1).
    key: str
    #: None for a tombstone, or when the record did not decode (`error` then says why).
    tokens: Tokens | None = None
    error: str | None = None
    #: Where the record is (``topic[partition]@offset``), for messages; "" when not known.
    where: str = ""


@dataclass(frozen=True, slots=True)
class Request:
    """One request to write: its latest Tokens and its billing event (whose tenant it is)."""

    tokens: Tokens
    billing: BillingEvent

    @property
    def ref(self) -> RequestRef:
        """The request: the billing event's tenant and the request id."""
        return RequestRef(self.billing.tenant, self.tokens.request_id)


@dataclass(slots=True)
class Plan:
    """What `join` found: the requests to write (ordered) and the ones left out."""

    requests: list[Request] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    #: Billing records dropped because their event_id was already seen.
    billing_replays: int = 0
    #: Tokens records replaced by a later record of the same request.
    tokens_superseded: int = 0


@dataclass(frozen=True, slots=True)
class _Entry:
    """A Tokens record with the request its key names: `ref` (v2), or only `request_id` (v1)."""

    #: The record's position in topic order (a later record supersedes an earlier one).
    seq: int
    request_id: str
    #: None for a v1 record: keyed by the request id alone, its tenant unknown.
    ref: RequestRef | None
    tokens: Tokens | None
    error: str | None


def _at(where: str, text: str) -> str:
    return f"{where}: {text}" if where else text


def _classify(seq: int, record: TokensRecord) -> _Entry:
    """Which request `record` is of: v1 when its key is its value's request id, else its ref.

    A tombstone or undecodable value is v2 when its key parses as a
    `RequestRef`, else v1.  A key that names another request than the value
    holds makes the record undecodable (attributed to the request its key names).
    """
    key, tokens = record.key, record.tokens
    if tokens is not None and key == tokens.request_id:
        return _Entry(seq, key, None, tokens, None)
    try:
        ref: RequestRef | None = RequestRef.parse(key)
    except ValueError:
        ref = None
    request_id = key if ref is None else ref.request_id
    if tokens is not None and tokens.request_id != request_id:
        error = _at(record.where, f"keyed {key!r} but holds {tokens.request_id!r}")
        return _Entry(seq, request_id, ref, None, error)
    return _Entry(seq, request_id, ref, tokens, record.error)


def _latest_tokens(
    tokens_records: Iterable[TokensRecord], plan: Plan
) -> tuple[dict[RequestRef, _Entry], dict[str, _Entry]]:
    """The latest record per key: v2 ones by ref, v1 ones by request id (counts the superseded)."""
    by_ref: dict[RequestRef, _Entry] = {}
    by_id: dict[str, _Entry] = {}
    for seq, record in enumerate(tokens_records):
        entry = _classify(seq, record)
        if entry.ref is not None:
            if entry.ref in by_ref:
                plan.tokens_superseded += 1
            by_ref[entry.ref] = entry
        else:
            if entry.request_id in by_id:
                plan.tokens_superseded += 1
            by_id[entry.request_id] = entry
    return by_ref, by_id


def _billing_by_ref(
    billing_events: Iterable[BillingEvent], plan: Plan
) -> dict[RequestRef, list[BillingEvent]]:
    """The distinct billing events (first per event_id) of each request (counts the replays)."""
    seen_events: set[str] = set()
    billing: dict[RequestRef, list[BillingEvent]] = {}
    for event in billing_events:
        if event.event_id in seen_events:
            plan.billing_replays += 1
            continue
        seen_events.add(event.event_id)
        billing.setdefault(RequestRef(event.tenant, event.request_id), []).append(event)
    return billing


def _unclaimed(entry: _Entry) -> Skipped:
    """A v1 record no single tenant claims: undecodable, deleted, or Tokens without billing."""
    if entry.error is not None:
        return Skipped(entry.request_id, SkipReason.UNDECODABLE, f"{_V1_RECORD}; {entry.error}")
    if entry.tokens is None:
        return Skipped(entry.request_id, SkipReason.DELETED, _V1_RECORD)
    return Skipped(entry.request_id, SkipReason.NO_BILLING, _V1_RECORD)


def _resolve_v1(
    v1: dict[str, _Entry],
    latest: dict[RequestRef, _Entry],
    billing: dict[RequestRef, list[BillingEvent]],
    plan: Plan,
) -> tuple[list[Skipped], set[str]]:
    """Give each v1 record the one tenant billed for its id (into `latest`, unless superseded).

    Returns the v1 records left out, and the request ids of the ambiguous
    ones (billed to several tenants).
    """
    tenants_of: dict[str, set[str]] = {}
    for ref in billing:
        tenants_of.setdefault(ref.request_id, set()).add(ref.tenant)
    skipped: list[Skipped] = []
    ambiguous: set[str] = set()
    for request_id, entry in v1.items():
        tenants = sorted(tenants_of.get(request_id, ()))
        refs = [RequestRef(tenant, request_id) for tenant in tenants]
        if refs and all(ref in latest and latest[ref].seq > entry.seq for ref in refs):
            plan.tokens_superseded += 1  # whichever tenant's it was, a later record replaced it
        elif len(refs) == 1:
            if refs[0] in latest:  # an earlier record of the request, keyed by its ref
                plan.tokens_superseded += 1
            latest[refs[0]] = entry
        elif not refs or entry.tokens is None:
            skipped.append(_unclaimed(entry))
        else:
            ambiguous.add(request_id)
            listed = ", ".join(repr(t) for t in tenants)
            detail = f"keyed by the request id alone, billed to tenants {listed}"
            skipped.append(Skipped(request_id, SkipReason.AMBIGUOUS, detail))
    return skipped, ambiguous


def _matches(tokens: Tokens, billing: BillingEvent) -> str | None:
    """Why `billing` is not the billing event of `tokens` (what the sink checks); None if it is."""
    if billing.model != tokens.model:
        return f"billing model {billing.model!r} != tokens model {tokens.model!r}"
    if billing.usage != tokens.usage:
        return f"billing usage {billing.usage!r} != tokens usage {tokens.usage!r}"
    return None


def _join_one(
    ref: RequestRef, entry: _Entry | None, events: list[BillingEvent], ambiguous: set[str]
) -> Request | Skipped:
    """The request `ref` to write, or why it is skipped."""
    if entry is None:
        detail = ""
        if ref.request_id in ambiguous:
            detail = "only a v1 tokens record of this id, which several tenants billed"
        return Skipped.of(ref, SkipReason.NO_TOKENS, detail)
    if entry.tokens is None:
        if entry.error is not None:
            return Skipped.of(ref, SkipReason.UNDECODABLE, entry.error)
        return Skipped.of(ref, SkipReason.DELETED)
    if not events:
        return Skipped.of(ref, SkipReason.NO_BILLING)
    if len(events) > 1:
        ids = ", ".join(e.event_id for e in events)
        return Skipped.of(ref, SkipReason.CONFLICT, f"event ids {ids}")
    mismatch = _matches(entry.tokens, events[0])
    if mismatch is not None:
        return Skipped.of(ref, SkipReason.MISMATCH, mismatch)
    return Request(entry.tokens, events[0])


def _skip_order(skipped: Skipped) -> tuple[str, bool, str, str]:
    """Skipped requests by request id, the tenant-less first, then tenant and reason."""
    tenant = skipped.tenant
    return (skipped.request_id or "", tenant is not None, tenant or "", skipped.reason.value)


def join(tokens_records: Iterable[TokensRecord], billing_events: Iterable[BillingEvent]) -> Plan:
    """Join the Tokens topic's records with the billing topic's events by request (`RequestRef`).

    `tokens_records` in topic order (a request's records are on one
    partition, so per request that is offset order): the latest per key wins;
    a v1 record (keyed by the request id alone) joins the one tenant billed
    for its id.  `billing_events` are deduplicated by ``event_id`` (first
    wins).  The requests come ordered by (billing event time, tenant, request
    id); the skipped ones by (request id, tenant, reason).  See the module
    docstring.
    """
    plan = Plan()
    latest, v1 = _latest_tokens(tokens_records, plan)
    billing = _billing_by_ref(billing_events, plan)
    skipped, ambiguous = _resolve_v1(v1, latest, billing, plan)
    for ref in sorted(latest.keys() | billing.keys()):
        outcome = _join_one(ref, latest.get(ref), billing.get(ref, []), ambiguous)
        if isinstance(outcome, Request):
            plan.requests.append(outcome)
        else:
            skipped.append(outcome)
    plan.requests.sort(key=lambda r: (r.billing.event_time, r.billing.tenant, r.tokens.request_id))
    plan.skipped = sorted(skipped, key=_skip_order)
    return plan


# --------------------------------------------------------------------------- Kafka


@dataclass(slots=True)
class Inputs:
    """What the two topics hold, decoded, in topic order."""

    tokens: list[TokensRecord] = field(default_factory=list)
    billing: list[BillingEvent] = field(default_factory=list)
    #: Billing records that did not decode, and Tokens records without a usable key.
    bad: list[Skipped] = field(default_factory=list)


def _where(topic: str, partition: int, offset: int) -> str:
    return f"{topic}[{partition}]@{offset}"


async def read_inputs(servers: str, *, tokens_topic: str, billing_topic: str) -> Inputs:
    """Both topics from their beginning to their current end (`streamtally.wire.kafka.read_topic`).

    A Tokens record is kept with its key as text (`TokensRecord`; which
    request it is of is for `join` to say).  Raises `StackError` when Kafka
    cannot be reached or a topic is missing.
    """
    inputs = Inputs()
    async with contextlib.aclosing(read_topic(servers, tokens_topic)) as records:
        async for record in records:
            where = _where(record.topic, record.partition, record.offset)
            try:
                key = decode_key(record.key)
            except InputError as exc:
                inputs.bad.append(Skipped(None, SkipReason.UNDECODABLE, f"{where}: {exc}"))
                continue
            if record.value is None:
                inputs.tokens.append(TokensRecord(key, where=where))
                continue
            try:
                tokens = decode_tokens(record.value)
            except AvroDecodeError as exc:
                inputs.tokens.append(TokensRecord(key, error=f"{where}: {exc}", where=where))
                continue
            inputs.tokens.append(TokensRecord(key, tokens, where=where))
    async with contextlib.aclosing(read_topic(servers, billing_topic)) as records:
        async for record in records:
            where = _where(record.topic, record.partition, record.offset)
            if record.value is None:
                inputs.bad.append(_bad_billing(record.key, f"{where}: no value (tombstone)"))
                continue
            try:
                inputs.billing.append(decode_billing_event(record.value))
            except AvroDecodeError as exc:
                inputs.bad.append(_bad_billing(record.key, f"{where}: {exc}"))
    return inputs


def _bad_billing(key: bytes | None, detail: str) -> Skipped:
    """An undecodable billing record, of the request its key names (`RequestRef.text`, or v1
    the request id alone) when it has a key."""
    try:
        text = decode_key(key)
    except InputError:
        return Skipped(None, SkipReason.UNDECODABLE, detail)
    try:
        return Skipped.of(RequestRef.parse(text), SkipReason.UNDECODABLE, detail)
    except ValueError:
        return Skipped(text, SkipReason.UNDECODABLE, detail)


# --------------------------------------------------------------------------- Redis


@dataclass(slots=True)
class Applied:
    """What `apply` did."""

    #: Requests written by this rebuild.
    applied: int = 0
    #: Requests whose Tokens were already in Redis (left untouched).
    present: int = 0
    #: Requests the sink refused (a value that does not fit a counter).
    refused: list[Skipped] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.applied + self.present + len(self.refused)


async def apply(
    store: RedisStore,
    requests: Sequence[Request],
    *,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[Applied, int], None] | None = None,
    progress_every: int = 1000,
) -> Applied:
    """Write `requests` through the worker's sink, `batch_size` per flush.

    First `RedisStore.ensure_layout`: an empty Redis is claimed for layout
    version 2, one of another layout (v1 data, a migration under way) raises
    `LayoutError` before anything is written.  Each request is added with
    closing marker `CLOSED_MARKER` and 0 raw records and duplicates, keyed by
    its billing event's tenant and its request id.  `progress(result, total)`
    is called after the flush that crosses each multiple of `progress_every`
    requests, and after the last one.
    """
    if batch_size < 1 or progress_every < 1:
        raise ValueError("batch_size and progress_every must be >= 1")
    await store.ensure_layout()
    sink = RedisSink(store)
    result = Applied()
    total = len(requests)
    reported = 0
    for start in range(0, total, batch_size):
        for request in requests[start : start + batch_size]:
            try:
                sink.add(
                    request.tokens, request.billing, closed=CLOSED_MARKER, records=0, duplicates=0
                )
            except ValueError as exc:
                result.refused.append(Skipped.of(request.ref, SkipReason.REFUSED, str(exc)))
        for flag in await sink.flush():
            if flag:
                result.applied += 1
            else:
                result.present += 1
        if progress is not None and (
            result.done // progress_every > reported // progress_every or result.done == total
        ):
            progress(result, total)
        reported = result.done
    return result
