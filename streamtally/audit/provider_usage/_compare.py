"""The provider's totals against the ledger's, per (UTC day, model, tenant) and token kind.

What is compared (`compare_usage`), per provider export (`ProviderReport`):

- its buckets wholly inside the audit's range (``--since`` / ``--until``; all without
  them); the others are counted as ``buckets_outside`` and left out;
- its lines mapped to a tenant (`TenantMap`) audited (all, or those of ``--tenant``);
  a line of an id the map lacks is listed under ``unmapped``, not compared (the map says
  which keys are ours);
- the bills that stand (`BillingLedger`) of the tenants the map names (and audits), of a
  model the export reports, whose `event_time` (the request's last receive time) lies in
  one of those buckets: each is counted on the UTC day of its `event_time`.  A model two
  exports both report is refused: its bills would be counted twice.

Each kind the provider reports (`PROVIDER_KINDS`) is compared; a difference beyond the
`Tolerance` is a ``provider_usage_mismatch`` (`field` the kind, `expected` the provider's
count, `found` the ledger's).  The default tolerance is none: exact, which holds when the
buckets are days and no call straddles midnight UTC (the provider may count a call by its
start, streamtally by its last receive time).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from streamtally.audit import Discrepancy, Kind, TimeRange
from streamtally.audit.provider_usage._parse import KINDS, ProviderReport, UsageLine
from streamtally.audit.provider_usage._tenants import TenantMap
from streamtally.errors import InputError
from streamtally.wire.records import BillingEvent

__all__ = ["ProviderCheck", "Tolerance", "compare_usage"]

Key = tuple[str, str, str]  # (day, model, tenant)


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How far apart two counts may be and still match: within `tokens` (token kinds) or
    `requests` (requests), or within `relative` times the larger count; 0, 0, 0: exact."""

    relative: Decimal = Decimal(0)
    tokens: int = 0
    requests: int = 0

    @classmethod
    def parse(cls, text: str | None) -> Tolerance:
        """``rel=0.001,tokens=2000,requests=2`` (any subset, in any order; empty: exact)."""
        values: dict[str, Any] = {}
        for part in (text or "").split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in ("rel", "tokens", "requests") or name in values:
                raise InputError(
                    f"provider tolerance {text!r}: want rel=FRACTION,tokens=N,requests=N "
                    "(each at most once)"
                )
            if name == "rel":
                try:
                    rel = Decimal(value)
                except InvalidOperation:
                    rel = Decimal(-1)
                if not rel.is_finite() or not 0 <= rel < 1:
                    raise InputError(f"provider tolerance {text!r}: rel must be >= 0 and < 1")
                values["relative"] = rel
            else:
                if not value.isdigit():
                    raise InputError(f"provider tolerance {text!r}: {name} must be a count >= 0")
                values[name] = int(value)
        return cls(**values)

    def allows(self, kind: str, provider: int, ours: int) -> bool:
        difference = abs(provider - ours)
        absolute = self.requests if kind == "requests" else self.tokens
        return difference <= absolute or difference <= self.relative * max(provider, ours)

    def to_json(self) -> dict[str, Any]:
        return {"rel": str(self.relative), "tokens": self.tokens, "requests": self.requests}


@dataclass(slots=True)
class _Intervals:
    """Disjoint [start, end) intervals, sorted, for `contains`."""

    starts: list[datetime] = field(default_factory=list)
    ends: list[datetime] = field(default_factory=list)

    @classmethod
    def of(cls, spans: Iterable[tuple[datetime, datetime]]) -> _Intervals:
        out = cls()
        for start, end in sorted(set(spans)):
            if out.ends and start <= out.ends[-1]:
                out.ends[-1] = max(out.ends[-1], end)
            else:
                out.starts.append(start)
                out.ends.append(end)
        return out

    def contains(self, moment: datetime) -> bool:
        i = bisect.bisect_right(self.starts, moment) - 1
        return i >= 0 and moment < self.ends[i]


@dataclass(slots=True)
class _Sums:
    counts: dict[Key, dict[str, int]] = field(default_factory=dict)

    def add(self, key: Key, counts: dict[str, int]) -> None:
        into = self.counts.setdefault(key, dict.fromkeys(KINDS, 0))
        for kind, n in counts.items():
            into[kind] += n


