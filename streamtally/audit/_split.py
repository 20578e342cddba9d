"""A split audit: one snapshot, shares of the raw partitions, partial reports merged exactly.

The raw topics are co-partitioned by request id (`streamtally.topics`): all of a request's
records are on one partition number of every raw topic.  Share ``i/N`` replays the raw
partitions ``p`` with ``p % N == i`` (`Share.owns`), of every raw topic, and indexes the
billing events of its requests.  The worker writes a request's bills on the billing
partition its request id hashes to, the number of its raw partition when the billing topic
has as many partitions as the raw topics (`billing_by_partition`, the declared topics): a
share then reads the billing partitions of its own numbers only (the bills a correction
stands, by `billing_partition_of`).  Otherwise each share reads the whole billing topic and
keeps the events whose raw partition is its own: the one their provenance names
(BillingEvent v3: where the worker folded it from), else the one their request id hashes
to on the raw topics (`raw_partition_of`).

A share writes a `Part`: its counts, its discrepancies, the replay's sums per usage row
and per tenant (and with ``--prices`` its re-rating sums per tenant, with the digest of
the table), and the few things a merge needs to check across shares: the requests it
closed and found no bill for (their replayed event), the bills it indexed and no request
of its own took (the index entry and the events whole), and the partial requests it had
no bill for; and for ``--correct`` the replayed event of each request whose bill differs
(`Merged.bills`: the bills the corrections stand, written once after the merge).
`merge_parts` adds the parts up, then matches a request one share missed
with a bill another share held (a new call of a reused id, whose bill is keyed by the
call's own id; an event whose provenance was altered, or of a producer that partitions
otherwise: routed to another share than its request's) exactly as one process would have
compared them, and drops a bill another share's partial request accounts for.  The usage
rows are compared once, after the merge, with the rows the snapshot read.

One limit: billing events of one ``event_id`` that are routed to different shares
(written to different billing partitions, or one of them with a provenance partition or a
request id that is not its request's) are judged apart: the request's share judges those
it holds, the other share reports its own as ``unexpected_billing``, where one process
reports a ``conflicting_billing``.  Either way a discrepancy, never a clean report.

`run_audit` of one process is share ``0/1`` merged alone: the same code writes both
reports, so a split run's merged report is byte for byte the one process's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from aiokafka.partitioner import murmur2

from streamtally.audit._billing import BillingIndex
from streamtally.audit._compare import (
    Discrepancy,
    Kind,
    billing_discrepancies,
    event_digest,
    event_key,
    legacy_digest,
)
from streamtally.audit._ledger import Aborted, Ledger, RequestCounts
from streamtally.audit._range import TimeRange
from streamtally.audit._rerate import RerateSum
from streamtally.audit._rows import RowKey, RowSum
from streamtally.audit._snapshot import Snapshot
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError
from streamtally.topics import encode_key
from streamtally.wire.avro import decode_billing_event, encode_billing_event
from streamtally.wire.records import BillingEvent

__all__ = [
    "PART_FORMAT",
    "Merged",
    "Part",
    "Plan",
    "Share",
    "billing_by_partition",
    "billing_partition_of",
    "merge_parts",
    "part_of",
    "raw_partition_of",
]

#: The `format` of a part file (`Part.to_json`) and of a snapshot file (`Plan.to_json`);
#: v2: a part carries its `suspects` and the digest of its ``--prices`` table.
PART_FORMAT: Final = "streamtally.audit.part.v2"
PLAN_FORMAT: Final = "streamtally.audit.snapshot.v1"
_SHARE: Final = re.compile(r"(\d+)/(\d+)")


@dataclass(frozen=True, slots=True)
class Share:
    """Share `index` of `count`: the raw partitions `p` with ``p % count == index``."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise InputError(f"share {self.index}/{self.count}: want 0 <= i < N")

    @classmethod
    def parse(cls, text: str) -> Share:
        """``i/N`` (0-based: ``0/2`` and ``1/2`` are the two halves)."""
        match = _SHARE.fullmatch(text.strip())
        if match is None:
            raise InputError(f"--share {text!r}: want i/N, as 0/2 and 1/2")
        return cls(int(match.group(1)), int(match.group(2)))

    def owns(self, partition: int) -> bool:
        return partition % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def raw_partition_of(event: BillingEvent, raw_partitions: int) -> int:
    """The raw partition the request of `event` was read from: its provenance's, else the
    partition its request id hashes to (murmur2 of `encode_key`, the default partitioner)."""
    if event.has_provenance and event.raw_partition is not None:
        return event.raw_partition
    return billing_partition_of(event, raw_partitions)


