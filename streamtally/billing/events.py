"""Pricing a finished request into its `BillingEvent`.

One billing event goes out per finished request, whatever its finish
reason: requests that ended in an error or were cancelled are billed for
the usage the provider reported (often 0 tokens, so a cost of 0).

`event_id` is the idempotency key of the event: a function of the request's
identity (tenant and request id) alone (not of `provider_request_id`, which the
event carries beside it), so replaying a request (after a crash,
or a re-run of the pipeline) produces the same id and downstream consumers
drop the duplicate, while two tenants that reuse one provider id get two ids.

A request is priced at its *receive time*: the receive time of its last raw
record, which is also its billing event's `event_time` (see `price_request`).
The event's `price_table_version` names the version of the price table in
force then (`streamtally.billing.pricing.PriceTable.in_force`), or
``"(none in force)"`` (`NO_VERSION`) before the table's first version.
`charge` is the one pricing function: the worker, the audit's replay (both
through `RequestProcessor`) and the audit's re-rating all go through it.

Unpriced requests are still billed, with cost ``Decimal(0)`` and
``BillingEvent.priced`` False, so their usage is never lost and never hidden:
a model no entry of the price table matches (exact name or wildcard, see
`streamtally.billing.pricing`; a request without a model matches only ``"*"``),
a request received before the table's first version took effect, and a cost
the billing record cannot carry (beyond decimal(38, 12), a price table
error).  A warning is logged on the ``streamtally.billing.events`` logger (once
per model and price version for an unknown model or a time before the first
version, every time for a cost that does not fit).  Re-price them from the
event's token counts once the price table knows the model (``streamtally
audit --prices``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Final

from streamtally.billing.pricing import NO_VERSION, PriceTable, Quote
from streamtally.core.identity import RequestRef
from streamtally.core.models import Tokens, Usage
from streamtally.core.money import COST_SCALE, scaled_cost
from streamtally.wire.records import BillingEvent, Provenance, UsageSource

__all__ = [
    "EVENT_ID_PREFIX",
    "Billed",
    "Charge",
    "bill",
    "charge",
    "event_id",
    "price_request",
]

log = logging.getLogger("streamtally.billing.events")

#: Versioned namespace of `event_id`; changing it changes every id (never do it lightly).
#: v1 hashed the request id alone; v2 hashes the request's identity (`RequestRef.text`).
EVENT_ID_PREFIX: Final = b"streamtally.billing.v2\x00"

#: The cost of an unpriced request, at the Avro scale.
_ZERO: Final = Decimal((0, (0,), -COST_SCALE))


def event_id(tenant: str, request_id: str, revision: int = 0) -> str:
    """The deterministic id of a request's billing event: 32 hex chars of a sha256.

    ``sha256(b"streamtally.billing.v2\\x00" + RequestRef(tenant, request_id).text
    .encode("utf-8"))[:32 hex]``: the escaped tenant, ``:``, the request id.  Revision
    n > 0 of the bill (an amendment) hashes ``#n`` after that text: each revision has
    an id of its own (a consumer that dedupes by id keeps every revision), and
    revision 0 keeps the id bills had before revisions existed.
    """
    if not request_id:
        raise ValueError("request_id must not be empty")
    if revision < 0:
        raise ValueError(f"revision must be >= 0, not {revision}")
    text = RequestRef(tenant, request_id).text
    if revision:
        text += f"#{revision}"
    return hashlib.sha256(EVENT_ID_PREFIX + text.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Billed:
    """A billing event with how it was priced."""

    event: BillingEvent
    quote: Quote

    @property
    def priced(self) -> bool:
        """The event's `priced`: False when the request could not be priced (cost 0)."""
        return self.event.priced


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request is charged under a price table, and why."""

    quote: Quote
    #: The cost billed: None when unpriced (no entry, no version in force, or `overflow`).
    cost: Decimal | None
    #: The price version in force at the request's receive time, or `NO_VERSION`.
    version: str
    #: True when the quote's cost does not fit the billing record (decimal(38,12)).
    overflow: bool = False

    @property
    def billed_cost(self) -> Decimal:
        """The event's cost: `cost`, or 0 at the Avro scale when unpriced."""
        return _ZERO if self.cost is None else self.cost


