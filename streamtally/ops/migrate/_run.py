"""The whole migration, stage by stage: `migrate` and the `Report` of what it did.

The stages and why they are safe to interrupt are in the package docstring
(`streamtally.ops.migrate`); `streamtally migrate` (`streamtally.cli.migrate`)
prints the `Report`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import redis.asyncio as aioredis

from streamtally.connection import KafkaConnection
from streamtally.errors import MigrateError, StackError
from streamtally.ops.migrate._billing import Billing, read_billing
from streamtally.ops.migrate._plan import Counts, Plan, plan
from streamtally.ops.migrate._redis import BATCH_SIZE, UNPLACED_KEY, apply, begin, finish, scan
from streamtally.store import LAYOUT_KEY, RedisStore
from streamtally.store.layout_v2 import MIGRATING_FROM_1 as MIGRATING
from streamtally.store.layout_v2 import VERSION as LAYOUT_VERSION


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
    servers: KafkaConnection | str,
    billing_topic: str,
    *,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
    progress_every: int = 1000,
    notify: Callable[[str], None] | None = None,
) -> Report:
    """Migrate the Redis of `client` to layout version 2 (the package docstring says how).

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
