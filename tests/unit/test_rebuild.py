"""`streamtally.ops.rebuild.join`: latest Tokens wins, billing replays collapse."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from streamtally.cli import build_parser
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.core.pricing import PriceTable
from streamtally.ops.rebuild import (
    CLOSED_MARKER,
    Plan,
    Skipped,
    SkipReason,
    TokensRecord,
    apply,
    join,
)
from streamtally.store import FinishedRequest
from streamtally.wire import avro
from streamtally.wire.billing import bill
from streamtally.wire.records import BillingEvent

PRICES = PriceTable.from_dict(
    {
        "version": "2026-11-01",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {"gpt-4.1-20*": {"input": "2.00", "cached_input": "0.50", "output": "8.00"}},
    }
)
WHEN = datetime(2026, 11, 21, 12, 30, tzinfo=UTC)


def make_tokens(
    request_id: str,
    text: str = "hello",
    output_tokens: int = 48,
    model: str | None = "gpt-4.1-2025-04-14",
) -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model=model,
        text=text,
        reasoning="",
        tool_calls=(),
        usage=Usage(input_tokens=1520, cached_tokens=1408, output_tokens=output_tokens),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=4,
    )


def billing_of(tokens: Tokens, tenant: str = "acme", when: datetime = WHEN) -> BillingEvent:
    return bill(tokens, tenant, when, PRICES)


def record(tokens: Tokens) -> TokensRecord:
    return TokensRecord(tokens.request_id, tokens)


def skipped_by_id(plan: Plan) -> dict[str | None, Skipped]:
    return {s.request_id: s for s in plan.skipped}


def test_a_request_with_tokens_and_billing_is_joined() -> None:
    tokens = make_tokens("r1")
    event = billing_of(tokens)
    plan = join([record(tokens)], [event])
    assert [(r.tokens, r.billing) for r in plan.requests] == [(tokens, event)]
    assert plan.skipped == []
    assert (plan.tokens_superseded, plan.billing_replays) == (0, 0)


def test_the_latest_tokens_record_of_a_request_wins() -> None:
    old, new = make_tokens("r1", text="first"), make_tokens("r1", text="second")
    other = make_tokens("r2", text="other")
    records = [record(old), record(other), record(new)]
    plan = join(records, [billing_of(new), billing_of(other)])
    by_id = {r.tokens.request_id: r.tokens for r in plan.requests}
    assert by_id == {"r1": new, "r2": other}
    assert plan.tokens_superseded == 1


def test_a_tombstone_deletes_a_request_and_a_later_record_brings_it_back() -> None:
    gone, back = make_tokens("gone"), make_tokens("back", text="again")
    records = [
        record(gone),
        TokensRecord("gone"),  # tombstone
        TokensRecord("back"),
        record(back),
    ]
    plan = join(records, [billing_of(gone), billing_of(back)])
    assert [r.tokens for r in plan.requests] == [back]
    assert plan.skipped == [Skipped("gone", SkipReason.DELETED)]


def test_duplicate_billing_events_collapse_into_one_request() -> None:
    tokens = make_tokens("r1")
    event = billing_of(tokens)
    replay = dataclasses.replace(event)  # equal, a distinct object: a re-sent record
    plan = join([record(tokens)], [event, replay, event])
    assert len(plan.requests) == 1
    assert plan.requests[0].billing == event
    assert plan.billing_replays == 2
    assert plan.skipped == []


def test_the_first_of_several_records_with_one_event_id_wins() -> None:
    tokens = make_tokens("r1")
    first = billing_of(tokens, tenant="acme")
    later = dataclasses.replace(first, tenant="globex")  # same event_id
    plan = join([record(tokens)], [first, later])
    assert [r.billing.tenant for r in plan.requests] == ["acme"]
    assert plan.billing_replays == 1


def test_orphans_are_reported_and_skipped() -> None:
    both, lonely_tokens, lonely_billing = (
        make_tokens("both"),
        make_tokens("tokens-only"),
        make_tokens("billing-only"),
    )
    plan = join(
        [record(both), record(lonely_tokens)],
        [billing_of(both), billing_of(lonely_billing)],
    )
    assert [r.tokens.request_id for r in plan.requests] == ["both"]
    assert plan.skipped == [
        Skipped("billing-only", SkipReason.NO_TOKENS),
        Skipped("tokens-only", SkipReason.NO_BILLING),
    ]


def test_a_billing_event_that_does_not_match_its_tokens_is_skipped() -> None:
    billed = make_tokens("r1", output_tokens=48)
    stored = make_tokens("r1", output_tokens=49)  # a later Tokens with other usage
    plan = join([record(billed), record(stored)], [billing_of(billed)])
    assert plan.requests == []
    (skip,) = plan.skipped
    assert (skip.request_id, skip.reason) == ("r1", SkipReason.MISMATCH)
    assert "usage" in skip.detail


def test_distinct_billing_events_of_one_request_are_a_conflict() -> None:
    tokens = make_tokens("r1")
    event = billing_of(tokens)
    other = dataclasses.replace(event, event_id="f" * 32)
    plan = join([record(tokens)], [event, other])
    assert plan.requests == []
    (skip,) = plan.skipped
    assert (skip.request_id, skip.reason) == ("r1", SkipReason.CONFLICT)
    assert event.event_id in skip.detail
    assert other.event_id in skip.detail


def test_an_undecodable_latest_tokens_record_skips_the_request() -> None:
    tokens = make_tokens("r1")
    records = [record(tokens), TokensRecord("r1", error="tokens[0]@7: bad marker")]
    plan = join(records, [billing_of(tokens)])
    assert plan.requests == []
    assert plan.skipped == [Skipped("r1", SkipReason.UNDECODABLE, "tokens[0]@7: bad marker")]


def test_requests_come_ordered_by_event_time_then_request_id() -> None:
    late, early_b, early_a = make_tokens("a-late"), make_tokens("b"), make_tokens("a")
    events = [
        billing_of(late, when=WHEN + timedelta(hours=1)),
        billing_of(early_b),
        billing_of(early_a),
    ]
    plan = join([record(late), record(early_b), record(early_a)], events)
    assert [r.tokens.request_id for r in plan.requests] == ["a", "b", "a-late"]


def test_nothing_in_nothing_out() -> None:
    assert join([], []) == Plan()


class FakeStore:
    """What the rebuild's sink needs of a `RedisStore`: `apply_requests`."""

    def __init__(self) -> None:
        self.batches: list[list[FinishedRequest]] = []

    async def apply_requests(self, batch: Sequence[FinishedRequest]) -> list[bool]:
        self.batches.append(list(batch))
        return [True] * len(batch)


