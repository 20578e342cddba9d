"""The Redis key layout of streamtally: the one place keys, members and stored texts are spelled.

Every key, every member of a row index and every stored text is built by a
function or constant of this module; the scripts (`streamtally.store.scripts`)
receive them as KEYS and ARGV, and the reads (`streamtally.store.RedisStore`)
use them.  The layout is a contract with the data already in Redis: change
nothing here without a migration (``tests/unit/store/test_store_layout.py`` pins it).

Redis layout (version 3)
========================

A request is its tenant and its request id together (`RequestRef`); ``{ref}``
below is `RequestRef.text`: the tenant with ``%`` and ``:`` percent-escaped, a
``:``, the request id as is (``acme:chatcmpl-1``).

Shards.  The data is spread over `SHARDS` (16) shards, and every key of a shard
carries the shard's hash tag ``{T}`` (`SHARD_TAGS`, ``{s0-60}`` .. ``{s15-21}``),
so Redis Cluster keeps a shard in one hash slot and a script that touches one
shard touches one slot.  The tag of shard *i* is chosen to hash into the
*i*-th sixteenth of the 16,384 slots, so a cluster whose masters own even slot
ranges gets even shares of the shards.  A request lives in shard
``crc32(ref.text) % 16`` (`shard_of`): its Tokens, its close marker and its
contribution to the usage rows, which are therefore kept per shard and summed
when read.  A dead-lettered record lives in ``crc32(position) % 16``.

``st:layout`` (string)
    The layout version of the data, ``"3"``.  A worker claims it on an empty
    Redis and refuses to start on data of another version: data of versions 1
    and 2 is migrated by ``streamtally migrate`` (`streamtally.ops.migrate`),
    which sets ``"1>2"`` or ``"2>3"`` while it runs.

``st:{T}:layout`` (string)
    The same version, once per shard: the scripts check the key of their own
    shard (Redis Cluster forbids reading ``st:layout`` from another slot), so
    nothing is written into data being migrated.

``st:{T}:tokens:{ref}`` (string, expires after the state TTL)
    The request's Tokens JSON, exactly
    ``json.dumps(tokens.to_json_dict(), ensure_ascii=False, separators=(",", ":"))``
    (UTF-8).  It is also the idempotency marker of the request: while it
    exists, a replay of the request counts nothing.  It expires after the
    state TTL (``STREAMTALLY_STATE_TTL``, by default the raw topics' retention
    plus one segment, the longest a raw record can be read again), so Redis
    does not grow without bound; 0 keeps it forever.

``st:{T}:closed:{ref}`` (string, expires after the state TTL)
    ``"offset reason"``, the close decision of the request, written once
    (SET NX) before its outputs leave; ``"offset reason last_received"``
    since new calls, and ``"offset reason last_received revision"`` (with
    ``-`` for an unknown ``last_received``) for an amendment's close, which
    replaces the marker of the revision before it, and only that one.

``st:{T}:closes:{ref}`` (string, expires after the state TTL)
    The close markers of an amended request's earlier revisions, one per line,
    revision 0 first (each appended as an amendment's marker replaces it): what
    the audit replays the request's closes from.

``st:{T}:revision:{ref}`` (string, expires after the state TTL)
    The latest revision of the request's bill applied (its Tokens, its usage
    row): a decimal integer, written with each amendment.  Absent: revision 0
    when the Tokens key exists.

``st:{T}:amend:{ref}`` (string, binary, expires after the state TTL)
    For a request whose latest revision closed at its timeout or over a gap:
    what its next revision starts from (`streamtally.processors.amendable`:
    zlib-compressed, its applied raw records and its bill).  Deleted when an
    amendment closes at its END.

``st:{T}:usage:{day}:{tenant}:{model}`` (hash, never expires)
    This shard's part of one usage row. `day` is the UTC date of
    ``billing.event_time`` (``YYYY-MM-DD``), `tenant` is ``billing.tenant``
    with ``%`` and ``:`` percent-escaped (``%25``, ``%3A``; an ordinary tenant
    is written as is), `model` is ``tokens.model`` or ``"unknown"``, as is.
    A row is the sum of its parts over the shards.  Fields, all decimal
    integers (HINCRBY):

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
                        one is; absent reads as 0
    ==================  ==========================================================

    The exact total cost is ``cost_units + cost_pico / 10**12``; the script
    carries ``cost_pico`` into ``cost_units`` so neither field ever needs more
    than 64 bits (a Lua number holds the < 2 * 10**12 intermediate sum exactly).
    A row whose `unpriced_requests` is above 0 has a cost that is too low by
    what those requests would have cost: re-rate them from the billing events.

``st:{T}:usage:rows`` (set)
    Every row this shard holds a part of, as the compact JSON array
    ``["day","tenant","model"]`` (unescaped values), so rows can be listed
    without SCAN and without parsing keys.

``st:{T}:stats`` (hash)
    This shard's raw-record counts: ``records``, ``duplicates``, ``requests``,
    ``dead_lettered`` (summed over the shards when read).

``st:{T}:dead:{position}`` (string ``"1"``, expires after the state TTL)
    One per dead-lettered raw record (``topic:partition:offset``), so each
    counts once in ``dead_lettered`` however often it is dead-lettered again.

``st:{T}:correction:{correction_id}`` (string ``"1"``, expires after the state TTL)
    One per usage row corrected by ``streamtally audit --correct``
    (`streamtally.audit`), in the shard `shard_of_row` of the row: the
    correction's difference was added to that shard's part of the row, once.
"""

