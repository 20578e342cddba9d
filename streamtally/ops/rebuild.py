"""Rebuilding the Redis state from Kafka: the Tokens topic joined with the billing topic.

Redis holds, per finished request, its Tokens JSON and its share of a usage
row (``st:usage:{day}:{tenant}:{model}``).  Kafka holds the same facts for
ever: the compacted Tokens topic keeps the latest `Tokens` of every request,
the billing topic every `BillingEvent` (tenant, event time, cost).  So when
Redis is lost, `streamtally rebuild` reads both topics to their current end,
joins them by request id (`join`, a pure function) and writes each request
through the worker's own sink (`apply`: `streamtally.store.RedisSink`, one
atomic, idempotent script call per batch).

Join rules (`join`):

* Tokens: the latest record per request id wins (what compaction keeps); a
  tombstone (null value) deletes the request, a record that does not decode
  makes it unknown; both are reported and skipped.
* Billing: events are deduplicated by ``event_id`` (the first one wins, as
  every billing consumer does); a request with several distinct events is
  reported and skipped.
* A request with Tokens but no billing event, or the reverse, is reported and
  skipped (the worker sends both in one flush, so this is a request caught
  mid-flush, or a topic truncated by hand); so is one whose billing event
  does not match its Tokens (model or usage).

What is rebuilt and what is not:

* ``st:tokens:{id}``, the usage rows and ``st:usage:rows``: exactly as the
  worker wrote them (same Tokens JSON, same row, same cost, and the row's
  ``unpriced_requests`` from each billing event's ``priced``), and
  ``st:stats`` ``requests`` (+1 per request applied).  A billing event
  written before ``priced`` existed (BillingEvent v1) reads as priced, so a
  request billed unpriced by such an old worker (cost 0) is not counted in
  ``unpriced_requests`` by the rebuild: the event cannot tell.
* ``st:closed``: the worker's closing marker ("offset reason") names the
  offset of the request's last raw record, which neither topic carries; the
  rebuild writes ``"0 end"`` (`CLOSED_MARKER`).  A request is never counted
  twice whatever its marker (its Tokens key is the idempotency marker), but
  should the worker read a raw record of a rebuilt request again (its
  consumer group reset to earlier offsets), that record is dead-lettered as
  late instead of being dropped as a replay.
* ``st:stats`` ``records``, ``duplicates`` and ``dead_lettered`` and the set
  ``st:deadletter:seen`` count raw records; they cannot be rebuilt from these
  topics and are not restored (the rebuild adds 0 to them).

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


class SkipReason(StrEnum):
    """Why a request was not rebuilt."""

    NO_BILLING = "tokens without billing event"
    NO_TOKENS = "billing event without tokens"
    DELETED = "deleted (tombstone on the tokens topic)"
    MISMATCH = "billing event does not match tokens"
    CONFLICT = "several distinct billing events"
    UNDECODABLE = "record does not decode"
    REFUSED = "refused by the sink"


@dataclass(frozen=True, slots=True)
class Skipped:
    """A request (or a record whose request is unknown: None) the rebuild left out, and why."""

    request_id: str | None
    reason: SkipReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TokensRecord:
    """One record of the Tokens topic, in topic order: the Tokens, a tombstone or bad bytes."""

    request_id: str
    #: None for a tombstone, or when the record did not decode (`error` then says why).
    tokens: Tokens | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One request to write: its latest Tokens and its billing event."""

    tokens: Tokens
    billing: BillingEvent


@dataclass(slots=True)
class Plan:
    """What `join` found: the requests to write (ordered) and the ones left out."""

    requests: list[Request] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    #: Billing records dropped because their event_id was already seen.
    billing_replays: int = 0
    #: Tokens records replaced by a later record of the same request id.
    tokens_superseded: int = 0


def _matches(tokens: Tokens, billing: BillingEvent) -> str | None:
    """Why `billing` is not the billing event of `tokens` (what the sink checks); None if it is."""
    if billing.model != tokens.model:
        return f"billing model {billing.model!r} != tokens model {tokens.model!r}"
    if billing.usage != tokens.usage:
        return f"billing usage {billing.usage!r} != tokens usage {tokens.usage!r}"
    return None


