"""`streamtally migrate`: move a Redis written before layout version 2 to version 2.

The logic (read the billing topic, plan, move atomically and resumably) is
`streamtally.ops.migrate`, whose docstring says what moves where and why.
This command picks Kafka, Redis and the billing topic as ``streamtally
rebuild`` does, reports progress on stderr and prints a summary (text, or
one JSON object with ``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import redis.asyncio as aioredis

from streamtally.cli._args import add_kafka_to_read, kafka_of, positive
from streamtally.cli._output import escape, json_text, say, write_stdout
from streamtally.cli.tokens import add_redis_url, run_redis
from streamtally.errors import MigrateError, ShardMigrateError
from streamtally.ops import migrate
from streamtally.ops.migrate import shards as migrate_shards
from streamtally.settings import Settings
from streamtally.store import LAYOUT_KEY, LAYOUT_VERSION, MIGRATING, RedisStore
from streamtally.store.layout_v2 import CLOSED_KEY, MIGRATING_FROM_1, tokens_pattern
from streamtally.store.layout_v2 import VERSION as LAYOUT_2
from streamtally.topics import Topics

__all__ = ["add_parser"]

T = TypeVar("T")

#: Unplaced requests and dropped markers the text summary lists one by one (--json lists all).
SHOWN: Final = 20

_EPILOG = f"""\
Two steps, each run when the data is older than it.
1. layout 1 to 2: layout 1 (before streamtally's layout 2) keyed a request by
its request id alone; layout 2 keys it by tenant and request id. The tenants
come from the billing topic, read to its end.
migrated: every {tokens_pattern()} key of layout 1 is renamed to its
         tenant's key, its {CLOSED_KEY} field moved with it (same marker), when
         the billing topic names exactly one tenant for its id; a close
         marker without Tokens likewise.
unplaced: Tokens of an id with no billing event or several tenants move to
         the hash {migrate.UNPLACED_KEY} (id -> Tokens JSON), their markers to
         {migrate.UNPLACED_CLOSED_KEY}: resolve them by hand. A close marker
         without Tokens and without a single tenant is dropped (its outputs
         were never billed; the worker decides again).
unchanged: the usage rows, st:usage:rows, st:stats, st:deadletter:seen.
2. layout 2 to 3: every key moves into one of 16 shards, each under its own
Redis Cluster hash tag (see streamtally/store/layout.py); Tokens, close markers
and dead-letter marks get the state TTL ($STREAMTALLY_STATE_TTL seconds).
Stop every worker first. {LAYOUT_KEY} is "{MIGRATING_FROM_1}" or "{MIGRATING}"
while a step runs (workers refuse to start) and "{LAYOUT_VERSION}" at the end.
Each batch moves atomically; an interrupted run is resumed by running the
command again.
exit status: 0 migrated, nothing to do, or planned (--dry-run); 1 refused
             (an unknown layout version, or Redis changed during the
             migration: a worker still running?); 2 Kafka or Redis
             unreachable, the billing topic missing or a bad argument
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help=f"move Redis data of an older layout (1 or 2) to layout {LAYOUT_VERSION}",
        description=(
            "Move the Tokens keys and close markers a streamtally before layout 2 wrote "
            "(keyed by request id alone) to their tenant's keys, taking each request's "
            "tenant from the billing topic; then move layout 2 into the 16 shards of "
            f"layout {LAYOUT_VERSION}, and mark Redis as layout {LAYOUT_VERSION}."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="read and plan, print what would move, write nothing",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--batch-size",
        type=positive,
        default=migrate.BATCH_SIZE,
        metavar="N",
        help=f"request ids per atomic Redis script call (default: {migrate.BATCH_SIZE})",
    )
    parser.add_argument(
        "--progress-every",
        type=positive,
        default=10000,
        metavar="N",
        help="report progress on stderr every N request ids (default: 10000)",
    )
    add_kafka_to_read(parser)
    add_redis_url(parser)
    parser.set_defaults(func=run)


def _say(text: str) -> None:
    say(f"streamtally migrate: {text}")


def _with_client(url: str, work: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    """`run_redis` (its URL check and error messages), with a plain client of `url`."""

    async def main(store: RedisStore) -> T:
        del store  # never connects: the migration needs SCAN and its own scripts
        client = aioredis.from_url(url, socket_connect_timeout=5, socket_timeout=60)
        try:
            return await work(client)
        finally:
            await client.aclose()

    return run_redis(url, main)


def run(args: argparse.Namespace, settings: Settings) -> int:
    # aiokafka logs every failed connection attempt; the error raised says it in one line.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    url: str = args.redis_url or settings.redis_url
    topic = Topics.in_namespace(settings.namespace).billing.name
    dry_run: bool = args.dry_run
    batch_size: int = args.batch_size
    every: int = args.progress_every

    def progress(done: int, total: int) -> None:
        _say(f"{done}/{total} request ids migrated")

    async def layout_of(client: aioredis.Redis) -> str | None:
        return await RedisStore(client).layout_version()

    if settings.redis_cluster:
        # Layouts 1 and 2 touch several hash slots per script: no Redis Cluster holds them.
        before = run_redis(url, lambda store: store.layout_version(), cluster=True)
        if before not in (None, LAYOUT_VERSION):
            _say(
                f"the Redis Cluster at {url} holds layout {before!r}: only layout 3 runs on a "
                "cluster, and migrate moves one Redis's data: migrate it there, then copy it"
            )
            return 1
        if args.json:
            write_stdout(json_text(_summary_json(None, None, before, dry_run)) + "\n")
        return 0
    before = _with_client(url, layout_of)
    report: migrate.Report | None = None
    try:
        if before not in (LAYOUT_2, MIGRATING, LAYOUT_VERSION):
            report = _with_client(
                url,
                lambda client: migrate.migrate(
                    client,
                    servers,
                    topic,
                    dry_run=dry_run,
                    batch_size=batch_size,
                    progress=progress,
                    progress_every=every,
                    notify=_say,
                ),
            )
        shards: migrate_shards.ShardMoves | None = None
        if before != LAYOUT_VERSION and not (dry_run and report is not None):
            shards = _with_client(
                url,
                lambda client: migrate_shards.migrate_shards(
                    client,
                    ttl_s=settings.state_ttl,
                    dry_run=dry_run,
                    batch_size=batch_size,
                    notify=_say,
                ),
            )
    except (MigrateError, ShardMigrateError) as exc:
        _say(str(exc))
        return 1
    if args.json:
        write_stdout(json_text(_summary_json(report, shards, before, dry_run)) + "\n")
    else:
        if report is not None:
            write_stdout(_summary_text(report, dry_run))
        write_stdout(_shards_text(shards, before, dry_run))
    return 0


def _shards_text(
    shards: migrate_shards.ShardMoves | None, before: str | None, dry_run: bool
) -> str:
    if before == LAYOUT_VERSION:
        return f"Redis is of layout {LAYOUT_VERSION} already: nothing to migrate\n"
    if shards is None:
        return f"then layout {LAYOUT_2} to {LAYOUT_VERSION} (planned once layout {LAYOUT_2} is)\n"
    would = "would be " if dry_run else ""
    return (
        f"layout {LAYOUT_2} to {LAYOUT_VERSION}: {shards.tokens} Tokens, {shards.closed} close "
        f"markers, {shards.rows} usage rows and {shards.dead_letters} dead-letter marks "
        f"{would}moved into the shards\n"
    )


def _summary_json(
    report: migrate.Report | None,
    shards: migrate_shards.ShardMoves | None,
    before: str | None,
    dry_run: bool,
) -> dict[str, Any]:
    moved = None if shards is None else dataclasses.asdict(shards)
    out: dict[str, Any] = {
        "dry_run": dry_run,
        "layout_before": before,
        "layout": before if dry_run else LAYOUT_VERSION,
        "shards": moved,
    }
    if report is None:
        if shards is None:
            out["outcome"] = migrate.Outcome.UP_TO_DATE.value
        else:  # a dry run plans the move, the real run makes it
            planned = migrate.Outcome.PLANNED if dry_run else migrate.Outcome.MIGRATED
            out["outcome"] = planned.value
        return out
    return _layout_1_json(report) | out


def _layout_1_json(report: migrate.Report) -> dict[str, Any]:
    counts = report.counts
    billing = report.billing
    unplaced = report.plan.of(migrate.Action.UNPLACE)
    dropped = report.plan.of(migrate.Action.DROP_CLOSED)
    return {
        "outcome": report.outcome.value,
        "billing_events": billing.events if billing else 0,
        "billing_undecodable": billing.undecodable if billing else 0,
        "billing_request_ids": len(billing) if billing else 0,
        "moved_before": report.plan.already_moved,
        "moved": counts.moved,
        "closed_moved": counts.closed_moved,
        "unplaced": counts.unplaced,
        "closed_unplaced": counts.closed_unplaced,
        "closed_dropped": counts.closed_dropped,
        "unplaced_total": report.unplaced_total,
        "unplaced_key": migrate.UNPLACED_KEY,
        "unplaced_closed_key": migrate.UNPLACED_CLOSED_KEY,
        "unplaced_requests": [_step_json(s) for s in unplaced],
        "dropped_closed": [_step_json(s) for s in dropped],
    }


def _step_json(step: migrate.Step) -> dict[str, Any]:
    return {"request_id": step.request_id, "reason": step.reason, "tenants": list(step.tenants)}


def _listed(steps: list[migrate.Step], what: str) -> str:
    out = ""
    for reason, n in Counter(s.reason for s in steps).most_common():
        out += f"  {n:>6}  {reason}\n"
    for step in steps[:SHOWN]:
        tenants = f" ({', '.join(step.tenants)})" if step.tenants else ""
        out += escape(f"  {what} {step.request_id}: {step.reason}{tenants}") + "\n"
    if len(steps) > SHOWN:
        out += f"  ... and {len(steps) - SHOWN} more (--json lists all)\n"
    return out


def _summary_text(report: migrate.Report, dry_run: bool) -> str:
    if report.outcome is migrate.Outcome.UP_TO_DATE:
        return ""
    if report.outcome is migrate.Outcome.EMPTY:
        return "Redis holds no streamtally data of layout 1\n"
    counts = report.counts
    plan = report.plan
    would = "would be " if dry_run else ""
    head = (
        f"dry run, nothing written: layout 1 to {LAYOUT_2}"
        if dry_run
        else f"migrated to layout {LAYOUT_2}"
    )
    out = (
        f"{head}: {counts.moved} requests {would}moved to their tenant's keys, "
        f"{counts.closed_moved} close markers {would}moved"
    )
    if plan.already_moved:
        out += f" ({plan.already_moved} requests moved by an earlier run)"
    out += "\n"
    unplaced = plan.of(migrate.Action.UNPLACE)
    if unplaced:
        out += (
            f"{counts.unplaced} requests could not be placed: their Tokens {would}moved to "
            f"{migrate.UNPLACED_KEY}"
            + (
                f", {counts.closed_unplaced} close markers to {migrate.UNPLACED_CLOSED_KEY}"
                if counts.closed_unplaced
                else ""
            )
            + "\n"
        )
        out += _listed(unplaced, "unplaced")
    if report.unplaced_total > counts.unplaced:
        out += (
            f"{migrate.UNPLACED_KEY} {'would hold' if dry_run else 'holds'} "
            f"{report.unplaced_total} unplaced requests in all (earlier runs' included)\n"
        )
    dropped = plan.of(migrate.Action.DROP_CLOSED)
    if dropped:
        out += (
            f"{counts.closed_dropped} close markers without Tokens {would}dropped (no single "
            "tenant: never billed, the worker decides again)\n"
        )
        out += _listed(dropped, "dropped")
    if report.billing is not None and report.billing.undecodable:
        out += (
            f"{report.billing.undecodable} billing records did not decode: their requests "
            "count as without billing event\n"
        )
    return out
