"""The Lua scripts of the Redis store, and their calling convention (KEYS and ARGV).

`FLUSH_SCRIPT` applies finished requests of ONE shard in one atomic, idempotent
call; `CLOSE_ONCE_SCRIPT` records close decisions of one shard, write-once;
`DEAD_LETTER_SCRIPT` counts dead-lettered raw records of one shard once per
source position; `AMEND_CLOSE_SCRIPT` records the close decision of an
amendment over the marker of the revision it supersedes, and `AMEND_SCRIPT`
applies one amendment (`AmendedRequest`) once.  Every key a call touches
carries its shard's hash tag (`streamtally.store.layout`), so each call
touches one hash slot and runs on
Redis Cluster as on one Redis.  The texts are a contract too: a script's SHA1
names it in Redis's script cache, and the argument order below is what the
texts read.

Each script first checks its shard's layout key (``st:{T}:layout``) against the
version it is given, `streamtally.store.layout.LAYOUT_VERSION`: a Redis not
yet migrated, or being migrated, gets an error and no write (a writer calls
`RedisStore.ensure_layout` first, which claims an empty Redis).
`FLUSH_SCRIPT` then checks every key it will touch (types, integer fields)
and fails before writing anything if one is wrong; then, request by request in
batch order: if the request's Tokens key exists it changes nothing and reports
0 (already applied, by an earlier call or earlier in the same batch: the first
Tokens written wins), else it records the close marker and the raw-record
counts, writes the Tokens, HINCRBYs the shard's part of the row (and its
``unpriced_requests`` when the request was billed unpriced), carries the cost
and adds the row to the shard's index, and reports 1.  Tokens, close markers
and dead-letter marks get the state TTL (ARGV; 0: no expiry).

One request is a `FinishedRequest`; `flush_calls` lays a batch out as one
call per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from streamtally.store.layout import LAYOUT_VERSION, guard_key, rows_key, stats_key

__all__ = [
    "AMEND_CLOSE_SCRIPT",
    "AMEND_SCRIPT",
    "ARGS_PER_REQUEST",
    "CLOSE_ONCE_SCRIPT",
    "CORRECT_ROW_SCRIPT",
    "DEAD_LETTER_SCRIPT",
    "FLUSH_SCRIPT",
    "AmendedRequest",
    "FinishedRequest",
    "ShardCall",
    "amend_call",
    "amend_close_calls",
    "close_once_calls",
    "dead_letter_calls",
    "flush_calls",
]

#: The Lua lines every script opens with: its layout check and the TTL'd SET.
_PRELUDE: Final = """
local function layout_is(key, version)
  local layout = redis.call('GET', key)
  if layout ~= version then
    return redis.error_reply('streamtally: ' .. key .. ' is ' .. tostring(layout) ..
                             ', not ' .. version .. ': see `streamtally migrate --help`')
  end
  return nil
end

local function set(key, value, ttl, nx)
  if nx and ttl > 0 then return redis.call('SET', key, value, 'NX', 'EX', ttl) end
  if nx then return redis.call('SET', key, value, 'NX') end
  if ttl > 0 then return redis.call('SET', key, value, 'EX', ttl) end
  return redis.call('SET', key, value)
end
"""

FLUSH_SCRIPT: Final = (
    """
-- KEYS[1]            st:{T}:layout      (must be ARGV[2]: nothing is written to another layout)
-- KEYS[2]            st:{T}:usage:rows
-- KEYS[3]            st:{T}:stats       (records, duplicates, requests, dead_lettered)
-- KEYS[3i+1], KEYS[3i+2], KEYS[3i+3] (i = 1..n)
--                    st:{T}:tokens:{ref}, st:{T}:closed:{ref}, st:{T}:usage:{day}:{tenant}:{model}
-- ARGV[1]            n
-- ARGV[2]            the layout version these keys are of
-- ARGV[3]            the state TTL in seconds (0: Tokens and markers never expire)
-- ARGV[4 + 13(i-1) ..] tokens_json, row_member, input, output, reasoning, cached,
--                     cache_write, cost_units, cost_pico, closed marker,
--                     records, duplicates, unpriced (1 if billed unpriced, else 0)
--                     (integers as decimal strings)
"""
    + _PRELUDE
    + """
