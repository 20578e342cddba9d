"""Usage rows as read back: the day filter, and a row's shard parts summed into what `usage` prints.

Pure functions used by `streamtally.store.RedisStore.usage_rows`; the Redis
calls stay in the store.  Values may come from a client made with or without
``decode_responses`` (bytes or str).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from typing import Any, Final

from streamtally.core.models import USAGE_FIELDS
from streamtally.core.money import cost_text
from streamtally.store.layout import ROW_FIELDS, UNPRICED_FIELD, day_of

__all__ = ["day_filter", "reply_text", "usage_row"]

_DAY: Final = re.compile(r"\d{4}-\d{2}-\d{2}")


def reply_text(value: bytes | str) -> str:
    """A Redis reply as text (UTF-8 when it is bytes)."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def day_filter(day: str | date | None) -> str | None:
    """The ``YYYY-MM-DD`` of a day given as text, a date or an aware datetime (its UTC day)."""
    if day is None:
        return None
    if isinstance(day, datetime):
        return day_of(day)
    if isinstance(day, date):
        return day.isoformat()
    if not _DAY.fullmatch(day):
        raise ValueError(f"day must be YYYY-MM-DD, got {day!r}")
    date.fromisoformat(day)  # a real calendar day
    return day


def _int(row: Mapping[str, bytes | str | None], field: str, key: str) -> int:
    raw = row.get(field)
    if raw is None:
        return 0
    try:
        return int(reply_text(raw))
    except ValueError:
        raise ValueError(f"{key} field {field} is not an integer: {raw!r}") from None


def usage_row(
    day: str, tenant: str, model: str, parts: Sequence[tuple[str, Sequence[bytes | str | None]]]
) -> dict[str, Any] | None:
    """One row from its shards' parts: (key, `ROW_FIELDS` values in HMGET order) each.

    The row is ``{"tenant", "model", "day", "requests", "unpriced_requests",
    <the five usage fields>, "cost"}``, each count the sum over the parts, with
    `cost` the exact total as a decimal string (12 places) and
    `unpriced_requests` how many of `requests` were billed unpriced (0 when a
    hash has no such field).  None when every part is gone (listed, then
    deleted by hand: nothing to report).
    """
    totals = dict.fromkeys(ROW_FIELDS, 0)
    found = False
    for key, values in parts:
        if all(value is None for value in values):
            continue
        found = True
        fields = dict(zip(ROW_FIELDS, values, strict=True))
        for name in ROW_FIELDS:
            totals[name] += _int(fields, name, key)
    if not found:
        return None
    return {
        "tenant": tenant,
        "model": model,
        "day": day,
        "requests": totals["requests"],
        UNPRICED_FIELD: totals[UNPRICED_FIELD],
        **{name: totals[name] for name in USAGE_FIELDS},
        "cost": cost_text(totals["cost_units"], totals["cost_pico"]),
    }
