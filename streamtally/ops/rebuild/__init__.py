"""Rebuilding the Redis state from Kafka: the Tokens topic joined with the billing topic.

Redis holds, per finished request, its Tokens JSON and its share of a usage
row (``st:usage:{day}:{tenant}:{model}``).  Kafka holds the same facts for
ever: the compacted Tokens topic keeps the latest `Tokens` of every request,
the billing topic every `BillingEvent` (tenant, event time, cost).  So when
Redis is lost, `streamtally rebuild` reads both topics to their current end,
joins them by request (`join`, a pure function), a request being its tenant
and its request id together (`RequestRef`), and writes each request through
the worker's own sink (`apply`: `streamtally.store.RedisBatch`, one atomic,
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
  The billing and corrections topics are settled by the one rule of every
  billing consumer (`streamtally.billing.ledger.BillingLedger`, docs/billing.md,
  "One ledger, one rule"): events deduplicated by ``event_id`` (the first one wins; a
  different event under an id already read is a conflict, counted), each
  request's highest revision stands (an amended request is rebuilt from its
  latest revision alone, as the worker's usage row holds it, never from
  revision 0 and 1 both), and the corrections of ``audit --correct`` apply.
  A request with several bills at its highest revision is reported and
  skipped.
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
* An amended request's revision (``st:{T}:revision:{ref}``) and what a
  further amendment would start from (``st:{T}:amend:{ref}``) expire with the
  state TTL and are not restored: its row holds its standing bill, and a raw
  record of it arriving after the rebuild is dead-lettered as late.
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

The topics are read to their end before anything is written, and held in
memory: the latest Tokens of every request and every billing event.

Requests already in Redis are left untouched (the sink skips a request whose
Tokens key exists), so a rebuild is safe to run at any time, also next to a
running worker, and running it twice changes nothing the second time.
"""

from __future__ import annotations

from streamtally.ops.rebuild._apply import BATCH_SIZE, CLOSED_MARKER, Applied, apply
from streamtally.ops.rebuild._join import Plan, join
from streamtally.ops.rebuild._read import Inputs, read_inputs
from streamtally.ops.rebuild._records import Request, Skipped, SkipReason, TokensRecord

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
