"""Moving a Redis of layout version 1 to version 2: what ``streamtally migrate`` does.

Version 1 (streamtally before layout 2) keyed a request by its provider
request id alone: ``st:tokens:{request_id}`` and `st:closed` fields
``{request_id}``, one tenant per id.  Version 2 keys it by tenant and request
id (`RequestRef`, see `streamtally.store.layout`): ``st:tokens:{ref}`` and
fields ``{ref}``.  The usage rows, ``st:usage:rows``, ``st:stats`` and
``st:deadletter:seen`` are the same in both versions and are not touched.

The tenant of a version-1 request is not in Redis (its Tokens JSON holds the
request id, not the tenant).  The billing topic has it: every billed request's
`BillingEvent` carries its tenant and request id, kept forever.  So `migrate`:

1. marks Redis as migrating (``st:layout`` = ``"1>2"``, `MIGRATING`): from then
   on workers refuse to start and the store's write scripts refuse to write,
   until the migration ends;
2. reads the billing topic to its end (`read_billing`): request id -> tenants;
3. lists what is still of version 1 (`scan`): the Tokens keys and the
   `st:closed` fields, less those moved by an earlier, interrupted run;
4. plans one `Step` per version-1 request id (`plan`, a pure function);
5. applies the steps, `BATCH_SIZE` per atomic script call (`apply`,
   `MIGRATE_SCRIPT`): each call checks every step first and writes nothing
   when one no longer fits what Redis holds;
6. scans again (nothing of version 1 may be left: a worker of a version before
   2 still running would write some), then sets ``st:layout`` to ``"2"`` and
   deletes `MOVED_KEY`, in one atomic step (`finish`).

The steps (`Action`):

``move``
    A Tokens key whose id the billing topic knows for exactly one tenant:
    RENAMEd to the request's version-2 key; its close marker, if any, moves
    to the field of its `RequestRef`, unchanged.
``move-closed``
    A close marker without Tokens (the close was decided, the request never
    applied: the worker stopped in between) of an id billed to one tenant:
    moved to the field of its `RequestRef`, so that the worker, re-reading
    the request's records, closes it at the same offset for the same reason.
``unplace``
    A Tokens key whose id has no billing event (the billing topic lost it, or
    the request was caught mid-flush) or several tenants (version 1 could not
    tell them apart): it cannot be placed, so it moves out of the Tokens keys
    into the hash `UNPLACED_KEY` (field: the request id, value: the Tokens
    JSON), its close marker into `UNPLACED_CLOSED_KEY`.  Such a request is no
    longer marked as counted (its usage stays in the usage rows): should the
    worker read its raw records again, it would count it again.  Resolve each
    by hand (its tenant known: SET its version-2 key to the JSON, HSET its
    close marker), then HDEL it.
``drop-closed``
    A close marker without Tokens whose id has no single tenant: deleted.  No
    billing event means its outputs were never sent; the worker decides again
    when it re-reads the request's records.

Resumable: every step of a batch, and the record of what it moved, is written
in one script call.  A moved request's ``{ref}`` text is added to the set
`MOVED_KEY` in the same call, so a rerun does not mistake the moved key
``st:tokens:acme:r1`` for the version-1 key of a request id ``acme:r1``; the
set is deleted when ``st:layout`` becomes ``"2"``.  An interrupted run (killed,
Kafka or Redis gone) leaves ``st:layout`` at ``"1>2"``: run it again.

Order: a version-2 name is ``{tenant}:{id}``, longer than the id, and may be
the name of another version-1 request (ids may hold ``:``: request ``r1`` of
tenant ``acme`` and request ``acme:r1`` of another tenant).  Steps run longest
id first, so such a name is always moved out of the way before it is needed;
the script refuses to overwrite anything.

Stop every worker first: one of version 2 refuses to start while this runs,
but a worker of a version before 2 does not know ``st:layout`` and would keep
writing version-1 keys (the final scan finds them and the migration stops).
Run one migration at a time.  Both the billing map and the list of version-1
entries are held in memory.  A single Redis, not Redis Cluster (the script's
keys span hash slots).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from streamtally.core.identity import RequestRef
from streamtally.errors import StackError, StreamtallyError
from streamtally.store import (
    CLOSED_KEY,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    TOKENS_PREFIX,
    RedisStore,
    closed_field,
    tokens_key,
    tokens_pattern,
)
from streamtally.store.layout import PREFIX
from streamtally.store.rows import reply_text
from streamtally.wire.avro import decode_billing_event
from streamtally.wire.kafka import read_decoded

__all__ = [
    "BATCH_SIZE",
    "FINISH_SCRIPT",
    "MIGRATE_SCRIPT",
    "MOVED_KEY",
    "UNPLACED_CLOSED_KEY",
    "UNPLACED_KEY",
    "Action",
    "Billing",
    "Counts",
    "Entries",
    "MigrateError",
    "Outcome",
    "Plan",
    "Report",
    "Step",
    "apply",
    "apply_batch",
    "begin",
    "finish",
    "migrate",
    "plan",
    "read_billing",
    "scan",
]

#: Set of the `RequestRef.text` of every request moved so far (deleted by `finish`).
MOVED_KEY: Final = f"{PREFIX}migrate:moved"
#: Hash request id -> Tokens JSON of the version-1 requests that could not be placed.
UNPLACED_KEY: Final = f"{PREFIX}migrate:unplaced"
#: Hash request id -> close marker ("offset reason") of those requests.
UNPLACED_CLOSED_KEY: Final = f"{PREFIX}migrate:unplaced:closed"
#: Steps per script call (each call is atomic and blocks Redis while it runs).
BATCH_SIZE: Final = 500


class MigrateError(StreamtallyError):
    """The migration refuses to go on: another layout, or Redis changed under it."""


class Action(StrEnum):
    """What a `Step` does with one version-1 request id."""

    MOVE = "move"
    MOVE_CLOSED = "move-closed"
    UNPLACE = "unplace"
    DROP_CLOSED = "drop-closed"


@dataclass(frozen=True, slots=True)
class Step:
    """One version-1 request id and what becomes of its Tokens key and close marker."""

    action: Action
    request_id: str
    #: The tenant it is placed under (`MOVE`, `MOVE_CLOSED`); None otherwise.
    tenant: str | None
    #: Whether a close marker (a `CLOSED_KEY` field) of the id goes along.
    closed: bool
    #: Every tenant the billing topic names for the id, sorted (none, one or several).
    tenants: tuple[str, ...] = ()

    @property
    def ref(self) -> RequestRef | None:
        """The version-2 identity the id moves to; None when it cannot be placed."""
        return None if self.tenant is None else RequestRef(self.tenant, self.request_id)

    @property
    def reason(self) -> str:
        """Why an id was not placed ("" when it was)."""
        if self.tenant is not None:
            return ""
        if not self.tenants:
            return "no billing event"
        return f"billed to {len(self.tenants)} tenants"


@dataclass(frozen=True, slots=True)
class Counts:
    """How many of each: planned (`Plan.counts`) or done (`apply`)."""

    #: Tokens keys renamed to their version-2 key.
    moved: int = 0
    #: Close markers moved to their version-2 field (with their Tokens or alone).
    closed_moved: int = 0
    #: Tokens moved to `UNPLACED_KEY`.
    unplaced: int = 0
    #: Close markers moved to `UNPLACED_CLOSED_KEY`.
    closed_unplaced: int = 0
    #: Close markers without Tokens and without a single tenant, deleted.
    closed_dropped: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.moved + other.moved,
            self.closed_moved + other.closed_moved,
            self.unplaced + other.unplaced,
            self.closed_unplaced + other.closed_unplaced,
            self.closed_dropped + other.closed_dropped,
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps, in the order they must run (longest request id first)."""

    steps: tuple[Step, ...] = ()
    #: Requests an earlier, interrupted run moved already (members of `MOVED_KEY`).
    already_moved: int = 0

    def of(self, *actions: Action) -> list[Step]:
        """The steps doing one of `actions`, in order."""
        return [s for s in self.steps if s.action in actions]

    @property
    def counts(self) -> Counts:
        """What the steps will do."""
        moves = self.of(Action.MOVE)
        unplaced = self.of(Action.UNPLACE)
        return Counts(
            moved=len(moves),
            closed_moved=sum(s.closed for s in moves) + len(self.of(Action.MOVE_CLOSED)),
            unplaced=len(unplaced),
            closed_unplaced=sum(s.closed for s in unplaced),
            closed_dropped=len(self.of(Action.DROP_CLOSED)),
        )


