"""``audit --correct`` as pure functions: the correction record, its Avro bytes, how a billing
consumer applies corrections (`CorrectionLog`) and what an audit plans to write (no Kafka,
no Redis; the integration tier writes and re-audits them)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from streamtally.audit._billing import BillingIndex
from streamtally.audit._compare import Kind, event_key
from streamtally.audit._corrections import audit_id, plan_corrections
from streamtally.audit._ledger import Ledger, Scope
from streamtally.audit._range import TimeRange
from streamtally.audit._rows import row_key
from streamtally.billing.corrections import CorrectionLog
from streamtally.wire import avro
from streamtally.wire.avro import AvroDecodeError
from streamtally.wire.records import BillingCorrection, BillingEvent
from tests.unit.audit.test_audit_compare import DAY, event

NOW = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
AUDIT = "0123456789abcdef0123456789abcdef"


def correction(**changes: Any) -> BillingCorrection:
    bill = event("r1")
    base = BillingCorrection(
        correction_id="f" * 32,
        audit_id=AUDIT,
        reason="usage_mismatch",
        field="input_tokens",
        tenant="acme",
        request_id="r1",
        model=bill.model,
        expected="1520",
        found="1620",
        superseded_event_id=bill.event_id,
        billing_before={0: 10, 3: 7},
        corrected=bill,
        input_tokens=bill.input_tokens,
        output_tokens=bill.output_tokens,
        cached_tokens=bill.cached_tokens,
        requests=1,
        cost=bill.cost,
        created_at=NOW,
    )
    return dataclasses.replace(base, **changes)


# --------------------------------------------------------------------------- the record


def test_a_correction_round_trips_through_avro() -> None:
    for c in (
        correction(),
        correction(reason="unexpected_billing", corrected=None, requests=0, cost=Decimal(0)),
        correction(
            reason="usage_row_mismatch",
            request_id=None,
            day=DAY,
            superseded_event_id=None,
            corrected=None,
            billing_before={},
            requests=44,
            cost=Decimal("12.345678901234"),
        ),
    ):
        data = avro.encode_billing_correction(c)
        assert data[:2] == b"\xc3\x01"  # a single-object message
        assert data[2:10] == avro.current("BillingCorrection").fingerprint
        back = avro.decode_billing_correction(data)
        assert back == dataclasses.replace(c, billing_before=dict(c.billing_before))
    # another record's bytes are refused, not misread
    with pytest.raises(AvroDecodeError, match="expected a BillingCorrection"):
        avro.decode_billing_correction(avro.encode_billing_event(event()))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"correction_id": "xyz"}, "correction_id must be 32"),
        ({"reason": "because"}, "unknown correction reason"),
        ({"superseded_event_id": None, "corrected": None}, "supersedes a bill, or carries one"),
        ({"request_id": None}, "names its day"),
        ({"day": DAY}, "names no day"),
        ({"cost": 0.5}, "float"),
        ({"requests": -1}, "requests must be an int >= 0"),
        ({"created_at": datetime(2026, 11, 24)}, "timezone-aware"),  # noqa: DTZ001
    ],
)
def test_a_correction_checks_itself(changes: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        correction(**changes)


# --------------------------------------------------------------------------- a consumer


def test_a_consumer_applies_corrections_by_event_id_and_offset() -> None:
    bill = event("r1")
    wrong = dataclasses.replace(bill, input_tokens=1620)
    log = CorrectionLog()
    log.add(correction(billing_before={2: 10}))
    # the event it supersedes: that id, on that partition, below the offset
    assert log.superseded(wrong, 2, 9)
    assert not log.superseded(wrong, 2, 10)  # billed after the audit: a new bill
    assert not log.superseded(wrong, 1, 0)  # nothing read of partition 1
    assert not log.superseded(event("r2"), 2, 0)  # another request
    assert log.standing() == [bill]
    # a later correction of the same bill replaces the earlier one
    voided = correction(
        reason="unexpected_billing", corrected=None, billing_before={2: 20}, cost=Decimal(0)
    )
    log.add(voided)
    assert log.superseded(wrong, 2, 15)
    assert log.standing() == []
    # a missing bill stands under its own id; a row correction bills nothing
    missing = event("r3")
    log.add(correction(reason="missing_billing", superseded_event_id=None, corrected=missing))
    log.add(
        correction(
            reason="usage_row_mismatch",
            request_id=None,
            day=DAY,
            superseded_event_id=None,
            corrected=None,
        )
    )
    assert log.standing() == [missing]
    assert (log.records, log.rows, len(log)) == (4, 1, 2)


# --------------------------------------------------------------------------- the plan


def _ledger() -> tuple[Ledger, list[BillingEvent]]:
    """A ledger with one bill altered, one missing, one forged and one row that differs."""
    altered, missing, kept = event("r1"), event("r2"), event("r3")
    forged = event("ghost", tenant="acme", cost=Decimal("0.5"))
    wrong = dataclasses.replace(altered, input_tokens=1620)
    index = BillingIndex()
    for e in (wrong, kept, forged):
        index.add(e)
    ledger = Ledger(index, Scope(TimeRange()))
    for e in (altered, missing, kept):
        ledger.closed(e)
    wanted = ledger.close_index()
    assert wanted == {event_key(wrong.event_id), event_key(forged.event_id)}
    ledger.resolve({event_key(e.event_id): [e] for e in (wrong, forged)})
    return ledger, [altered, missing, kept, forged]


def test_the_plan_has_one_correction_per_discrepancy() -> None:
    ledger, (altered, missing, kept, forged) = _ledger()
    tenant, model, day = row_key(kept)
    stored = {
        "tenant": tenant,
        "model": model,
        "day": day,
        "requests": 2,
        "unpriced_requests": 0,
        "input_tokens": 2 * 1520,
        "output_tokens": 2 * 48,
        "reasoning_tokens": 0,
        "cached_tokens": 2 * 1408,
        "cache_write_tokens": 0,
        "cost": "0.002584000000",
    }
    rows, _ = ledger.compare_rows([stored])
    found = ledger.discrepancies + rows.discrepancies
    kinds = sorted(d.kind for d in found)
    assert kinds == sorted(
        [
            Kind.USAGE_MISMATCH,
            Kind.MISSING_BILLING,
            Kind.UNEXPECTED_BILLING,
            *[Kind.USAGE_ROW_MISMATCH] * 5,  # requests, input, output, cached, cost
        ]
    )
    before = {0: 5, 1: 9}
    plan = plan_corrections(
        found, ledger, audit=AUDIT, billing_before=before, currency="USD", now=NOW
    )
    assert len(plan.corrections) == len(found)
    by_reason: dict[str, list[BillingCorrection]] = {}
    for c in plan.corrections:
        by_reason.setdefault(c.reason, []).append(c)
        assert c.audit_id == AUDIT
        assert c.created_at == NOW
    [usage] = by_reason["usage_mismatch"]
    assert (usage.superseded_event_id, usage.corrected) == (altered.event_id, altered)
    assert (usage.input_tokens, usage.requests, usage.cost) == (1520, 1, altered.cost)
    assert (usage.expected, usage.found) == ("1520", "1620")
    assert usage.billing_before == before
    [gone] = by_reason["missing_billing"]
    assert (gone.superseded_event_id, gone.corrected) == (None, missing)
    [void] = by_reason["unexpected_billing"]
    assert (void.superseded_event_id, void.corrected) == (forged.event_id, None)
    assert (void.requests, void.cost, void.input_tokens) == (0, Decimal(0), 0)
    # the row: every correction carries the whole row as the replay sums it
    for c in by_reason["usage_row_mismatch"]:
        assert (c.request_id, c.day, c.superseded_event_id) == (None, day, None)
        assert (c.requests, c.input_tokens, c.cost) == (3, 3 * 1520, Decimal("0.003876000000"))
    # one difference per row, added once: the replay's three requests against the two found
    [fix] = plan.row_fixes
    assert fix.day_tenant_model == (day, tenant, model)
    assert fix.differences == {
        "requests": 1,
        "input_tokens": 1520,
        "output_tokens": 48,
        "cached_tokens": 1408,
        "cost_pico": 1_292_000_000,
    }
    # the ids are the audit's and the discrepancy's: the same plan again, the same ids
    again = plan_corrections(
        found, ledger, audit=AUDIT, billing_before=before, currency="USD", now=NOW
    )
    assert [c.correction_id for c in again.corrections] == [
        c.correction_id for c in plan.corrections
    ]
    assert len({c.correction_id for c in plan.corrections}) == len(found)
    other = plan_corrections(
        found, ledger, audit="e" * 32, billing_before=before, currency="USD", now=NOW
    )
    assert {c.correction_id for c in other.corrections}.isdisjoint(
        c.correction_id for c in plan.corrections
    )
    assert other.row_fixes[0].fix_id != fix.fix_id


def test_a_row_correction_that_lowers_a_row_gives_negative_differences() -> None:
    ledger, _ = _ledger()
    kept = event("r3")
    tenant, model, day = row_key(kept)
    stored = {
        "tenant": tenant,
        "model": model,
        "day": day,
        "requests": 3,
        "unpriced_requests": 0,
        "input_tokens": 3 * 1520,
        "output_tokens": 3 * 48 + 5,
        "reasoning_tokens": 0,
        "cached_tokens": 3 * 1408,
        "cache_write_tokens": 0,
        "cost": "0.003876000001",
    }
    rows, _ = ledger.compare_rows([stored])
    plan = plan_corrections(
        rows.discrepancies, ledger, audit=AUDIT, billing_before={}, currency="USD", now=NOW
    )
    assert [c.field for c in plan.corrections] == ["output_tokens", "cost"]
    assert plan.row_fixes[0].differences == {"output_tokens": -5, "cost_pico": -1}


def test_the_audit_id_names_the_offsets_not_the_moment() -> None:
    snap = {"taken_at": "2026-11-24T10:00:00+00:00", "topics": {"b": {"0": {"end": 4}}}}
    later = {**snap, "taken_at": "2026-11-24T11:00:00+00:00"}
    moved = {**snap, "topics": {"b": {"0": {"end": 5}}}}
    assert audit_id(snap) == audit_id(later) != audit_id(moved)
    assert len(audit_id(snap)) == 32
