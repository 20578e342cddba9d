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


class RawUsage:
    """Last-reported-wins store of a provider's raw usage fields."""

    __slots__ = ("_convert", "_fields", "_last")

    def __init__(self, convert: Callable[[Mapping[str, int]], Usage]) -> None:
        self._fields: dict[str, int] = {}
        self._convert = convert
        self._last: Usage | None = None

    def report(self, fields: Mapping[str, object]) -> Usage:
        """Record one usage report (None means "not reported") and return the running total.

        A report that is not counts, or whose total would pass a 64-bit count,
        raises `InvalidEvent` and changes nothing (the running total stays).
        """
        stored = self._fields
        updates: dict[str, int] = {}
        for name, value in fields.items():
            if value is None:
                continue
            if type(value) is int and 0 <= value <= MAX_COUNT:
                count = value
            else:
                count = as_int(value, f"usage field {name}") or 0  # raises: not a count
            if stored.get(name) != count:
                updates[name] = count
        if updates or self._last is None:
            usage = self._convert({**stored, **updates})
            if max(usage.counts()) > MAX_COUNT:
                raise InvalidEvent(f"usage {usage.counts()} is beyond a 64-bit count")
            stored.update(updates)
            self._last = usage
        return self._last

    def raw(self) -> dict[str, int]:
        return dict(self._fields)
