"""Price tables in use: which entry prices a model, and the exact cost of a request.

The file format and its validation are `streamtally.billing.price_file`; this
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
carry it (decimal(38, 12)) is for `streamtally.billing.events` to check.

Price history (`PriceTable.in_force`): a table holds one or more versions,
each in force from its `effective_from` (included) until the next one's (see
`streamtally.billing.price_file`).  Every lookup and quote takes the time `at`
of the request; the version in force then prices it, and its entries whose
own `effective_from` is later than `at` are as if absent.  Before the first
version's `effective_from` no version is in force and every model is
unpriced (`Quote.version` None).  `at` None asks for the newest prices: the
last version, every entry in force (a one-version table without dates, the
format of every table before history, prices the same at any time).

Inconsistent usage: `cached_tokens` and `cache_write_tokens` are parts of
`input_tokens` and `reasoning_tokens` is part of `output_tokens`.  When a
report says otherwise (cached + cache_write > input, or reasoning > output)
the parts are still priced exactly as reported and only the remainder
(uncached input, non-reasoning output) is floored at 0, so the bill never
goes below what the parts cost.  Nothing is clamped silently: `Quote.notes`
describes it and a warning is logged on the ``streamtally.billing.pricing`` logger.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from bisect import bisect_right
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Final

from streamtally.billing.price_file import (
    NO_VERSION,
    WILDCARD,
    ModelRates,
    PriceFile,
    PriceTableError,
    Rates,
    VersionFile,
    is_wildcard,
    parse_table,
    read_table_text,
)
from streamtally.core.models import Usage
from streamtally.core.money import COST_SCALE

__all__ = [
    "NO_VERSION",
    "WILDCARD",
    "ModelRates",
    "PriceTable",
    "PriceTableError",
    "PriceVersion",
    "Quote",
    "Rates",
]

log = logging.getLogger("streamtally.billing.pricing")

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
    #: The name of the version that priced it; None when no version was in force.
    version: str | None = None

    @property
    def priced(self) -> bool:
        return self.cost is not None


def _check_aware(at: datetime | None) -> None:
    if at is not None and at.utcoffset() is None:
        raise ValueError(f"a price lookup time must be timezone-aware, got {at!r}")


def _exact_rates(rates: Rates, unit: int) -> tuple[tuple[int, int, int, int, int], int]:
    """`rates` (input, cached input, cache write, output, reasoning) as integers over one
    common denominator, and that denominator times `unit`: rate = integer / denominator
    exactly, so a cost is their integer sum over the divisor."""
    exact = [
        Fraction(rate)
        for rate in (
            rates.input,
            rates.cached_input,
            rates.cache_write,
            rates.output,
            rates.reasoning,
        )
    ]
    denominator = math.lcm(*(f.denominator for f in exact))
    n_input, n_cached, n_write, n_output, n_reasoning = (
        f.numerator * (denominator // f.denominator) for f in exact
    )
    return (n_input, n_cached, n_write, n_output, n_reasoning), denominator * unit


class PriceVersion:
    """One version of a price table: its entries and rates.  Read-only, safe to share."""

    __slots__ = (
        "_exact",
        "_numerators",
        "_rates",
        "_since",
        "_wildcards",
        "effective_from",
        "notes",
        "unit",
        "version",
    )

    version: str
    #: When the version takes effect (None: since always).
    effective_from: datetime | None
    unit: int
    notes: str | None
    _rates: dict[str, Rates]
    #: The exact entries, by model name.
    _exact: dict[str, Rates]
    #: (text before the ``*``, entry name) of every wildcard entry, longest text first.
    _wildcards: tuple[tuple[str, str], ...]
    #: When an entry comes into force, for the entries that say so.
    _since: dict[str, datetime]
    #: Per entry, its five rates as integers over one denominator, and the denominator
    #: times `unit` (`_exact_rates`): a quote is then integer arithmetic.
    _numerators: dict[str, tuple[tuple[int, int, int, int, int], int]]

    def __init__(self, checked: VersionFile) -> None:
        self.version = checked.version
        self.effective_from = checked.effective_from
        self.unit = checked.unit
        self.notes = checked.notes
        self._rates = {name: entry.resolved() for name, entry in checked.models.items()}
        self._since = {
            name: entry.effective_from
            for name, entry in checked.models.items()
            if entry.effective_from is not None
        }
        self._exact = {n: r for n, r in self._rates.items() if not is_wildcard(n)}
        self._numerators = {n: _exact_rates(r, self.unit) for n, r in self._rates.items()}
        self._wildcards = tuple(
            sorted(
                ((name[:-1], name) for name in self._rates if is_wildcard(name)),
                key=lambda pair: (-len(pair[0]), pair[0]),
            )
        )

    @property
    def models(self) -> tuple[str, ...]:
        """The configured entry names (wildcards such as ``"*"`` included), sorted."""
        return tuple(sorted(self._rates))

    def _in_force(self, name: str, at: datetime | None) -> bool:
        since = self._since.get(name)
        return since is None or at is None or at >= since

    def entry_for(self, model: str | None, at: datetime | None = None) -> str | None:
        """The entry that prices `model` at `at`: its exact name, else the longest matching
        wildcard, among the entries in force then.  None when no entry does."""
        if model is None:
            return WILDCARD if WILDCARD in self._rates and self._in_force(WILDCARD, at) else None
        if model in self._exact and self._in_force(model, at):
            return model
        for prefix, name in self._wildcards:
            if model.startswith(prefix) and self._in_force(name, at):
                return name
        return None

    def rates(self, entry: str) -> Rates:
        """The resolved rates of the entry `entry` (KeyError when it is none)."""
        return self._rates[entry]

    def quote(self, model: str | None, usage: Usage, at: datetime | None = None) -> Quote:
        """The exact cost of `usage` on `model` at `at`, with the entry used and any notes."""
        entry = self.entry_for(model, at)
        if entry is None:
            return Quote(model=model, entry=None, cost=None, version=self.version)
        (n_input, n_cached, n_write, n_output, n_reasoning), divisor = self._numerators[entry]
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
        # The cost in units of 10**-COST_SCALE is numerator / divisor exactly: the sum of
        # each count times its rate, over the table's unit.
        numerator = (
            uncached * n_input
            + usage.cached_tokens * n_cached
            + usage.cache_write_tokens * n_write
            + visible * n_output
            + usage.reasoning_tokens * n_reasoning
        ) * _SCALE
        units, remainder = divmod(numerator, divisor)
        # To the nearest integer, ties to even (as `round` of a Fraction).
        if remainder * 2 > divisor or (remainder * 2 == divisor and units % 2):
            units += 1
        sign, digits, _ = Decimal(units).as_tuple()
        cost = Decimal((sign, digits, -COST_SCALE))  # exact: no context precision involved
        quote = Quote(
            model=model,
            entry=entry,
            cost=cost,
            rounded=remainder != 0,
            notes=tuple(notes),
            version=self.version,
        )
        if notes:
            log.warning("pricing %s: inconsistent usage: %s", model, "; ".join(notes))
        return quote

    def __repr__(self) -> str:
        return (
            f"PriceVersion(version={self.version!r}, effective_from={self.effective_from!r}, "
            f"unit={self.unit}, models={len(self._rates)})"
        )


class PriceTable:
    """A loaded, validated price table and its history.  Read-only; safe to share between tasks.

    `version`, `unit` and `models` are those of the newest version (the only one
    of a table without history).
    """

    __slots__ = ("_file", "_starts", "currency", "notes", "versions")

    currency: str
    notes: str | None
    #: Oldest first.
    versions: tuple[PriceVersion, ...]
    _file: PriceFile
    #: The `effective_from` of every version but the first, for `bisect_right`.
    _starts: tuple[datetime, ...]

    def __init__(self, checked: PriceFile) -> None:
        """Use `load`, `loads` or `from_dict`."""
        self._file = checked
        self.currency = checked.currency
        self.notes = checked.notes
        self.versions = tuple(PriceVersion(v) for v in checked.versions)
        starts = [v.effective_from for v in self.versions[1:]]
        if any(s is None for s in starts):  # parse_table refuses it; never bisect on None
            raise PriceTableError("every price version but the first needs an effective_from")
        self._starts = tuple(s for s in starts if s is not None)

    @classmethod
    def default(cls) -> PriceTable:
        """The price table shipped with streamtally (`streamtally/billing/prices.json`)."""
        text = resources.files("streamtally.billing").joinpath("prices.json").read_text("utf-8")
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
        """Validate an already parsed table (same shapes and rules as the file)."""
        return cls(parse_table(data, origin=origin))

    def without_prices(self) -> PriceTable:
        """The same versions, currency and dates with not a single entry: prices nothing."""
        empty = tuple(v.model_copy(update={"models": {}}) for v in self._file.versions)
        return PriceTable(PriceFile(self.currency, self.notes, empty))

    def digest(self) -> str:
        """32 hex digits naming what the table prices (currency, notes, every version as
        validated): two tables of one digest price every request alike."""
        doc = [
            self.currency,
            self.notes,
            [v.model_dump(mode="json") for v in self._file.versions],
        ]
        text = json.dumps(doc, sort_keys=True, ensure_ascii=False)
        return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()

    # ---------------------------------------------------------------- history

    @property
    def newest(self) -> PriceVersion:
        return self.versions[-1]

    @property
    def version(self) -> str:
        """The newest version's name."""
        return self.newest.version

    @property
    def unit(self) -> int:
        """The newest version's unit."""
        return self.newest.unit

    def in_force(self, at: datetime | None) -> PriceVersion | None:
        """The version in force at `at` (aware): the last whose `effective_from` is at or
        before it.  None before the first version's `effective_from`; `at` None: the newest.
        """
        if at is None:
            return self.newest
        _check_aware(at)
        found = self.versions[bisect_right(self._starts, at)]
        first = found.effective_from
        return None if first is not None and at < first else found

    # ---------------------------------------------------------------- lookup

    @property
    def models(self) -> tuple[str, ...]:
        """The newest version's entry names (wildcards such as ``"*"`` included), sorted."""
        return self.newest.models

    def entry_for(self, model: str | None, at: datetime | None = None) -> str | None:
        """The entry that prices `model` at `at`: its exact name, else the longest matching
        wildcard, in the version in force then (see the module docstring).

        None when no entry does (the model is unpriced).  A model of None only
        matches the catch-all ``"*"``.
        """
        found = self.in_force(at)
        return None if found is None else found.entry_for(model, at)

    def rates_for(self, model: str | None, at: datetime | None = None) -> Rates | None:
        """The resolved rates that price `model` at `at`, or None when it is unpriced."""
        found = self.in_force(at)
        entry = None if found is None else found.entry_for(model, at)
        return None if found is None or entry is None else found.rates(entry)

    def is_priced(self, model: str | None, at: datetime | None = None) -> bool:
        return self.entry_for(model, at) is not None

    # ---------------------------------------------------------------- cost

    def quote(self, model: str | None, usage: Usage, at: datetime | None = None) -> Quote:
        """The exact cost of `usage` on `model` at the time `at` (aware; None: the newest
        prices), with the version and entry used and any notes."""
        found = self.in_force(at)
        if found is None:
            return Quote(model=model, entry=None, cost=None, version=None)
        return found.quote(model, usage, at)

    def cost(self, model: str | None, usage: Usage, at: datetime | None = None) -> Decimal | None:
        """The exact cost (12 decimal places) of `usage` on `model` at `at`; None when unpriced."""
        return self.quote(model, usage, at).cost

    def __repr__(self) -> str:
        return (
            f"PriceTable(version={self.version!r}, currency={self.currency!r}, "
            f"unit={self.unit}, models={len(self.models)}, versions={len(self.versions)})"
        )
