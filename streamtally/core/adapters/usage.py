"""Running usage: the last reported value of each raw field, then one conversion.

Providers report usage as running totals, sometimes split over several
events that each carry only some fields (Anthropic's `message_delta` may carry
only `output_tokens`; Vertex sends count-less usage objects until the last
chunk).  `RawUsage` keeps the last reported value of every raw field; each
adapter converts the raw fields into the five normalised ones with its own
arithmetic, in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from streamtally.core.adapters.base import MAX_COUNT, as_int
from streamtally.core.models import Usage
from streamtally.errors import InvalidEvent

__all__ = ["RawUsage"]


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
        changed = self._last is None
        previous: dict[str, int | None] = {}
        large = self._large
        try:
            for name, value in fields.items():
                if value is None:
                    continue
                if type(value) is int and 0 <= value <= MAX_COUNT:
                    count = value
                else:
                    count = as_int(value, f"usage field {name}") or 0  # raises: not a count
                old = stored.get(name)
                if old != count:
                    if name not in previous:
                        previous[name] = old
                    stored[name] = count
                    changed = True
                    if count >= _LARGE:
                        large = True
            if not changed:
                return self._last  # type: ignore[return-value]
            usage = self._convert(stored)
            # A total adds a few counts: below 2**60 each, it cannot pass 2**63.
            if large and max(usage.counts()) > MAX_COUNT:
                raise InvalidEvent(f"usage {usage.counts()} is beyond a 64-bit count")
        except InvalidEvent:
            for name, old in previous.items():  # as if the report never came
                if old is None:
                    del stored[name]
                else:
                    stored[name] = old
            raise
        self._large = large
        self._last = usage
        return usage

    def raw(self) -> dict[str, int]:
        return dict(self._fields)
