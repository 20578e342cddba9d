"""`streamtally.ops.rebuild`: requests joined by (tenant, request id), latest Tokens wins,
billing replays collapse, v1 records (keyed by the request id alone) join their one tenant."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.cli import build_parser
from streamtally.cli.rebuild import _summary_json, _summary_text
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.ops.rebuild import (
    CLOSED_MARKER,
    Applied,
    Inputs,
    Plan,
    Skipped,
    SkipReason,
    TokensRecord,
    _read,
    apply,
    join,
    read_inputs,
)
from streamtally.store import FinishedRequest, LayoutError, tokens_json, tokens_key
from streamtally.topics import output_key
from streamtally.wire import avro, kafka
from streamtally.wire.records import BillingEvent
from tests.unit.billing.test_cli_billing_ledger import TOPICS, FakeTopics
from tests.unit.billing.test_ledger import correction

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


def key(request_id: str, tenant: str = "acme") -> str:
    """The key text of a request's Tokens record (v2): `RequestRef.text`."""
    return RequestRef(tenant, request_id).text


def record(tokens: Tokens, tenant: str = "acme") -> TokensRecord:
    """A Tokens record keyed by its request's ref (v2)."""
    return TokensRecord(key(tokens.request_id, tenant), tokens)


def v1_record(tokens: Tokens) -> TokensRecord:
    """A Tokens record written before keys carried the tenant: keyed by the request id."""
    return TokensRecord(tokens.request_id, tokens)


def refs(plan: Plan) -> list[RequestRef]:
    return [r.ref for r in plan.requests]


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
        TokensRecord(key("gone")),  # tombstone
        TokensRecord(key("back")),
        record(back),
    ]
    plan = join(records, [billing_of(gone), billing_of(back)])
    assert [r.tokens for r in plan.requests] == [back]
    assert plan.skipped == [Skipped("gone", SkipReason.DELETED, tenant="acme")]


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
        Skipped("billing-only", SkipReason.NO_TOKENS, tenant="acme"),
        Skipped("tokens-only", SkipReason.NO_BILLING, tenant="acme"),
    ]


def test_a_billing_event_that_does_not_match_its_tokens_is_skipped() -> None:
    billed = make_tokens("r1", output_tokens=48)
    stored = make_tokens("r1", output_tokens=49)  # a later Tokens with other usage
    plan = join([record(billed), record(stored)], [billing_of(billed)])
    assert plan.requests == []
    (skip,) = plan.skipped
    assert (skip.ref, skip.reason) == (RequestRef("acme", "r1"), SkipReason.MISMATCH)
    assert "usage" in skip.detail


def test_distinct_billing_events_of_one_request_are_a_conflict() -> None:
    tokens = make_tokens("r1")
    event = billing_of(tokens)
    other = dataclasses.replace(event, event_id="f" * 32)
    plan = join([record(tokens)], [event, other])
    assert plan.requests == []
    (skip,) = plan.skipped
    assert (skip.ref, skip.reason) == (RequestRef("acme", "r1"), SkipReason.CONFLICT)
    assert event.event_id in skip.detail
    assert other.event_id in skip.detail


def test_an_undecodable_latest_tokens_record_skips_the_request() -> None:
    tokens = make_tokens("r1")
    records = [record(tokens), TokensRecord(key("r1"), error="tokens[0]@7: bad marker")]
    plan = join(records, [billing_of(tokens)])
    assert plan.requests == []
    assert plan.skipped == [
        Skipped("r1", SkipReason.UNDECODABLE, "tokens[0]@7: bad marker", tenant="acme")
    ]


def test_requests_come_ordered_by_event_time_then_tenant_then_request_id() -> None:
    late, early_b, early_a = make_tokens("a-late"), make_tokens("b"), make_tokens("a")
    events = [
        billing_of(late, when=WHEN + timedelta(hours=1)),
        billing_of(early_b),
        billing_of(early_a),
        billing_of(early_b, tenant="aaa"),
    ]
    records = [record(late), record(early_b), record(early_a), record(early_b, "aaa")]
    plan = join(records, events)
    assert refs(plan) == [
        RequestRef("aaa", "b"),
        RequestRef("acme", "a"),
        RequestRef("acme", "b"),
        RequestRef("acme", "a-late"),
    ]


def test_nothing_in_nothing_out() -> None:
    assert join([], []) == Plan()


# --------------------------------------------------------------------------- identity


