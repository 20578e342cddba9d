"""The Lua scripts of a migration: a batch of steps, and the final switch to layout 2.

`MIGRATE_SCRIPT` checks every step of a batch against what Redis holds and
writes nothing when one does not fit, then applies them in order;
`FINISH_SCRIPT` sets ``st:layout`` to ``"2"`` and deletes the set of moved
requests.  Both refuse unless ``st:layout`` is still ``"1>2"``.  Called by
`streamtally.ops.migrate._redis`.
"""

from __future__ import annotations

from typing import Final

MIGRATE_SCRIPT: Final = """
-- KEYS[1]  st:layout (must be ARGV[1], "1>2": nothing is moved otherwise)
-- KEYS[2]  st:closed
-- KEYS[3]  st:migrate:moved            (set of {ref} moved)
-- KEYS[4]  st:migrate:unplaced         (hash id -> Tokens JSON)
-- KEYS[5]  st:migrate:unplaced:closed  (hash id -> close marker)
-- KEYS[4+2i], KEYS[5+2i] (i = 1..n)  st:tokens:{id} (version 1), st:tokens:{ref}
--                                     (the version-1 key again when the step has no ref)
-- ARGV[1]  "1>2";  ARGV[2]  n
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2]  action, request id (the version-1 field), {ref} or ''
-- Checks every step first and writes nothing if one does not fit; then runs them in order.
-- Returns {moved, closed_moved, unplaced, closed_unplaced, closed_dropped}.
local n = tonumber(ARGV[2])

local function kind(key)
  local t = redis.call('TYPE', key)
  if type(t) == 'table' then return t['ok'] end
  return t
end

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('streamtally migrate: ' .. KEYS[1] .. ' is not ' .. ARGV[1] ..
                           ' any more (another migration finished or was undone?)')
end
for _, k in ipairs({KEYS[2], KEYS[4], KEYS[5]}) do
  local t = kind(k)
  if t ~= 'none' and t ~= 'hash' then
    return redis.error_reply('streamtally migrate: ' .. k .. ' is a ' .. t .. ', not a hash')
  end
end
local moved_type = kind(KEYS[3])
if moved_type ~= 'none' and moved_type ~= 'set' then
  return redis.error_reply('streamtally migrate: ' .. KEYS[3] .. ' is a ' .. moved_type ..
                           ', not a set')
end

-- 1. check every step against what Redis holds after the steps before it
local gone, made, fgone, fmade, unplaced = {}, {}, {}, {}, {}
local function key_exists(k)
  if made[k] then return true end
  if gone[k] then return false end
  return redis.call('EXISTS', k) == 1
end
local function field_exists(f)
  if fmade[f] then return true end
  if fgone[f] then return false end
  return redis.call('HEXISTS', KEYS[2], f) == 1
end
local function is_tokens(k)
  if gone[k] then return false end
  return kind(k) == 'string'
end
local function take_key(old, new)
  gone[old] = true; made[old] = nil
  if new then made[new] = true; gone[new] = nil end
end
local function take_field(old, new)
  fgone[old] = true; fmade[old] = nil
  if new then fmade[new] = true; fgone[new] = nil end
end

local function check(i)
  local action, id, ref = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local old, new = KEYS[4 + 2 * i], KEYS[5 + 2 * i]
  if action == 'move' then
    if not is_tokens(old) then return old .. ' is no longer a Tokens string' end
    if key_exists(new) then return new .. ' exists already' end
    take_key(old, new)
    if field_exists(id) then
      if field_exists(ref) then return KEYS[2] .. ' field ' .. ref .. ' exists already' end
      take_field(id, ref)
    end
  elseif action == 'move-closed' then
    if key_exists(old) then return old .. ' appeared (a close marker alone was planned)' end
    if not field_exists(id) then return KEYS[2] .. ' field ' .. id .. ' is gone' end
    if field_exists(ref) then return KEYS[2] .. ' field ' .. ref .. ' exists already' end
    take_field(id, ref)
  elseif action == 'unplace' then
    if not is_tokens(old) then return old .. ' is no longer a Tokens string' end
    if unplaced[id] or redis.call('HEXISTS', KEYS[4], id) == 1 then
      return KEYS[4] .. ' holds ' .. id .. ' already'
    end
    take_key(old, nil)
    unplaced[id] = true
    if field_exists(id) then
      if redis.call('HEXISTS', KEYS[5], id) == 1 then
        return KEYS[5] .. ' holds ' .. id .. ' already'
      end
      take_field(id, nil)
    end
  elseif action == 'drop-closed' then
    if key_exists(old) then return old .. ' appeared (a close marker alone was planned)' end
    if not field_exists(id) then return KEYS[2] .. ' field ' .. id .. ' is gone' end
    take_field(id, nil)
  else
    return 'unknown action ' .. action
  end
  return nil
end

for i = 1, n do
  local problem = check(i)
  if problem then
    return redis.error_reply('streamtally migrate: ' .. problem ..
                             ' (Redis changed since it was scanned)')
  end
end

-- 2. apply, in order
local counts = {0, 0, 0, 0, 0}
for i = 1, n do
  local action, id, ref = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local old, new = KEYS[4 + 2 * i], KEYS[5 + 2 * i]
  local marker = redis.call('HGET', KEYS[2], id)
  if action == 'move' or action == 'move-closed' then
    if action == 'move' then
      redis.call('RENAME', old, new)
      counts[1] = counts[1] + 1
    end
    if marker then
      redis.call('HSET', KEYS[2], ref, marker)
      redis.call('HDEL', KEYS[2], id)
      counts[2] = counts[2] + 1
    end
    redis.call('SADD', KEYS[3], ref)
  elseif action == 'unplace' then
    redis.call('HSET', KEYS[4], id, redis.call('GET', old))
    redis.call('DEL', old)
    counts[3] = counts[3] + 1
    if marker then
      redis.call('HSET', KEYS[5], id, marker)
      redis.call('HDEL', KEYS[2], id)
      counts[4] = counts[4] + 1
    end
  else
    redis.call('HDEL', KEYS[2], id)
    counts[5] = counts[5] + 1
  end
end
return counts
"""

FINISH_SCRIPT: Final = """
-- KEYS[1] st:layout, KEYS[2] st:migrate:moved;  ARGV[1] "1>2", ARGV[2] "2"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('streamtally migrate: ' .. KEYS[1] .. ' is not ' .. ARGV[1] ..
                           ' any more (another migration finished or was undone?)')
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2])
return 1
"""