def _order(request_id: str) -> tuple[int, str]:
    return -len(request_id), request_id


def plan(
    tokens: Iterable[str],
    closed: Iterable[str],
    billing: Mapping[str, Collection[str]],
    moved: AbstractSet[str] = frozenset(),
) -> Plan:
    """The steps moving version-1 entries to version 2.

    `tokens`: what follows ``st:tokens:`` in each Tokens key; `closed`: each
    field of `CLOSED_KEY` (repeats are fine, SCAN may repeat); `billing`:
    request id -> the tenants the billing topic names for it; `moved`: the
    members of `MOVED_KEY`, whose keys and fields are version 2 already and
    are left alone.  Every other key or field is a version-1 request id; an id
    with exactly one tenant is placed under it, the others are unplaced
    (Tokens) or dropped (a close marker alone).  Steps are ordered longest
    id first, then by id (see the module docstring: a version-2 name is
    longer than its id, so a version-1 entry of that name moves first).
    """
    with_tokens = {text for text in tokens if text not in moved}
    with_closed = {text for text in closed if text not in moved}
    steps = []
    for request_id in sorted(with_tokens | with_closed, key=_order):
        tenants = tuple(sorted(billing.get(request_id, ())))
        tenant = tenants[0] if len(tenants) == 1 else None
        if request_id in with_tokens:
            action = Action.MOVE if tenant is not None else Action.UNPLACE
        else:
            action = Action.MOVE_CLOSED if tenant is not None else Action.DROP_CLOSED
        steps.append(Step(action, request_id, tenant, request_id in with_closed, tenants))
    return Plan(tuple(steps), already_moved=len(moved))