@dataclass(slots=True)
class ProviderCheck:
    """The comparison's outcome: its discrepancies and what the report says of it."""

    discrepancies: list[Discrepancy] = field(default_factory=list)
    providers: list[dict[str, Any]] = field(default_factory=list)
    unmapped: list[dict[str, Any]] = field(default_factory=list)
    tolerance: Tolerance = field(default_factory=Tolerance)
    bills_read: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "tolerance": self.tolerance.to_json(),
            "bills_standing": self.bills_read,
            "providers": self.providers,
            "unmapped": self.unmapped,
        }


def _bill_counts(bill: BillingEvent) -> dict[str, int]:
    return {"requests": 1, **{k: getattr(bill, k) for k in KINDS if k != "requests"}}


def compare_usage(
    reports: list[ProviderReport],
    tenant_map: TenantMap,
    bills: list[BillingEvent],
    *,
    window: TimeRange,
    tenants: frozenset[str] | None = None,
    tolerance: Tolerance | None = None,
) -> ProviderCheck:
    """Each export of `reports` against the standing `bills` (see the module docstring)."""
    check = ProviderCheck(tolerance=tolerance or Tolerance(), bills_read=len(bills))
    owner: dict[str, str] = {}
    for report in reports:
        for model in {line.model for line in report.lines}:
            if owner.setdefault(model, report.provider) != report.provider:
                raise InputError(
                    f"--provider-usage: model {model} is in the {owner[model]} and the "
                    f"{report.provider} exports: its bills would be counted twice"
                )
    audited = tenant_map.named() if tenants is None else tenant_map.named() & tenants
    for report in reports:
        check.providers.append(
            _compare_one(
                report,
                tenant_map=tenant_map,
                audited=audited,
                bills=bills,
                window=window,
                check=check,
            )
        )
    check.discrepancies.sort(key=lambda d: d.sort_key())
    return check


def _compare_one(
    report: ProviderReport,
    *,
    tenant_map: TenantMap,
    audited: frozenset[str],
    bills: list[BillingEvent],
    window: TimeRange,
    check: ProviderCheck,
) -> dict[str, Any]:
    inside: list[UsageLine] = []
    outside: set[tuple[datetime, datetime]] = set()
    for line in report.lines:
        if window.contains(line.start) and (window.until is None or line.end <= window.until):
            inside.append(line)
        else:
            outside.add((line.start, line.end))
    covered = _Intervals.of((line.start, line.end) for line in inside)
    theirs, ours = _Sums(), _Sums()
    unmapped: dict[tuple[str, str, str], dict[str, int]] = {}
    for line in inside:
        tenant = tenant_map.tenant_of(line.ids)
        if tenant is None:
            into = unmapped.setdefault((line.day, line.model, line.ids[0]), {})
            for kind, n in line.counts.items():
                into[kind] = into.get(kind, 0) + n
        elif tenant in audited:
            theirs.add((line.day, line.model, tenant), line.counts)
    models = {line.model for line in report.lines}
    for bill in bills:
        if bill.tenant in audited and bill.model in models and covered.contains(bill.event_time):
            day = bill.event_time.date().isoformat()
            ours.add((day, bill.model, bill.tenant), _bill_counts(bill))
    kinds = report.kinds
    matched = within = mismatched = 0
    for key in sorted(theirs.counts.keys() | ours.counts.keys()):
        day, model, tenant = key
        p = theirs.counts.get(key) or dict.fromkeys(KINDS, 0)
        o = ours.counts.get(key) or dict.fromkeys(KINDS, 0)
        differing = [k for k in kinds if p[k] != o[k]]
        beyond = [k for k in differing if not check.tolerance.allows(k, p[k], o[k])]
        if beyond:
            mismatched += 1
        elif differing:
            within += 1
        else:
            matched += 1
        for kind in beyond:
            check.discrepancies.append(
                Discrepancy(
                    Kind.PROVIDER_USAGE_MISMATCH, None, tenant, model, day, kind, p[kind], o[kind]
                )
            )
    for (day, model, provider_id), counts in sorted(unmapped.items()):
        check.unmapped.append(
            {"provider": report.provider, "day": day, "model": model, "id": provider_id, **counts}
        )
    return {
        "provider": report.provider,
        "files": report.files,
        "kinds": list(kinds),
        "buckets_compared": len({(line.start, line.end) for line in inside}),
        "buckets_outside": len(outside),
        "keys": {"matched": matched, "within_tolerance": within, "mismatched": mismatched},
        "provider_totals": _total(theirs, kinds),
        "ledger_totals": _total(ours, kinds),
    }


def _total(sums: _Sums, kinds: tuple[str, ...]) -> dict[str, int]:
    return {k: sum(c[k] for c in sums.counts.values()) for k in kinds}
