"""A split audit (`streamtally.ops.audit._split`): the share of each raw partition and each
bill, and the merge of the parts into the report of one process, byte for byte (no Kafka,
no Redis: each share is the ledger of its partitions' requests, as `run_share` feeds it)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from aiokafka.partitioner import DefaultPartitioner

from streamtally.cli._output import json_text
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError
from streamtally.ops.audit import Kind, TimeRange, merged_report
from streamtally.ops.audit._billing import BillingIndex
from streamtally.ops.audit._compare import event_key
from streamtally.ops.audit._ledger import Ledger, Scope
from streamtally.ops.audit._snapshot import Snapshot
from streamtally.ops.audit._split import (
    Part,
    Plan,
    Share,
    billing_by_partition,
    billing_partition_of,
    merge_parts,
    part_of,
    raw_partition_of,
)
from streamtally.topics import encode_key
from streamtally.wire.billing import event_id
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


def _share(
    share: Share,
    plan: Plan,
    replay: dict[int, list[Outcome]],
    bills: list[Any],
    route: str = "raw partition",
) -> Part:
    """What `run_share` does for `share`, its replay's outcomes given."""
    scope = Scope(TimeRange())
    index = BillingIndex()
    for bill in bills:
        if share.count == 1 or share.owns(ROUTES[route](bill, PARTITIONS)):
            index.add(bill)
    ledger = Ledger(index, scope)
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
    return Part.from_json(json.loads(json_text(part.to_json())))  # through its file


def _report(count: int, route: str = "raw partition") -> tuple[str, str]:
    replay, bills, stored = _scene()
    plan = _plan(stored)
    parts = [_share(Share(i, count), plan, replay, bills, route) for i in range(count)]
    report = merged_report(plan, merge_parts(list(reversed(parts))))
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


def test_a_plan_goes_through_its_file() -> None:
    plan = _plan(_scene()[2])
    again = Plan.from_json(json.loads(json_text(plan.to_json())))
    assert again == plan
    assert again.digest() == plan.digest()
    with pytest.raises(InputError):
        Plan.from_json({"format": "other"})