# --------------------------------------------------------------------------- Kafka


@dataclass(slots=True)
class Billing(Mapping[str, tuple[str, ...]]):
    """Request id -> the tenants the billing topic names for it, as read by `read_billing`.

    Kept lean: one tenant per id (the usual case) is a plain string.
    """

    #: Billing records read and decoded.
    events: int = 0
    #: Billing records that did not decode (or were tombstones): their ids are unknown.
    undecodable: int = 0
    _one: dict[str, str] = field(default_factory=dict)
    _several: dict[str, set[str]] = field(default_factory=dict)

    def add(self, request_id: str, tenant: str) -> None:
        """Record that `request_id` was billed to `tenant`."""
        several = self._several.get(request_id)
        if several is not None:
            several.add(tenant)
            return
        known = self._one.setdefault(request_id, tenant)
        if known != tenant:
            del self._one[request_id]
            self._several[request_id] = {known, tenant}

    def __getitem__(self, request_id: str) -> tuple[str, ...]:
        one = self._one.get(request_id)
        if one is not None:
            return (one,)
        return tuple(sorted(self._several[request_id]))

    def __iter__(self) -> Iterator[str]:
        yield from self._one
        yield from self._several

    def __len__(self) -> int:
        return len(self._one) + len(self._several)


async def read_billing(servers: str, topic: str) -> Billing:
    """The tenants of every request id on the billing `topic`, from its beginning to its end.

    Raises `StackError` when Kafka cannot be reached or the topic is missing.
    """
    billing = Billing()
    bad: list[tuple[int, int, str]] = []
    reading = read_decoded(servers, topic, decode_billing_event, bad)
    async with contextlib.aclosing(reading) as events:
        async for event in events:
            billing.events += 1
            billing.add(event.request_id, event.tenant)
    billing.undecodable = len(bad)
    return billing


# --------------------------------------------------------------------------- Redis

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


@dataclass(frozen=True, slots=True)
class Entries:
    """What Redis holds of requests while (or before) it is migrated, as `scan` found it."""

    #: What follows ``st:tokens:`` in every Tokens key.
    tokens: frozenset[str]
    #: Every field of `CLOSED_KEY`.
    closed: frozenset[str]
    #: The members of `MOVED_KEY` (requests moved already).
    moved: frozenset[str]


