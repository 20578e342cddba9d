"""Price tables: per-model token rates as exact decimals, and the exact cost of a request.

A price table is one JSON file::

    {
      "version": "2026-11-01",
      "currency": "USD",
      "unit": 1000000,
      "notes": "optional free text: where the rates come from",
      "models": {
        "gpt-4.1": {"input": "2.00", "cached_input": "0.50", "cache_write": "2.50",
                    "output": "8.00", "reasoning": null},
        ...
      }
    }

Every rate is the price of `unit` tokens, written as a decimal *string*
(``"0.075"``): a JSON number is refused, floats above all, because a binary
float cannot hold most decimal prices exactly.  `input` and `output` are
required; `cached_input` (cache reads) and `cache_write` default to the input
rate, `reasoning` to the output rate (``null`` or absent: use the default).

Model lookup (`PriceTable.rates_for`): the exact name, else the longest
configured name that is a prefix of the model (``gpt-4o-2024-08-06`` →
``gpt-4o``; configure ``gpt-4o-mini`` too, or the mini model is priced as
``gpt-4o``), else the ``"*"`` entry if the table has one, else the model is
*unpriced* (`cost` returns None).  A request without a model only matches
``"*"``.

Cost (`PriceTable.quote`, `PriceTable.cost`)::

    (  max(0, input - cached - cache_write) * input_rate
     + cached * cached_input_rate
     + cache_write * cache_write_rate
     + max(0, output - reasoning) * output_rate
     + reasoning * reasoning_rate ) / unit

computed with exact rational arithmetic (never a float).  The result is a
`Decimal` with exactly 12 decimal places (the scale of `BillingEvent.cost`);
it is rounded, ROUND_HALF_EVEN, only when the exact value has more than 12
decimal places (`Quote.rounded` says so).

Inconsistent usage: `cached_tokens` and `cache_write_tokens` are parts of
`input_tokens` and `reasoning_tokens` is part of `output_tokens`.  When a
report says otherwise (cached + cache_write > input, or reasoning > output)
the parts are still priced exactly as reported and only the remainder
(uncached input, non-reasoning output) is floored at 0, so the bill never
goes below what the parts cost.  Nothing is clamped silently: `Quote.notes`
describes it and a warning is logged on the ``streamtally.core.pricing`` logger.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
)

from streamtally.core.models import Usage
from streamtally.core.money import COST_SCALE
from streamtally.errors import InputError

__all__ = [
    "WILDCARD",
    "ModelRates",
    "PriceTable",
    "PriceTableError",
    "Quote",
    "Rates",
]

log = logging.getLogger("streamtally.core.pricing")

#: The model name of the catch-all entry.
WILDCARD: Final = "*"

_DECIMAL_TEXT: Final = re.compile(r"[0-9]+(\.[0-9]+)?")
_CURRENCY: Final = re.compile(r"[A-Z]{3}")
_SCALE: Final = 10**COST_SCALE


class PriceTableError(InputError):
    """A price table file that cannot be read or is not valid; the message says where."""


class _JsonNumber(str):
    """The literal text of a JSON number that has a fraction or exponent (see `_loads`)."""

    __slots__ = ()


def _rate(value: object) -> object:
    """Accept only a plain non-negative decimal string such as ``"2.50"``."""
    if isinstance(value, _JsonNumber):
        raise ValueError(
            f"rate is the JSON number {value}; write it as the string {json.dumps(str(value))} "
            "(floats cannot hold decimal prices exactly)"
        )
    if isinstance(value, int | float):  # bool is an int too
        raise ValueError(
            f"rate is the JSON number {value!r}; write it as the string {json.dumps(str(value))}"
        )
    if not isinstance(value, str):
        raise ValueError(f'rate must be a decimal string like "2.50", got {type(value).__name__}')
    if not _DECIMAL_TEXT.fullmatch(value):
        raise ValueError(
            f'rate {value!r} is not a plain non-negative decimal like "2.50" '
            "(no sign, exponent, spaces or thousands separators)"
        )
    return Decimal(value)


def _optional_rate(value: object) -> object:
    return None if value is None else _rate(value)


Rate = Annotated[Decimal, BeforeValidator(_rate)]
#: Validated before the union, so a bad value gets one error, not one per union branch.
OptionalRate = Annotated[Decimal | None, BeforeValidator(_optional_rate)]


class ModelRates(BaseModel):
    """The rates of one model entry as written in the file (`None`: use the default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: Rate
    output: Rate
    cached_input: OptionalRate = None
    cache_write: OptionalRate = None
    reasoning: OptionalRate = None

    def resolved(self) -> Rates:
        """The five rates with the defaults filled in."""
        return Rates(
            input=self.input,
            cached_input=self.input if self.cached_input is None else self.cached_input,
            cache_write=self.input if self.cache_write is None else self.cache_write,
            output=self.output,
            reasoning=self.output if self.reasoning is None else self.reasoning,
        )


@dataclass(frozen=True, slots=True)
class Rates:
    """The five resolved rates of a model, each the price of `PriceTable.unit` tokens."""

    input: Decimal
    cached_input: Decimal
    cache_write: Decimal
    output: Decimal
    reasoning: Decimal


@dataclass(frozen=True, slots=True)
class Quote:
    """The cost of one request under one price table, with how it was found.

    `cost` is None exactly when the model is unpriced (`entry` is None then).
    """

    model: str | None
    #: The price table entry used: the model itself, a prefix of it, or "*".
    entry: str | None
    cost: Decimal | None
    #: True when the exact cost had more than 12 decimal places and was rounded half-even.
    rounded: bool = False
    #: What was inconsistent in the usage report (see the module docstring); empty if nothing.
    notes: tuple[str, ...] = ()

    @property
    def priced(self) -> bool:
        return self.cost is not None


class _TableFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Annotated[str, Field(min_length=1)]
    currency: str
    unit: PositiveInt
    notes: str | None = None
    models: dict[str, ModelRates]

    @field_validator("version", "currency", "notes", mode="before")
    @classmethod
    def _text_not_number(cls, value: object) -> object:
        if isinstance(value, _JsonNumber):
            raise ValueError(f"must be a JSON string, got the number {value}")
        return value

    @field_validator("currency")
    @classmethod
    def _currency(cls, value: str) -> str:
        if not _CURRENCY.fullmatch(value):
            raise ValueError(f"currency must be an ISO 4217 code like 'USD', got {value!r}")
        return value

    @field_validator("unit", mode="before")
    @classmethod
    def _unit(cls, value: object) -> object:
        if isinstance(value, _JsonNumber):
            raise ValueError(f"unit must be a whole JSON number like 1000000, got {value}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"unit must be a whole JSON number like 1000000, got {value!r}")
        return value

    @field_validator("models")
    @classmethod
    def _names(cls, value: dict[str, ModelRates]) -> dict[str, ModelRates]:
        for name in value:
            if not name or name != name.strip():
                raise ValueError(f"model name {name!r} is empty or has surrounding spaces")
        return value


def _loads(text: str) -> Any:
    """JSON with every non-integer number kept as its literal text (a `_JsonNumber`)."""

    def duplicate_check(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    return json.loads(text, parse_float=_JsonNumber, object_pairs_hook=duplicate_check)


def _where(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


class PriceTable:
    """A loaded, validated price table.  Treat it as read-only; safe to share between tasks."""

    __slots__ = ("_rates", "currency", "notes", "unit", "version")

    version: str
    currency: str
    unit: int
    notes: str | None
    _rates: dict[str, Rates]

    def __init__(self, checked: _TableFile) -> None:
        """Use `load`, `loads` or `from_dict`."""
        self.version = checked.version
        self.currency = checked.currency
        self.unit = checked.unit
        self.notes = checked.notes
        self._rates = {name: entry.resolved() for name, entry in checked.models.items()}

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
        try:
            raw = _loads(text)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise PriceTableError(f"{origin}: not valid JSON: {exc}") from exc
        return cls.from_dict(raw, origin=origin)

    @classmethod
    def from_dict(cls, data: object, *, origin: str = "<price table>") -> PriceTable:
        """Validate an already parsed table (same shape and rules as the file)."""
        try:
            checked = _TableFile.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{_where(e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            )
            raise PriceTableError(f"{origin}: invalid price table: {problems}") from None
        return cls(checked)

    # ---------------------------------------------------------------- lookup

    @property
    def models(self) -> tuple[str, ...]:
        """The configured model names (``"*"`` included if present), sorted."""
        return tuple(sorted(self._rates))

    def entry_for(self, model: str | None) -> str | None:
        """The configured name that prices `model` (exact, longest prefix, ``"*"``) or None."""
        if model is not None:
            if model in self._rates:
                return model
            best: str | None = None
            for name in self._rates:
                if (
                    name != WILDCARD
                    and model.startswith(name)
                    and (best is None or len(name) > len(best))
                ):
                    best = name
            if best is not None:
                return best
        return WILDCARD if WILDCARD in self._rates else None

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
