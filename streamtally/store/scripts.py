"""The Lua scripts of the Redis store, and their calling convention (KEYS and ARGV).

`FLUSH_SCRIPT` applies a batch of finished requests in one atomic, idempotent
call; `DEAD_LETTER_SCRIPT` counts dead-lettered raw records once per source
position.  The texts are a contract too: a script's SHA1 names it in Redis's
script cache, and the argument order below is what the texts read.

`FLUSH_SCRIPT` and `CLOSE_ONCE_SCRIPT` write only into data of the layout
version they are given (``st:layout``, `streamtally.store.layout.LAYOUT_VERSION`):
a Redis not yet migrated, or being migrated, gets an error and no write (a
writer calls `RedisStore.ensure_layout` first, which claims an empty Redis).
`FLUSH_SCRIPT` first checks every key it will touch (types, integer fields)
and fails before writing anything if one is wrong; then, request by request in
batch order: if ``st:tokens:{ref}`` exists it changes nothing and
reports 0 (already applied, by an earlier call or earlier in the same batch:
the first Tokens written wins), else it records the close marker and the
raw-record counts, writes the Tokens, HINCRBYs the row (and its
``unpriced_requests`` when the request was billed unpriced), carries the cost
and adds the row to the index, and reports 1.  All keys are passed as KEYS; they
span hash slots, so this is for a single Redis (not Redis Cluster).

One request is a `FinishedRequest`; `flush_call` lays a batch out as the
script's KEYS and ARGV.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from streamtally.store.layout import (
    CLOSED_KEY,
    DEAD_SEEN_KEY,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    ROWS_KEY,
    STATS_KEY,
)

__all__ = [
    "ARGS_PER_REQUEST",
    "CLOSE_ONCE_SCRIPT",
    "DEAD_LETTER_SCRIPT",
    "FLUSH_SCRIPT",
    "FinishedRequest",
    "close_once_call",
    "dead_letter_call",
    "flush_call",
]

FLUSH_SCRIPT: Final = """
-- KEYS[1]            st:usage:rows
-- KEYS[2]            st:closed   ({ref} -> "offset reason")
-- KEYS[3]            st:stats    (records, duplicates, requests, dead_lettered)
-- KEYS[4]            st:layout   (must be ARGV[2]: nothing is written to another layout)
-- KEYS[2i+3], KEYS[2i+4] (i = 1..n)  st:tokens:{ref}, st:usage:{day}:{tenant}:{model}
-- ARGV[1]            n
-- ARGV[2]            the layout version these keys are of
-- ARGV[3 + 14(i-1) ..] tokens_json, row_member, input, output, reasoning, cached,
--                     cache_write, cost_units, cost_pico, {ref}, closed marker,
--                     records, duplicates, unpriced (1 if billed unpriced, else 0)
--                     (integers as decimal strings)
local PICO = 1000000000000
local FIELDS = {'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_tokens',
                'cache_write_tokens'}
local ALL = {'requests', 'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_tokens',
             'cache_write_tokens', 'cost_units', 'cost_pico', 'unpriced_requests'}
local n = tonumber(ARGV[1])

local function kind(key)
  local t = redis.call('TYPE', key)
  if type(t) == 'table' then return t['ok'] end
  return t
end

-- 1. check everything, write nothing
local layout = redis.call('GET', KEYS[4])
if layout ~= ARGV[2] then
  return redis.error_reply('streamtally: ' .. KEYS[4] .. ' is ' .. tostring(layout) ..
                           ', not ' .. ARGV[2] .. ': see `streamtally migrate --help`')
end
local rows_type = kind(KEYS[1])
if rows_type ~= 'none' and rows_type ~= 'set' then
  return redis.error_reply('streamtally: ' .. KEYS[1] .. ' is a ' .. rows_type .. ', not a set')
end
for _, k in ipairs({KEYS[2], KEYS[3]}) do
  local t = kind(k)
  if t ~= 'none' and t ~= 'hash' then
    return redis.error_reply('streamtally: ' .. k .. ' is a ' .. t .. ', not a hash')
  end
end
for i = 1, n do
  local tk, uk = KEYS[2 * i + 3], KEYS[2 * i + 4]
  local tt = kind(tk)
  if tt ~= 'none' and tt ~= 'string' then
    return redis.error_reply('streamtally: ' .. tk .. ' is a ' .. tt .. ', not a string')
  end
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
  local tk, uk = KEYS[2 * i + 3], KEYS[2 * i + 4]
  local a = 3 + 14 * (i - 1)
  if redis.call('EXISTS', tk) == 1 then
    applied[i] = 0
  else
    redis.call('HSET', KEYS[2], ARGV[a + 9], ARGV[a + 10])
    redis.call('HINCRBY', KEYS[3], 'records', ARGV[a + 11])
    redis.call('HINCRBY', KEYS[3], 'duplicates', ARGV[a + 12])
    redis.call('HINCRBY', KEYS[3], 'requests', 1)
    redis.call('SET', tk, ARGV[a])
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
    if ARGV[a + 13] ~= '0' then
      redis.call('HINCRBY', uk, 'unpriced_requests', ARGV[a + 13])
    end
    redis.call('SADD', KEYS[1], ARGV[a + 1])
    applied[i] = 1
  end