async def test_the_rebuild_counts_unpriced_requests_from_their_billing_events() -> None:
    priced, unknown = make_tokens("priced"), make_tokens("unknown", model="mystery-1")
    events = [billing_of(priced), billing_of(unknown)]
    assert [e.priced for e in events] == [True, False]
    # as read back from the billing topic
    decoded = [avro.decode_billing_event(avro.encode_billing_event(e)) for e in events]
    plan = join([record(priced), record(unknown)], decoded)
    store = FakeStore()
    result = await apply(store, plan.requests)  # type: ignore[arg-type]
    assert result.applied == 2
    [batch] = store.batches
    assert [(r.request_id, r.priced, r.argv()[-1]) for r in batch] == [
        ("priced", True, "0"),
        ("unknown", False, "1"),  # the flush script adds 1 to the row's unpriced_requests
    ]


def test_the_commands_are_registered() -> None:
    parser = build_parser()
    rebuild = parser.parse_args(["rebuild", "--yes", "--batch-size", "7"])
    assert (rebuild.yes, rebuild.batch_size) == (True, 7)
    deadletter = parser.parse_args(["deadletter", "--json", "--limit", "0"])
    assert (deadletter.json, deadletter.limit) == (True, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["rebuild", "--batch-size", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["deadletter", "--limit", "-1"])
    assert CLOSED_MARKER == "0 end"
