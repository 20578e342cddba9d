"""The Redis side of a migration: the keys it adds, and scan, begin, apply and finish.

`scan` lists what Redis holds of requests; `begin` marks Redis as migrating;
`apply` runs the steps of a `Plan`, a batch per atomic script call
(`apply_batch`, `MIGRATE_SCRIPT`); `finish` sets layout version 2
(`FINISH_SCRIPT`).  `MigrateError` says Redis changed under the migration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from streamtally.errors import MigrateError
from streamtally.ops.migrate._plan import Counts, Step
from streamtally.ops.migrate._scripts import FINISH_SCRIPT, MIGRATE_SCRIPT
from streamtally.store import LAYOUT_KEY, RedisStore
from streamtally.store.layout import PREFIX
from streamtally.store.layout_v2 import (
    CLOSED_KEY,
    TOKENS_PREFIX,
    closed_field,
    tokens_key,
    tokens_pattern,
)
from streamtally.store.layout_v2 import MIGRATING_FROM_1 as MIGRATING
from streamtally.store.layout_v2 import VERSION as LAYOUT_VERSION
from streamtally.store.rows import reply_text

#: Set of the `RequestRef.text` of every request moved so far (deleted by `finish`).
MOVED_KEY: Final = f"{PREFIX}migrate:moved"
#: Hash request id -> Tokens JSON of the version-1 requests that could not be placed.
UNPLACED_KEY: Final = f"{PREFIX}migrate:unplaced"
#: Hash request id -> close marker ("offset reason") of those requests.
UNPLACED_CLOSED_KEY: Final = f"{PREFIX}migrate:unplaced:closed"
#: Steps per script call (each call is atomic and blocks Redis while it runs).
BATCH_SIZE: Final = 500


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