end
return applied
"""


DEAD_LETTER_SCRIPT: Final = """
-- KEYS[1] st:deadletter:seen (set of "topic:partition:offset"), KEYS[2] st:stats
-- ARGV: positions; each counts once, however often it is dead-lettered again
local new = 0
for _, position in ipairs(ARGV) do
  new = new + redis.call('SADD', KEYS[1], position)
end
if new > 0 then
  redis.call('HINCRBY', KEYS[2], 'dead_lettered', new)
end
return new
"""

CLOSE_ONCE_SCRIPT: Final = """
-- KEYS[1] st:closed ({ref} -> "offset reason"), KEYS[2] st:layout
-- ARGV[1]: the layout version the fields are of (must be st:layout's: else nothing is written)
-- ARGV[2..]: ref, marker, ref, marker, ...
-- Each close decision is written once and never overwritten; returns, flat, every
-- ref decided before with ANOTHER marker, and that marker.
local layout = redis.call('GET', KEYS[2])
if layout ~= ARGV[1] then
  return redis.error_reply('streamtally: ' .. KEYS[2] .. ' is ' .. tostring(layout) ..
                           ', not ' .. ARGV[1] .. ': see `streamtally migrate --help`')
end
local conflicts = {}
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 0 then
    local current = redis.call('HGET', KEYS[1], ARGV[i])
    if current ~= ARGV[i + 1] then
      conflicts[#conflicts + 1] = ARGV[i]
      conflicts[#conflicts + 1] = current
    end
  end
end
return conflicts
"""

#: ARGV entries per request of `FLUSH_SCRIPT` (after ARGV[1], the request count).
ARGS_PER_REQUEST: Final = 14


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request as `FLUSH_SCRIPT` takes it: its two keys and its arguments.

    Built by `streamtally.store.RedisSink.add`, which checks the values
    (every counter fits a signed 64-bit HINCRBY, the cost parts are exact).
    """

    #: The request's field of ``st:closed`` (`streamtally.store.layout.closed_field`).
    closed_field: str
    #: ``st:tokens:{ref}`` and the usage row's key (`streamtally.store.layout`).
    tokens_key: str
    usage_key: str
    #: The stored Tokens text and the row's member of ``st:usage:rows``.
    tokens_json: str
    row_member: str
    #: The five usage counts, in `USAGE_FIELDS` order.
    usage: tuple[int, int, int, int, int]
    cost_units: int
    cost_pico: int
    #: The closing marker kept in ``st:closed`` ("offset reason").
    closed: str
    #: Raw-record counts added to ``st:stats``.
    records: int
    duplicates: int
    #: False when the billing event is unpriced: counted in the row's ``unpriced_requests``.
    priced: bool

    def keys(self) -> tuple[str, str]:
        """KEYS[2i+3], KEYS[2i+4] of request i."""
        return self.tokens_key, self.usage_key

    def argv(self) -> tuple[str, ...]:
        """The `ARGS_PER_REQUEST` ARGV entries of this request, in the script's order."""
        return (
            self.tokens_json,
            self.row_member,
            *(str(count) for count in self.usage),
            str(self.cost_units),
            str(self.cost_pico),
            self.closed_field,
            self.closed,
            str(self.records),
            str(self.duplicates),
            "0" if self.priced else "1",
        )


def flush_call(batch: Sequence[FinishedRequest]) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of one `FLUSH_SCRIPT` call applying `batch`, in order."""
    keys: list[str] = [ROWS_KEY, CLOSED_KEY, STATS_KEY, LAYOUT_KEY]
    argv: list[str] = [str(len(batch)), LAYOUT_VERSION]
    for request in batch:
        keys += request.keys()
        argv += request.argv()
    return keys, argv


def dead_letter_call(positions: Sequence[str]) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of one `DEAD_LETTER_SCRIPT` call counting `positions`."""
    return [DEAD_SEEN_KEY, STATS_KEY], list(positions)


def close_once_call(fields: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of one `CLOSE_ONCE_SCRIPT` call recording `fields` (field -> marker)."""
    return [CLOSED_KEY, LAYOUT_KEY], [LAYOUT_VERSION, *(p for kv in fields.items() for p in kv)]
