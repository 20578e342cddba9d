"""The Redis key layout of streamtally, and the read side of it.

The layout (written by `streamtally.store.redis_sink.RedisSink`, which documents it
in full) in short:

====================================  ======  ==============================================
key                                   type    holds
====================================  ======  ==============================================
``st:tokens:{request_id}``            string  the Tokens JSON of a finished request
``st:usage:{day}:{tenant}:{model}``   hash    running usage of one (day, tenant, model) row
``st:usage:rows``                     set     every row as JSON ``["day","tenant","model"]``
====================================  ======  ==============================================

Readers here: `get_tokens_text`, `get_tokens`, `usage_rows`.  They accept a
`redis.asyncio.Redis` client made with or without ``decode_responses``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import date, datetime
from typing import Any, Final

import redis.asyncio as aioredis

from streamtally.core.money import PICO, cost_parts, cost_text

__all__ = [
    "CLOSED_KEY",
    "COST_FIELDS",
    "DEAD_SEEN_KEY",
    "PICO",
    "PREFIX",
    "ROWS_KEY",
    "STATS_KEY",
    "TOKEN_FIELDS",
    "UNKNOWN_MODEL",
    "USAGE_FIELDS",
    "closed_markers",
    "cost_parts",
    "cost_text",
    "day_of",
    "get_tokens",
    "get_tokens_text",
    "row_member",
    "stats",
    "tokens_key",
    "usage_key",
    "usage_rows",
]

PREFIX: Final = "st:"
ROWS_KEY: Final = "st:usage:rows"
#: Hash request_id -> "offset reason" of every closed (or closing) request.
CLOSED_KEY: Final = "st:closed"
#: Hash of raw-record counts: records, duplicates, requests, dead_lettered.
STATS_KEY: Final = "st:stats"
#: Set of "topic:partition:offset" of every dead-lettered raw record.
DEAD_SEEN_KEY: Final = "st:deadletter:seen"
#: Model name of a usage row whose request reported none.
UNKNOWN_MODEL: Final = "unknown"

#: The integer token fields of a usage row, in order.
TOKEN_FIELDS: Final = (
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cached_tokens",
    "cache_write_tokens",
)
COST_FIELDS: Final = ("cost_units", "cost_pico")
#: Every field of a usage row hash, in order.
USAGE_FIELDS: Final = ("requests", *TOKEN_FIELDS, *COST_FIELDS)

_DAY: Final = re.compile(r"\d{4}-\d{2}-\d{2}")


def tokens_key(request_id: str) -> str:
    """``st:tokens:{request_id}``."""
    if not request_id:
        raise ValueError("request_id must not be empty")
    return f"{PREFIX}tokens:{request_id}"


def _tenant_part(tenant: str) -> str:
    """The tenant as a key component: ``%`` → ``%25`` and ``:`` → ``%3A``, nothing else."""
    return tenant.replace("%", "%25").replace(":", "%3A")


def usage_key(day: str, tenant: str, model: str) -> str:
    """``st:usage:{day}:{tenant}:{model}``.

    The tenant has ``%`` and ``:`` percent-escaped (an ordinary tenant is
    written as is) so that a tenant holding a ``:`` cannot collide with
    another tenant's model: ``("a:b", "m")`` and ``("a", "b:m")`` stay two rows.
    The model is written as is (model names often hold ``:`` and ``/``); the
    key is unambiguous because the day has a fixed form and the tenant no ``:``.
    """
    return f"{PREFIX}usage:{day}:{_tenant_part(tenant)}:{model}"


def row_member(day: str, tenant: str, model: str) -> str:
    """The member of `ROWS_KEY` naming a usage row: compact JSON ``["day","tenant","model"]``."""
    return json.dumps([day, tenant, model], ensure_ascii=False, separators=(",", ":"))


def day_of(moment: datetime) -> str:
    """The UTC calendar day of an aware datetime, ``YYYY-MM-DD``."""
    offset = moment.utcoffset()
    if offset is None:
        raise ValueError(f"need a timezone-aware datetime, got {moment!r}")
    return (moment - offset).date().isoformat()


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


async def get_tokens_text(client: aioredis.Redis, request_id: str) -> str | None:
    """The stored Tokens JSON text of `request_id`, exactly as written; None if absent."""
    raw: bytes | str | None = await client.get(tokens_key(request_id))
    return None if raw is None else _text(raw)


async def get_tokens(client: aioredis.Redis, request_id: str) -> dict[str, Any] | None:
    """The stored Tokens of `request_id` as a JSON dict; None if absent (or still streaming)."""
    text = await get_tokens_text(client, request_id)
    if text is None:
        return None
    parsed = json.loads(text)
    if not isinstance(parsed, dict):
        raise ValueError(f"{tokens_key(request_id)} does not hold a JSON object")
    return parsed


def _day_filter(day: str | date | None) -> str | None:
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
        return int(_text(raw))
    except ValueError:
        raise ValueError(f"{key} field {field} is not an integer: {raw!r}") from None


async def usage_rows(
    client: aioredis.Redis, tenant: str | None = None, day: str | date | None = None
) -> list[dict[str, Any]]:
    """The usage rows, optionally of one tenant and/or one UTC day, sorted by (day, tenant, model).

    Each row is ``{"tenant", "model", "day", "requests", "input_tokens",
    "output_tokens", "reasoning_tokens", "cached_tokens", "cache_write_tokens",
    "cost"}`` with `cost` the exact total as a decimal string (12 places).
    The hashes are read in one MULTI/EXEC, so the rows are one consistent
    snapshot of the rows listed in the index.
    """
    wanted_day = _day_filter(day)
    members: set[bytes | str] = await client.smembers(ROWS_KEY)
    rows: list[tuple[str, str, str]] = []
    for member in members:
        try:
            parsed = json.loads(_text(member))
        except ValueError:
            raise ValueError(f"{ROWS_KEY} holds a member that is not JSON: {member!r}") from None
        if (
            not isinstance(parsed, list)
            or len(parsed) != 3
            or not all(isinstance(part, str) for part in parsed)
        ):
            raise ValueError(f"{ROWS_KEY} member is not [day, tenant, model]: {member!r}")
        row_day, row_tenant, row_model = parsed
        if (tenant is None or row_tenant == tenant) and (
            wanted_day is None or row_day == wanted_day
        ):
            rows.append((row_day, row_tenant, row_model))
    rows.sort()
    if not rows:
        return []
    async with client.pipeline(transaction=True) as pipe:
        for row_day, row_tenant, row_model in rows:
            pipe.hmget(usage_key(row_day, row_tenant, row_model), list(USAGE_FIELDS))
        results: list[list[bytes | str | None]] = await pipe.execute()
    out: list[dict[str, Any]] = []
    for (row_day, row_tenant, row_model), values in zip(rows, results, strict=True):
        if all(value is None for value in values):
            continue  # listed but gone (deleted by hand): nothing to report
        key = usage_key(row_day, row_tenant, row_model)
        fields = dict(zip(USAGE_FIELDS, values, strict=True))
        out.append(
            {
                "tenant": row_tenant,
                "model": row_model,
                "day": row_day,
                "requests": _int(fields, "requests", key),
                **{name: _int(fields, name, key) for name in TOKEN_FIELDS},
                "cost": cost_text(_int(fields, "cost_units", key), _int(fields, "cost_pico", key)),
            }
        )
    return out


async def closed_markers(
    client: aioredis.Redis, request_ids: list[str]
) -> dict[str, tuple[str, bool]]:
    """For each id that closed (or was deciding to): its marker and whether it was applied."""
    if not request_ids:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        pipe.hmget(CLOSED_KEY, request_ids)
        for request_id in request_ids:
            pipe.exists(tokens_key(request_id))
        replies = await pipe.execute()
    markers, applied = replies[0], replies[1:]
    found: dict[str, tuple[str, bool]] = {}
    for request_id, marker, exists in zip(request_ids, markers, applied, strict=True):
        if marker is not None:
            text = marker.decode() if isinstance(marker, bytes) else str(marker)
            found[request_id] = (text, bool(exists))
    return found


async def stats(client: aioredis.Redis) -> dict[str, int]:
    """The pipeline's raw-record counts (`st:stats`)."""
    raw = await client.hgetall(STATS_KEY)
    out = {"records": 0, "duplicates": 0, "dead_lettered": 0, "requests": 0}
    for name, value in raw.items():
        key = name.decode() if isinstance(name, bytes) else str(name)
        out[key] = int(value)
    return out
