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
`streamtally.billing.pricing.PriceTable.entry_for`.

Price history.  A table may say when it takes effect, and a file may hold
several versions of the table::

    {
      "currency": "USD",
      "notes": "optional",
      "versions": [
        {"version": "2026-10-01", "unit": 1000000, "models": {...}},
        {"version": "2026-11-01", "effective_from": "2026-11-01T00:00:00Z",
         "unit": 1000000, "notes": "optional", "models": {...}}
      ]
    }

A file without ``"versions"`` is the one-version table above, exactly as
before (it may carry an ``"effective_from"`` too).  `effective_from` is an
RFC 3339 time in UTC (``Z`` or ``+00:00``; a time without a zone is refused);
a version is in force from it (included) until the next version's.  The
versions are listed oldest first, each but the first with an
``effective_from`` later than the one before; the first may omit it (in force
since always).  Version names are distinct and non-empty.  One currency per
file: every cost of a history is summed into the same usage rows.

A model entry may carry an ``"effective_from"`` as well: a model added to a
version after it took effect.  Before that time the entry is as if absent
(the lookup falls to a wildcard, or the model is unpriced).  It must lie
inside its version's time (not before its ``effective_from``, before the next
version's): rates never change inside a version, so a version's name and a
request's time say exactly which rates priced it.

This module only reads and checks the file; `streamtally.billing.pricing` is the
table in use and the cost arithmetic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
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

from streamtally.errors import PriceTableError

__all__ = [
    "NO_VERSION",
    "WILDCARD",
    "HistoryFile",
    "ModelRates",
    "PriceFile",
    "PriceTableError",
    "Rates",
    "TableFile",
    "VersionFile",
    "check_model_name",
    "history_problems",
    "is_wildcard",
    "parse_table",
    "read_table_text",
]

#: The model name of the catch-all entry (the wildcard with nothing before its ``*``).
WILDCARD: Final = "*"

#: The version a billing event names when no version of its price table was in force at
#: its request's receive time (before the first version's `effective_from`); never a name.
NO_VERSION: Final = "(none in force)"

_DECIMAL_TEXT: Final = re.compile(r"[0-9]+(\.[0-9]+)?")
_UTC_TIME: Final = re.compile(
    r"(\d{4}-\d{2}-\d{2})T(\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?)(Z|[+-]\d{2}:\d{2})?"
)
_CURRENCY: Final = re.compile(r"[A-Z]{3}")


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


def _utc_time(value: object) -> object:
    """Accept only an RFC 3339 UTC time string such as ``"2026-11-01T00:00:00Z"``."""
    if value is None:
        return None
    if isinstance(value, _JsonNumber) or not isinstance(value, str):
        shown = value if isinstance(value, _JsonNumber) else repr(value)
        raise ValueError(
            f'effective_from must be an RFC 3339 UTC time string like "2026-11-01T00:00:00Z", '
            f"got {shown}"
        )
    match = _UTC_TIME.fullmatch(value)
    if match is None:
        raise ValueError(
            f'effective_from {value!r} is not an RFC 3339 time like "2026-11-01T00:00:00Z"'
        )
    day, clock, zone = match.groups()
    if zone is None:
        raise ValueError(
            f"effective_from {value!r} has no time zone: write it in UTC, ending with Z"
        )
    if zone not in ("Z", "+00:00"):
        raise ValueError(f"effective_from {value!r} is not UTC: write it in UTC, ending with Z")
    try:
        return datetime.fromisoformat(f"{day}T{clock}").replace(tzinfo=UTC)
    except ValueError as exc:
        raise ValueError(f"effective_from {value!r} is not a valid time: {exc}") from None


Rate = Annotated[Decimal, BeforeValidator(_rate)]
#: An aware UTC time (None: not given).
UtcTime = Annotated[datetime | None, BeforeValidator(_utc_time)]
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
    #: When the entry comes into force inside its version (None: with its version).
    effective_from: UtcTime = None

    def resolved(self) -> Rates:
        """The five rates with the defaults filled in."""
        return Rates(
            input=self.input,
            cached_input=self.input if self.cached_input is None else self.cached_input,
            cache_write=self.input if self.cache_write is None else self.cache_write,
            output=self.output,
            reasoning=self.output if self.reasoning is None else self.reasoning,
        )