def test_two_tenants_with_one_request_id_are_two_requests() -> None:
    acme, globex = make_tokens("r1", text="acme's"), make_tokens("r1", text="globex's")
    plan = join(
        [record(acme, "acme"), record(globex, "globex")],
        [billing_of(acme, "acme"), billing_of(globex, "globex")],
    )
    assert refs(plan) == [RequestRef("acme", "r1"), RequestRef("globex", "r1")]
    assert [r.tokens.text for r in plan.requests] == ["acme's", "globex's"]
    assert (plan.skipped, plan.tokens_superseded, plan.billing_replays) == ([], 0, 0)


async def test_two_tenants_with_one_request_id_get_two_tokens_keys_and_two_rows() -> None:
    acme, globex = make_tokens("r1", text="acme's"), make_tokens("r1", text="globex's")
    plan = join(
        [record(acme, "acme"), record(globex, "glo:bex%")],
        [billing_of(acme, "acme"), billing_of(globex, "glo:bex%")],
    )
    store = FakeStore()
    assert (await apply(store, plan.requests)).applied == 2  # type: ignore[arg-type]
    [batch] = store.batches
    both = [RequestRef("acme", "r1"), RequestRef("glo:bex%", "r1")]
    assert [r.tokens_key for r in batch] == [tokens_key(ref) for ref in both]
    assert [r.closed_key.split(":closed:", 1)[1] for r in batch] == ["acme:r1", "glo%3Abex%25:r1"]
    assert len({r.usage_key for r in batch}) == 2
    assert {r.closed for r in batch} == {CLOSED_MARKER}


def test_a_tenant_with_colons_and_percents_round_trips_through_the_key() -> None:
    tokens = make_tokens("r:1")
    event = billing_of(tokens, tenant="a:b%3Ac")
    plan = join([record(tokens, "a:b%3Ac")], [event])
    assert refs(plan) == [RequestRef("a:b%3Ac", "r:1")]
    assert plan.skipped == []


def test_a_v1_record_joins_the_billing_event_of_its_one_tenant() -> None:
    tokens = make_tokens("r1")
    event = billing_of(tokens, tenant="globex")
    plan = join([v1_record(tokens)], [event])
    assert [(r.ref, r.tokens, r.billing) for r in plan.requests] == [
        (RequestRef("globex", "r1"), tokens, event)
    ]
    assert plan.skipped == []


def test_a_v1_record_whose_id_was_billed_to_two_tenants_is_skipped() -> None:
    tokens = make_tokens("r1")
    plan = join([v1_record(tokens)], [billing_of(tokens, "acme"), billing_of(tokens, "globex")])
    assert plan.requests == []
    ambiguous, *no_tokens = plan.skipped
    assert (ambiguous.request_id, ambiguous.tenant) == ("r1", None)
    assert ambiguous.reason is SkipReason.AMBIGUOUS
    assert ambiguous.reason.value == "v1 tokens record, several tenants billed this id"
    assert "'acme', 'globex'" in ambiguous.detail
    # the two billing events have no Tokens of their own: each is reported, saying why
    assert [(s.ref, s.reason) for s in no_tokens] == [
        (RequestRef("acme", "r1"), SkipReason.NO_TOKENS),
        (RequestRef("globex", "r1"), SkipReason.NO_TOKENS),
    ]
    assert all("v1 tokens record" in s.detail for s in no_tokens)


def test_a_v1_record_billed_to_two_tenants_each_with_a_later_record_is_superseded() -> None:
    old, acme, globex = make_tokens("r1", "old"), make_tokens("r1", "a"), make_tokens("r1", "g")
    records = [v1_record(old), record(acme, "acme"), record(globex, "globex")]
    plan = join(records, [billing_of(acme, "acme"), billing_of(globex, "globex")])
    assert [r.tokens.text for r in plan.requests] == ["a", "g"]
    assert (plan.skipped, plan.tokens_superseded) == ([], 1)


def test_a_later_v2_record_supersedes_a_v1_record_of_the_same_request() -> None:
    old, new = make_tokens("r1", text="v1"), make_tokens("r1", text="v2")
    plan = join([v1_record(old), record(new)], [billing_of(new)])
    assert [r.tokens for r in plan.requests] == [new]
    assert (plan.skipped, plan.tokens_superseded) == ([], 1)


def test_a_later_v1_record_supersedes_an_earlier_v2_record() -> None:
    old, new = make_tokens("r1", text="v2 first"), make_tokens("r1", text="v1 later")
    plan = join([record(old), v1_record(new)], [billing_of(new)])
    assert [r.tokens for r in plan.requests] == [new]
    assert plan.tokens_superseded == 1


