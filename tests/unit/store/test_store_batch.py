"""`RedisBatch` without Redis: what `add` refuses, and how `flush` hands its batch to the store."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.store import (
    FinishedRequest,
    RedisBatch,
    closed_key,
    finished_request,
    tokens_key,
)
from streamtally.wire.records import BillingEvent

PRICES = PriceTable.from_dict(
    {
        "version": "2026-11-01",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {"gpt-4.1-20*": {"input": "2.00", "cached_input": "0.50", "output": "8.00"}},
    }
)
WHEN = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


def make_tokens(
    request_id: str, usage: Usage | None = None, model: str | None = "gpt-4.1-2025-04-14"
) -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model=model,
        text="hi",
        reasoning="",
        tool_calls=(),
        usage=usage or Usage(input_tokens=10, output_tokens=2),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=1,
    )


def billed(tokens: Tokens) -> BillingEvent:
    return bill(tokens, "acme", WHEN, PRICES)


class FakeStore:
    """What `RedisBatch` needs of a `RedisStore`: `apply_requests`."""

    def __init__(self, fail: int = 0) -> None:
        self.batches: list[list[FinishedRequest]] = []
        self.fail = fail

    async def apply_requests(self, batch: Sequence[FinishedRequest]) -> list[bool]:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("Redis went away")
        self.batches.append(list(batch))
        return [not request.closed_key.endswith(":closed:acme:seen") for request in batch]


def test_a_billing_event_of_another_request_model_or_usage_is_refused() -> None:
    tokens = make_tokens("r1")
    event = billed(tokens)
    with pytest.raises(ValueError, match="billing event of 'r2' added with tokens of 'r1'"):
        finished_request(tokens, dataclasses.replace(event, request_id="r2"))
    with pytest.raises(ValueError, match="billing model 'other' != tokens model"):
        finished_request(tokens, dataclasses.replace(event, model="other"))
    with pytest.raises(ValueError, match="billing usage"):
        finished_request(tokens, billed(make_tokens("r1", Usage(input_tokens=11))))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"records": -1}, "records=-1 does not fit a Redis counter"),
        ({"duplicates": 2**63}, "duplicates=9223372036854775808 does not fit"),
    ],
)
def test_counts_that_do_not_fit_a_counter_are_refused(
    changes: dict[str, Any], message: str
) -> None:
    tokens = make_tokens("r1")
    with pytest.raises(ValueError, match=message):
        finished_request(tokens, billed(tokens), **changes)


def test_usage_beyond_a_counter_and_a_cost_beyond_one_increment_are_refused() -> None:
    huge = make_tokens("r1", Usage(input_tokens=2**63, output_tokens=2))
    with pytest.raises(ValueError, match="input_tokens=9223372036854775808 does not fit"):
        finished_request(huge, dataclasses.replace(billed(make_tokens("r1")), input_tokens=2**63))
    tokens = make_tokens("r1")
    rich = dataclasses.replace(billed(tokens), cost=Decimal(2**63))
    with pytest.raises(ValueError, match=r"r1: cost .* is too large to count"):
        finished_request(tokens, rich)


def test_an_unpriced_billing_event_is_counted_as_unpriced() -> None:
    priced = make_tokens("r1")
    unknown = make_tokens("r2", model="mystery-1")
    nameless = make_tokens("r3", model=None)
    requests = [finished_request(t, billed(t)) for t in (priced, unknown, nameless)]
    assert [r.priced for r in requests] == [True, False, False]
    assert [r.argv()[-1] for r in requests] == ["0", "1", "1"]
    assert [(r.cost_units, r.cost_pico) for r in requests[1:]] == [(0, 0), (0, 0)]


async def test_flush_hands_the_batch_in_add_order_and_empties_it() -> None:
    store = FakeStore()
    sink = RedisBatch(store)  # type: ignore[arg-type]
    assert await sink.flush() == []
    assert store.batches == []  # nothing to write: no call
    for request_id in ("a", "seen", "b"):
        tokens = make_tokens(request_id)
        sink.add(tokens, billed(tokens), closed="3 end", records=2)
    assert len(sink) == 3
    assert await sink.flush() == [True, False, True]
    assert len(sink) == 0
    [batch] = store.batches
    assert [(r.closed_key, r.tokens_key, r.closed, r.records) for r in batch] == [
        (closed_key(RequestRef("acme", r)), tokens_key(RequestRef("acme", r)), "3 end", 2)
        for r in ("a", "seen", "b")
    ]


async def test_a_failed_flush_keeps_the_batch_for_the_retry() -> None:
    store = FakeStore(fail=1)
    sink = RedisBatch(store)  # type: ignore[arg-type]
    tokens = make_tokens("a")
    sink.add(tokens, billed(tokens))
    with pytest.raises(ConnectionError):
        await sink.flush()
    assert len(sink) == 1
    assert await sink.flush() == [True]
    assert [r.closed_key for r in store.batches[0]] == [closed_key(RequestRef("acme", "a"))]