class VersionFile(BaseModel):
    """One version of a price table, as written (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Annotated[str, Field(min_length=1)]
    #: When the version takes effect (None: since always; the first version only).
    effective_from: UtcTime = None
    unit: PositiveInt
    notes: str | None = None
    models: dict[str, ModelRates]

    @field_validator("version", "notes", mode="before")
    @classmethod
    def _text_not_number(cls, value: object) -> object:
        if isinstance(value, _JsonNumber):
            raise ValueError(f"must be a JSON string, got the number {value}")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if value == NO_VERSION:
            raise ValueError(f"{NO_VERSION!r} is reserved (what an unpriced event names)")
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


def _currency(value: object) -> object:
    if isinstance(value, _JsonNumber):
        raise ValueError(f"must be a JSON string, got the number {value}")
    if not isinstance(value, str) or not _CURRENCY.fullmatch(value):
        raise ValueError(f"currency must be an ISO 4217 code like 'USD', got {value!r}")
    return value


Currency = Annotated[str, BeforeValidator(_currency)]


class TableFile(VersionFile):
    """A one-version price table file, as written: the format of every table before history."""

    currency: Currency


class HistoryFile(BaseModel):
    """A price table file with several versions, as written (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    currency: Currency
    notes: str | None = None
    versions: Annotated[list[VersionFile], Field(min_length=1)]

    @field_validator("notes", mode="before")
    @classmethod
    def _text_not_number(cls, value: object) -> object:
        if isinstance(value, _JsonNumber):
            raise ValueError(f"must be a JSON string, got the number {value}")
        return value


@dataclass(frozen=True, slots=True)
class PriceFile:
    """A validated price table file of either shape: its versions, oldest first."""

    currency: str
    notes: str | None
    versions: tuple[VersionFile, ...]


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


def read_table_text(text: str, *, origin: str) -> PriceFile:
    """Parse and validate a price table's JSON text; `PriceTableError` names `origin` and where."""
    try:
        raw = _loads(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise PriceTableError(f"{origin}: not valid JSON: {exc}") from exc
    return parse_table(raw, origin=origin)


def parse_table(data: object, *, origin: str) -> PriceFile:
    """Validate an already parsed table (same shapes and rules as the file)."""
    history = isinstance(data, dict) and "versions" in data
    try:
        if history:
            many = HistoryFile.model_validate(data)
            checked = PriceFile(many.currency, many.notes, tuple(many.versions))
        else:
            one = TableFile.model_validate(data)
            checked = PriceFile(one.currency, one.notes, (one,))
    except ValidationError as exc:
        problems = "; ".join(
            f"{_where(e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
        )
        raise PriceTableError(f"{origin}: invalid price table: {problems}") from None
    found = history_problems(checked.versions, nested=history)
    if found:
        raise PriceTableError(f"{origin}: invalid price table: {'; '.join(found)}")
    return checked


def history_problems(versions: Sequence[VersionFile], *, nested: bool = True) -> list[str]:
    """What is wrong with the dates and names of `versions` (oldest first), each with its place.

    `nested`: the versions are a file's ``"versions"`` list (places ``versions.1...``);
    else the one version is the file itself (places ``models...``).
    """

    def at(i: int) -> str:
        return f"versions.{i}." if nested else ""

    def shown(moment: datetime) -> str:
        return moment.isoformat().replace("+00:00", "Z")

    problems: list[str] = []
    names: dict[str, int] = {}
    for i, v in enumerate(versions):
        if v.version in names:
            problems.append(
                f"{at(i)}version: {v.version!r} is also the name of versions.{names[v.version]} "
                "(a billing event names the version that priced it)"
            )
        names.setdefault(v.version, i)
        start = v.effective_from
        if i > 0:
            before = versions[i - 1].effective_from
            if start is None:
                problems.append(
                    f"{at(i)}effective_from: missing: every version but the first says when "
                    f"it takes over from versions.{i - 1}"
                )
            elif before is not None and start <= before:
                problems.append(
                    f"{at(i)}effective_from: {shown(start)} is not after versions.{i - 1}'s "
                    f"{shown(before)}: versions are listed oldest first and cannot overlap"
                )
        end = versions[i + 1].effective_from if i + 1 < len(versions) else None
        for name, entry in v.models.items():
            since = entry.effective_from
            if since is None:
                continue
            if start is not None and since < start:
                problems.append(
                    f"{at(i)}models.{name}.effective_from: {shown(since)} is before its "
                    f"version's {shown(start)}: an entry is in force only inside its version"
                )
            if end is not None and since >= end:
                problems.append(
                    f"{at(i)}models.{name}.effective_from: {shown(since)} is not before the next "
                    f"version's {shown(end)}: the entry would never be in force"
                )
    return problems