def billing_by_partition(snapshot: Snapshot) -> bool:
    """Whether a share reads the billing partitions of its own numbers only: the billing
    topic has as many partitions as every raw topic (the worker writes a request's bills on
    the partition of its request id, the number its raw records are on)."""
    counts = {len(ranges) for ranges in snapshot.raw.values()}
    return counts == {len(snapshot.billing)}


def billing_partition_of(event: BillingEvent, partitions: int) -> int:
    """The billing partition the worker writes the bill `event` to (murmur2 of its
    request id over `partitions`)."""
    hashed: int = murmur2(encode_key(event.request_id))
    return (hashed & 0x7FFFFFFF) % partitions


def _b64(event: BillingEvent) -> str:
    return base64.b64encode(encode_billing_event(event)).decode("ascii")


def _event(text: str) -> BillingEvent:
    return decode_billing_event(base64.b64decode(text))


def _rerate_list(r: RerateSum) -> list[int]:
    return [r.requests, r.billed_pico, r.rerated_pico, r.unpriced_billed, r.unpriced_rerated]


def _discrepancy_json(d: Discrepancy) -> dict[str, Any]:
    return {**d.to_json(), "event_id": d.event_id}


def _discrepancy(doc: Mapping[str, Any]) -> Discrepancy:
    return Discrepancy(
        Kind(doc["kind"]),
        doc["request_id"],
        doc["tenant"],
        doc["model"],
        doc["day"],
        doc["field"],
        doc["expected"],
        doc["found"],
        event_id=doc["event_id"],
    )


