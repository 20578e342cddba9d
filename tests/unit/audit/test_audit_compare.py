"""`streamtally.audit`: the comparisons, the billing index, the ledger and the time range,
as pure functions (no Kafka, no Redis)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from streamtally.audit import TimeRange, parse_time
from streamtally.audit._billing import BillingIndex, Entry
from streamtally.audit._compare import (
    Discrepancy,
    Kind,
    billing_discrepancies,
    event_digest,
    event_key,
    legacy_digest,
    missing_billing,
    unexpected_billing,
)
from streamtally.audit._ledger import Ledger, Scope
from streamtally.audit._rows import RowSum, compare_rows, row_key
from streamtally.audit._snapshot import _window
from streamtally.billing.events import event_id
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source
from streamtally.errors import InputError
from streamtally.wire.records import BillingEvent, UsageSource

WHEN = datetime(2026, 11, 23, 10, 30, tzinfo=UTC)
DAY = "2026-11-23"


def event(request_id: str = "r1", tenant: str = "acme", **changes: Any) -> BillingEvent:
    base = BillingEvent(
        event_id=event_id(tenant, request_id),
        request_id=request_id,
        tenant=tenant,
        model="gpt-4.1-2025-04-14",
        source=Source.OPENAI,
        finish_reason=FinishReason.STOP,
        input_tokens=1520,
        output_tokens=48,
        cached_tokens=1408,
        cost=Decimal("0.001292000000"),
        price_table_version="2026-11-01",
        event_time=WHEN,
    )
    return dataclasses.replace(base, **changes)


# --------------------------------------------------------------------------- the range


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-23", datetime(2026, 11, 23, tzinfo=UTC)),
        ("2026-11-23T10:00:00Z", datetime(2026, 11, 23, 10, tzinfo=UTC)),
        ("2026-11-23t10:00:00z", datetime(2026, 11, 23, 10, tzinfo=UTC)),
        ("2026-11-23 10:00:00.250+01:00", datetime(2026, 11, 23, 9, 0, 0, 250000, tzinfo=UTC)),
        ("2026-11-23T10:00:00-05:30", datetime(2026, 11, 23, 15, 30, tzinfo=UTC)),
    ],
)
def test_times_are_rfc3339_or_utc_dates(text: str, expected: datetime) -> None:
    parsed = parse_time(text)
    assert parsed == expected
    assert parsed.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    "text",
    [
        "2026-11-23T10:00:00",  # no offset: which zone?
        "2026-11-23T10:00Z",
        "2026-13-01",
        "2026-02-30T10:00:00Z",
        "yesterday",
        "1732356000",
        "",
        "2026-11-23T25:00:00Z",
    ],
)
def test_other_times_are_refused(text: str) -> None:
    with pytest.raises(InputError):
        parse_time(text)


def test_a_range_holds_whole_days_only() -> None:
    since = parse_time("2026-11-23T10:00:00Z")
    until = parse_time("2026-11-26")
    window = TimeRange(since, until)
    assert not window.contains(since - timedelta(microseconds=1))
    assert window.contains(since)
    assert not window.contains(until)
    assert [
        d for d in ("2026-11-23", "2026-11-24", "2026-11-25", "2026-11-26") if window.holds_day(d)
    ] == [
        "2026-11-24",
        "2026-11-25",
    ]
    assert TimeRange().holds_day("1999-01-01")
    assert TimeRange(parse_time("2026-11-23")).holds_day("2026-11-23")
    with pytest.raises(InputError, match="must be before"):
        TimeRange(until, since)
    with pytest.raises(InputError):
        TimeRange(since, since)


def test_retention_moves_the_start_past_what_was_deleted() -> None:
    first = parse_time("2026-11-20T08:00:00Z")
    held = first + timedelta(seconds=300)
    assert _window(TimeRange(), None, 300) == TimeRange()
    assert _window(TimeRange(), first.timestamp(), 300) == TimeRange(held)
    later = parse_time("2026-11-21")
    assert _window(TimeRange(later), first.timestamp(), 300) == TimeRange(later)
    assert _window(TimeRange(parse_time("2026-11-19")), first.timestamp(), 300) == TimeRange(held)
    with pytest.raises(InputError, match="retention"):
        _window(TimeRange(None, first), first.timestamp(), 300)


# --------------------------------------------------------------------------- events


def test_the_digest_sees_every_compared_field_and_nothing_else() -> None:
    base = event()
    assert event_digest(base) == event_digest(event())
    assert event_digest(dataclasses.replace(base, price_table_version="other")) == event_digest(
        base
    )
    changes: dict[str, Any] = {
        "model": "gpt-4o",
        "source": Source.GEMINI,
        "finish_reason": FinishReason.LENGTH,
        "input_tokens": 1521,
        "output_tokens": 49,
        "reasoning_tokens": 1,
        "cached_tokens": 1,
        "cache_write_tokens": 1,
        "cost": Decimal("0.001292000001"),
        "currency": "EUR",
        "event_time": WHEN + timedelta(microseconds=1),
    }
    for name, value in changes.items():
        assert event_digest(dataclasses.replace(base, **{name: value})) != event_digest(base), name
    unpriced = dataclasses.replace(base, priced=False, cost=Decimal(0))
    assert event_digest(unpriced) != event_digest(dataclasses.replace(base, cost=Decimal(0)))


def test_one_differing_event_names_each_field_with_its_kind() -> None:
    expected = event()
    found = dataclasses.replace(expected, output_tokens=50, cost=Decimal("0.001300000000"))
    got = billing_discrepancies(expected, [found], conflicting=False)
    assert [(d.kind, d.field, d.expected, d.found) for d in got] == [
        (Kind.USAGE_MISMATCH, "output_tokens", 48, 50),
        (Kind.COST_MISMATCH, "cost", "0.001292000000", "0.001300000000"),
    ]
    assert {(d.request_id, d.tenant, d.model, d.day) for d in got} == {
        ("r1", "acme", "gpt-4.1-2025-04-14", None)
    }
    assert billing_discrepancies(expected, [expected], conflicting=False) == []
    unpriced = dataclasses.replace(expected, priced=False, cost=Decimal(0))
    assert {d.field for d in billing_discrepancies(expected, [unpriced], conflicting=False)} == {
        "cost",
        "priced",
    }
    late = dataclasses.replace(expected, event_time=WHEN + timedelta(days=1))
    (moved,) = billing_discrepancies(expected, [late], conflicting=False)
    assert (moved.kind, moved.field) == (Kind.USAGE_MISMATCH, "event_time")


def test_conflicting_events_are_conflicts_field_by_field() -> None:
    expected = event()
    other = dataclasses.replace(expected, output_tokens=49)
    (got,) = billing_discrepancies(expected, [other], conflicting=True)
    assert (got.kind, got.field, got.expected, got.found) == (
        Kind.CONFLICTING_BILLING,
        "output_tokens",
        48,
        49,
    )


def test_missing_and_unexpected_name_the_money_at_stake() -> None:
    assert missing_billing(event()).to_json() == {
        "kind": "missing_billing",
        "request_id": "r1",
        "tenant": "acme",
        "model": "gpt-4.1-2025-04-14",
        "day": None,
        "field": "cost",
        "expected": "0.001292000000",
        "found": None,
    }
    got = unexpected_billing(event("forged", model=None))
    assert (got.kind, got.model, got.expected, got.found) == (
        Kind.UNEXPECTED_BILLING,
        None,
        None,
        "0.001292000000",
    )


# --------------------------------------------------------------------------- rows


def test_row_sums_are_exact() -> None:
    total = RowSum()
    total.add(event("a", cost=Decimal("0.000000000001")))
    total.add(event("b", cost=Decimal("1.999999999999")))
    total.add(event("c", cost=Decimal(0), priced=False))
    assert total.values() == {
        "requests": 3,
        "unpriced_requests": 1,
        "input_tokens": 3 * 1520,
        "output_tokens": 3 * 48,
        "reasoning_tokens": 0,
        "cached_tokens": 3 * 1408,
        "cache_write_tokens": 0,
        "cost": "2.000000000000",
    }
    assert row_key(event(model=None)) == ("acme", "unknown", DAY)


def _row(**changes: Any) -> dict[str, Any]:
    row = {
        "requests": 2,
        "unpriced_requests": 0,
        "input_tokens": 10,
        "output_tokens": 5,
        "reasoning_tokens": 0,
        "cached_tokens": 0,
        "cache_write_tokens": 0,
        "cost": "0.100000000000",
    }
    return {**row, **changes}


def test_rows_are_compared_field_by_field() -> None:
    key = ("acme", "m", DAY)
    same = compare_rows({key: _row()}, {key: _row()})
    assert (same.checked, same.matched, same.mismatched, same.discrepancies) == (1, 1, 0, [])
    differ = compare_rows({key: _row()}, {key: _row(output_tokens=10, cost="0.2")})
    assert (differ.checked, differ.mismatched) == (1, 1)
    assert differ.discrepancies == [
        Discrepancy(Kind.USAGE_ROW_MISMATCH, None, "acme", "m", DAY, "output_tokens", 5, 10),
        Discrepancy(
            Kind.USAGE_ROW_MISMATCH, None, "acme", "m", DAY, "cost", "0.100000000000", "0.2"
        ),
    ]
    gone = compare_rows({key: _row()}, {})
    assert {(d.field, d.found) for d in gone.discrepancies} == {
        ("requests", None),
        ("input_tokens", None),
        ("output_tokens", None),
        ("cost", None),
    }
    extra = compare_rows({}, {key: _row()})
    assert {d.expected for d in extra.discrepancies} == {None}
    zeros = _row(requests=0, input_tokens=0, output_tokens=0, cost="0.000000000000")
    assert compare_rows({}, {key: zeros}).mismatched == 0
    only = compare_rows({key: _row()}, {key: _row(requests=3)}, keys=[])
    assert only.checked == 0


# --------------------------------------------------------------------------- index and ledger


def _ledger(*billed: BillingEvent, scope: Scope | None = None) -> Ledger:
    index = BillingIndex()
    for e in billed:
        index.add(e)
    return Ledger(index, scope or Scope(TimeRange()))


def test_the_index_collapses_replays_and_keeps_conflicts() -> None:
    index = BillingIndex()
    first = event()
    index.add(first)
    index.add(first)  # a byte-identical replay
    assert (index.records, index.billed, len(index)) == (2, 1, 1)
    index.add(dataclasses.replace(first, output_tokens=1))
    assert index.billed == 1
    entry = index.take(event_key(first.event_id))
    assert entry is not None
    assert entry.conflicting
    assert index.take(event_key(first.event_id)) is None
    assert index.remaining() == set()


def test_the_ledger_sorts_every_request_into_one_outcome() -> None:
    good, wrong, twice, missing = event("good"), event("wrong"), event("twice"), event("missing")
    forged, half = event("forged", tenant="globex"), event("half")
    ledger = _ledger(
        good,
        dataclasses.replace(wrong, input_tokens=1),
        twice,
        dataclasses.replace(twice, cost=Decimal("9.000000000000")),
        forged,
        half,
    )
    for e in (good, wrong, twice, missing):
        ledger.closed(e)
    ledger.partial(RequestRef("acme", "half"), DAY, "open at the snapshot")
    ledger.dead_lettered(RequestRef("acme", "lone"))
    wanted = ledger.close_index()
    assert wanted == {event_key(e.event_id) for e in (wrong, twice, forged)}
    assert ledger.counts.to_json() == {
        "replayed": 4,
        "amended": 0,
        "billed": 5,
        "matched": 1,
        "mismatched": 1,
        "missing_billing": 1,
        "unexpected_billing": 1,
        "conflicting_billing": 1,
        "partial": 1,
        "dead_lettered": 1,
    }
    ledger.resolve(
        {
            event_key(wrong.event_id): [dataclasses.replace(wrong, input_tokens=1)],
            event_key(twice.event_id): [
                twice,
                dataclasses.replace(twice, cost=Decimal("9.000000000000")),
            ],
            event_key(forged.event_id): [forged, forged],
        }
    )
    got = sorted((d.kind.value, d.request_id, d.field) for d in ledger.discrepancies)
    assert got == [
        ("conflicting_billing", "twice", "cost"),
        ("missing_billing", "missing", "cost"),
        ("unexpected_billing", "forged", "cost"),
        ("usage_mismatch", "wrong", "input_tokens"),
    ]
    assert ledger.totals()["acme"]["requests"] == 4


def test_rows_are_checked_only_where_the_audit_saw_everything() -> None:
    scope = Scope(
        TimeRange(parse_time("2026-11-23"), parse_time("2026-11-25")), frozenset({"acme", "globex"})
    )
    ledger = _ledger(scope=scope)
    inside = event("a")  # 2026-11-23, a whole day of the range
    ledger.closed(inside)
    ledger.closed(event("b", tenant="globex", event_time=WHEN + timedelta(days=1)))
    ledger.partial(RequestRef("globex", "open"), "2026-11-24", "open at the snapshot")

    def stored(tenant: str, day: str, **changes: Any) -> dict[str, Any]:
        values = RowSum()
        values.add(event(tenant=tenant, event_time=parse_time(day) + timedelta(hours=1)))
        return {
            "tenant": tenant,
            "model": "gpt-4.1-2025-04-14",
            "day": day,
            **values.values(),
            **changes,
        }

    rows, skipped = ledger.compare_rows(
        [
            stored("acme", DAY),  # checked, matches
            stored("acme", "2026-11-24", requests=7),  # checked: nothing replayed there
            stored("globex", "2026-11-24", requests=9),  # a partial request may be in it
            stored("acme", "2026-11-22", requests=9),  # before the range
            stored("acme", "2026-11-25", requests=9),  # after the range
            stored("initech", DAY, requests=9),  # a tenant not audited
        ]
    )
    assert skipped == 1
    assert (rows.checked, rows.matched, rows.mismatched) == (2, 1, 1)
    assert {(d.tenant, d.day, d.field, d.expected, d.found) for d in rows.discrepancies} >= {
        ("acme", "2026-11-24", "requests", None, 7)
    }


# --------------------------------------------------------------------------- provenance

SHA = "ab" * 32
PROVENANCE: dict[str, Any] = {
    "raw_topic": "streamtally.raw.sse",
    "raw_partition": 2,
    "first_offset": 40,
    "last_offset": 57,
    "raw_sha256": SHA,
    "usage_source": UsageSource.PROVIDER_REPORTED,
}


def proven(request_id: str = "r1", **changes: Any) -> BillingEvent:
    """`event` with the provenance a v3 worker gives it."""
    return event(request_id, **{**PROVENANCE, **changes})


def test_each_provenance_field_is_a_provenance_mismatch() -> None:
    expected = proven()
    changes: dict[str, Any] = {
        "raw_topic": "streamtally.raw.engine",
        "raw_partition": 3,
        "first_offset": 39,
        "last_offset": 58,
        "raw_sha256": "cd" * 32,
        "usage_source": UsageSource.MISSING,
    }
    for name, value in changes.items():
        found = dataclasses.replace(expected, **{name: value})
        assert event_digest(found) != event_digest(expected), name
        (got,) = billing_discrepancies(expected, [found], conflicting=False)
        want = value.value if isinstance(value, UsageSource) else value
        have = PROVENANCE[name]
        have = have.value if isinstance(have, UsageSource) else have
        assert (got.kind, got.field, got.expected, got.found) == (
            Kind.PROVENANCE_MISMATCH,
            name,
            have,
            want,
        )
    # Tampered usage shows both: the count differs, and so does where it came from.
    zeroed = dataclasses.replace(
        expected, input_tokens=0, output_tokens=0, cached_tokens=0, usage_source=UsageSource.MISSING
    )
    got = billing_discrepancies(expected, [zeroed], conflicting=False)
    assert {(d.kind, d.field) for d in got} == {
        (Kind.USAGE_MISMATCH, "input_tokens"),
        (Kind.USAGE_MISMATCH, "output_tokens"),
        (Kind.USAGE_MISMATCH, "cached_tokens"),
        (Kind.PROVENANCE_MISMATCH, "usage_source"),
    }


def test_an_event_of_before_v3_has_no_provenance_to_mismatch() -> None:
    expected = proven()
    old = event()  # what a v2 event decodes to: no provenance, usage_source unknown
    assert not old.has_provenance
    assert old.usage_source is UsageSource.UNKNOWN
    assert billing_discrepancies(expected, [old], conflicting=False) == []
    assert legacy_digest(expected) == event_digest(old) != event_digest(expected)
    # ... but its other fields still are compared.
    wrong = dataclasses.replace(old, output_tokens=1)
    (got,) = billing_discrepancies(expected, [wrong], conflicting=False)
    assert (got.kind, got.field) == (Kind.USAGE_MISMATCH, "output_tokens")


def test_the_ledger_matches_a_bill_of_before_v3_and_catches_a_tampered_hash() -> None:
    old, fine, tampered = event("old"), proven("fine"), proven("tampered")
    ledger = _ledger(old, fine, dataclasses.replace(tampered, raw_sha256="00" * 32))
    for e in (proven("old"), fine, tampered):
        ledger.closed(e)
    assert ledger.close_index() == {event_key(tampered.event_id)}
    assert (ledger.counts.matched, ledger.counts.mismatched) == (2, 1)
    ledger.resolve(
        {event_key(tampered.event_id): [dataclasses.replace(tampered, raw_sha256="00" * 32)]}
    )
    (got,) = ledger.discrepancies
    assert (got.kind.value, got.request_id, got.field, got.expected, got.found) == (
        "provenance_mismatch",
        "tampered",
        "raw_sha256",
        SHA,
        "00" * 32,
    )


def test_the_index_takes_a_v3_copy_of_a_v2_bill_as_the_same_bill() -> None:
    """A worker upgraded while the request was replayed: v2 event, then its v3 copy."""
    index = BillingIndex()
    index.add(event())
    index.add(proven())
    index.add(proven())
    assert (index.records, index.billed) == (3, 1)
    entry = index.take(event_key(event().event_id))
    assert entry == Entry(event_digest(proven()))
    other = BillingIndex()
    other.add(event())
    other.add(proven(output_tokens=1))  # not the same bill: a conflict
    conflict = other.take(event_key(event().event_id))
    assert conflict is not None
    assert conflict.conflicting


def test_an_amendment_moves_the_row_and_one_unbilled_is_its_own_kind() -> None:
    """Revision 1 of a request supersedes revision 0 in the replay's rows (the row counts
    the request once, at revision 1); an amendment with no billing event is an
    `unbilled_amendment`, not a plain missing bill."""
    zero = event(
        "late",
        finish_reason=FinishReason.ERROR,
        input_tokens=0,
        output_tokens=0,
        cached_tokens=0,
        cost=Decimal("0.000000000000"),
    )
    one = event(
        "late",
        event_id=event_id("acme", "late", 1),
        revision=1,
        supersedes=zero.event_id,
    )
    ledger = _ledger(zero, one)
    ledger.closed(zero)
    ledger.closed(one, zero)
    assert ledger.counts.to_json()["replayed"] == 1
    assert ledger.counts.to_json()["amended"] == 1
    assert ledger.counts.matched == 2
    totals = ledger.totals()["acme"]
    assert (totals["requests"], totals["input_tokens"], totals["cost"]) == (
        1,
        1520,
        "0.001292000000",
    )
    # The worker dead-lettered the late records instead: revision 1 billed nowhere.
    unbilled = _ledger(zero)
    unbilled.closed(zero)
    unbilled.closed(one, zero)
    (found,) = unbilled.discrepancies
    assert found.kind.value == "unbilled_amendment"
    assert (found.request_id, found.field, found.expected) == ("late", "cost", "0.001292000000")
