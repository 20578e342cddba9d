"""`RedisBatch`: a batching sink of finished requests, their Tokens and their usage rows.

Use it like a quix-streams `BatchingSink`: `add` each finished request (its
`Tokens` and its priced `BillingEvent`) as it comes, then `flush` the batch
before committing the consumer offsets.  A flush is one atomic script call per
shard (`RedisStore.apply_requests`, `streamtally.store.scripts.FLUSH_SCRIPT`),
idempotent per request, so a replay after a crash never counts twice.  What
lands where is `streamtally.store.layout`.

Limits: each counter is a signed 64-bit integer (HINCRBY); `add` refuses
values that cannot fit one increment.
"""

from __future__ import annotations

from typing import Final

from streamtally.core.identity import RequestRef
from streamtally.core.models import Tokens
from streamtally.core.money import cost_parts
from streamtally.store.layout import (
    UNKNOWN_MODEL,
    amend_key,
    closed_key,
    day_of,
    revision_key,
    row_member,
    shard_of,
    tokens_json,
    tokens_key,
    usage_key,
)
from streamtally.store.redis_store import RedisStore
from streamtally.store.scripts import AmendedRequest, FinishedRequest
from streamtally.wire.records import BillingEvent

__all__ = ["RedisBatch", "amended_request", "finished_request"]

_INT64_MAX: Final = 2**63 - 1


def _counter(name: str, value: int) -> int:
    if not 0 <= value <= _INT64_MAX:
        raise ValueError(f"{name}={value} does not fit a Redis counter (0 .. 2**63-1)")
    return value


def finished_request(
    tokens: Tokens,
    billing: BillingEvent,
    *,
    closed: str = "0 end",
    records: int = 0,
    duplicates: int = 0,
) -> FinishedRequest:
    """What the flush script takes for one finished request.

    The request is (billing event's tenant, request id).  An unpriced billing
    event (``priced`` False) is counted in its row's ``unpriced_requests``.

    Raises ValueError when `billing` is not the billing event of `tokens`
    (another request id, model or usage) or a value cannot be counted.
    """
    if billing.request_id != tokens.request_id:
        raise ValueError(
            f"billing event of {billing.request_id!r} added with tokens of {tokens.request_id!r}"
        )
    if billing.model != tokens.model:
        raise ValueError(
            f"{tokens.request_id}: billing model {billing.model!r} != tokens model {tokens.model!r}"
        )
    if billing.usage != tokens.usage:
        raise ValueError(
            f"{tokens.request_id}: billing usage {billing.usage!r} != tokens usage {tokens.usage!r}"
        )
    day = day_of(billing.event_time)
    model = tokens.model or UNKNOWN_MODEL
    units, pico = cost_parts(billing.cost)
    if abs(units) > _INT64_MAX:
        raise ValueError(f"{tokens.request_id}: cost {billing.cost} is too large to count")
    usage = tokens.usage
    ref = RequestRef(billing.tenant, tokens.request_id)
    shard = shard_of(ref)
    return FinishedRequest(
        shard=shard,
        tokens_key=tokens_key(ref),
        closed_key=closed_key(ref),
        usage_key=usage_key(shard, day, billing.tenant, model),
        tokens_json=tokens_json(tokens),
        row_member=row_member(day, billing.tenant, model),
        usage=(
            _counter("input_tokens", usage.input_tokens),
            _counter("output_tokens", usage.output_tokens),
            _counter("reasoning_tokens", usage.reasoning_tokens),
            _counter("cached_tokens", usage.cached_tokens),
            _counter("cache_write_tokens", usage.cache_write_tokens),
        ),
        cost_units=units,
        cost_pico=pico,
        closed=closed,
        records=_counter("records", records),
        duplicates=_counter("duplicates", duplicates),
        priced=billing.priced,
    )


def _bill_values(billing: BillingEvent) -> tuple[int, int, int, int, int, int, int, int]:
    """A bill's five usage counts, whole cost units, cost remainder and unpriced (0/1)."""
    units, pico = cost_parts(billing.cost)
    if abs(units) > _INT64_MAX:
        raise ValueError(f"{billing.request_id}: cost {billing.cost} is too large to count")
    counts = billing.usage_counts()
    return (
        *(_counter(name, value) for name, value in counts.items()),  # type: ignore[return-value]
        units,
        pico,
        0 if billing.priced else 1,
    )


