"""A split audit (`streamtally.audit._split`): the share of each raw partition and each
bill, and the merge of the parts into the report of one process, byte for byte (no Kafka,
no Redis: each share is the ledger of its partitions' requests, as `run_share` feeds it)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import pytest
from aiokafka.partitioner import DefaultPartitioner

from streamtally.audit import (
    Kind,
    Rerating,
    TimeRange,
    audit_corrections,
    correct_audit,
    merged_report,
)
from streamtally.audit._billing import BillingIndex
from streamtally.audit._compare import event_key
from streamtally.audit._corrections import CorrectionPlan, audit_id, plan_corrections
from streamtally.audit._ledger import Ledger, Scope
from streamtally.audit._snapshot import Snapshot
from streamtally.audit._split import (
    Merged,
    Part,
    Plan,
    Share,
    Tally,
    billing_by_partition,
    billing_partition_of,
    merge_parts,
    part_of,
    raw_partition_of,
)
from streamtally.billing.events import event_id
from streamtally.billing.pricing import PriceTable
from streamtally.cli._output import json_text
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError
from streamtally.settings import Settings
from streamtally.store import RedisStore
from streamtally.topics import encode_key
from streamtally.wire.records import UsageSource
from tests.unit.audit.test_audit_compare import DAY, event, proven

PARTITIONS = 6
RAW = "streamtally.raw.sse"


def test_each_raw_partition_is_in_exactly_one_share() -> None:
    for count in (1, 2, 3, 4, 6, 7):
        shares = [Share(i, count) for i in range(count)]
        for p in range(PARTITIONS):
            assert sum(s.owns(p) for s in shares) == 1
    assert [p for p in range(PARTITIONS) if Share.parse("1/2").owns(p)] == [1, 3, 5]
    assert str(Share.parse(" 2/3 ")) == "2/3"
    for bad in ("2/2", "1", "-1/2", "a/b", "0/0"):
        with pytest.raises(InputError):
            Share.parse(bad)


def test_a_bill_belongs_to_its_requests_raw_partition() -> None:
    assert raw_partition_of(proven("r1", raw_partition=4), PARTITIONS) == 4
    legacy = event("chatcmpl-9")  # before v3: where the producers put its request id
    hashed = DefaultPartitioner()(
        encode_key("chatcmpl-9"), list(range(PARTITIONS)), list(range(PARTITIONS))
    )
    assert raw_partition_of(legacy, PARTITIONS) == hashed
    assert {raw_partition_of(event(f"r{i}"), PARTITIONS) for i in range(40)} == set(
        range(PARTITIONS)
    )


# --------------------------------------------------------------------------- the merge

#: What the replay does per raw partition: ("closed", expected, superseded) or
#: ("partial", ref, day, reason).
Outcome = tuple[Any, ...]


def _scene() -> tuple[dict[int, list[Outcome]], list[Any], list[dict[str, Any]]]:
    """Requests on every partition with every kind of discrepancy the audit has, and bills
    routed to another share than their request's (an altered provenance partition)."""
    replay: dict[int, list[Outcome]] = {p: [] for p in range(PARTITIONS)}
    bills: list[Any] = []

    def closed(p: int, expected: Any, superseded: Any = None) -> None:
        replay[p].append(("closed", expected, superseded))

    for i in range(12):  # matched, two tenants
        tenant = "acme" if i % 3 else "globex"
        bill = proven(f"ok-{i}", tenant=tenant, raw_partition=i % PARTITIONS)
        bill = dataclasses.replace(bill, event_id=event_id(tenant, f"ok-{i}"))
        closed(i % PARTITIONS, bill)
        bills.append(bill)
    closed(1, proven("gone", raw_partition=1))  # missing_billing
    bills.append(event("forged", tenant="globex", cost=Decimal("0.000123000000")))
    twice = proven("twice", raw_partition=2)  # conflicting_billing
    closed(2, twice)
    bills += [twice, dataclasses.replace(twice, output_tokens=49)]
    usage = proven("usage", raw_partition=3)  # usage_mismatch
    closed(3, usage)
    bills.append(dataclasses.replace(usage, input_tokens=1620))
    cost = proven("cost", raw_partition=4)  # cost_mismatch
    closed(4, cost)
    bills.append(dataclasses.replace(cost, cost=Decimal("0.002000000000")))
    prov = proven("prov", raw_partition=5)  # provenance_mismatch
    closed(5, prov)
    bills.append(dataclasses.replace(prov, raw_sha256="0" * 64))
    zero = proven("late", raw_partition=0, input_tokens=0, output_tokens=0, cached_tokens=0)
    one = dataclasses.replace(
        proven("late", raw_partition=0),
        event_id=event_id("acme", "late", 1),
        revision=1,
        supersedes=zero.event_id,
    )
    closed(0, zero)
    closed(0, one, zero)  # unbilled_amendment
    bills.append(zero)
    # Routed to another share than its request's: the provenance names partition 4.
    moved = proven("moved", raw_partition=1)
    closed(1, moved)
    bills.append(dataclasses.replace(moved, raw_partition=4, input_tokens=1))
    # Billed before v3 (no provenance), by a producer that partitions otherwise: its bill
    # hashes to another partition than the one its records were read from.
    legacy = event("elsewhere")
    closed((raw_partition_of(legacy, PARTITIONS) + 1) % PARTITIONS, proven("elsewhere"))
    bills.append(legacy)
    # A partial request whose bill sits in another share.
    replay[3].append(("partial", RequestRef("acme", "open"), DAY, "open at the snapshot"))
    bills.append(proven("open", raw_partition=2))
    for name, p in (("abort-z", 1), ("abort-a", 2), ("abort-m", 5)):
        aborted = proven(name, raw_partition=p, usage_source=UsageSource.ABORTED)
        closed(p, aborted)
        bills.append(aborted)
    stored = [  # one stored row the replay has nothing for; every other row is missing
        {
            "tenant": "initech",
            "model": "gpt-4.1-2025-04-14",
            "day": DAY,
            "requests": 1,
            "unpriced_requests": 0,
            "input_tokens": 5,
            "output_tokens": 0,
            "reasoning_tokens": 0,
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "cost": "0.000000000000",
        }
    ]
    return replay, bills, stored