async def scan(client: aioredis.Redis) -> Entries:
    """Every Tokens key, close marker field and moved request (SCAN, HSCAN, SSCAN)."""
    tokens = set()
    async for key in client.scan_iter(match=tokens_pattern(), count=1000):
        tokens.add(reply_text(key)[len(TOKENS_PREFIX) :])
    closed = set()
    async for name, _ in client.hscan_iter(CLOSED_KEY, count=1000):
        closed.add(reply_text(name))
    moved = set()
    async for member in client.sscan_iter(MOVED_KEY, count=1000):
        moved.add(reply_text(member))
    return Entries(frozenset(tokens), frozenset(closed), frozenset(moved))


def _v1_tokens_key(request_id: str) -> str:
    return f"{TOKENS_PREFIX}{request_id}"


async def begin(client: aioredis.Redis) -> str | None:
    """Mark a Redis of layout version 1 as migrating; returns the version found before.

    Sets ``st:layout`` to `MIGRATING` only when it is not set (SET NX);
    returns None when this call set it, else what it holds (`MIGRATING`: an
    earlier run was interrupted; anything else: nothing was written).
    """
    if await client.set(LAYOUT_KEY, MIGRATING, nx=True):
        return None
    return await RedisStore(client).layout_version()


async def apply_batch(client: aioredis.Redis, steps: Sequence[Step]) -> Counts:
    """Run `steps` in one atomic script call (`MIGRATE_SCRIPT`); what it did.

    Raises `MigrateError`, having written nothing, when ``st:layout`` is not
    `MIGRATING` or a step no longer fits what Redis holds.
    """
    if not steps:
        return Counts()
    keys = [LAYOUT_KEY, CLOSED_KEY, MOVED_KEY, UNPLACED_KEY, UNPLACED_CLOSED_KEY]
    args = [MIGRATING, str(len(steps))]
    for step in steps:
        ref = step.ref
        old = _v1_tokens_key(step.request_id)
        keys += [old, old if ref is None else tokens_key(ref)]
        args += [step.action.value, step.request_id, "" if ref is None else closed_field(ref)]
    script = client.register_script(MIGRATE_SCRIPT)
    try:
        reply = await script(keys=keys, args=args)
    except ResponseError as exc:
        if "streamtally migrate:" in str(exc):
            raise MigrateError(
                f"{exc}; nothing of that batch was written ({LAYOUT_KEY} stays {MIGRATING!r}: "
                "run `streamtally migrate` again to plan anew)"
            ) from exc
        raise
    moved, closed_moved, unplaced, closed_unplaced, dropped = (int(n) for n in reply)
    return Counts(moved, closed_moved, unplaced, closed_unplaced, dropped)


async def apply(
    client: aioredis.Redis,
    steps: Sequence[Step],
    *,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
    progress_every: int = 1000,
) -> Counts:
    """Run `steps` in order, `batch_size` per script call (`apply_batch`); what they did.

    `progress(done, total)` is called after the call that crosses each
    multiple of `progress_every` steps, and after the last one.
    """
    if batch_size < 1 or progress_every < 1:
        raise ValueError("batch_size and progress_every must be >= 1")
    total = len(steps)
    done = Counts()
    for start in range(0, total, batch_size):
        done += await apply_batch(client, steps[start : start + batch_size])
        end = min(start + batch_size, total)
        if progress is not None and (
            end // progress_every > start // progress_every or end == total
        ):
            progress(end, total)
    return done


async def finish(client: aioredis.Redis) -> None:
    """Set ``st:layout`` to ``"2"`` and delete `MOVED_KEY`, atomically (`MigrateError`:
    ``st:layout`` was not `MIGRATING`, nothing written)."""
    script = client.register_script(FINISH_SCRIPT)
    try:
        await script(keys=[LAYOUT_KEY, MOVED_KEY], args=[MIGRATING, LAYOUT_VERSION])
    except ResponseError as exc:
        if "streamtally migrate:" in str(exc):
            raise MigrateError(str(exc)) from exc
        raise


# --------------------------------------------------------------------------- the whole migration


class Outcome(StrEnum):
    """How a `migrate` call ended."""

    #: ``st:layout`` was ``"2"`` already: nothing done.
    UP_TO_DATE = "up to date"
    #: Redis held no streamtally data: layout 2 claimed (not by a dry run), nothing moved.
    EMPTY = "empty"
    #: Version-1 data moved to version 2 and ``st:layout`` set to ``"2"``.
    MIGRATED = "migrated"
    #: ``--dry-run``: planned, nothing written.
    PLANNED = "planned"