def amended_request(
    tokens: Tokens,
    billing: BillingEvent,
    superseded: BillingEvent,
    *,
    records: int = 0,
    duplicates: int = 0,
    amendable: bytes | None = None,
) -> AmendedRequest:
    """What the amend script takes for revision ``billing.revision`` of a request, which
    replaces `superseded` (its revision before) in the usage rows.

    Raises ValueError when the bills are not of one request, revision after revision,
    or `billing` is not the billing event of `tokens`, or a value cannot be counted.
    """
    if billing.revision < 1 or superseded.revision != billing.revision - 1:
        raise ValueError(
            f"{tokens.request_id}: revision {billing.revision} does not follow revision "
            f"{superseded.revision}"
        )
    if (superseded.tenant, superseded.request_id) != (billing.tenant, billing.request_id):
        raise ValueError(f"{tokens.request_id}: the superseded bill is of another request")
    if billing.supersedes != superseded.event_id:
        raise ValueError(f"{tokens.request_id}: the amendment supersedes another bill")
    plain = finished_request(tokens, billing, records=records, duplicates=duplicates)
    ref = RequestRef(billing.tenant, tokens.request_id)
    shard = shard_of(ref)
    model = superseded.model or UNKNOWN_MODEL
    return AmendedRequest(
        shard=shard,
        revision=billing.revision,
        tokens_key=plain.tokens_key,
        revision_key=revision_key(ref),
        amend_key=amend_key(ref),
        superseded_key=usage_key(shard, day_of(superseded.event_time), billing.tenant, model),
        usage_key=plain.usage_key,
        tokens_json=plain.tokens_json,
        row_member=plain.row_member,
        superseded=_bill_values(superseded),
        amended=_bill_values(billing),
        records=plain.records,
        duplicates=plain.duplicates,
        amendable=amendable,
    )


class RedisBatch:
    """Batches finished requests and writes them to Redis: atomic per shard, idempotent.

    Not safe for concurrent use by several tasks (one sink per consumer task).
    """

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._pending: list[FinishedRequest] = []
        #: Amendable states of requests in `_pending`, written once they are applied.
        self._states: dict[RequestRef, bytes] = {}
        self._amendments: list[AmendedRequest] = []

    def __len__(self) -> int:
        """How many requests wait for the next flush."""
        return len(self._pending) + len(self._amendments)

    def keep(self, ref: RequestRef, amendable: bytes) -> None:
        """Keep `ref`'s amendable state, with the next `flush` (after its request's apply)."""
        self._states[ref] = amendable

    def amend(self, amendment: AmendedRequest) -> None:
        """Queue one amendment for the next `flush` (applied after the requests added)."""
        self._amendments.append(amendment)

    def add(
        self,
        tokens: Tokens,
        billing: BillingEvent,
        *,
        closed: str = "0 end",
        records: int = 0,
        duplicates: int = 0,
    ) -> None:
        """Queue one finished request for the next `flush`.

        `closed` is the request's closing marker ("offset reason"); `records`
        and `duplicates` are its raw-record counts, added to the stats when
        the request is applied.

        Raises ValueError when `billing` is not the billing event of `tokens`
        (another request id, model or usage) or a value cannot be counted.
        """
        self._pending.append(
            finished_request(tokens, billing, closed=closed, records=records, duplicates=duplicates)
        )

    async def flush(self) -> list[bool]:
        """Write every queued request: one atomic script call per shard, in one round trip.

        Returns one flag per request, in `add` order: True when this flush
        applied it, False when it had been applied before (its Tokens key
        existed).  On an error the batch stays queued, so calling `flush`
        again retries it: each shard's checks fail before anything of that shard
        is written, and a retry of a batch that was (partly) applied, say when the reply
        was lost, reports False for the requests already applied.
        """
        batch = list(self._pending)
        flags = await self._store.apply_requests(batch) if batch else []
        del self._pending[: len(batch)]
        # A failure below leaves these queued: a retry writes the same states and applies
        # each amendment at most once (the script checks its revision).
        if self._states:
            await self._store.keep_amendable(self._states)
            self._states = {}
        if self._amendments:
            amendments = list(self._amendments)
            await self._store.apply_amendments(amendments)
            del self._amendments[: len(amendments)]
        return flags
