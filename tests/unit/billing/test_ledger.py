"""The one rule of the bills that stand (`streamtally.billing.ledger.BillingLedger`): revisions of
the worker and corrections of ``audit --correct``, every edge case of its docstring."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sqlite3
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from streamtally.billing.corrections import CorrectionLog
from streamtally.billing.events import event_id
from streamtally.billing.ledger import BillingLedger, Seen, Standing
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source
from streamtally.wire import avro
from streamtally.wire.records import BillingCorrection, BillingEvent

WHEN = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
AUDIT = "0123456789abcdef0123456789abcdef"


def revision(n: int, request_id: str = "r1", tenant: str = "acme", **changes: Any) -> BillingEvent:
    """Revision `n` of a request's bill: 0 closed at its timeout with nothing (error, 0
    tokens), n > 0 with the whole usage (n * 100 output tokens), superseding n - 1."""
    base = BillingEvent(
        event_id=event_id(tenant, request_id, n),
        request_id=request_id,
        tenant=tenant,
        model="gpt-4.1-2025-04-14",
        source=Source.OPENAI,
        finish_reason=FinishReason.STOP if n else FinishReason.ERROR,
        input_tokens=1520 if n else 0,
        output_tokens=100 * n,
        cost=Decimal(f"0.00{n}000000000"),
        price_table_version="2026-11-01",
        event_time=WHEN + timedelta(seconds=n),
        revision=n,
        supersedes=event_id(tenant, request_id, n - 1) if n else None,
    )
    return dataclasses.replace(base, **changes)


def correction(
    superseded: BillingEvent | None,
    corrected: BillingEvent | None,
    before: int,
    *,
    reason: str = "usage_mismatch",
    correction_id: str = "f" * 32,
) -> BillingCorrection:
    """A correction of the audit that saw partition 0 below offset `before`."""
    bill = corrected or superseded
    assert bill is not None
    return BillingCorrection(
        correction_id=correction_id,
        audit_id=AUDIT,
        reason=reason,
        tenant=bill.tenant,
        request_id=bill.request_id,
        superseded_event_id=None if superseded is None else superseded.event_id,
        billing_before={0: before},
        corrected=corrected,
        requests=0 if corrected is None else 1,
        cost=Decimal(0) if corrected is None else corrected.cost,
        created_at=WHEN,
    )


def ledger_of(
    *events: BillingEvent, corrections: tuple[BillingCorrection, ...] = ()
) -> BillingLedger:
    """The events read at offsets 0, 1, ... of partition 0, then the corrections."""
    ledger = BillingLedger()
    for offset, event in enumerate(events):
        ledger.add(event, 0, offset)
    for c in corrections:
        ledger.correct(c)
    return ledger


# --------------------------------------------------------------------------- rule 1


def test_the_first_record_of_an_event_id_is_its_bill_replays_drop_conflicts_are_reported() -> None:
    bill = revision(0)
    other = dataclasses.replace(bill, output_tokens=7)
    ledger = BillingLedger()
    assert ledger.add(bill, 0, 0) is Seen.BILL
    assert ledger.add(dataclasses.replace(bill), 0, 1) is Seen.REPLAY
    assert ledger.add(other, 0, 2) is Seen.CONFLICT
    assert (ledger.records, ledger.replays, ledger.conflicts) == (3, 1, [(bill, other)])
    assert ledger.bills() == [bill]  # the first stays


def test_positions_are_checked() -> None:
    with pytest.raises(ValueError, match="partition and offset"):
        BillingLedger().add(revision(0), 0, -1)


# --------------------------------------------------------------------------- rule 3: revisions


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_highest_revision_stands_whatever_order_they_are_read_in(
    order: tuple[int, ...],
) -> None:
    ledger = ledger_of(*(revision(n) for n in order))
    settled = ledger.settle()
    assert settled.bills == [Standing(revision(2))]
    assert (settled.revised, settled.corrected, settled.split) == (2, 0, [])


def test_a_revision_whose_superseded_bill_was_never_read_still_stands_alone() -> None:
    # revision 1 lost (or not read): revision 2 names it, and revision 0 is lower anyway
    assert ledger_of(revision(0), revision(2)).bills() == [revision(2)]
    assert ledger_of(revision(1)).bills() == [revision(1)]


def test_an_event_written_before_revisions_reads_as_revision_0_and_is_amended() -> None:
    record = avro.decode("BillingEvent", avro.encode_billing_event(revision(0)))
    decoded = avro.decode_billing_event(avro.encode("BillingEvent", record, version=4))
    assert (decoded.revision, decoded.supersedes) == (0, None)
    assert ledger_of(decoded, revision(1)).bills() == [revision(1)]
    assert ledger_of(revision(1), decoded).bills() == [revision(1)]


def test_requests_of_two_tenants_with_one_id_are_two_bills() -> None:
    acme, globex = revision(1), revision(0, tenant="globex")
    settled = ledger_of(revision(0), acme, globex).settle()
    assert [b.ref for b in settled.bills] == [RequestRef("globex", "r1"), RequestRef("acme", "r1")]


def test_two_ids_of_one_request_at_its_highest_revision_both_stand_and_are_reported() -> None:
    legacy = revision(0, event_id="0" * 32)  # billed under another id scheme
    settled = ledger_of(revision(0), legacy).settle()
    assert sorted(b.event.event_id for b in settled.bills) == sorted(
        ["0" * 32, revision(0).event_id]
    )
    assert settled.split == [RequestRef("acme", "r1")]
    # a revision above them settles it
    assert ledger_of(revision(0), legacy, revision(1)).settle().split == []


# --------------------------------------------------------------------------- rule 2: corrections


def test_a_correction_replaces_the_bill_it_saw_and_not_one_written_after_the_audit() -> None:
    wrong = revision(0, output_tokens=999)
    right = revision(0)
    seen = ledger_of(wrong, corrections=(correction(wrong, right, before=1),))
    settled = seen.settle()
    assert settled.events() == [right]
    assert settled.bills[0].correction is not None
    assert settled.corrected == 1
    # the audit saw offsets below 0 only: the record at 0 was written after it
    unseen = ledger_of(wrong, corrections=(correction(wrong, right, before=0),))
    assert unseen.settle().bills == [Standing(wrong)]


def test_the_latest_correction_of_an_event_id_decides_and_one_read_twice_changes_nothing() -> None:
    wrong, right = revision(0, output_tokens=999), revision(0)
    once = correction(wrong, right, before=1)
    again = ledger_of(wrong, corrections=(once, once))
    assert again.bills() == [right]
    withdrawn = correction(wrong, None, before=1, reason="unexpected_billing")
    assert ledger_of(wrong, corrections=(once, withdrawn)).bills() == []
    assert ledger_of(wrong, corrections=(withdrawn, once)).bills() == [right]


def test_a_missing_bill_stands_until_the_worker_writes_it_after_the_audit() -> None:
    missing = revision(0)
    c = correction(None, missing, before=0, reason="missing_billing")
    assert ledger_of(corrections=(c,)).bills() == [missing]
    late = dataclasses.replace(missing, output_tokens=5)  # written after the audit (offset 0)
    assert ledger_of(late, corrections=(c,)).bills() == [late]  # one bill, the worker's


def test_a_withdrawal_of_a_bill_never_read_withdraws_nothing() -> None:
    c = correction(revision(0), None, before=5, reason="unexpected_billing")
    assert ledger_of(revision(0, request_id="r2"), corrections=(c,)).bills() == [
        revision(0, request_id="r2")
    ]


# --------------------------------------------------------------------------- rules 2 and 3 together


def test_revision_0_corrected_then_a_worker_revision_1_revision_1_stands() -> None:
    r0, r1 = revision(0), revision(1)
    audited = dataclasses.replace(r0, input_tokens=3)  # the audit's bill for revision 0
    c = correction(r0, audited, before=1)  # saw revision 0 (offset 0), not 1 (offset 1)
    settled = ledger_of(r0, r1, corrections=(c,)).settle()
    assert settled.bills == [Standing(r1)]
    assert (settled.revised, settled.corrected) == (1, 1)
    # and read the other way round (the corrections topic first): the same
    ledger = BillingLedger()
    ledger.correct(c)
    ledger.add(r1, 0, 1)
    ledger.add(r0, 0, 0)
    assert ledger.settle() == settled


def test_a_correction_of_the_highest_revision_stands_in_its_place() -> None:
    r0, r1 = revision(0), revision(1)
    audited = dataclasses.replace(r1, output_tokens=150)
    c = correction(r1, audited, before=2)
    settled = ledger_of(r0, r1, corrections=(c,)).settle()
    assert settled.events() == [audited]
    assert settled.bills[0].correction == c
    # and a worker revision 2 written after the audit supersedes the corrected bill
    assert ledger_of(r0, r1, revision(2), corrections=(c,)).bills() == [revision(2)]


def test_an_amendment_billed_by_a_correction_stands_over_the_revision_it_supersedes() -> None:
    # `unbilled_amendment`: the audit's replay amended the request, the worker billed only
    # revision 0; the correction bills revision 1 under its own id, superseding nothing
    r0, r1 = revision(0), revision(1)
    c = correction(None, r1, before=1, reason="unbilled_amendment")
    settled = ledger_of(r0, corrections=(c,)).settle()
    assert settled.bills == [Standing(r1, c)]
    assert (settled.revised, settled.corrected) == (1, 0)
    # and the worker's own revision 1, written after the audit, is that bill: one stands
    assert ledger_of(r0, r1, corrections=(c,)).bills() == [r1]


def test_the_highest_revision_withdrawn_leaves_the_request_without_a_bill() -> None:
    r0, r1 = revision(0), revision(1)
    c = correction(r1, None, before=2, reason="unexpected_billing")
    settled = ledger_of(r0, r1, corrections=(c,)).settle()
    assert settled.bills == []
    assert (settled.revised, settled.corrected) == (1, 1)


def test_a_correction_log_read_beforehand_is_the_ledgers_corrections() -> None:
    r0 = revision(0, output_tokens=9)
    log = CorrectionLog()
    log.add(correction(r0, revision(0), before=1))
    ledger = BillingLedger(log)
    ledger.add(r0, 0, 0)
    assert ledger.bills() == [revision(0)]
    assert ledger.corrections is log


# --------------------------------------------------------------------------- the docs


def _readme_block(language: str) -> str:
    """The first ```language block of docs/billing.md's section "One ledger, one rule"."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "billing.md").read_text()
    section = page.split("\n## One ledger, one rule\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(rf"```{language}\n(.*?)```", section, re.DOTALL)
    assert found is not None, f"no ```{language} block under One ledger, one rule"
    return found.group(1)


