"""Moving a Redis of layout version 2 to version 3: the second step of ``streamtally migrate``.

Version 2 (`streamtally.store.layout_v2`) kept each kind of state under one key
or one prefix; version 3 (`streamtally.store.layout`) spreads it over 16
shards, each under its own hash tag, so that Redis Cluster can hold it, and
lets Tokens, close markers and dead-letter marks expire after the state TTL.
The move, on the single Redis that holds version 2:

1. ``st:layout`` ``"2"`` becomes ``"2>3"`` (`MIGRATING`): workers refuse to start,
   and the write scripts of both versions refuse to write;
2. every ``st:tokens:{ref}`` is RENAMEd to its shard's key and given the TTL;
3. every field of the hash ``st:closed`` becomes its shard's close-marker key
   (TTL), and leaves the hash;
4. every usage row moves whole into shard 0 (a row is the sum of its shards'
   parts, so one part holding all of it reads the same), with its member of
   ``st:usage:rows``; ``st:stats`` becomes shard 0's stats;
5. every member of ``st:deadletter:seen`` becomes its shard's dead-letter mark (TTL);
6. ``st:layout`` and every shard's layout key become ``"3"``.

Each batch of steps 2-5 is one atomic script call that removes what it moved
from version 2, so an interrupted run (killed, Redis gone) is resumed by
running ``streamtally migrate`` again: it finds ``"2>3"`` and moves what is
left.  The script refuses to overwrite a key of version 3 that exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from streamtally.core.identity import RequestRef
from streamtally.errors import ShardMigrateError
from streamtally.store import layout, layout_v2
from streamtally.store.layout import LAYOUT_KEY, LAYOUT_VERSION, MIGRATING, SHARDS
from streamtally.store.rows import reply_text

__all__ = ["BATCH_SIZE", "MIGRATING", "ShardMigrateError", "ShardMoves", "migrate_shards"]

#: Keys, fields or members moved per atomic script call.
BATCH_SIZE: Final = 500

#: KEYS[1] st:layout; ARGV[1] the kind, ARGV[2] "2>3", ARGV[3] the TTL (0: none).
#: key   KEYS[2i], KEYS[2i+1]: an old key RENAMEd to a new one (absent: skipped);
#:       ARGV[3+i]: "1" to give the new key the TTL
#: field KEYS[2]: the old hash; KEYS[2+i]: the new key of field ARGV[3+i] (SET NX, TTL)
#: member KEYS[2]: the old set; KEYS[2+i]: the new key of member ARGV[3+i] (SET NX "1", TTL)
#: row   KEYS[2], KEYS[3]: the old and new rows sets; KEYS[2i+2], KEYS[2i+3]: the row's
#:       old and new key; ARGV[3+i]: its member
_MOVE_SCRIPT: Final = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then
  return redis.error_reply('streamtally: ' .. KEYS[1] .. ' is no longer ' .. ARGV[2])
end
local kind, ttl = ARGV[1], tonumber(ARGV[3])
local function keep(key)
  if ttl > 0 then redis.call('EXPIRE', key, ttl) end
end
local function free(key)
  if redis.call('EXISTS', key) == 1 then
    error('streamtally: ' .. key .. ' exists already: nothing of this batch was moved')
  end
end
local moved = 0
if kind == 'key' then
  local n = (#KEYS - 1) / 2
  for i = 1, n do free(KEYS[2 * i + 1]) end
  for i = 1, n do
    local old, new = KEYS[2 * i], KEYS[2 * i + 1]
    if redis.call('EXISTS', old) == 1 then
      redis.call('RENAME', old, new)
      if ARGV[3 + i] == '1' then keep(new) end
      moved = moved + 1
    end
  end
elseif kind == 'row' then
  local n = (#KEYS - 3) / 2
  for i = 1, n do free(KEYS[2 * i + 3]) end
  for i = 1, n do
    local old, new, member = KEYS[2 * i + 2], KEYS[2 * i + 3], ARGV[3 + i]
    if redis.call('EXISTS', old) == 1 then redis.call('RENAME', old, new) end
    redis.call('SADD', KEYS[3], member)
    redis.call('SREM', KEYS[2], member)
    moved = moved + 1
  end
else
  for i = 3, #KEYS do free(KEYS[i]) end
  for i = 3, #KEYS do
    local name = ARGV[1 + i]
    local value = '1'
    if kind == 'field' then value = redis.call('HGET', KEYS[2], name) end
    if value then
      redis.call('SET', KEYS[i], value)
      keep(KEYS[i])
      moved = moved + 1
    end
    if kind == 'field' then
      redis.call('HDEL', KEYS[2], name)
    else
      redis.call('SREM', KEYS[2], name)
    end
  end
end
return moved
"""