def test_v1_records_that_no_tenant_claims_are_reported_with_the_tenant_unknown() -> None:
    lonely, gone = make_tokens("lonely"), make_tokens("gone")
    records = [
        v1_record(lonely),
        v1_record(gone),
        TokensRecord("gone"),  # a tombstone of a v1 key
        TokensRecord("bad", error="tokens[1]@3: bad marker"),
    ]
    plan = join(records, [billing_of(gone, "acme"), billing_of(gone, "globex")])
    assert [(s.request_id, s.tenant, s.reason) for s in plan.skipped] == [
        ("bad", None, SkipReason.UNDECODABLE),
        ("gone", None, SkipReason.DELETED),
        ("gone", "acme", SkipReason.NO_TOKENS),
        ("gone", "globex", SkipReason.NO_TOKENS),
        ("lonely", None, SkipReason.NO_BILLING),
    ]
    assert all("tenant unknown" in s.detail for s in plan.skipped if s.tenant is None)
    assert "tokens[1]@3: bad marker" in plan.skipped[0].detail


def test_a_v1_tombstone_of_a_request_with_one_tenant_deletes_it() -> None:
    tokens = make_tokens("r1")
    plan = join([v1_record(tokens), TokensRecord("r1")], [billing_of(tokens, "globex")])
    assert plan.requests == []
    assert plan.skipped == [Skipped("r1", SkipReason.DELETED, tenant="globex")]


def test_a_record_keyed_by_a_ref_of_another_request_id_is_undecodable() -> None:
    tokens = make_tokens("r1")
    forged = TokensRecord(key("r2"), tokens, where="st.tokens[2]@5")
    plan = join([forged], [billing_of(tokens)])
    assert plan.requests == []
    assert [(s.ref, s.reason) for s in plan.skipped] == [
        (RequestRef("acme", "r1"), SkipReason.NO_TOKENS),
        (RequestRef("acme", "r2"), SkipReason.UNDECODABLE),
    ]
    assert plan.skipped[1].detail == "st.tokens[2]@5: keyed 'acme:r2' but holds 'r1'"


def test_a_record_keyed_by_neither_a_ref_nor_its_request_id_is_undecodable() -> None:
    tokens = make_tokens("r1")
    plan = join([TokensRecord("other", tokens)], [])
    assert [(s.request_id, s.tenant, s.reason) for s in plan.skipped] == [
        ("other", None, SkipReason.UNDECODABLE)
    ]
    assert "keyed 'other' but holds 'r1'" in plan.skipped[0].detail


class FakeStore:
    """What `apply` needs of a `RedisStore`: `ensure_layout` and `apply_requests`."""

    def __init__(self, layout_error: str | None = None) -> None:
        self.layout_error = layout_error
        self.ensured = False
        self.batches: list[list[FinishedRequest]] = []

    async def ensure_layout(self) -> None:
        if self.layout_error is not None:
            raise LayoutError(self.layout_error)
        self.ensured = True

    async def apply_requests(self, batch: Sequence[FinishedRequest]) -> list[bool]:
        assert self.ensured, "wrote before ensure_layout"
        self.batches.append(list(batch))
        return [True] * len(batch)