def test_the_readmes_sql_keeps_the_bills_the_ledger_keeps() -> None:
    events = [
        revision(2),
        revision(0, request_id="r2"),
        revision(0),
        revision(1, tenant="globex"),
        revision(1),
        revision(0, tenant="globex"),
    ]
    db = sqlite3.connect(":memory:")
    db.execute(
        "CREATE TABLE billing_events (event_id TEXT PRIMARY KEY, tenant TEXT, "
        "request_id TEXT, revision INTEGER, supersedes TEXT)"
    )
    db.executemany(
        "INSERT INTO billing_events VALUES (?, ?, ?, ?, ?)",
        [(e.event_id, e.tenant, e.request_id, e.revision, e.supersedes) for e in events],
    )
    db.executescript(_readme_block("sql"))
    kept = sorted(row[0] for row in db.execute("SELECT event_id FROM standing_bills"))
    assert kept == sorted(e.event_id for e in ledger_of(*events).bills())
    assert len(kept) == 3


def test_the_readmes_example_is_a_bill_and_its_amendment() -> None:
    lines = [line for line in _readme_block("json").splitlines() if line.strip()]
    first, amended = (json.loads(line) for line in lines)
    assert (first["revision"], first["supersedes"], first["finish_reason"]) == (0, None, "error")
    assert first["input_tokens"] == first["output_tokens"] == 0
    assert (amended["revision"], amended["supersedes"]) == (1, first["event_id"])
    assert first["event_id"] == event_id(first["tenant"], first["request_id"])
    assert amended["event_id"] == event_id(first["tenant"], first["request_id"], 1)
    assert amended["output_tokens"] > 0
