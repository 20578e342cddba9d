"""A batching Redis sink for finished requests: their Tokens and their usage rows.

Use it like a quix-streams `BatchingSink`: `add` each finished request (its
`Tokens` and its priced `BillingEvent`) as it comes, then `flush` the batch
before committing the consumer offsets.  A flush is one atomic Lua script
call, idempotent per request, so a replay after a crash never counts twice.

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
    ==================  ==========================================================

    The exact total cost is ``cost_units + cost_pico / 10**12``; the script
    carries ``cost_pico`` into ``cost_units`` so neither field ever needs more
    than 64 bits (a Lua number holds the < 2 * 10**12 intermediate sum exactly).

``st:usage:rows`` (set)
    Every usage row ever written, as the compact JSON array
    ``["day","tenant","model"]`` (unescaped values), so rows can be listed
    without SCAN and without parsing keys.

Atomicity and idempotency
=========================

`flush` makes ONE ``EVALSHA`` call (the script is registered once per sink
and loaded on first use).  The script first checks every key it will touch
(types, integer fields) and fails before writing anything if one is wrong;
then, request by request in `add` order: if ``st:tokens:{request_id}``
exists it changes nothing and reports 0 (already applied, by an earlier
flush or earlier in the same batch: the first Tokens written wins), else it
writes the Tokens, HINCRBYs the row, carries the cost and adds the row to
the index, and reports 1.  All keys are passed as KEYS; they span hash
slots, so this is for a single Redis (not Redis Cluster).

Limits: each counter is a signed 64-bit integer (HINCRBY); `add` refuses
values that cannot fit one increment.  Reading: `streamtally.store.redis_keys`
(`get_tokens`, `get_tokens_text`, `usage_rows`, re-exported here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import redis.asyncio as aioredis

from streamtally.core.models import Tokens
from streamtally.store.redis_keys import (
    CLOSED_KEY,
    DEAD_SEEN_KEY,
    ROWS_KEY,
    STATS_KEY,
    UNKNOWN_MODEL,
    cost_parts,
    day_of,
    get_tokens,
    get_tokens_text,
    row_member,
    tokens_key,
    usage_key,
    usage_rows,
)
from streamtally.wire.records import BillingEvent

__all__ = [
    "FLUSH_SCRIPT",
    "RedisSink",
    "get_tokens",
    "get_tokens_text",
    "tokens_json",
    "usage_rows",
]

_INT64_MAX: Final = 2**63 - 1

FLUSH_SCRIPT: Final = """
-- KEYS[1]            st:usage:rows
-- KEYS[2]            st:closed   (request_id -> "offset reason")
-- KEYS[3]            st:stats    (records, duplicates, requests, dead_lettered)
-- KEYS[2i+2], KEYS[2i+3] (i = 1..n)  st:tokens:{request_id}, st:usage:{day}:{tenant}:{model}
-- ARGV[1]            n
-- ARGV[2 + 13(i-1) ..] tokens_json, row_member, input, output, reasoning, cached,
--                     cache_write, cost_units, cost_pico, request_id, closed marker,
--                     records, duplicates   (integers as decimal strings)
local PICO = 1000000000000
local FIELDS = {'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_tokens',
                'cache_write_tokens'}
local ALL = {'requests', 'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_tokens',
             'cache_write_tokens', 'cost_units', 'cost_pico'}
local n = tonumber(ARGV[1])

local function kind(key)
  local t = redis.call('TYPE', key)
  if type(t) == 'table' then return t['ok'] end
  return t
end

-- 1. check everything, write nothing
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
  local tk, uk = KEYS[2 * i + 2], KEYS[2 * i + 3]
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
  local tk, uk = KEYS[2 * i + 2], KEYS[2 * i + 3]
  local a = 2 + 13 * (i - 1)
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