def _plan(stored: list[dict[str, Any]]) -> Plan:
    snapshot = Snapshot(
        datetime(2026, 11, 24, tzinfo=UTC),
        TimeRange(),
        {RAW: dict.fromkeys(range(PARTITIONS), (0, 100))},
        "streamtally.billing",
        dict.fromkeys(range(PARTITIONS), (0, 50)),
        "streamtally.processors",
        {(RAW, p): 100 for p in range(PARTITIONS)},
    )
    return Plan(snapshot, "streamtally", None, tuple(stored))


#: How a share finds its bills: by their raw partition (provenance, else the request id's
#: hash: the billing topic read whole), or by the billing partition the worker wrote them
#: to (the request id's hash: a share reads its own billing partitions).
ROUTES = {"raw partition": raw_partition_of, "billing partition": billing_partition_of}


def _doubled() -> PriceTable:
    """The packaged price table with every rate doubled (another table to re-rate at)."""
    packaged = json.loads(
        (Path(__file__).parents[3] / "streamtally/billing/prices.json").read_text()
    )

    def doubled(entry: dict[str, str | None]) -> dict[str, str | None]:
        return {k: None if v is None else str(Decimal(v) * 2) for k, v in entry.items()}

    packaged["models"] = {name: doubled(e) for name, e in packaged["models"].items()}
    return PriceTable.from_dict(packaged)


def _share(
    share: Share,
    plan: Plan,
    replay: dict[int, list[Outcome]],
    bills: list[Any],
    route: str = "raw partition",
    prices: PriceTable | None = None,
) -> Part:
    """What `run_share` does for `share`, its replay's outcomes given."""
    return _share_and_ledger(share, plan, replay, bills, route, prices)[0]


def _share_and_ledger(
    share: Share,
    plan: Plan,
    replay: dict[int, list[Outcome]],
    bills: list[Any],
    route: str = "raw partition",
    prices: PriceTable | None = None,
) -> tuple[Part, Ledger]:
    scope = Scope(TimeRange())
    index = BillingIndex()
    for bill in bills:
        if share.count == 1 or share.owns(ROUTES[route](bill, PARTITIONS)):
            index.add(bill)
    rerating = None if prices is None else Rerating(prices, "doubled.json")
    ledger = Ledger(index, scope, rerating=rerating)
    read = 0
    for p, outcomes in replay.items():
        if not share.owns(p):
            continue
        read += 10 * len(outcomes)
        for outcome in outcomes:
            if outcome[0] == "closed":
                ledger.closed(outcome[1], outcome[2])
            else:
                ledger.partial(outcome[1], outcome[2], outcome[3])
    wanted = ledger.close_index()
    found: dict[int, list[Any]] = {}
    for bill in bills:  # `find_events`: distinct events, in topic order
        key = event_key(bill.event_id)
        if key in wanted and bill not in found.get(key, []):
            found.setdefault(key, []).append(bill)
    ledger.resolve(found)
    part = part_of(
        share, plan.digest(), Counter(read=read), index=index, ledger=ledger, found=found
    )
    return Part.from_json(json.loads(json_text(part.to_json()))), ledger  # through its file