from __future__ import annotations

import json
import re
import zlib
from datetime import datetime
from typing import Final

from streamtally.core.identity import RequestRef, tenant_part
from streamtally.core.models import USAGE_FIELDS, Tokens

__all__ = [
    "COST_FIELDS",
    "LAYOUT_KEY",
    "LAYOUT_VERSION",
    "MIGRATING",
    "PREFIX",
    "RAW_RECORD_STATS",
    "ROW_FIELDS",
    "SHARDS",
    "SHARD_TAGS",
    "STATS_FIELDS",
    "UNKNOWN_MODEL",
    "UNPRICED_FIELD",
    "amend_key",
    "closed_key",
    "closed_pattern",
    "closes_key",
    "correction_key",
    "day_of",
    "dead_key",
    "guard_key",
    "marker_revision",
    "parse_row_member",
    "parse_tokens_key",
    "position_of",
    "revision_key",
    "row_member",
    "rows_key",
    "shard_of",
    "shard_of_position",
    "shard_of_row",
    "stats_key",
    "tokens_json",
    "tokens_key",
    "tokens_pattern",
    "tokens_pattern_of_id",
    "usage_key",
]

PREFIX: Final = "st:"
#: The layout version of the data (a string key, and one per shard: `guard_key`).
LAYOUT_KEY: Final = f"{PREFIX}layout"
#: The version this code reads and writes.
LAYOUT_VERSION: Final = "3"
#: `LAYOUT_KEY` while ``streamtally migrate`` moves version-2 data to version 3.
MIGRATING: Final = "2>3"
#: How many shards the data is spread over (a contract: changing it moves every key).
SHARDS: Final = 16
#: The hash tag of each shard: tag *i* hashes into slots [i * 1024, (i + 1) * 1024).
SHARD_TAGS: Final = (
    "s0-60", "s1-63", "s2-40", "s3-43", "s4-10", "s5-13", "s6-3", "s7-0",
    "s8-1", "s9-2", "s10-0", "s11-3", "s12-60", "s13-63", "s14-22", "s15-21",
)  # fmt: skip