def tokens_json(tokens: Tokens) -> str:
    """The stored text of `st:tokens:{request_id}`."""
    return json.dumps(tokens.to_json_dict(), ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class _Item:
    tokens_key: str
    usage_key: str
    args: tuple[str, ...]


def _counter(name: str, value: int) -> str:
    if not 0 <= value <= _INT64_MAX:
        raise ValueError(f"{name}={value} does not fit a Redis counter (0 .. 2**63-1)")
    return str(value)


class RedisSink:
    """Batches finished requests and writes them to Redis in one atomic, idempotent call.

    Not safe for concurrent use by several tasks (one sink per consumer task).
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._script = client.register_script(FLUSH_SCRIPT)
        self._dead_script = client.register_script(DEAD_LETTER_SCRIPT)
        self._pending: list[_Item] = []

    async def mark_closing(self, markers: dict[str, str]) -> None:
        """Record close decisions ("offset reason") before their outputs are sent.

        A replay that finds a decision but no Tokens closes the request again
        at the same offset for the same reason, so its outputs do not change.
        """
        if markers:
            await self._client.hset(CLOSED_KEY, mapping=cast("Mapping[Any, Any]", markers))

    async def count_dead_letters(self, positions: list[str]) -> int:
        """Count dead letters once per source position; returns how many were new."""
        if not positions:
            return 0
        return int(await self._dead_script(keys=[DEAD_SEEN_KEY, STATS_KEY], args=positions))

    def __len__(self) -> int:
        """How many requests wait for the next flush."""
        return len(self._pending)

    def add(
        self,
        tokens: Tokens,
        billing: BillingEvent,
        *,
        closed: str = "0 end",
        records: int = 0,
        duplicates: int = 0,
    ) -> None:
        """Queue one finished request for the next `flush`.

        `closed` is the request's closing marker ("offset reason", kept in
        `st:closed`); `records` and `duplicates` are its raw-record counts,
        added to `st:stats` when the request is applied.

        Raises ValueError when `billing` is not the billing event of `tokens`
        (another request id, model or usage) or a value cannot be counted.
        """
        if billing.request_id != tokens.request_id:
            raise ValueError(
                f"billing event of {billing.request_id!r} added with tokens of "
                f"{tokens.request_id!r}"
            )
        if billing.model != tokens.model:
            raise ValueError(
                f"{tokens.request_id}: billing model {billing.model!r} != tokens model "
                f"{tokens.model!r}"
            )
        if billing.usage != tokens.usage:
            raise ValueError(
                f"{tokens.request_id}: billing usage {billing.usage!r} != tokens usage "
                f"{tokens.usage!r}"
            )
        day = day_of(billing.event_time)
        model = tokens.model or UNKNOWN_MODEL
        units, pico = cost_parts(billing.cost)
        if abs(units) > _INT64_MAX:
            raise ValueError(f"{tokens.request_id}: cost {billing.cost} is too large to count")
        usage = tokens.usage
        args = (
            tokens_json(tokens),
            row_member(day, billing.tenant, model),
            _counter("input_tokens", usage.input_tokens),
            _counter("output_tokens", usage.output_tokens),
            _counter("reasoning_tokens", usage.reasoning_tokens),
            _counter("cached_tokens", usage.cached_tokens),
            _counter("cache_write_tokens", usage.cache_write_tokens),
            str(units),
            str(pico),
            tokens.request_id,
            closed,
            _counter("records", records),
            _counter("duplicates", duplicates),
        )
        self._pending.append(
            _Item(
                tokens_key=tokens_key(tokens.request_id),
                usage_key=usage_key(day, billing.tenant, model),
                args=args,
            )
        )

    async def flush(self) -> list[bool]:
        """Write every queued request in one atomic script call.

        Returns one flag per request, in `add` order: True when this flush
        applied it, False when it had been applied before (its Tokens key
        existed).  On an error the batch stays queued, so calling `flush`
        again retries it: the script's checks fail before anything is written,
        and a retry of a batch that was (partly) applied, say when the reply
        was lost, reports False for the requests already applied.
        """
        if not self._pending:
            return []
        batch = list(self._pending)
        keys: list[str] = [ROWS_KEY, CLOSED_KEY, STATS_KEY]
        argv: list[str] = [str(len(batch))]
        for item in batch:
            keys += (item.tokens_key, item.usage_key)
            argv += item.args
        result = await self._script(keys=keys, args=argv)
        if not isinstance(result, list) or len(result) != len(batch):
            raise RuntimeError(f"redis sink script returned {result!r} for {len(batch)} requests")
        del self._pending[: len(batch)]
        return [int(flag) == 1 for flag in result]
