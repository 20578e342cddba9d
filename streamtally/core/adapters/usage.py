"""Running usage: the last reported value of each raw field, then one conversion.

Providers report usage as running totals, sometimes split over several
events that each carry only some fields (Anthropic's `message_delta` may carry
only `output_tokens`; Vertex sends count-less usage objects until the last
chunk).  `RawUsage` keeps the last reported value of every raw field; each
adapter converts the raw fields into the five normalised ones with its own
arithmetic, in one place.

`RawCounts` is the same store for a source that reports the same few fields
with every event (Gemini, vLLM): fields are positional, so a report builds
no dict, which matters at one report per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from streamtally.core.adapters.base import MAX_COUNT, as_int
from streamtally.core.models import Usage
from streamtally.errors import InvalidEvent

__all__ = ["RawCounts", "RawUsage"]


#: Counts below this can be summed by any provider's conversion (a few fields) safely.
_LARGE = 2**60


class RawUsage:
    """Last-reported-wins store of a provider's raw usage fields."""

    __slots__ = ("_convert", "_fields", "_large", "_last")

    def __init__(self, convert: Callable[[Mapping[str, int]], Usage]) -> None:
        self._fields: dict[str, int] = {}
        self._convert = convert
        self._last: Usage | None = None
        #: Whether a stored count is large enough for a total of a few to pass 2**63.
        self._large = False

    def report(self, fields: Mapping[str, object]) -> Usage:
        """Record one usage report (None means "not reported") and return the running total.

        A report that is not counts, or whose total would pass a 64-bit count,
        raises `InvalidEvent` and changes nothing (the running total stays).
        """
        stored = self._fields
        updated: dict[str, int] | None = None  # a copy, kept only if the whole report is valid
        large = self._large
        for name, value in fields.items():
            if value is None:
                continue
            count = value
            if type(count) is not int or count < 0 or count > MAX_COUNT:
                count = as_int(value, f"usage field {name}") or 0  # raises: not a count
            if stored.get(name) != count:
                if updated is None:
                    updated = dict(stored)
                updated[name] = count
                if count >= _LARGE:
                    large = True
        if updated is None:
            if self._last is not None:
                return self._last
            updated = stored
        usage = self._convert(updated)
        # A total adds a few counts: below 2**60 each, it cannot pass 2**63.
        if large and max(usage.counts()) > MAX_COUNT:
            raise InvalidEvent(f"usage {usage.counts()} is beyond a 64-bit count")
        self._fields = updated
        self._large = large
        self._last = usage
        return usage

    def raw(self) -> dict[str, int]:
        return dict(self._fields)


class RawCounts:
    """`RawUsage` for a fixed list of raw fields, reported and converted positionally.

    `report(a, b, ...)` takes one value per field name given at construction
    (None: not reported); `convert(a, b, ...)` gets the last reported count of
    each, 0 for a field never reported (what `RawUsage` converters read as
    `raw.get(name, 0)`).  The rules are those of `RawUsage.report`.
    """

    __slots__ = ("_convert", "_counts", "_large", "_last", "_names")

    def __init__(self, names: Sequence[str], convert: Callable[..., Usage]) -> None:
        self._names = tuple(names)
        self._convert = convert
        self._counts = [0] * len(self._names)
        self._last: Usage | None = None
        self._large = False

    def report(self, *values: object) -> Usage:
        """Record one report (one value per field, None: not reported); the running total.

        A report that is not counts, or whose total would pass a 64-bit count,
        raises `InvalidEvent` and changes nothing (the running total stays).
        """
        counts = self._counts
        updated: list[int] | None = None  # a copy, kept only if the whole report is valid
        large = self._large
        index = -1
        for value in values:
            index += 1
            if value is None:
                continue
            count = value
            if type(count) is not int or count < 0 or count > MAX_COUNT:
                count = as_int(value, f"usage field {self._names[index]}") or 0  # raises
            if counts[index] != count:
                if updated is None:
                    updated = counts.copy()
                updated[index] = count
                if count >= _LARGE:
                    large = True
        if updated is None:
            if self._last is not None:
                return self._last
            updated = counts
        usage = self._convert(*updated)
        # A total adds a few counts: below 2**60 each, it cannot pass 2**63.
        if large and max(usage.counts()) > MAX_COUNT:
            raise InvalidEvent(f"usage {usage.counts()} is beyond a 64-bit count")
        self._counts = updated
        self._large = large
        self._last = usage
        return usage