local PICO = 1000000000000
local FIELDS = {'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_tokens',
                'cache_write_tokens'}
local ALL = {'requests', 'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_tokens',
             'cache_write_tokens', 'cost_units', 'cost_pico', 'unpriced_requests'}
local n = tonumber(ARGV[1])
local ttl = tonumber(ARGV[3])

local function kind(key)
  local t = redis.call('TYPE', key)
  if type(t) == 'table' then return t['ok'] end
  return t
end

-- 1. check everything, write nothing
local refused = layout_is(KEYS[1], ARGV[2])
if refused then return refused end
local rows_type = kind(KEYS[2])
if rows_type ~= 'none' and rows_type ~= 'set' then
  return redis.error_reply('streamtally: ' .. KEYS[2] .. ' is a ' .. rows_type .. ', not a set')
end
local stats_type = kind(KEYS[3])
if stats_type ~= 'none' and stats_type ~= 'hash' then
  return redis.error_reply('streamtally: ' .. KEYS[3] .. ' is a ' .. stats_type .. ', not a hash')
end
for i = 1, n do
  for _, k in ipairs({KEYS[3 * i + 1], KEYS[3 * i + 2]}) do
    local t = kind(k)
    if t ~= 'none' and t ~= 'string' then
      return redis.error_reply('streamtally: ' .. k .. ' is a ' .. t .. ', not a string')
    end
  end
  local uk = KEYS[3 * i + 3]
  local ut = kind(uk)
  if ut == 'hash' then
    local values = redis.call('HMGET', uk, unpack(ALL))
    for j, v in ipairs(values) do
      if v and not string.match(v, '^%-?%d+$') then
        return redis.error_reply('streamtally: ' .. uk .. ' field ' .. ALL[j] ..
                                 ' is not an integer')
      end
    end
    local pico = tonumber(values[8] or '0')
    if pico < 0 or pico >= PICO then
      return redis.error_reply('streamtally: ' .. uk .. ' cost_pico is out of range')
    end
  elseif ut ~= 'none' then
    return redis.error_reply('streamtally: ' .. uk .. ' is a ' .. ut .. ', not a hash')
  end
end

-- 2. apply, request by request
local applied = {}
for i = 1, n do
  local tk, ck, uk = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local a = 4 + 13 * (i - 1)
  if redis.call('EXISTS', tk) == 1 then
    applied[i] = 0
  else
    set(ck, ARGV[a + 9], ttl, false)
    redis.call('HINCRBY', KEYS[3], 'records', ARGV[a + 10])
    redis.call('HINCRBY', KEYS[3], 'duplicates', ARGV[a + 11])
    redis.call('HINCRBY', KEYS[3], 'requests', 1)
    set(tk, ARGV[a], ttl, false)
    redis.call('HINCRBY', uk, 'requests', 1)
    for j = 1, 5 do
      redis.call('HINCRBY', uk, FIELDS[j], ARGV[a + 1 + j])
    end
    local pico = tonumber(redis.call('HGET', uk, 'cost_pico') or '0') + tonumber(ARGV[a + 8])
    local carry = 0
    if pico >= PICO then
      pico = pico - PICO
      carry = 1
    end
    redis.call('HINCRBY', uk, 'cost_units', ARGV[a + 7])
    if carry == 1 then
      redis.call('HINCRBY', uk, 'cost_units', 1)
    end
    redis.call('HSET', uk, 'cost_pico', string.format('%d', pico))
    if ARGV[a + 12] ~= '0' then
      redis.call('HINCRBY', uk, 'unpriced_requests', ARGV[a + 12])
    end
    redis.call('SADD', KEYS[2], ARGV[a + 1])
    applied[i] = 1
  end
end
return applied
"""
)


DEAD_LETTER_SCRIPT: Final = (
    """
