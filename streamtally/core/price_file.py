"""The price table file: its JSON format, its validation, and what a model name in it may be.

A price table is one JSON file::

    {
      "version": "2026-11-01",
      "currency": "USD",
      "unit": 1000000,
      "notes": "optional free text: where the rates come from",
      "models": {
        "gpt-4.1": {"input": "2.00", "cached_input": "0.50", "cache_write": "2.50",
                    "output": "8.00", "reasoning": null},
        "gpt-4.1-20*": {"input": "2.00", "cached_input": "0.50", "output": "8.00"},
        ...
      }
    }

Every rate is the price of `unit` tokens, written as a decimal *string*
(``"0.075"``): a JSON number is refused, floats above all, because a binary
float cannot hold most decimal prices exactly.  `input` and `output` are
required; `cached_input` (cache reads) and `cache_write` default to the input
rate, `reasoning` to the output rate (``null`` or absent: use the default).

Model names.  A name is either exact (``"gpt-4.1"`` prices the model
``gpt-4.1`` and nothing else) or a *wildcard*: a name whose last character is
``*`` prices every model that starts with what precedes it (``"gpt-4.1-20*"``
prices ``gpt-4.1-2025-04-14``; ``"*"`` alone prices every model, and a request
without a model).  A ``*`` anywhere but at the end is refused, as are empty
names and names with surrounding spaces.  How a model is looked up is
`streamtally.core.pricing.PriceTable.entry_for`.

This module only reads and checks the file; `streamtally.core.pricing` is the
table in use and the cost arithmetic.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
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

from streamtally.errors import InputError

__all__ = [
    "WILDCARD",
    "ModelRates",
    "PriceTableError",
    "Rates",
    "TableFile",
    "check_model_name",
    "is_wildcard",
    "parse_table",
    "read_table_text",
]

#: The model name of the catch-all entry (the wildcard with nothing before its ``*``).
WILDCARD: Final = "*"

_DECIMAL_TEXT: Final = re.compile(r"[0-9]+(\.[0-9]+)?")
_CURRENCY: Final = re.compile(r"[A-Z]{3}")


class PriceTableError(InputError):
    """A price table file that cannot be read or is not valid; the message says where."""


def is_wildcard(name: str) -> bool:
    """Whether a (valid) table entry name is a wildcard: it ends with ``*``."""
    return name.endswith(WILDCARD)


def check_model_name(name: str) -> str:
    """`name` if it may name a table entry, else ValueError saying why (see the module doc)."""
    if not name or name != name.strip():
        raise ValueError(f"model name {name!r} is empty or has surrounding spaces")
    if WILDCARD in name[:-1]:
        raise ValueError(
            f"model name {name!r} has a '*' before its end: a wildcard has exactly one '*', "
            'as its last character (like "gpt-4.1*"); an entry cannot match in the middle '
            "of a name"
        )
    return name


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


@dataclass(frozen=True, slots=True)
class Rates:
    """The five resolved rates of a model, each the price of `unit` tokens of the table."""

    input: Decimal
    cached_input: Decimal
    cache_write: Decimal
    output: Decimal
    reasoning: Decimal


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


class TableFile(BaseModel):
    """A validated price table file, as written (see the module docstring)."""

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
            check_model_name(name)
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


def read_table_text(text: str, *, origin: str) -> TableFile:
    """Parse and validate a price table's JSON text; `PriceTableError` names `origin` and where."""
    try:
        raw = _loads(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise PriceTableError(f"{origin}: not valid JSON: {exc}") from exc
    return parse_table(raw, origin=origin)


def parse_table(data: object, *, origin: str) -> TableFile:
    """Validate an already parsed table (same shape and rules as the file)."""
    try:
        return TableFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_where(e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
        )
        raise PriceTableError(f"{origin}: invalid price table: {problems}") from None