def charge(model: str | None, usage: Usage, received: datetime, prices: PriceTable) -> Charge:
    """What a request of `model` with `usage`, received at `received`, is charged by `prices`.

    The one pricing function of streamtally (pure: no logging): `received` selects the
    version in force (`PriceTable.in_force`), which prices the usage exactly; a cost
    the billing record cannot carry is charged as unpriced (`overflow`).
    """
    if received.tzinfo is None or received.utcoffset() is None:
        raise ValueError(f"the receive time must be timezone-aware, got {received!r}")
    quote = prices.quote(model, usage, received)
    version = NO_VERSION if quote.version is None else quote.version
    cost = quote.cost
    if cost is not None and not _carried(cost):
        return Charge(quote=quote, cost=None, version=version, overflow=True)
    return Charge(quote=quote, cost=cost, version=version)


_WARNED: set[tuple[str | None, str]] = set()


def price_request(
    tokens: Tokens,
    tenant: str,
    event_time: datetime,
    prices: PriceTable,
    provenance: Provenance | None = None,
    *,
    revision: int = 0,
) -> Billed:
    """The billing event of the finished request `tokens`, and the quote behind its cost.

    `provenance` (the processor's: raw topic, partition, offsets, `raw_sha256`, usage
    source) goes onto the event as is; without it the event carries none (as before
    BillingEvent v3).  It changes neither the price nor `event_id`.

    `event_time` is the request's receive time, and the time it is priced at: the
    receive time of its last raw record (the worker's and the replay's
    ``state.last_time``).  The last, not the first, because a request's usage is known
    only when it ends (the usage arrives in its last events), and because the billing
    event carries that time as `event_time` (and its usage row's day derives from it):
    event, row and price version agree, and anyone holding the event alone can tell
    which version priced it, as the audit's re-rating does.
    """
    if event_time.tzinfo is None or event_time.utcoffset() is None:
        raise ValueError(f"event_time must be timezone-aware, got {event_time!r}")
    usage = tokens.usage
    charged = charge(tokens.model, usage, event_time, prices)
    quote, version = charged.quote, charged.version
    if charged.overflow:
        log.warning(
            "request %r (tenant %r, model %r): cost %s does not fit the billing record "
            "(decimal(38,12)); billed at 0 as unpriced with price table %s entry %r",
            tokens.request_id,
            tenant,
            tokens.model,
            quote.cost,
            version,
            quote.entry,
        )
    elif charged.cost is None and (tokens.model, version) not in _WARNED:
        _WARNED.add((tokens.model, version))  # once per model: not a log flood
        if quote.version is None:
            first = prices.versions[0].effective_from
            log.warning(
                "request %s (tenant %s, model %r) received at %s, before the first version "
                "of the price table (%s, effective from %s): billed at 0 %s as unpriced; "
                "add a version in force then",
                tokens.request_id,
                tenant,
                tokens.model,
                event_time.isoformat(),
                prices.versions[0].version,
                first.isoformat() if first is not None else "-",
                prices.currency,
            )
        else:
            log.warning(
                "unpriced model %r (first seen in request %s, tenant %s): billed at 0 %s with "
                "price table %s; add it to the price table",
                tokens.model,
                tokens.request_id,
                tenant,
                prices.currency,
                version,
            )
    event = BillingEvent(
        event_id=event_id(tenant, tokens.request_id, revision),
        request_id=tokens.request_id,
        tenant=tenant,
        model=tokens.model,
        source=tokens.source,
        finish_reason=tokens.finish_reason,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        cached_tokens=usage.cached_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        cost=charged.billed_cost,
        priced=charged.cost is not None,
        currency=prices.currency,
        price_table_version=version,
        event_time=event_time,
        raw_topic=None if provenance is None else provenance.raw_topic,
        raw_partition=None if provenance is None else provenance.raw_partition,
        first_offset=None if provenance is None else provenance.first_offset,
        last_offset=None if provenance is None else provenance.last_offset,
        raw_sha256=None if provenance is None else provenance.raw_sha256,
        usage_source=UsageSource.UNKNOWN if provenance is None else provenance.usage_source,
        provider_request_id=tokens.provider_request_id,
        revision=revision,
        supersedes=event_id(tenant, tokens.request_id, revision - 1) if revision else None,
    )
    return Billed(event=event, quote=quote)


def bill(
    tokens: Tokens,
    tenant: str,
    event_time: datetime,
    prices: PriceTable,
    provenance: Provenance | None = None,
    *,
    revision: int = 0,
) -> BillingEvent:
    """The billing event of the finished request `tokens` (unpriced: cost 0, priced False);
    `revision` n > 0: its n-th amendment, superseding revision n - 1."""
    return price_request(tokens, tenant, event_time, prices, provenance, revision=revision).event


def _carried(cost: Decimal) -> bool:
    """Whether the billing record can carry `cost` (decimal(38, 12))."""
    try:
        scaled_cost(cost)
    except ValueError:
        return False
    return True