@dataclass(frozen=True, slots=True)
class Plan:
    """What every share of one audit reads: the snapshot, the namespace and tenants it was
    taken for, and the usage rows read within it (`take_snapshot`)."""

    snapshot: Snapshot
    namespace: str
    tenants: frozenset[str] | None
    rows: tuple[dict[str, Any], ...]

    def check_namespace(self, namespace: str) -> None:
        """`InputError` unless the snapshot is of `namespace` (the settings')."""
        if self.namespace != namespace:
            raise InputError(
                f"the snapshot is of namespace {self.namespace}, the settings name "
                f"{namespace} (STREAMTALLY_NAMESPACE)"
            )

    def digest(self) -> str:
        """32 hex digits naming the plan: parts of one audit carry the same."""
        text = json.dumps(self.to_json(), sort_keys=True, ensure_ascii=False)
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def to_json(self) -> dict[str, Any]:
        s = self.snapshot

        def spans(ranges: Mapping[int, tuple[int, int]]) -> list[list[int]]:
            return [[p, a, b] for p, (a, b) in sorted(ranges.items())]

        return {
            "format": PLAN_FORMAT,
            "namespace": self.namespace,
            "tenants": None if self.tenants is None else sorted(self.tenants),
            "taken_at": s.taken_at.isoformat(),
            "window": s.window.to_json(),
            "raw": {name: spans(ranges) for name, ranges in s.raw.items()},
            "billing_topic": s.billing_topic,
            "billing": spans(s.billing),
            "group": s.group,
            "committed": [[t, p, o] for (t, p), o in sorted(s.committed.items())],
            "corrections_topic": s.corrections_topic,
            "corrections": spans(s.corrections),
            "usage_rows": list(self.rows),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Plan:
        if not isinstance(doc, Mapping) or doc.get("format") != PLAN_FORMAT:
            raise InputError(f"not an audit snapshot file (format {PLAN_FORMAT})")
        try:

            def ranges(rows: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
                return {int(p): (int(a), int(b)) for p, a, b in rows}

            def moment(text: str | None) -> datetime | None:
                return None if text is None else datetime.fromisoformat(text)

            window = doc["window"]
            snapshot = Snapshot(
                datetime.fromisoformat(doc["taken_at"]),
                TimeRange(moment(window["since"]), moment(window["until"])),
                {str(name): ranges(rows) for name, rows in doc["raw"].items()},
                str(doc["billing_topic"]),
                ranges(doc["billing"]),
                str(doc["group"]),
                {(str(t), int(p)): int(o) for t, p, o in doc["committed"]},
                str(doc["corrections_topic"]),
                ranges(doc["corrections"]),
            )
            tenants = doc["tenants"]
            return cls(
                snapshot,
                str(doc["namespace"]),
                None if tenants is None else frozenset(tenants),
                tuple(doc["usage_rows"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"a damaged audit snapshot file: {exc!r}") from None


@dataclass(slots=True, kw_only=True)
class Tally:
    """What shares count and a merge adds up (`Part`, `Merged`): one `add` for every field."""

    counts: RequestCounts = field(default_factory=RequestCounts)
    discrepancies: list[Discrepancy] = field(default_factory=list)
    rows: dict[RowKey, RowSum] = field(default_factory=dict)
    totals: dict[str, RowSum] = field(default_factory=dict)
    unsure: set[tuple[str, str]] = field(default_factory=set)
    aborted: Aborted = field(default_factory=Aborted)
    partial_reasons: Counter[str] = field(default_factory=Counter)
    #: The replay's raw record counters, by the names of the report's ``raw_records``.
    raw_records: Counter[str] = field(default_factory=Counter)
    billing_in_scope: int = 0
    billing_superseded: int = 0
    #: (partition, offset, reason) of billing records that did not decode: of the share's
    #: own billing partitions, or (the billing topic read whole) share 0's alone.
    billing_bad: list[tuple[int, int, str]] = field(default_factory=list)
    #: Every share reads the corrections topic whole: the same two numbers in each.
    corrections_read: int = 0
    bills_corrected: int = 0
    #: (partition, offset, reason) of correction records that did not decode (share 0).
    corrections_bad: list[tuple[int, int, str]] = field(default_factory=list)
    #: tenant -> the re-rating sum (``--prices``), None without it.
    rerating: dict[str, RerateSum] | None = None

    def add(self, other: Tally, *, first: bool) -> None:
        """Add `other` (a share's part) to this sum; `first`: it is share 0's, whose reads of
        the whole corrections topic are taken (each share's are the same), not added."""
        for name, value in other.counts.to_json().items():
            setattr(self.counts, name, getattr(self.counts, name) + value)
        self.discrepancies.extend(other.discrepancies)
        for row_key, row in other.rows.items():
            self.rows.setdefault(row_key, RowSum()).merge(row)
        for tenant, total in other.totals.items():
            self.totals.setdefault(tenant, RowSum()).merge(total)
        self.unsure |= other.unsure
        self.aborted.merge(other.aborted)
        self.partial_reasons.update(other.partial_reasons)
        self.raw_records.update(other.raw_records)
        self.billing_in_scope += other.billing_in_scope
        self.billing_superseded += other.billing_superseded
        self.billing_bad.extend(other.billing_bad)
        self.corrections_bad.extend(other.corrections_bad)
        if first:
            self.corrections_read = other.corrections_read
            self.bills_corrected = other.bills_corrected
        if other.rerating is not None:
            sums = self.rerating = self.rerating if self.rerating is not None else {}
            for tenant, one in other.rerating.items():
                sums.setdefault(tenant, RerateSum()).merge(one)

    def tally_json(self) -> dict[str, Any]:
        """The fields of `Tally` in a part file (`Part.to_json`)."""
        return {
            "counts": self.counts.to_json(),
            "discrepancies": [_discrepancy_json(d) for d in self.discrepancies],
            "rows": [[*k, *s.to_list()] for k, s in sorted(self.rows.items())],
            "totals": {t: s.to_list() for t, s in sorted(self.totals.items())},
            "unsure": sorted([list(u) for u in self.unsure]),
            "aborted": {
                "count": self.aborted.count,
                "requests": [list(r) for r in self.aborted.listed()],
            },
            "partial_reasons": dict(sorted(self.partial_reasons.items())),
            "raw_records": dict(sorted(self.raw_records.items())),
            "billing": {
                "in_scope": self.billing_in_scope,
                "superseded": self.billing_superseded,
                "undecodable": [list(b) for b in self.billing_bad],
            },
            "corrections": {
                "read": self.corrections_read,
                "bills_corrected": self.bills_corrected,
                "undecodable": [list(b) for b in self.corrections_bad],
            },
            "rerating": None
            if self.rerating is None
            else {t: _rerate_list(r) for t, r in sorted(self.rerating.items())},
        }

    @staticmethod
    def tally_fields(doc: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of `Tally` from `tally_json`'s document (KeyError, TypeError or
        ValueError when it is not one)."""
        rerating = doc["rerating"]
        return {
            "counts": RequestCounts(**doc["counts"]),
            "discrepancies": [_discrepancy(d) for d in doc["discrepancies"]],
            "rows": {(t, m, d): RowSum.from_list(v) for t, m, d, *v in doc["rows"]},
            "totals": {t: RowSum.from_list(v) for t, v in doc["totals"].items()},
            "unsure": {(t, d) for t, d in doc["unsure"]},
            "aborted": Aborted(
                doc["aborted"]["count"],
                [RequestRef(t, r) for t, r in doc["aborted"]["requests"]],
            ),
            "partial_reasons": Counter(doc["partial_reasons"]),
            "raw_records": Counter(doc["raw_records"]),
            "billing_in_scope": int(doc["billing"]["in_scope"]),
            "billing_superseded": int(doc["billing"]["superseded"]),
            "billing_bad": [(int(p), int(o), str(r)) for p, o, r in doc["billing"]["undecodable"]],
            "corrections_read": int(doc["corrections"]["read"]),
            "bills_corrected": int(doc["corrections"]["bills_corrected"]),
            "corrections_bad": [
                (int(p), int(o), str(r)) for p, o, r in doc["corrections"]["undecodable"]
            ],
            "rerating": None
            if rerating is None
            else {t: RerateSum(*map(int, v)) for t, v in rerating.items()},
        }


@dataclass(slots=True, kw_only=True)
class Part(Tally):
    """What one share found (see the module docstring); `merge_parts` adds parts up."""

    share: Share
    plan: str = ""
    #: event key -> the replayed event of a request closed with no bill in this share.
    missing: dict[int, BillingEvent] = field(default_factory=dict)
    #: event key -> (digest, conflicting, the events whole) of a bill no request here took.
    unexpected: dict[int, tuple[int, bool, list[BillingEvent]]] = field(default_factory=dict)
    #: Event keys of partial requests with no bill in this share.
    partial_missed: set[int] = field(default_factory=set)
    #: event key -> the replayed event of a request whose bill here differs (mismatched or
    #: conflicting): the bill a correction stands (``--correct``, after the merge).
    suspects: dict[int, BillingEvent] = field(default_factory=dict)
    #: The `PriceTable.digest` of the ``--prices`` table the share re-rated at ("": none).
    prices: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PART_FORMAT,
            "share": str(self.share),
            "plan": self.plan,
            **self.tally_json(),
            "missing": {str(k): _b64(e) for k, e in sorted(self.missing.items())},
            "unexpected": {
                str(k): [digest, conflicting, [_b64(e) for e in events]]
                for k, (digest, conflicting, events) in sorted(self.unexpected.items())
            },
            "partial_missed": sorted(self.partial_missed),
            "suspects": {str(k): _b64(e) for k, e in sorted(self.suspects.items())},
            "prices": self.prices,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Part:
        if not isinstance(doc, Mapping) or doc.get("format") != PART_FORMAT:
            raise InputError(f"not a part of an audit (format {PART_FORMAT})")
        try:
            return cls(
                share=Share.parse(doc["share"]),
                plan=str(doc["plan"]),
                missing={int(k): _event(v) for k, v in doc["missing"].items()},
                unexpected={
                    int(k): (int(d), bool(c), [_event(e) for e in events])
                    for k, (d, c, events) in doc["unexpected"].items()
                },
                partial_missed={int(k) for k in doc["partial_missed"]},
                suspects={int(k): _event(v) for k, v in doc["suspects"].items()},
                prices=str(doc["prices"]),
                **cls.tally_fields(doc),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"a damaged audit part: {exc!r}") from None


@dataclass(slots=True, kw_only=True)
class Merged(Tally):
    """The parts of one audit added up, every request judged as one process judges it."""

    #: event key -> the replayed event of each request whose billing differs or is missing
    #: (the parts' `suspects` and `missing`): what ``--correct`` makes the bill that stands.
    bills: dict[int, BillingEvent] = field(default_factory=dict)
    #: The `PriceTable.digest` of the table the parts re-rated at ("": without ``--prices``).
    prices: str = ""

    def expected_bill(self, event_id: str) -> BillingEvent | None:
        """The replay's billing event of `event_id`, for a request whose billing differs
        (as `Ledger.expected_bill` of one process)."""
        bill = self.bills.get(event_key(event_id))
        return bill if bill is not None and bill.event_id == event_id else None


def part_of(
    share: Share,
    plan: str,
    raw_records: Counter[str],
    *,
    index: BillingIndex,
    ledger: Ledger,
    found: Mapping[int, list[BillingEvent]],
) -> Part:
    """The part of `share` once its replay is done (`Ledger.close_index` and `resolve`
    called, `found` the events `find_events` read whole)."""
    rows, totals, unsure = ledger.sums()
    unexpected = {}
    for key in ledger.unexpected:
        entry = index.peek(key)
        if entry is not None:
            unexpected[key] = (entry.digest, entry.conflicting, list(found.get(key, ())))
    return Part(
        share=share,
        plan=plan,
        counts=ledger.counts,
        discrepancies=list(ledger.discrepancies),
        missing=dict(ledger.missing),
        unexpected=unexpected,
        partial_missed=set(ledger.partial_missed),
        suspects=dict(ledger.suspects),
        prices="" if ledger.rerating is None else ledger.rerating.prices.digest(),
        rows=rows,
        totals=totals,
        unsure=unsure,
        aborted=ledger.aborted,
        partial_reasons=ledger.partial_reasons,
        raw_records=raw_records,
        billing_in_scope=index.records,
        billing_superseded=index.superseded,
        billing_bad=list(index.bad),
        rerating=None if ledger.rerating is None else ledger.rerating.sums(),
    )


def _check_shares(parts: Sequence[Part]) -> None:
    if not parts:
        raise InputError("no part to merge")
    count = parts[0].share.count
    have = sorted(p.share.index for p in parts)
    if any(p.share.count != count for p in parts) or have != list(range(count)):
        names = ", ".join(sorted(str(p.share) for p in parts))
        raise InputError(
            f"the parts are shares {names}: want each of 0/{count} to {count - 1}/{count} once"
        )
    if len({p.plan for p in parts}) != 1:
        raise InputError("the parts are of different snapshots: merge the parts of one")
    if len({p.prices for p in parts}) != 1:
        raise InputError(
            "the parts were re-rated at different prices (or some without --prices): run "
            "every share with the same --prices FILE, or none"
        )


def _judge(
    merged: Merged,
    expected: BillingEvent,
    entry: tuple[int, bool, list[BillingEvent]],
) -> None:
    """A request one share closed with no bill, and the bill another share held for it:
    compared as `Ledger.closed` and `Ledger.resolve` compare them in one process."""
    digest, conflicting, events = entry
    counts = merged.counts
    if conflicting:
        counts.conflicting_billing += 1
        mine = event_digest(expected)
        others = [e for e in events if event_digest(e) != mine]
        merged.discrepancies.extend(billing_discrepancies(expected, others, conflicting=True))
    elif digest in (event_digest(expected), legacy_digest(expected)):
        counts.matched += 1
    else:
        counts.mismatched += 1
        merged.discrepancies.extend(billing_discrepancies(expected, events, conflicting=False))


def merge_parts(parts: Sequence[Part]) -> Merged:
    """The parts of every share of one audit as one process would have found them."""
    _check_shares(parts)
    parts = sorted(parts, key=lambda p: p.share.index)
    merged = Merged()
    held: dict[int, tuple[int, bool, list[BillingEvent]]] = {}
    missing: dict[int, BillingEvent] = {}
    partial_missed: set[int] = set()
    for part in parts:
        merged.add(part, first=part.share.index == 0)
        held.update(part.unexpected)
        missing.update(part.missing)
        partial_missed |= part.partial_missed
        for bills in (part.missing, part.suspects):  # a suspect wins, as `expected_bill`'s
            merged.bills.update(bills)
    merged.prices = parts[0].prices
    # Bills one share held for a request another share replayed (routed by a provenance
    # or a partitioner that was not the request's): judged now, as one index would have.
    crossed = (set(missing) | partial_missed) & set(held)
    if crossed:
        dropped = {
            (kind, key)
            for key in crossed
            for kind in (
                (Kind.UNEXPECTED_BILLING,)
                if key not in missing
                else (Kind.UNEXPECTED_BILLING, Kind.MISSING_BILLING, Kind.UNBILLED_AMENDMENT)
            )
        }
        merged.discrepancies = [
            d
            for d in merged.discrepancies
            if d.event_id is None or (d.kind, event_key(d.event_id)) not in dropped
        ]
        for key in sorted(crossed):
            merged.counts.unexpected_billing -= 1
            if key in missing:
                merged.counts.missing_billing -= 1
                _judge(merged, missing[key], held[key])
    merged.discrepancies.sort(key=lambda d: d.sort_key())
    return merged