-- KEYS[1] st:{T}:layout, KEYS[2] st:{T}:stats, KEYS[3..] st:{T}:dead:{position}
-- ARGV[1] the layout version, ARGV[2] the state TTL in seconds (0: never expires)
-- Each position counts once, however often it is dead-lettered again (while marked).
"""
    + _PRELUDE
    + """
local refused = layout_is(KEYS[1], ARGV[1])
if refused then return refused end
local ttl = tonumber(ARGV[2])
local new = 0
for i = 3, #KEYS do
  if set(KEYS[i], '1', ttl, true) then new = new + 1 end
end
if new > 0 then
  redis.call('HINCRBY', KEYS[2], 'dead_lettered', new)
end
return new
"""
)

CLOSE_ONCE_SCRIPT: Final = (
    """
-- KEYS[1] st:{T}:layout, KEYS[2..] st:{T}:closed:{ref} of the requests deciding
-- ARGV[1] the layout version, ARGV[2] the state TTL in seconds, ARGV[3..] their markers
-- Each close decision is written once and never overwritten; returns, flat, the
-- index (1-based, among the requests) of every one decided before with ANOTHER
-- marker, and that marker.
"""
    + _PRELUDE
    + """
local refused = layout_is(KEYS[1], ARGV[1])
if refused then return refused end
local ttl = tonumber(ARGV[2])
local conflicts = {}
for i = 2, #KEYS do
  local marker = ARGV[i + 1]
  if not set(KEYS[i], marker, ttl, true) then
    local current = redis.call('GET', KEYS[i])
    if current ~= marker then
      conflicts[#conflicts + 1] = i - 1
      conflicts[#conflicts + 1] = current
    end
  end
end
return conflicts
"""
)

AMEND_CLOSE_SCRIPT: Final = (
    """
-- KEYS[1] st:{T}:layout, then per amendment st:{T}:closed:{ref} and st:{T}:closes:{ref}
-- ARGV[1] the layout version, ARGV[2] the state TTL in seconds,
-- ARGV[3..] per amendment: its marker, then the marker of the revision it supersedes
-- An amendment's close decision replaces the marker of the revision it supersedes, and
-- only that one: one decision per revision, whoever made it first.  The marker replaced
-- is appended to the request's close history (one marker per line, revision 0 first).
-- Returns, flat, the index (1-based) of every amendment found decided with ANOTHER
-- marker, and that marker.
"""
    + _PRELUDE
    + """
local refused = layout_is(KEYS[1], ARGV[1])
if refused then return refused end
local ttl = tonumber(ARGV[2])
local conflicts = {}
for i = 1, (#KEYS - 1) / 2 do
  local closed, history = KEYS[2 * i], KEYS[2 * i + 1]
  local marker, previous = ARGV[2 * i + 1], ARGV[2 * i + 2]
  local current = redis.call('GET', closed)
  if current == previous then
    set(closed, marker, ttl, false)
    local before = redis.call('GET', history)
    set(history, before and (before .. '\\n' .. previous) or previous, ttl, false)
  elseif current ~= marker then
    conflicts[#conflicts + 1] = i
    conflicts[#conflicts + 1] = current or ''
  end
end
return conflicts
"""
)

AMEND_SCRIPT: Final = (
    """
-- KEYS[1] st:{T}:layout, KEYS[2] st:{T}:usage:rows, KEYS[3] st:{T}:stats,
-- KEYS[4] st:{T}:tokens:{ref}, KEYS[5] st:{T}:revision:{ref}, KEYS[6] st:{T}:amend:{ref},
-- KEYS[7] the superseded bill's row part, KEYS[8] the amendment's row part
-- ARGV[1] the layout version, ARGV[2] the state TTL in seconds, ARGV[3] the revision,
-- ARGV[4] the Tokens JSON, ARGV[5] the amendment's row member,
-- ARGV[6..13] the superseded bill: the five usage fields, cost_units, cost_pico, unpriced,
-- ARGV[14..21] the amendment's: the same eight, ARGV[22] records, ARGV[23] duplicates,
-- ARGV[24] its amendable state ('' : none, the key is deleted)
-- Applies revision n once, and only over revision n - 1: the Tokens replaced, the
-- superseded bill taken off its row part and the amendment added to its own (the same
-- row, or another day's or model's), the records counted, the revision recorded.
-- Returns 1 when it applied it, 0 when revision n or a later one was applied before.
"""
    + _PRELUDE
    + """
local PICO = 1000000000000
local FIELDS = {'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_tokens',
                'cache_write_tokens'}
local refused = layout_is(KEYS[1], ARGV[1])
if refused then return refused end
local ttl = tonumber(ARGV[2])
local revision = tonumber(ARGV[3])
for _, k in ipairs({KEYS[7], KEYS[8]}) do
  local t = redis.call('TYPE', k)
  if type(t) == 'table' then t = t['ok'] end
  if t ~= 'none' and t ~= 'hash' then
    return redis.error_reply('streamtally: ' .. k .. ' is a ' .. t .. ', not a hash')
  end
end
local applied = redis.call('GET', KEYS[5])
if applied then
  applied = tonumber(applied)
elseif redis.call('EXISTS', KEYS[4]) == 1 then
  applied = 0
else
  applied = -1
end
if applied >= revision then return 0 end
if applied ~= revision - 1 then
  return redis.error_reply('streamtally: revision ' .. revision .. ' of ' .. KEYS[4] ..
                           ' over revision ' .. applied .. ', not ' .. (revision - 1))
end

local function add(key, a, sign)
  for j = 1, 5 do
    local v = tonumber(ARGV[a + j - 1])
    if v ~= 0 then redis.call('HINCRBY', key, FIELDS[j], sign * v) end
  end
  redis.call('HINCRBY', key, 'requests', sign)
  local unpriced = tonumber(ARGV[a + 7])
  if unpriced ~= 0 then redis.call('HINCRBY', key, 'unpriced_requests', sign * unpriced) end
  local units = sign * tonumber(ARGV[a + 5])
  local pico = tonumber(redis.call('HGET', key, 'cost_pico') or '0') + sign * tonumber(ARGV[a + 6])
  if pico >= PICO then
    pico = pico - PICO
    units = units + 1
  elseif pico < 0 then
    pico = pico + PICO
    units = units - 1
  end
  if units ~= 0 then redis.call('HINCRBY', key, 'cost_units', units) end
  redis.call('HSET', key, 'cost_pico', string.format('%d', pico))
end

add(KEYS[7], 6, -1)
add(KEYS[8], 14, 1)
redis.call('SADD', KEYS[2], ARGV[5])
redis.call('HINCRBY', KEYS[3], 'records', ARGV[22])
redis.call('HINCRBY', KEYS[3], 'duplicates', ARGV[23])
set(KEYS[4], ARGV[4], ttl, false)
set(KEYS[5], ARGV[3], ttl, false)
if ARGV[24] == '' then
  redis.call('DEL', KEYS[6])
else
  set(KEYS[6], ARGV[24], ttl, false)
end
return 1
"""
)

CORRECT_ROW_SCRIPT: Final = (
    """
-- KEYS[1] st:{T}:layout, KEYS[2] st:{T}:usage:rows, KEYS[3] st:{T}:usage:{day}:{tenant}:{model},
-- KEYS[4] st:{T}:correction:{id}
-- ARGV[1] the layout version, ARGV[2] the state TTL in seconds, ARGV[3] the row member,
-- ARGV[4..10] the differences of requests, unpriced_requests and the five usage fields,
-- ARGV[11] of cost_units, ARGV[12] of cost_pico (0 <= x < 10**12): signed decimal strings.
-- Adds the differences to this shard's part of the row once per correction id (KEYS[4]);
-- returns 1 when it did, 0 when that correction had been applied before.
"""
    + _PRELUDE
    + """
local PICO = 1000000000000
local refused = layout_is(KEYS[1], ARGV[1])
if refused then return refused end
local t = redis.call('TYPE', KEYS[3])
if type(t) == 'table' then t = t['ok'] end
if t ~= 'none' and t ~= 'hash' then
  return redis.error_reply('streamtally: ' .. KEYS[3] .. ' is a ' .. t .. ', not a hash')
end
if not set(KEYS[4], '1', tonumber(ARGV[2]), true) then return 0 end
local names = {'requests', 'unpriced_requests', 'input_tokens', 'output_tokens',
               'reasoning_tokens', 'cached_tokens', 'cache_write_tokens', 'cost_units'}
for i, name in ipairs(names) do
  if ARGV[3 + i] ~= '0' then redis.call('HINCRBY', KEYS[3], name, ARGV[3 + i]) end
end
local pico = tonumber(redis.call('HGET', KEYS[3], 'cost_pico') or '0') + tonumber(ARGV[12])
if pico >= PICO then
  pico = pico - PICO
  redis.call('HINCRBY', KEYS[3], 'cost_units', 1)
end
redis.call('HSET', KEYS[3], 'cost_pico', string.format('%d', pico))
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""
)

#: ARGV entries per request of `FLUSH_SCRIPT` (after the count, the version and the TTL).
ARGS_PER_REQUEST: Final = 13


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request as `FLUSH_SCRIPT` takes it: its shard, its keys and its arguments.

    Built by `streamtally.store.finished_request`, which checks the values
    (every counter fits a signed 64-bit HINCRBY, the cost parts are exact).
    """

    #: The request's shard (`streamtally.store.layout.shard_of`); its three keys are in it.
    shard: int
    #: ``st:{T}:tokens:{ref}``, ``st:{T}:closed:{ref}`` and the shard's part of the row.
    tokens_key: str
    closed_key: str
    usage_key: str
    #: The stored Tokens text and the row's member of the shard's rows set.
    tokens_json: str
    row_member: str
    #: The five usage counts, in `USAGE_FIELDS` order.
    usage: tuple[int, int, int, int, int]
    cost_units: int
    cost_pico: int
    #: The closing marker ("offset reason").
    closed: str
    #: Raw-record counts added to the shard's stats.
    records: int
    duplicates: int
    #: False when the billing event is unpriced: counted in the row's ``unpriced_requests``.
    priced: bool

    def keys(self) -> tuple[str, str, str]:
        """KEYS[3i+1], KEYS[3i+2], KEYS[3i+3] of request i."""
        return self.tokens_key, self.closed_key, self.usage_key

    def argv(self) -> tuple[str, ...]:
        """The `ARGS_PER_REQUEST` ARGV entries of this request, in the script's order."""
        return (
            self.tokens_json,
            self.row_member,
            *(str(count) for count in self.usage),
            str(self.cost_units),
            str(self.cost_pico),
            self.closed,
            str(self.records),
            str(self.duplicates),
            "0" if self.priced else "1",
        )


@dataclass(frozen=True, slots=True)
class AmendedRequest:
    """One amendment as `AMEND_SCRIPT` takes it: revision n of a request's bill, replacing
    revision n - 1 (`superseded`) in the usage rows.

    Built by `streamtally.store.amended_request`, which checks the values.
    """

    shard: int
    revision: int
    tokens_key: str
    revision_key: str
    amend_key: str
    #: The superseded bill's part of its row, and the amendment's (the same key, or not).
    superseded_key: str
    usage_key: str
    tokens_json: str
    row_member: str
    #: The five usage counts, whole cost units, cost remainder and unpriced (0 or 1) of
    #: the superseded bill, then of the amendment.
    superseded: tuple[int, int, int, int, int, int, int, int]
    amended: tuple[int, int, int, int, int, int, int, int]
    records: int
    duplicates: int
    #: Its amendable state (`streamtally.processors.amendable`), if it may have a next.
    amendable: bytes | None

    def keys(self) -> list[str]:
        return [
            guard_key(self.shard),
            rows_key(self.shard),
            stats_key(self.shard),
            self.tokens_key,
            self.revision_key,
            self.amend_key,
            self.superseded_key,
            self.usage_key,
        ]

    def argv(self, ttl: str) -> list[str | bytes]:
        return [
            LAYOUT_VERSION,
            ttl,
            str(self.revision),
            self.tokens_json,
            self.row_member,
            *(str(v) for v in self.superseded),
            *(str(v) for v in self.amended),
            str(self.records),
            str(self.duplicates),
            b"" if self.amendable is None else self.amendable,
        ]


@dataclass(frozen=True, slots=True)
class ShardCall:
    """One script call on one shard: its KEYS and ARGV, and which inputs it carries.

    `indexes` are the positions, in the caller's sequence, of the items the
    call carries, in the order the script sees them.
    """

    shard: int
    keys: list[str]
    argv: list[str]
    indexes: list[int]


def _by_shard(shards: Sequence[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for index, shard in enumerate(shards):
        groups.setdefault(shard, []).append(index)
    return groups


def _ttl(ttl_s: int) -> str:
    if ttl_s < 0:
        raise ValueError(f"the state TTL must be >= 0 seconds (0: never expire), not {ttl_s}")
    return str(ttl_s)


def flush_calls(batch: Sequence[FinishedRequest], ttl_s: int) -> list[ShardCall]:
    """The `FLUSH_SCRIPT` calls applying `batch`: one per shard, each in batch order."""
    calls = []
    ttl = _ttl(ttl_s)
    for shard, indexes in sorted(_by_shard([r.shard for r in batch]).items()):
        keys = [guard_key(shard), rows_key(shard), stats_key(shard)]
        argv = [str(len(indexes)), LAYOUT_VERSION, ttl]
        for index in indexes:
            keys += batch[index].keys()
            argv += batch[index].argv()
        calls.append(ShardCall(shard, keys, argv, indexes))
    return calls


def close_once_calls(decisions: Sequence[tuple[int, str, str]], ttl_s: int) -> list[ShardCall]:
    """The `CLOSE_ONCE_SCRIPT` calls recording `decisions` ((shard, closed key, marker) each)."""
    calls = []
    ttl = _ttl(ttl_s)
    for shard, indexes in sorted(_by_shard([d[0] for d in decisions]).items()):
        keys = [guard_key(shard), *(decisions[i][1] for i in indexes)]
        argv = [LAYOUT_VERSION, ttl, *(decisions[i][2] for i in indexes)]
        calls.append(ShardCall(shard, keys, argv, indexes))
    return calls


def dead_letter_calls(marks: Sequence[tuple[int, str]], ttl_s: int) -> list[ShardCall]:
    """The `DEAD_LETTER_SCRIPT` calls counting `marks` ((shard, dead-letter key) each)."""
    calls = []
    ttl = _ttl(ttl_s)
    for shard, indexes in sorted(_by_shard([m[0] for m in marks]).items()):
        keys = [guard_key(shard), stats_key(shard), *(marks[i][1] for i in indexes)]
        calls.append(ShardCall(shard, keys, [LAYOUT_VERSION, ttl], indexes))
    return calls


def amend_close_calls(
    decisions: Sequence[tuple[int, str, str, str, str]], ttl_s: int
) -> list[ShardCall]:
    """The `AMEND_CLOSE_SCRIPT` calls recording `decisions` ((shard, closed key, history
    key, marker, superseded marker) each)."""
    calls = []
    ttl = _ttl(ttl_s)
    for shard, indexes in sorted(_by_shard([d[0] for d in decisions]).items()):
        keys = [guard_key(shard)]
        argv = [LAYOUT_VERSION, ttl]
        for i in indexes:
            keys += [decisions[i][1], decisions[i][2]]
            argv += [decisions[i][3], decisions[i][4]]
        calls.append(ShardCall(shard, keys, argv, indexes))
    return calls


def amend_call(amendment: AmendedRequest, ttl_s: int) -> tuple[list[str], list[str | bytes]]:
    """The KEYS and ARGV of the `AMEND_SCRIPT` call applying `amendment`."""
    return amendment.keys(), amendment.argv(_ttl(ttl_s))
