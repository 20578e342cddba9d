"""Re-rating: the audited period priced again at other prices (``streamtally audit --prices``).

Every request the replay closed (partial and dead-lettered requests are not) is charged
twice: as billed, by the replay at the price versions in force (the settings' table), and
at the prices of another table (`Rerating.prices`), each at the request's receive time, its
billing event's `event_time`, through the one pricing function `streamtally.billing.events
.charge`.  The sums per tenant are exact (10**-12 units); `difference` is re-rated minus
billed: positive when the tenant was charged too little at the other prices.  Nothing is
written anywhere; billing teams issue their corrections from the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from streamtally.billing.events import charge
from streamtally.billing.pricing import PriceTable
from streamtally.core.money import PICO, cost_parts, cost_text
from streamtally.wire.records import BillingEvent

__all__ = ["RerateSum", "Rerating", "rerated_cost"]


def rerated_cost(billed: BillingEvent, prices: PriceTable) -> Decimal | None:
    """What the request of `billed` costs at `prices` (None: unpriced there), at its
    receive time (`event_time`)."""
    return charge(billed.model, billed.usage, billed.event_time, prices).cost


def _pico(cost: Decimal) -> int:
    units, pico = cost_parts(cost)
    return units * PICO + pico


def _text(pico: int) -> str:
    units, rest = divmod(pico, PICO)
    return cost_text(units, rest)


@dataclass(slots=True)
class RerateSum:
    """One tenant's (or the total's) requests, billed and re-rated, in 10**-12 units."""

    requests: int = 0
    billed_pico: int = 0
    rerated_pico: int = 0
    unpriced_billed: int = 0
    unpriced_rerated: int = 0

    def add(self, billed: BillingEvent, rerated: Decimal | None) -> None:
        self.requests += 1
        self.billed_pico += _pico(billed.cost)
        self.unpriced_billed += 0 if billed.priced else 1
        if rerated is None:
            self.unpriced_rerated += 1
        else:
            self.rerated_pico += _pico(rerated)

    def merge(self, other: RerateSum) -> None:
        self.requests += other.requests
        self.billed_pico += other.billed_pico
        self.rerated_pico += other.rerated_pico
        self.unpriced_billed += other.unpriced_billed
        self.unpriced_rerated += other.unpriced_rerated

    def to_json(self) -> dict[str, Any]:
        """Costs as decimal strings with 12 places; `difference` = rerated - billed."""
        return {
            "requests": self.requests,
            "billed": _text(self.billed_pico),
            "rerated": _text(self.rerated_pico),
            "difference": _text(self.rerated_pico - self.billed_pico),
            "unpriced_billed": self.unpriced_billed,
            "unpriced_rerated": self.unpriced_rerated,
        }


@dataclass(slots=True)
class Rerating:
    """The re-rating of an audit at `prices` (named `name` in the report)."""

    prices: PriceTable
    name: str
    _tenants: dict[str, RerateSum] = field(default_factory=dict)

    def add(self, billed: BillingEvent) -> None:
        """A request the replay closed and billed as `billed` (at the prices in force)."""
        self._tenants.setdefault(billed.tenant, RerateSum()).add(
            billed, rerated_cost(billed, self.prices)
        )

    def sums(self) -> dict[str, RerateSum]:
        """tenant -> the sum of its requests (what a split audit's share hands over)."""
        return self._tenants

    def to_json(self) -> dict[str, Any]:
        """The report's ``rerating``: what was used, per tenant, and the total."""
        total = RerateSum()
        for one in self._tenants.values():
            total.merge(one)
        return {
            "prices": self.name,
            "currency": self.prices.currency,
            "versions": [
                {
                    "version": v.version,
                    "effective_from": None
                    if v.effective_from is None
                    else v.effective_from.isoformat().replace("+00:00", "Z"),
                }
                for v in self.prices.versions
            ],
            "tenants": {t: s.to_json() for t, s in sorted(self._tenants.items())},
            "total": total.to_json(),
        }
