"""Usage rows: the replay's sums per (tenant, model, day), and their comparison with Redis.

A row is compared on `ROW_FIELDS`: the requests counted, those billed unpriced, the five
usage fields and the exact cost (a decimal string with 12 places).  Which rows an audit
may compare at all is `Ledger.compare_rows`'s business (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from streamtally.audit._compare import Discrepancy, Kind
from streamtally.core.models import USAGE_FIELDS
from streamtally.core.money import PICO, cost_parts, cost_text
from streamtally.store import UNKNOWN_MODEL, UNPRICED_FIELD, day_of
from streamtally.wire.records import BillingEvent

__all__ = [
    "ROW_FIELDS",
    "RowComparison",
    "RowKey",
    "RowSum",
    "compare_rows",
    "row_key",
    "stored_row",
]

#: The fields of a usage row the audit compares.
ROW_FIELDS: Final = ("requests", UNPRICED_FIELD, *USAGE_FIELDS, "cost")

#: (tenant, model, day) of a usage row; `model` as the row names it (``unknown`` for none).
RowKey = tuple[str, str, str]


def row_key(event: BillingEvent) -> RowKey:
    """The usage row a billed request is counted in, as the worker's sink names it."""
    return (event.tenant, event.model or UNKNOWN_MODEL, day_of(event.event_time))


@dataclass(slots=True)
class RowSum:
    """The sum of billed requests of one usage row (costs in exact 10**-12 units)."""

    requests: int = 0
    unpriced_requests: int = 0
    usage: list[int] = field(default_factory=lambda: [0] * len(USAGE_FIELDS))
    cost_pico: int = 0

    def add(self, event: BillingEvent, sign: int = 1) -> None:
        """Count `event` in (`sign` -1: take it out again, as a revision that supersedes
        it does)."""
        self.requests += sign
        self.unpriced_requests += 0 if event.priced else sign
        for i, value in enumerate(event.usage.counts()):
            self.usage[i] += sign * value
        units, pico = cost_parts(event.cost)
        self.cost_pico += sign * (units * PICO + pico)

    def merge(self, other: RowSum) -> None:
        """Add the sum `other` (of other requests) to this one."""
        self.requests += other.requests
        self.unpriced_requests += other.unpriced_requests
        for i, value in enumerate(other.usage):
            self.usage[i] += value
        self.cost_pico += other.cost_pico

    def to_list(self) -> list[int]:
        """The sum as numbers: requests, unpriced, the usage fields, the cost in 10**-12."""
        return [self.requests, self.unpriced_requests, *self.usage, self.cost_pico]

    @classmethod
    def from_list(cls, values: list[int]) -> RowSum:
        """The sum `to_list` gave."""
        n = len(USAGE_FIELDS)
        if len(values) != n + 3:
            raise ValueError(f"a row sum has {n + 3} numbers, not {len(values)}")
        return cls(values[0], values[1], list(values[2 : 2 + n]), values[2 + n])

    def values(self) -> dict[str, Any]:
        """The row's `ROW_FIELDS` as JSON values."""
        units, pico = divmod(self.cost_pico, PICO)
        return {
            "requests": self.requests,
            UNPRICED_FIELD: self.unpriced_requests,
            **dict(zip(USAGE_FIELDS, self.usage, strict=True)),
            "cost": cost_text(units, pico),
        }


def stored_row(row: Mapping[str, Any]) -> tuple[RowKey, dict[str, Any]]:
    """A row of `RedisStore.usage_rows` as its key and its `ROW_FIELDS` values."""
    return (row["tenant"], row["model"], row["day"]), {name: row[name] for name in ROW_FIELDS}


@dataclass(frozen=True, slots=True)
class RowComparison:
    checked: int
    matched: int
    mismatched: int
    discrepancies: list[Discrepancy]


def _zero(name: str) -> Any:
    return cost_text(0, 0) if name == "cost" else 0


def compare_rows(
    expected: Mapping[RowKey, Mapping[str, Any]],
    found: Mapping[RowKey, Mapping[str, Any]],
    keys: Iterable[RowKey] | None = None,
) -> RowComparison:
    """Each row of `keys` (default: of either side) compared field by field.

    A row absent on one side is null there: a field differs unless the other side's value
    is zero (a row of only zeros needs no hash).
    """
    wanted = sorted(set(expected) | set(found)) if keys is None else sorted(set(keys))
    matched = mismatched = 0
    out: list[Discrepancy] = []
    for key in wanted:
        want, got = expected.get(key), found.get(key)
        differences = []
        for name in ROW_FIELDS:
            a = None if want is None else want[name]
            b = None if got is None else got[name]
            if (a if a is not None else _zero(name)) != (b if b is not None else _zero(name)):
                differences.append((name, a, b))
        if differences:
            mismatched += 1
            tenant, model, day = key
            out.extend(
                Discrepancy(Kind.USAGE_ROW_MISMATCH, None, tenant, model, day, name, a, b)
                for name, a, b in differences
            )
        else:
            matched += 1
    return RowComparison(len(wanted), matched, mismatched, out)
