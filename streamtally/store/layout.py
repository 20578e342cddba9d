"""The Redis key layout of streamtally: the one place keys, members and stored texts are spelled.

Every key, every member of the row index and every stored text is built by a
function or constant of this module; the scripts (`streamtally.store.scripts`)
receive them as KEYS and ARGV, and the reads (`streamtally.store.RedisStore`)
use them.  The layout is a contract with the data already in Redis: change
nothing here without a migration (``tests/unit/test_store_layout.py`` pins it).

Redis layout
============

``st:tokens:{request_id}`` (string)
    The request's Tokens JSON, exactly
    ``json.dumps(tokens.to_json_dict(), ensure_ascii=False, separators=(",", ":"))``
    (UTF-8).  It is also the idempotency marker of the request: never give it
    a TTL or delete it while its usage should stay counted, or a replay of the
    request would count it again.

``st:usage:{day}:{tenant}:{model}`` (hash)
    Running totals of one usage row. `day` is the UTC date of
    ``billing.event_time`` (``YYYY-MM-DD``), `tenant` is ``billing.tenant``
    with ``%`` and ``:`` percent-escaped (``%25``, ``%3A``; an ordinary tenant
    is written as is), `model` is ``tokens.model`` or ``"unknown"``, as is.
    Fields, all decimal integers (HINCRBY):

    ==================  ==========================================================
    requests            number of requests counted
    input_tokens        sum of the five usage fields of those requests
    output_tokens
    reasoning_tokens
    cached_tokens
    cache_write_tokens
    cost_units          whole currency units of the total cost
    cost_pico           remainder in 10**-12 currency units, always 0 <= x < 10**12
    unpriced_requests   how many of `requests` were billed unpriced (the billing
                        event's ``priced`` is false, its cost 0): written only when
                        one is; absent (rows written before it existed, or
                        without an unpriced request) reads as 0
    ==================  ==========================================================

    The exact total cost is ``cost_units + cost_pico / 10**12``; the script
    carries ``cost_pico`` into ``cost_units`` so neither field ever needs more
    than 64 bits (a Lua number holds the < 2 * 10**12 intermediate sum exactly).
    A row whose `unpriced_requests` is above 0 has a cost that is too low by
    what those requests would have cost: re-rate them from the billing events.

``st:usage:rows`` (set)
    Every usage row ever written, as the compact JSON array
    ``["day","tenant","model"]`` (unescaped values), so rows can be listed
    without SCAN and without parsing keys.

``st:closed`` (hash)
    request id -> ``"offset reason"``, the close decision of every closed (or
    closing) request, written before its outputs leave.

``st:stats`` (hash)
    Raw-record counts: ``records``, ``duplicates``, ``requests``, ``dead_lettered``.

``st:deadletter:seen`` (set)
    ``"topic:partition:offset"`` of every dead-lettered raw record, so each
    counts once in ``dead_lettered`` however often it is dead-lettered again.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Final

from streamtally.core.models import USAGE_FIELDS, Tokens

__all__ = [
    "CLOSED_KEY",
    "COST_FIELDS",
    "DEAD_SEEN_KEY",
    "PREFIX",
    "RAW_RECORD_STATS",
    "ROWS_KEY",
    "ROW_FIELDS",
    "STATS_FIELDS",
    "STATS_KEY",
    "TOKENS_PREFIX",
    "UNKNOWN_MODEL",
    "UNPRICED_FIELD",
    "day_of",
    "parse_row_member",
    "position_of",
    "row_member",
    "tokens_json",
    "tokens_key",
    "tokens_pattern",
    "usage_key",
]

PREFIX: Final = "st:"
#: The prefix of every Tokens key; the request id follows it as is.
TOKENS_PREFIX: Final = f"{PREFIX}tokens:"
#: Set of every usage row, as `row_member` texts.
ROWS_KEY: Final = f"{PREFIX}usage:rows"
#: Hash request_id -> "offset reason" of every closed (or closing) request.
CLOSED_KEY: Final = f"{PREFIX}closed"
#: Hash of raw-record counts (`STATS_FIELDS`).
STATS_KEY: Final = f"{PREFIX}stats"
#: Set of `position_of` texts of every dead-lettered raw record.
DEAD_SEEN_KEY: Final = f"{PREFIX}deadletter:seen"

#: Model name of a usage row whose request reported none.
UNKNOWN_MODEL: Final = "unknown"
#: The cost fields of a usage row: whole units, then the 10**-12 remainder.
COST_FIELDS: Final = ("cost_units", "cost_pico")
#: The field of a usage row counting its unpriced requests (absent: 0).
UNPRICED_FIELD: Final = "unpriced_requests"
#: Every field of a usage row hash, in order (the flush script's ``ALL``; new ones go last).
ROW_FIELDS: Final = ("requests", *USAGE_FIELDS, *COST_FIELDS, UNPRICED_FIELD)
#: The fields of `STATS_KEY`, in the order `RedisStore.stats` reports them.
STATS_FIELDS: Final = ("records", "duplicates", "dead_lettered", "requests")
#: The fields of `STATS_KEY` that count raw records (not rebuildable from the output topics).
RAW_RECORD_STATS: Final = ("records", "duplicates", "dead_lettered")


def tokens_key(request_id: str) -> str:
    """``st:tokens:{request_id}``."""
    if not request_id:
        raise ValueError("request_id must not be empty")
    return f"{TOKENS_PREFIX}{request_id}"


def tokens_pattern(id_prefix: str = "") -> str:
    """The glob of every Tokens key whose request id starts with `id_prefix` (not escaped)."""
    return f"{TOKENS_PREFIX}{id_prefix}*"


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


def parse_row_member(member: bytes | str) -> tuple[str, str, str]:
    """(day, tenant, model) of a `ROWS_KEY` member; ValueError when it is not one."""
    try:
        parsed = json.loads(member.decode("utf-8") if isinstance(member, bytes) else member)
    except ValueError:
        raise ValueError(f"{ROWS_KEY} holds a member that is not JSON: {member!r}") from None
    if (
        not isinstance(parsed, list)
        or len(parsed) != 3
        or not all(isinstance(part, str) for part in parsed)
    ):
        raise ValueError(f"{ROWS_KEY} member is not [day, tenant, model]: {member!r}")
    day, tenant, model = parsed
    return day, tenant, model


def position_of(topic: str, partition: int, offset: int) -> str:
    """The member of `DEAD_SEEN_KEY` naming a raw record: ``topic:partition:offset``."""
    return f"{topic}:{partition}:{offset}"


def day_of(moment: datetime) -> str:
    """The UTC calendar day of an aware datetime, ``YYYY-MM-DD`` (the `day` of a usage row)."""
    offset = moment.utcoffset()
    if offset is None:
        raise ValueError(f"need a timezone-aware datetime, got {moment!r}")
    return (moment - offset).date().isoformat()


def tokens_json(tokens: Tokens) -> str:
    """The stored text of ``st:tokens:{request_id}``."""
    return json.dumps(tokens.to_json_dict(), ensure_ascii=False, separators=(",", ":"))
