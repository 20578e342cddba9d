"""Exact money: costs as decimals with 12 places, and as whole units plus a 10**-12 remainder.

A cost is carried as a `Decimal` with exponent exactly -12 everywhere (the
Avro `decimal(38,12)` of the billing topic); Redis counts it as two integers,
whole currency units and pico units (`cost_parts`), so that HINCRBY sums it
exactly.  No float is ever involved.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Final

__all__ = ["COST_PRECISION", "COST_SCALE", "PICO", "cost_parts", "cost_text", "scaled_cost"]

#: A cost is an Avro decimal(38, 12): at most 12 decimal places, 38 digits.
COST_PRECISION: Final = 38
COST_SCALE: Final = 12
#: Pico units per currency unit (10**-12 is the smallest cost step).
PICO: Final = 10**COST_SCALE


def scaled_cost(cost: object) -> Decimal:
    """`cost` as a Decimal with exponent exactly -12 (the Avro scale), computed without rounding.

    Raises TypeError for anything but a `Decimal` (floats above all) and
    ValueError for a non-finite value, more than 12 significant decimal places
    or more than 38 digits.
    """
    if not isinstance(cost, Decimal):
        raise TypeError(
            f"cost must be a decimal.Decimal (never a float), got {type(cost).__name__}"
        )
    sign, digits, exponent = cost.as_tuple()
    if not isinstance(exponent, int):
        raise ValueError(f"cost must be finite, got {cost}")
    magnitude = int("".join(map(str, digits)) or "0")
    shift = exponent + COST_SCALE
    if shift >= 0:
        unscaled = magnitude * 10**shift
    else:
        unscaled, rest = divmod(magnitude, 10**-shift)
        if rest:
            raise ValueError(f"cost {cost} has more than {COST_SCALE} decimal places")
    text = str(unscaled)
    if len(text) > COST_PRECISION:
        raise ValueError(f"cost {cost} has more than {COST_PRECISION} digits at scale {COST_SCALE}")
    return Decimal((sign, tuple(int(ch) for ch in text), -COST_SCALE))


def cost_parts(cost: Decimal) -> tuple[int, int]:
    """An exact cost (at most 12 decimal places) as ``(units, pico)``.

    ``cost == units + pico / 10**12`` with ``0 <= pico < 10**12`` (floor
    division, so a negative cost has negative units and a non-negative pico).
    """
    sign, digits, _ = scaled_cost(cost).as_tuple()
    unscaled = int("".join(map(str, digits)) or "0")
    return divmod(-unscaled if sign else unscaled, PICO)


def cost_text(units: int, pico: int) -> str:
    """``units + pico / 10**12`` as a plain decimal string with exactly 12 places."""
    total = units * PICO + pico
    whole, frac = divmod(abs(total), PICO)
    return f"{'-' if total < 0 else ''}{whole}.{frac:0{COST_SCALE}d}"