#: Model name of a usage row whose request reported none.
UNKNOWN_MODEL: Final = "unknown"
#: The cost fields of a usage row: whole units, then the 10**-12 remainder.
COST_FIELDS: Final = ("cost_units", "cost_pico")
#: The field of a usage row counting its unpriced requests (absent: 0).
UNPRICED_FIELD: Final = "unpriced_requests"
#: Every field of a usage row hash, in order (the flush script's ``ALL``; new ones go last).
ROW_FIELDS: Final = ("requests", *USAGE_FIELDS, *COST_FIELDS, UNPRICED_FIELD)
#: The fields of a stats hash, in the order `RedisStore.stats` reports them.
STATS_FIELDS: Final = ("records", "duplicates", "dead_lettered", "requests")
#: The stats fields that count raw records (not rebuildable from the output topics).
RAW_RECORD_STATS: Final = ("records", "duplicates", "dead_lettered")

_TOKENS_KEY = re.compile(r"st:\{(s\d+-\d+)\}:tokens:(.*)", re.DOTALL)


def _tag(shard: int) -> str:
    return f"{PREFIX}{{{SHARD_TAGS[shard]}}}:"


def _ref_text(ref: RequestRef) -> str:
    if not ref.request_id:
        raise ValueError("request_id must not be empty")
    return ref.text


def shard_of(ref: RequestRef) -> int:
    """The shard of a request: ``crc32(ref.text) % SHARDS``."""
    return zlib.crc32(_ref_text(ref).encode("utf-8")) % SHARDS


def shard_of_position(position: str) -> int:
    """The shard of a dead-lettered record's `position_of` text."""
    return zlib.crc32(position.encode("utf-8")) % SHARDS


def shard_of_row(member: str) -> int:
    """The shard an audit's correction of a usage row goes to: of its `row_member` text."""
    return zlib.crc32(member.encode("utf-8")) % SHARDS


def correction_key(shard: int, correction_id: str) -> str:
    """``st:{T}:correction:{id}``: that a usage row correction was applied (in its shard)."""
    if not correction_id or not correction_id.isalnum():
        raise ValueError(f"bad correction id {correction_id!r}")
    return f"{_tag(shard)}correction:{correction_id}"


def guard_key(shard: int) -> str:
    """``st:{T}:layout``: the layout version, as the scripts of `shard` check it."""
    return f"{_tag(shard)}layout"


def rows_key(shard: int) -> str:
    """``st:{T}:usage:rows``: the rows `shard` holds a part of."""
    return f"{_tag(shard)}usage:rows"


def stats_key(shard: int) -> str:
    """``st:{T}:stats``: the raw-record counts of `shard`."""
    return f"{_tag(shard)}stats"


def tokens_key(ref: RequestRef) -> str:
    """``st:{T}:tokens:{ref}`` in the request's shard."""
    return f"{_tag(shard_of(ref))}tokens:{ref.text}"


def closed_key(ref: RequestRef) -> str:
    """``st:{T}:closed:{ref}``: the close decision of `ref`, in its shard."""
    return f"{_tag(shard_of(ref))}closed:{ref.text}"


def marker_revision(marker: str) -> int:
    """The revision a close marker names: its fourth field, absent (0) but in an
    amendment's (``"offset reason last_received revision"``)."""
    fields = marker.split(" ")
    return int(fields[3]) if len(fields) > 3 else 0


def closes_key(ref: RequestRef) -> str:
    """``st:{T}:closes:{ref}``: the close markers of `ref`'s earlier revisions."""
    return f"{_tag(shard_of(ref))}closes:{ref.text}"


def revision_key(ref: RequestRef) -> str:
    """``st:{T}:revision:{ref}``: the latest revision of `ref`'s bill applied."""
    return f"{_tag(shard_of(ref))}revision:{ref.text}"


def amend_key(ref: RequestRef) -> str:
    """``st:{T}:amend:{ref}``: what `ref`'s next revision starts from (if it may have one)."""
    return f"{_tag(shard_of(ref))}amend:{ref.text}"


def dead_key(position: str) -> str:
    """``st:{T}:dead:{position}``: the mark of one dead-lettered raw record."""
    return f"{_tag(shard_of_position(position))}dead:{position}"