#: SET st:layout and every shard's layout key to ARGV[2] if st:layout is ARGV[1].
_FINISH_SCRIPT: Final = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('streamtally: ' .. KEYS[1] .. ' is no longer ' .. ARGV[1])
end
for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[2]) end
return #KEYS
"""


@dataclass(slots=True)
class ShardMoves:
    """What the move to layout 3 moved (or, in a dry run, would move)."""

    tokens: int = 0
    closed: int = 0
    rows: int = 0
    stats: int = 0
    dead_letters: int = 0


def _batches(items: list[str], size: int) -> list[list[str]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _count(client: aioredis.Redis) -> ShardMoves:
    moves = ShardMoves()
    async for _ in client.scan_iter(match=layout_v2.tokens_pattern(), count=1000):
        moves.tokens += 1
    moves.closed = int(await client.hlen(layout_v2.CLOSED_KEY))
    moves.rows = int(await client.scard(layout_v2.ROWS_KEY))
    moves.stats = int(await client.exists(layout_v2.STATS_KEY))
    moves.dead_letters = int(await client.scard(layout_v2.DEAD_SEEN_KEY))
    return moves


async def migrate_shards(
    client: aioredis.Redis,
    *,
    ttl_s: int,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    notify: Callable[[str], None] = lambda _text: None,
) -> ShardMoves:
    """Move a Redis of layout 2 (or one whose move was interrupted) to layout 3.

    Raises `ShardMigrateError` when ``st:layout`` is neither ``"2"`` nor
    `MIGRATING`, or when Redis changed under the move.
    """
    before = reply_text(raw) if (raw := await client.get(LAYOUT_KEY)) is not None else None
    if before not in (layout_v2.VERSION, MIGRATING):
        raise ShardMigrateError(f"{LAYOUT_KEY} is {before!r}, not {layout_v2.VERSION!r}")
    if dry_run:
        return await _count(client)
    if before == layout_v2.VERSION:
        was = await client.set(LAYOUT_KEY, MIGRATING, xx=True, get=True)
        if not isinstance(was, bytes | str) or reply_text(was) != layout_v2.VERSION:
            raise ShardMigrateError(f"{LAYOUT_KEY} changed meanwhile; nothing was moved")
    notify(f"{LAYOUT_KEY} is {MIGRATING!r}: moving layout 2 into {SHARDS} shards")
    move = client.register_script(_MOVE_SCRIPT)
    head = [LAYOUT_KEY]
    args = [MIGRATING, str(ttl_s)]
    moves = ShardMoves()
    try:
        tokens = [
            reply_text(k)
            async for k in client.scan_iter(match=layout_v2.tokens_pattern(), count=1000)
        ]
        for batch in _batches(sorted(set(tokens)), batch_size):
            keys = [*head]
            for old in batch:
                keys += [old, layout.tokens_key(layout_v2.parse_tokens_key(old))]
            moves.tokens += int(await move(keys=keys, args=["key", *args, *["1"] * len(batch)]))
        fields = [reply_text(f) async for f, _ in client.hscan_iter(layout_v2.CLOSED_KEY)]
        for batch in _batches(sorted(set(fields)), batch_size):
            new = [layout.closed_key(RequestRef.parse(f)) for f in batch]
            keys = [*head, layout_v2.CLOSED_KEY, *new]
            moves.closed += int(await move(keys=keys, args=["field", *args, *batch]))
        members = [reply_text(m) for m in await client.smembers(layout_v2.ROWS_KEY)]
        for batch in _batches(sorted(members), batch_size):
            keys = [*head, layout_v2.ROWS_KEY, layout.rows_key(0)]
            for member in batch:
                row = layout.parse_row_member(member)
                keys += [layout_v2.usage_key(*row), layout.usage_key(0, *row)]
            moves.rows += int(await move(keys=keys, args=["row", *args, *batch]))
        stats = [*head, layout_v2.STATS_KEY, layout.stats_key(0)]
        moves.stats = int(await move(keys=stats, args=["key", *args, "0"]))
        seen = [reply_text(m) async for m in client.sscan_iter(layout_v2.DEAD_SEEN_KEY)]
        for batch in _batches(sorted(set(seen)), batch_size):
            keys = [*head, layout_v2.DEAD_SEEN_KEY, *(layout.dead_key(p) for p in batch)]
            moves.dead_letters += int(await move(keys=keys, args=["member", *args, *batch]))
        left = await _count(client)
        if left != ShardMoves():
            raise ShardMigrateError(
                f"layout-2 data appeared during the move ({left}): is a worker of an older "
                "streamtally still running? Stop it and run `streamtally migrate` again"
            )
        finish = client.register_script(_FINISH_SCRIPT)
        guards = [layout.guard_key(shard) for shard in range(SHARDS)]
        await finish(keys=[LAYOUT_KEY, *guards], args=[MIGRATING, LAYOUT_VERSION])
    except ResponseError as exc:
        raise ShardMigrateError(
            f"{exc} ({LAYOUT_KEY} stays {MIGRATING!r}: run `streamtally migrate` again)"
        ) from None
    notify(f"{LAYOUT_KEY} is {LAYOUT_VERSION!r}")
    return moves
