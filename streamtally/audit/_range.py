"""The audit's time range: ``--since`` / ``--until`` parsed, and the UTC days wholly inside it.

A time is RFC 3339 (``2026-11-23T10:00:00Z``, ``2026-11-23T11:00:00.5+01:00``; an offset is
required) or a UTC date (``2026-11-23``, its midnight UTC).  The range selects raw records by
their receive time, `since` included, `until` excluded; either end may be open.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Final

from streamtally.errors import InputError

__all__ = ["TimeRange", "parse_time"]

_DATE: Final = re.compile(r"\d{4}-\d{2}-\d{2}")
_RFC3339: Final = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2}(?:\.\d+)?)([Zz]|[+-]\d{2}:\d{2})"
)
_DAY: Final = timedelta(days=1)


def parse_time(text: str) -> datetime:
    """`text` as an aware UTC datetime; `InputError` when it is neither RFC 3339 nor a date."""
    value = text.strip()
    try:
        if _DATE.fullmatch(value):
            return datetime.combine(date.fromisoformat(value), datetime.min.time(), UTC)
        match = _RFC3339.fullmatch(value)
        if match:
            day, clock, offset = match.groups()
            zone = "+00:00" if offset in ("Z", "z") else offset
            return datetime.fromisoformat(f"{day}T{clock}{zone}").astimezone(UTC)
    except ValueError as exc:
        raise InputError(f"{text!r} is not a valid time: {exc}") from None
    raise InputError(
        f"{text!r} is not an RFC 3339 time with an offset or a UTC date "
        "(2026-11-23T10:00:00Z, 2026-11-23)"
    )


@dataclass(frozen=True, slots=True)
class TimeRange:
    """Receive times from `since` (included) to `until` (excluded); None: open on that side."""

    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            moment = getattr(self, name)
            if moment is not None and moment.utcoffset() is None:
                raise ValueError(f"{name} must be timezone-aware, got {moment!r}")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise InputError(
                f"--since ({self.since.isoformat()}) must be before --until "
                f"({self.until.isoformat()})"
            )

    def contains(self, moment: datetime) -> bool:
        """Whether `moment` lies in the range."""
        if self.since is not None and moment < self.since:
            return False
        return self.until is None or moment < self.until

    def holds_day(self, day: str) -> bool:
        """Whether the whole UTC day ``YYYY-MM-DD`` lies in the range."""
        start = datetime.combine(date.fromisoformat(day), datetime.min.time(), UTC)
        if self.since is not None and start < self.since:
            return False
        return self.until is None or start + _DAY <= self.until

    def to_json(self) -> dict[str, str | None]:
        return {
            "since": None if self.since is None else self.since.isoformat(),
            "until": None if self.until is None else self.until.isoformat(),
        }