def usage_key(shard: int, day: str, tenant: str, model: str) -> str:
    """``st:{T}:usage:{day}:{tenant}:{model}``: `shard`'s part of one usage row.

    The tenant has ``%`` and ``:`` percent-escaped (an ordinary tenant is
    written as is) so that a tenant holding a ``:`` cannot collide with
    another tenant's model: ``("a:b", "m")`` and ``("a", "b:m")`` stay two rows.
    The model is written as is (model names often hold ``:`` and ``/``); the
    key is unambiguous because the day has a fixed form and the tenant no ``:``.
    """
    return f"{_tag(shard)}usage:{day}:{tenant_part(tenant)}:{model}"


def parse_tokens_key(key: bytes | str) -> RequestRef:
    """The request a Tokens key names; ValueError when `key` is not one (of its own shard)."""
    text = key.decode("utf-8") if isinstance(key, bytes) else key
    match = _TOKENS_KEY.fullmatch(text)
    if match is None:
        raise ValueError(f"not a Tokens key: {text!r}")
    ref = RequestRef.parse(match[2])
    if SHARD_TAGS[shard_of(ref)] != match[1]:
        raise ValueError(f"Tokens key in the wrong shard: {text!r}")
    return ref


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


#: How every shard's tag reads in a SCAN glob (each key found is parsed to be sure).
_ANY_TAG: Final = f"{PREFIX}{{s*}}:"


def tokens_pattern(tenant: str | None = None, id_prefix: str = "") -> str:
    """The SCAN glob of the Tokens keys of `tenant` (None: every tenant) whose ids start so.

    `id_prefix` applies only with a tenant; both are matched literally.  A
    superset in every shard: parse each key found (`parse_tokens_key`).
    """
    if tenant is None:
        return f"{_ANY_TAG}tokens:*"
    return f"{_ANY_TAG}tokens:{_glob_escape(tenant_part(tenant))}:{_glob_escape(id_prefix)}*"


def tokens_pattern_of_id(request_id: str) -> str:
    """The SCAN glob of the Tokens keys ending in ``:{request_id}``, whatever the tenant.

    A superset: a key whose id merely ends so matches too (parse each key to be sure).
    """
    return f"{_ANY_TAG}tokens:*:{_glob_escape(request_id)}"


def closed_pattern() -> str:
    """The SCAN glob of every close marker (a superset: check each key's form)."""
    return f"{_ANY_TAG}closed:*"


def row_member(day: str, tenant: str, model: str) -> str:
    """The member of a shard's rows set naming a row: compact JSON ``["day","tenant","model"]``."""
    return json.dumps([day, tenant, model], ensure_ascii=False, separators=(",", ":"))


def parse_row_member(member: bytes | str) -> tuple[str, str, str]:
    """(day, tenant, model) of a `ROWS_KEY` member; ValueError when it is not one."""
    try:
        parsed = json.loads(member.decode("utf-8") if isinstance(member, bytes) else member)
    except ValueError:
        raise ValueError(f"a usage rows set holds a member that is not JSON: {member!r}") from None
    if (
        not isinstance(parsed, list)
        or len(parsed) != 3
        or not all(isinstance(part, str) for part in parsed)
    ):
        raise ValueError(f"a usage rows member is not [day, tenant, model]: {member!r}")
    day, tenant, model = parsed
    return day, tenant, model


def position_of(topic: str, partition: int, offset: int) -> str:
    """How a dead-lettered raw record is named (`dead_key`): ``topic:partition:offset``."""
    return f"{topic}:{partition}:{offset}"


def day_of(moment: datetime) -> str:
    """The UTC calendar day of an aware datetime, ``YYYY-MM-DD`` (the `day` of a usage row)."""
    offset = moment.utcoffset()
    if offset is None:
        raise ValueError(f"need a timezone-aware datetime, got {moment!r}")
    return (moment - offset).date().isoformat()


def tokens_json(tokens: Tokens) -> str:
    """The stored text of a request's Tokens key (`tokens_key`)."""
    return json.dumps(tokens.to_json_dict(), ensure_ascii=False, separators=(",", ":"))