def _merged(
    count: int, route: str = "raw partition", prices: PriceTable | None = None
) -> tuple[Plan, Merged]:
    replay, bills, stored = _scene()
    plan = _plan(stored)
    parts = [_share(Share(i, count), plan, replay, bills, route, prices) for i in range(count)]
    return plan, merge_parts(list(reversed(parts)))


def _report(
    count: int, route: str = "raw partition", prices: PriceTable | None = None
) -> tuple[str, str]:
    plan, merged = _merged(count, route, prices)
    rerate = None if prices is None else Rerating(prices, "doubled.json")
    report = merged_report(plan, merged, rerate=rerate)
    return json_text(report.to_json(), indent=2), report.csv_text()


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("count", [2, 3, 4, 6])
def test_merged_parts_are_the_report_of_one_process(count: int, route: str) -> None:
    one = _report(1)
    assert _report(count, route) == one
    doc = json.loads(one[0])
    kinds = {d["kind"] for d in doc["discrepancies"]}
    # Every kind of the replay; a provider's usage report is compared after the merge.
    replayed = {k.value for k in Kind} - {Kind.PROVIDER_USAGE_MISMATCH.value}
    assert kinds == replayed, "every discrepancy kind is in the scene"
    moved = [d for d in doc["discrepancies"] if d["request_id"] == "moved"]
    assert [(d["kind"], d["field"]) for d in moved] == [
        ("provenance_mismatch", "raw_partition"),
        ("usage_mismatch", "input_tokens"),
    ]
    assert not [d for d in doc["discrepancies"] if d["request_id"] in ("open", "elsewhere")]
    r = doc["requests"]
    assert (r["matched"], r["missing_billing"], r["unexpected_billing"]) == (17, 2, 1)
    assert (r["conflicting_billing"], r["partial"], r["billed"]) == (1, 1, len(_scene()[1]) - 1)
    assert [a["request_id"] for a in doc["aborted"]["requests"]] == [
        "abort-a",
        "abort-m",
        "abort-z",
    ]
    assert doc["totals"]["globex"]["requests"] == 4


def test_shares_read_their_own_billing_partitions_when_the_counts_agree() -> None:
    plan = _plan([])
    assert billing_by_partition(plan.snapshot)
    other = dataclasses.replace(plan.snapshot, billing=dict.fromkeys(range(3), (0, 5)))
    assert not billing_by_partition(other)
    bill = event("chatcmpl-9")
    assert billing_partition_of(bill, PARTITIONS) == raw_partition_of(bill, PARTITIONS)


def test_a_merge_wants_every_share_of_one_snapshot_once() -> None:
    replay, bills, stored = _scene()
    plan = _plan(stored)
    parts = [_share(Share(i, 3), plan, replay, bills) for i in range(3)]
    with pytest.raises(InputError, match="want each"):
        merge_parts(parts[:2])
    with pytest.raises(InputError, match="want each"):
        merge_parts([parts[0], parts[0], parts[2]])
    with pytest.raises(InputError, match="different snapshots"):
        merge_parts([parts[0], parts[1], dataclasses.replace(parts[2], plan="x")])
    with pytest.raises(InputError, match="no part"):
        merge_parts([])


def test_a_part_of_another_format_is_refused_by_name() -> None:
    replay, bills, stored = _scene()
    doc = _share(Share(), _plan(stored), replay, bills).to_json()
    assert Part.from_json(doc).to_json() == doc
    with pytest.raises(InputError, match=r"not a part of an audit \(format .*part\.v2\)"):
        Part.from_json({**doc, "format": "streamtally.audit.part.v1"})
    del doc["suspects"]
    with pytest.raises(InputError, match="a damaged audit part"):
        Part.from_json(doc)


def test_a_plan_goes_through_its_file() -> None:
    plan = _plan(_scene()[2])
    again = Plan.from_json(json.loads(json_text(plan.to_json())))
    assert again == plan
    assert again.digest() == plan.digest()
    with pytest.raises(InputError):
        Plan.from_json({"format": "other"})


# --------------------------------------------------------------------------- --prices, --correct

NOW = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("count", [2, 3, 6])
def test_a_split_re_rating_is_the_one_process_re_rating(count: int, route: str) -> None:
    doubled = _doubled()
    one = _report(1, prices=doubled)
    assert _report(count, route, doubled) == one
    rerating = json.loads(one[0])["rerating"]
    assert rerating["prices"] == "doubled.json"
    assert rerating["tenants"]["globex"]["requests"] == 4
    total = rerating["total"]
    assert Decimal(total["rerated"]) > Decimal(total["billed"]) > 0
    assert one != _report(1)  # the re-rating is in the report