def join(tokens_records: Iterable[TokensRecord], billing_events: Iterable[BillingEvent]) -> Plan:
    """Join the Tokens topic's records with the billing topic's events by request id.

    `tokens_records` in topic order (a request's records are on one
    partition, so per request id that is offset order): the latest per id
    wins.  `billing_events` are deduplicated by ``event_id`` (first wins).
    The requests come ordered by (billing event time, request id); the
    skipped ones by (request id, reason).  See the module docstring.
    """
    plan = Plan()
    latest: dict[str, TokensRecord] = {}
    for entry in tokens_records:
        if entry.request_id in latest:
            plan.tokens_superseded += 1
        latest[entry.request_id] = entry

    seen_events: set[str] = set()
    billing: dict[str, list[BillingEvent]] = {}
    for event in billing_events:
        if event.event_id in seen_events:
            plan.billing_replays += 1
            continue
        seen_events.add(event.event_id)
        billing.setdefault(event.request_id, []).append(event)

    skipped: list[Skipped] = []
    for request_id in sorted(latest.keys() | billing.keys()):
        record = latest.get(request_id)
        events = billing.get(request_id, [])
        if record is None:
            skipped.append(Skipped(request_id, SkipReason.NO_TOKENS))
            continue
        if record.tokens is None:
            if record.error is not None:
                skipped.append(Skipped(request_id, SkipReason.UNDECODABLE, record.error))
            else:
                skipped.append(Skipped(request_id, SkipReason.DELETED))
            continue
        if not events:
            skipped.append(Skipped(request_id, SkipReason.NO_BILLING))
            continue
        if len(events) > 1:
            ids = ", ".join(e.event_id for e in events)
            skipped.append(Skipped(request_id, SkipReason.CONFLICT, f"event ids {ids}"))
            continue
        mismatch = _matches(record.tokens, events[0])
        if mismatch is not None:
            skipped.append(Skipped(request_id, SkipReason.MISMATCH, mismatch))
            continue
        plan.requests.append(Request(record.tokens, events[0]))
    plan.requests.sort(key=lambda r: (r.billing.event_time, r.tokens.request_id))
    plan.skipped = skipped
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

    Raises `StackError` when Kafka cannot be reached or a topic is missing.
    """
    inputs = Inputs()
    async with contextlib.aclosing(read_topic(servers, tokens_topic)) as records:
        async for record in records:
            where = _where(record.topic, record.partition, record.offset)
            try:
                request_id = decode_key(record.key)
            except InputError as exc:
                inputs.bad.append(Skipped(None, SkipReason.UNDECODABLE, f"{where}: {exc}"))
                continue
            if record.value is None:
                inputs.tokens.append(TokensRecord(request_id))
                continue
            try:
                tokens = decode_tokens(record.value)
            except AvroDecodeError as exc:
                inputs.tokens.append(TokensRecord(request_id, error=f"{where}: {exc}"))
                continue
            if tokens.request_id != request_id:
                error = f"{where}: keyed {request_id!r} but holds {tokens.request_id!r}"
                inputs.tokens.append(TokensRecord(request_id, error=error))
                continue
            inputs.tokens.append(TokensRecord(request_id, tokens))
    async with contextlib.aclosing(read_topic(servers, billing_topic)) as records:
        async for record in records:
            where = _where(record.topic, record.partition, record.offset)
            if record.value is None:
                detail = f"{where}: no value (tombstone)"
                inputs.bad.append(Skipped(_key_text(record.key), SkipReason.UNDECODABLE, detail))
                continue
            try:
                inputs.billing.append(decode_billing_event(record.value))
            except AvroDecodeError as exc:
                detail = f"{where}: {exc}"
                inputs.bad.append(Skipped(_key_text(record.key), SkipReason.UNDECODABLE, detail))
    return inputs


def _key_text(key: bytes | None) -> str | None:
    try:
        return decode_key(key)
    except InputError:
        return None


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

    Each request is added with closing marker `CLOSED_MARKER` and 0 raw
    records and duplicates.  `progress(result, total)` is called after the
    flush that crosses each multiple of `progress_every` requests, and after
    the last one.
    """
    if batch_size < 1 or progress_every < 1:
        raise ValueError("batch_size and progress_every must be >= 1")
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
                result.refused.append(
                    Skipped(request.tokens.request_id, SkipReason.REFUSED, str(exc))
                )
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
