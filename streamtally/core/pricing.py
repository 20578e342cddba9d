"""Price tables in use: which entry prices a model, and the exact cost of a request.

The file format and its validation are `streamtally.core.price_file`; this
module is the loaded table (`PriceTable`) and its arithmetic.

Model lookup (`PriceTable.entry_for`): the exact name if the table has it;
else the longest *wildcard* entry (a name ending in ``*``) whose text before
the ``*`` starts the model (``"gpt-4.1-20*"`` prices ``gpt-4.1-2025-04-14``;
``"gpt-4.1-mini-20*"``, being longer, wins for ``gpt-4.1-mini-2025-04-14``);
else the model is *unpriced* (`cost` returns None).  ``"*"`` alone is the
shortest wildcard: it prices whatever nothing else does.  A request without a
model only matches ``"*"``.  Nothing is matched by an implicit prefix: an
entry ``"gpt-4.1"`` prices ``gpt-4.1`` only, never ``gpt-4.1-mini-...``, so a
model the table does not name stays visibly unpriced instead of being billed
at another model's rates.

Cost (`PriceTable.quote`, `PriceTable.cost`)::

    (  max(0, input - cached - cache_write) * input_rate
     + cached * cached_input_rate
     + cache_write * cache_write_rate
     + max(0, output - reasoning) * output_rate
     + reasoning * reasoning_rate ) / unit

computed with exact rational arithmetic (never a float).  The result is a
`Decimal` with exactly 12 decimal places (the scale of `BillingEvent.cost`);
it is rounded, ROUND_HALF_EVEN, only when the exact value has more than 12
decimal places (`Quote.rounded` says so).  Whether the billing record can
carry it (decimal(38, 12)) is for `streamtally.wire.billing` to check.

Inconsistent usage: `cached_tokens` and `cache_write_tokens` are parts of
`input_tokens` and `reasoning_tokens` is part of `output_tokens`.  When a
report says otherwise (cached + cache_write > input, or reasoning > output)
the parts are still priced exactly as reported and only the remainder
(uncached input, non-reasoning output) is floored at 0, so the bill never
goes below what the parts cost.  Nothing is clamped silently: `Quote.notes`
describes it and a warning is logged on the ``streamtally.core.pricing`` logger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Final

from streamtally.core.models import Usage
from streamtally.core.money import COST_SCALE
from streamtally.core.price_file import (
    WILDCARD,
    ModelRates,
    PriceTableError,
    Rates,
    TableFile,
    is_wildcard,
    parse_table,
    read_table_text,
)

__all__ = [
    "WILDCARD",
    "ModelRates",
    "PriceTable",
    "PriceTableError",
    "Quote",
    "Rates",
]

log = logging.getLogger("streamtally.core.pricing")

_SCALE: Final = 10**COST_SCALE


@dataclass(frozen=True, slots=True)
class Quote:
    """The cost of one request under one price table, with how it was found.

    `cost` is None exactly when the model is unpriced (`entry` is None then).
    """

    model: str | None
    #: The price table entry used: the model itself, or the wildcard entry that matched it.
    entry: str | None
    cost: Decimal | None
    #: True when the exact cost had more than 12 decimal places and was rounded half-even.
    rounded: bool = False
    #: What was inconsistent in the usage report (see the module docstring); empty if nothing.
    notes: tuple[str, ...] = ()

    @property
    def priced(self) -> bool:
        return self.cost is not None


class PriceTable:
    """A loaded, validated price table.  Treat it as read-only; safe to share between tasks."""

    __slots__ = ("_exact", "_rates", "_wildcards", "currency", "notes", "unit", "version")

    version: str
    currency: str
    unit: int
    notes: str | None
    _rates: dict[str, Rates]
    #: The exact entries, by model name.
    _exact: dict[str, Rates]
    #: (text before the ``*``, entry name) of every wildcard entry, longest text first.
    _wildcards: tuple[tuple[str, str], ...]

    def __init__(self, checked: TableFile) -> None:
        """Use `load`, `loads` or `from_dict`."""
        self.version = checked.version
        self.currency = checked.currency
        self.unit = checked.unit
        self.notes = checked.notes
        self._rates = {name: entry.resolved() for name, entry in checked.models.items()}
        self._exact = {n: r for n, r in self._rates.items() if not is_wildcard(n)}
        self._wildcards = tuple(
            sorted(
                ((name[:-1], name) for name in self._rates if is_wildcard(name)),
                key=lambda pair: (-len(pair[0]), pair[0]),
            )
        )

    @classmethod
    def default(cls) -> PriceTable:
        """The price table shipped with streamtally (`streamtally/core/prices.json`)."""
        text = resources.files("streamtally.core").joinpath("prices.json").read_text("utf-8")
        return cls.loads(text, origin="the packaged price table")

    @classmethod
    def load_or_default(cls, path: str | Path | None) -> PriceTable:
        """The table at `path`, or the packaged one when `path` is None."""
        return cls.default() if path is None else cls.load(path)

    @classmethod
    def load(cls, path: str | Path) -> PriceTable:
        """Read and validate the price table file at `path` (`PriceTableError` if it is not one)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PriceTableError(f"cannot read price table {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise PriceTableError(f"price table {path} is not UTF-8: {exc}") from exc
        return cls.loads(text, origin=str(path))

    @classmethod
    def loads(cls, text: str, *, origin: str = "<price table>") -> PriceTable:
        """Parse and validate a price table from its JSON text; `origin` names it in errors."""
        return cls(read_table_text(text, origin=origin))

    @classmethod
    def from_dict(cls, data: object, *, origin: str = "<price table>") -> PriceTable:
        """Validate an already parsed table (same shape and rules as the file)."""
        return cls(parse_table(data, origin=origin))

    # ---------------------------------------------------------------- lookup

    @property
    def models(self) -> tuple[str, ...]:
        """The configured entry names (wildcards such as ``"*"`` included), sorted."""
        return tuple(sorted(self._rates))

    def entry_for(self, model: str | None) -> str | None:
        """The entry that prices `model`: its exact name, else the longest matching wildcard.

        None when no entry does (the model is unpriced).  A model of None only
        matches the catch-all ``"*"``.
        """
        if model is None:
            return WILDCARD if WILDCARD in self._rates else None
        if model in self._exact:
            return model
        for prefix, name in self._wildcards:
            if model.startswith(prefix):
                return name
        return None

    def rates_for(self, model: str | None) -> Rates | None:
        """The resolved rates that price `model`, or None when it is unpriced."""
        entry = self.entry_for(model)
        return None if entry is None else self._rates[entry]

    def is_priced(self, model: str | None) -> bool:
        return self.entry_for(model) is not None

    # ---------------------------------------------------------------- cost

    def quote(self, model: str | None, usage: Usage) -> Quote:
        """The exact cost of `usage` on `model`, with the entry used and any notes."""
        entry = self.entry_for(model)
        if entry is None:
            return Quote(model=model, entry=None, cost=None)
        r = self._rates[entry]
        notes: list[str] = []
        parts = usage.cached_tokens + usage.cache_write_tokens
        if parts > usage.input_tokens:
            notes.append(
                f"cached_tokens + cache_write_tokens ({parts}) > input_tokens "
                f"({usage.input_tokens}): uncached input priced as 0 tokens"
            )
        if usage.reasoning_tokens > usage.output_tokens:
            notes.append(
                f"reasoning_tokens ({usage.reasoning_tokens}) > output_tokens "
                f"({usage.output_tokens}): non-reasoning output priced as 0 tokens"
            )
        uncached = max(0, usage.input_tokens - parts)
        visible = max(0, usage.output_tokens - usage.reasoning_tokens)
        total = (
            uncached * Fraction(r.input)
            + usage.cached_tokens * Fraction(r.cached_input)
            + usage.cache_write_tokens * Fraction(r.cache_write)
            + visible * Fraction(r.output)
            + usage.reasoning_tokens * Fraction(r.reasoning)
        ) / self.unit
        scaled = total * _SCALE
        units = round(scaled)  # Fraction.__round__: nearest integer, ties to even
        sign, digits, _ = Decimal(units).as_tuple()
        cost = Decimal((sign, digits, -COST_SCALE))  # exact: no context precision involved
        quote = Quote(
            model=model,
            entry=entry,
            cost=cost,
            rounded=scaled.denominator != 1,
            notes=tuple(notes),
        )
        if notes:
            log.warning("pricing %s: inconsistent usage: %s", model, "; ".join(notes))
        return quote

    def cost(self, model: str | None, usage: Usage) -> Decimal | None:
        """The exact cost (12 decimal places) of `usage` on `model`; None when unpriced."""
        return self.quote(model, usage).cost

    def __repr__(self) -> str:
        return (
            f"PriceTable(version={self.version!r}, currency={self.currency!r}, "
            f"unit={self.unit}, models={len(self._rates)})"
        )