def test_a_merge_wants_the_parts_re_rated_at_the_table_it_names() -> None:
    doubled, packaged = _doubled(), PriceTable.default()
    replay, bills, stored = _scene()
    plan = _plan(stored)
    at = {
        name: [_share(Share(i, 2), plan, replay, bills, prices=table) for i in range(2)]
        for name, table in (("doubled", doubled), ("packaged", packaged), ("none", None))
    }
    with pytest.raises(InputError, match="different prices"):
        merge_parts([at["doubled"][0], at["packaged"][1]])
    with pytest.raises(InputError, match="different prices"):
        merge_parts([at["doubled"][0], at["none"][1]])
    with pytest.raises(InputError, match="re-rated at other prices"):
        merged_report(plan, merge_parts(at["packaged"]), rerate=Rerating(doubled, "d.json"))
    with pytest.raises(InputError, match="not re-rated"):
        merged_report(plan, merge_parts(at["none"]), rerate=Rerating(doubled, "d.json"))
    # Re-rated shares merged without --prices: refused, never a report without their re-rating.
    with pytest.raises(InputError, match="give merge the same --prices FILE"):
        merged_report(plan, merge_parts(at["doubled"]))
    assert merged_report(plan, merge_parts(at["none"])).rerating is None


def _one_process_corrections() -> CorrectionPlan:
    """What a one-process ``--correct`` planned before corrections were planned from the
    merge: its own ledger's bills, the row values of the report's comparison."""
    replay, bills, stored = _scene()
    plan = _plan(stored)
    part, ledger = _share_and_ledger(Share(), plan, replay, bills)
    rows = Ledger(BillingIndex(), Scope(TimeRange()))
    report = merged_report(plan, merge_parts([part]), rows_ledger=rows)
    ledger.row_expected.update(rows.row_expected)
    return plan_corrections(
        report.discrepancies,
        ledger,
        audit=audit_id(plan.snapshot.to_json()),
        billing_before={p: end for p, (_, end) in plan.snapshot.billing.items()},
        currency="USD",
        now=NOW,
    )


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("count", [1, 2, 3, 6])
def test_a_split_audit_plans_the_corrections_of_one_process(count: int, route: str) -> None:
    plan, merged = _merged(count, route)
    report, corrections = audit_corrections(plan, merged, currency="USD", now=NOW)
    assert json_text(report.to_json(), indent=2) == _report(1)[0]
    one = _one_process_corrections()
    assert corrections == one
    # one per discrepancy, the bills that stand the replay's (the moved request's too: its
    # bill was judged at the merge, its replayed event came from another share's part)
    assert len(corrections.corrections) == len(report.discrepancies) > 8
    stood = {c.request_id: c.corrected for c in corrections.corrections if c.corrected}
    assert stood["moved"] is not None
    assert stood["moved"].input_tokens == 1520
    assert {c.reason for c in corrections.corrections} == {
        d.kind.value for d in report.discrepancies
    }
    rows = {(d.tenant, d.model, d.day) for d in report.rows.discrepancies}
    assert len(corrections.row_fixes) == len(rows) > 0


def test_a_tally_adds_every_field() -> None:
    """`Tally.add` of one part to nothing is that part's tally, field for field."""
    doubled = _doubled()
    replay, bills, stored = _scene()
    part = _share(Share(), _plan(stored), replay, bills, prices=doubled)
    part.corrections_read, part.bills_corrected, part.billing_superseded = 3, 2, 1
    part.corrections_bad = [(0, 7, "bad")]
    part.billing_bad = [(1, 4, "bad")]
    merged = Merged()
    merged.add(part, first=True)
    for f in dataclasses.fields(Tally):
        theirs = getattr(part, f.name)
        assert getattr(merged, f.name) == theirs, f.name
        assert theirs not in (0, [], {}, set(), None), f"{f.name}: give it a value"
    later = Merged()
    later.add(part, first=False)
    assert (later.corrections_read, later.bills_corrected) == (0, 0)  # share 0's are taken


def test_correcting_a_merge_refuses_unreadable_bills_and_another_namespace_first() -> None:
    """Before anything is written (no Kafka, no Redis here): a billing or correction record
    that did not decode in any share, or a snapshot of another namespace."""
    plan, merged = _merged(2)
    store = cast(RedisStore, None)
    nowhere = "127.0.0.1:9"  # were anything written, it would fail otherwise
    ours = Settings(namespace=plan.namespace, bootstrap_servers=nowhere)
    for bad in ("billing_bad", "corrections_bad"):
        broken = dataclasses.replace(merged, **{bad: [(0, 3, "truncated")]})
        with pytest.raises(InputError, match="cannot correct bills it cannot read"):
            asyncio.run(correct_audit(ours, store, plan, broken))
    other = Settings(namespace="elsewhere", bootstrap_servers=nowhere)
    with pytest.raises(InputError, match="the snapshot is of namespace streamtally"):
        asyncio.run(correct_audit(other, store, plan, merged))