async def test_the_rebuild_writes_nothing_to_a_redis_of_another_layout() -> None:
    tokens = make_tokens("r1")
    plan = join([record(tokens)], [billing_of(tokens)])
    store = FakeStore(layout_error="Redis holds streamtally data of layout version 1")
    with pytest.raises(LayoutError, match="layout version 1"):
        await apply(store, plan.requests)  # type: ignore[arg-type]
    assert store.batches == []


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
    assert store.ensured
    [batch] = store.batches
    assert [(r.closed_key.split(":closed:", 1)[1], r.priced, r.argv()[-1]) for r in batch] == [
        ("acme:priced", True, "0"),
        ("acme:unknown", False, "1"),  # the flush script adds 1 to the row's unpriced_requests
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


def test_the_summaries_show_the_tenant_of_skipped_requests() -> None:
    skipped = [
        Skipped("r1", SkipReason.NO_BILLING, tenant="acme"),
        Skipped("r2", SkipReason.AMBIGUOUS, "billed to tenants 'a', 'b'"),
        Skipped(None, SkipReason.UNDECODABLE, "st.tokens[0]@1: record has no key"),
    ]
    text = _summary_text(Plan(), Applied(), skipped)
    assert "  skipped r1 (tenant acme): tokens without billing event\n" in text
    assert (
        "  skipped r2: v1 tokens record, several tenants billed this id: "
        "billed to tenants 'a', 'b'\n"
    ) in text
    assert "  skipped ?: record does not decode: " in text
    summary = _summary_json(Inputs(), Plan(), Applied(), skipped)
    assert [(s["tenant"], s["request_id"]) for s in summary["skipped"]] == [
        ("acme", "r1"),
        (None, "r2"),
        (None, None),
    ]


def test_the_help_says_requests_are_joined_by_tenant_and_request_id(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rebuild", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "join them by request (tenant and request id)" in out
    assert "by request id" not in out


# --------------------------------------------------------------------------- amended requests


async def _rebuilt(
    topics: FakeTopics, monkeypatch: pytest.MonkeyPatch
) -> tuple[Inputs, Plan, FakeStore]:
    """`read_inputs` over the stand-in topics, `join`, `apply` into a stand-in store."""
    monkeypatch.setattr(_read, "read_topic", topics.read_topic)
    monkeypatch.setattr(kafka, "read_topic", topics.read_topic)  # the corrections topic
    inputs = await read_inputs(
        "fake:9092",
        tokens_topic=TOPICS.tokens.name,
        billing_topic=TOPICS.billing.name,
        corrections_topic=TOPICS.corrections.name,
    )
    plan = join(inputs.tokens, inputs.billing)
    store = FakeStore()
    await apply(store, plan.requests)  # type: ignore[arg-type]
    return inputs, plan, store


def _amended(topics: FakeTopics) -> tuple[BillingEvent, BillingEvent, Tokens]:
    """Request r1 closed at its timeout with nothing, then amended with its whole usage; r2
    billed once.  Tokens of r1: revision 0's, then revision 1's (the compacted topic keeps
    the latest)."""
    timed_out = Tokens(
        request_id="r1",
        source=Source.OPENAI,
        model="gpt-4.1-2025-04-14",
        text="hel",
        reasoning="",
        tool_calls=(),
        usage=Usage(),
        finish_reason=FinishReason.ERROR,
        finish_reason_raw=None,
        error="request timed out",
        chunks=1,
    )
    whole, other = make_tokens("r1", output_tokens=96), make_tokens("r2")
    first = bill(timed_out, "acme", WHEN, PRICES)
    amended = bill(whole, "acme", WHEN + timedelta(seconds=9), PRICES, revision=1)
    for tokens in (timed_out, other, whole):
        ref = output_key(RequestRef("acme", tokens.request_id))
        topics.append(TOPICS.tokens.name, ref, avro.encode_tokens(tokens))
    topics.bill(first, billing_of(other), amended)
    return first, amended, whole


async def test_an_amended_request_is_rebuilt_from_its_standing_revision_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topics = FakeTopics()
    first, amended, whole = _amended(topics)
    inputs, plan, store = await _rebuilt(topics, monkeypatch)
    assert (inputs.billing_records, inputs.revised, inputs.superseded) == (3, 1, 0)
    assert plan.skipped == []
    assert [(r.ref.request_id, r.billing) for r in plan.requests if r.ref.request_id == "r1"] == [
        ("r1", amended)
    ]
    [batch] = store.batches
    assert len(batch) == 2
    [row] = [r for r in batch if r.tokens_key == tokens_key(RequestRef("acme", "r1"))]
    # the amended bill once, as the worker's row holds it: not revision 0's too
    assert (first.output_tokens, first.cost) == (0, 0)
    assert row.usage == (1520, 96, 0, 1408, 0)
    assert Decimal(row.cost_units) + Decimal(row.cost_pico) / 10**12 == amended.cost
    assert row.tokens_json == tokens_json(whole)
    summary = _summary_json(inputs, plan, Applied(applied=2), [])
    assert (summary["billing_records"], summary["billing_revised"]) == (3, 1)
    text = _summary_text(plan, Applied(applied=2), [], inputs)
    assert "1 billing events superseded by a later revision" in text


async def test_a_correction_of_revision_0_gives_way_to_a_later_revision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topics = FakeTopics()
    first, amended, _ = _amended(topics)
    # an audit saw revision 0 (offset 0) and corrected it; revision 1 came after it
    topics.correct(correction(first, dataclasses.replace(first, input_tokens=3), before=1))
    inputs, plan, _ = await _rebuilt(topics, monkeypatch)
    assert (inputs.corrections, inputs.superseded, inputs.revised) == (1, 1, 1)
    assert [r.billing for r in plan.requests if r.ref.request_id == "r1"] == [amended]
