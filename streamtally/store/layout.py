"""The Redis key layout of streamtally: the one place keys, members and stored texts are spelled.

Every key, every member of the row index and every stored text is built by a
function or constant of this module; the scripts (`streamtally.store.scripts`)
receive them as KEYS and ARGV, and the reads (`streamtally.store.RedisStore`)
use them.  The layout is a contract with the data already in Redis: change
nothing here without a migration (``tests/unit/test_store_layout.py`` pins it).

Redis layout (version 2)
========================

A request is its tenant and its request id together (`RequestRef`); ``{ref}``
below is `RequestRef.text`: the tenant with ``%`` and ``:`` percent-escaped, a
``:``, the request id as is (``acme:chatcmpl-1``).

``st:layout`` (string)
    The layout version of the data, ``"2"``.  A worker claims it on an empty
    Redis and refuses to start on data of another version: Redis written by a
    version before 2 (no ``st:layout``, Tokens keyed by request id alone) is
    migrated by ``streamtally migrate`` (`streamtally.ops.migrate`), which
    sets ``"1>2"`` while it runs.

``st:tokens:{ref}`` (string)
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
    ``{ref}`` -> ``"offset reason"``, the close decision of every closed (or
    closing) request, written once (HSETNX) before its outputs leave.

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

from streamtally.core.identity import RequestRef, tenant_part
from streamtally.core.models import USAGE_FIELDS, Tokens

__all__ = [
    "CLOSED_KEY",
    "COST_FIELDS",
    "DEAD_SEEN_KEY",
    "LAYOUT_KEY",
    "LAYOUT_VERSION",
    "MIGRATING",
    "PREFIX",
    "RAW_RECORD_STATS",
    "ROWS_KEY",
    "ROW_FIELDS",
    "STATS_FIELDS",
    "STATS_KEY",
    "TOKENS_PREFIX",
    "UNKNOWN_MODEL",
    "UNPRICED_FIELD",
    "closed_field",
    "day_of",
    "parse_row_member",
    "parse_tokens_key",
    "position_of",
    "row_member",
    "tokens_json",
    "tokens_key",
    "tokens_pattern",
    "usage_key",
]

PREFIX: Final = "st:"
#: The layout version of the data (a string key).
LAYOUT_KEY: Final = f"{PREFIX}layout"
#: The version this code reads and writes.
LAYOUT_VERSION: Final = "2"
#: `LAYOUT_KEY` while ``streamtally migrate`` moves version-1 data to version 2.
MIGRATING: Final = "1>2"
#: The prefix of every Tokens key; the request's `RequestRef.text` follows it.
TOKENS_PREFIX: Final = f"{PREFIX}tokens:"
#: Set of every usage row, as `row_member` texts.
ROWS_KEY: Final = f"{PREFIX}usage:rows"
#: Hash `closed_field` -> "offset reason" of every closed (or closing) request.
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


def tokens_key(ref: RequestRef) -> str:
    """``st:tokens:{ref}``."""
    if not ref.request_id:
        raise ValueError("request_id must not be empty")
    return f"{TOKENS_PREFIX}{ref.text}"


def parse_tokens_key(key: bytes | str) -> RequestRef:
    """The request a Tokens key names; ValueError when `key` is not one."""
    text = key.decode("utf-8") if isinstance(key, bytes) else key
    if not text.startswith(TOKENS_PREFIX):
        raise ValueError(f"not a Tokens key: {text!r}")
    return RequestRef.parse(text[len(TOKENS_PREFIX) :])


def closed_field(ref: RequestRef) -> str:
    """The field of `CLOSED_KEY` holding the close decision of `ref`."""
    if not ref.request_id:
        raise ValueError("request_id must not be empty")
    return ref.text


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def tokens_pattern(tenant: str | None = None, id_prefix: str = "") -> str:
    """The SCAN glob of the Tokens keys of `tenant` (None: every tenant) whose ids start so.

    `id_prefix` applies only with a tenant; both are matched literally.
    """
    if tenant is None:
        return f"{TOKENS_PREFIX}*"
    return f"{TOKENS_PREFIX}{_glob_escape(tenant_part(tenant))}:{_glob_escape(id_prefix)}*"


def tokens_pattern_of_id(request_id: str) -> str:
    """The SCAN glob of the Tokens keys ending in ``:{request_id}``, whatever the tenant.

    A superset: a key whose id merely ends so matches too (parse each key to be sure).
    """
    return f"{TOKENS_PREFIX}*:{_glob_escape(request_id)}"


def usage_key(day: str, tenant: str, model: str) -> str:
    """``st:usage:{day}:{tenant}:{model}``.

    The tenant has ``%`` and ``:`` percent-escaped (an ordinary tenant is
    written as is) so that a tenant holding a ``:`` cannot collide with
    another tenant's model: ``("a:b", "m")`` and ``("a", "b:m")`` stay two rows.
    The model is written as is (model names often hold ``:`` and ``/``); the
    key is unambiguous because the day has a fixed form and the tenant no ``:``.
    """
    return f"{PREFIX}usage:{day}:{tenant_part(tenant)}:{model}"


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
