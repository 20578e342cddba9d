"""The join of a rebuild: Tokens records and billing events matched by request, a pure function.

`join` keeps the latest Tokens record per request, gives each v1 record
(keyed by the request id alone) the one tenant billed for its id, and pairs
each request with its billing event; the `Plan` it returns holds the
requests to write and the ones skipped.  The rules are in the package
docstring (`streamtally.ops.rebuild`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from streamtally.core.identity import RequestRef
from streamtally.core.models import Tokens
from streamtally.ops.rebuild._records import Request, Skipped, SkipReason, TokensRecord
from streamtally.wire.records import BillingEvent

#: The detail of a skipped v1 Tokens record whose tenant nothing tells.
_V1_RECORD: Final = "v1 record, keyed by the request id alone: tenant unknown"


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
    id); the skipped ones by (request id, tenant, reason).  See the package
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