@dataclass(frozen=True, slots=True)
class Report:
    """What `migrate` found and did (`counts`: done; planned for a dry run)."""

    outcome: Outcome
    #: ``st:layout`` before the call: None (version 1, or empty), `MIGRATING` (resumed), "2".
    layout_before: str | None
    billing: Billing | None = None
    plan: Plan = field(default_factory=Plan)
    counts: Counts = field(default_factory=Counts)
    #: Requests `UNPLACED_KEY` holds at the end (this run's and earlier runs'; a dry
    #: run: what it would hold).
    unplaced_total: int = 0


async def migrate(
    client: aioredis.Redis,
    servers: str,
    billing_topic: str,
    *,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
    progress_every: int = 1000,
    notify: Callable[[str], None] | None = None,
) -> Report:
    """Migrate the Redis of `client` to layout version 2 (the module docstring says how).

    `servers` and `billing_topic` are the Kafka to read the tenants from;
    `notify` gets a line for people at each stage, `progress` as in `apply`.
    A `dry_run` reads and plans, and writes nothing (not even ``st:layout``).

    Raises `MigrateError` for a layout it does not know, or when Redis changed
    under the migration (``st:layout`` then stays `MIGRATING`); `StackError`
    when Kafka cannot be reached or the billing topic is missing; a Redis
    error as redis-py raises it.
    """
    say = notify if notify is not None else (lambda _: None)
    store = RedisStore(client)
    before = await store.layout_version()
    if before is None and not await store.holds_data():
        # Nothing to migrate: claim version 2, as a starting worker would.
        if dry_run or await client.set(LAYOUT_KEY, LAYOUT_VERSION, nx=True):
            return Report(Outcome.EMPTY, None)
        before = await store.layout_version()  # somebody set it meanwhile
    if before == LAYOUT_VERSION:
        return Report(Outcome.UP_TO_DATE, before)
    if before not in (None, MIGRATING):
        raise MigrateError(
            f"Redis holds layout version {before!r}; this streamtally migrates version 1 "
            f"(no {LAYOUT_KEY}) to {LAYOUT_VERSION} (a newer streamtally wrote it?)"
        )
    if not dry_run:
        found = await begin(client)
        if found not in (None, MIGRATING):
            raise MigrateError(f"{LAYOUT_KEY} changed to {found!r} meanwhile; nothing was moved")
        say(
            f"{LAYOUT_KEY} is {MIGRATING!r}"
            + (" (resuming an interrupted migration)" if before == MIGRATING else "")
            + ": workers refuse to start until the migration ends"
        )
    try:
        billing = await read_billing(servers, billing_topic)
    except StackError as exc:
        if dry_run:
            raise
        raise StackError(
            f"{exc} ({LAYOUT_KEY} stays {MIGRATING!r}: run `streamtally migrate` again once "
            "the billing topic can be read)"
        ) from exc
    say(
        f"read {billing.events} billing events of {len(billing)} request ids from "
        f"{billing_topic}"
        + (f" ({billing.undecodable} did not decode)" if billing.undecodable else "")
    )
    entries = await scan(client)
    steps = plan(entries.tokens, entries.closed, billing, entries.moved)
    say(
        f"{len(steps.steps)} request ids of layout 1 to migrate"
        + (f" ({steps.already_moved} moved by an earlier run)" if steps.already_moved else "")
    )
    if dry_run:
        held = int(await client.hlen(UNPLACED_KEY)) + steps.counts.unplaced
        return Report(Outcome.PLANNED, before, billing, steps, steps.counts, held)
    counts = await apply(
        client, steps.steps, batch_size=batch_size, progress=progress, progress_every=progress_every
    )
    again = await scan(client)
    left = plan(again.tokens, again.closed, billing, again.moved).steps
    if left:
        raise MigrateError(
            f"{len(left)} entries of layout 1 appeared while migrating (first: "
            f"{left[0].request_id!r}): is a worker of a version before 2 still running? Stop "
            f"it and run `streamtally migrate` again ({LAYOUT_KEY} stays {MIGRATING!r})"
        )
    await finish(client)
    held = int(await client.hlen(UNPLACED_KEY))
    return Report(Outcome.MIGRATED, before, billing, steps, counts, held)
