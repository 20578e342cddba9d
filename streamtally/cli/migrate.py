"""`streamtally migrate`: move a Redis written before layout version 2 to version 2.

The logic (read the billing topic, plan, move atomically and resumably) is
`streamtally.ops.migrate`, whose docstring says what moves where and why.
This command picks Kafka, Redis and the billing topic as ``streamtally
rebuild`` does, reports progress on stderr and prints a summary (text, or
one JSON object with ``--json``).
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import redis.asyncio as aioredis

from streamtally.cli._args import add_kafka_to_read, positive
from streamtally.cli._output import escape, json_text, say, write_stdout
from streamtally.cli.tokens import add_redis_url, run_redis
from streamtally.ops import migrate
from streamtally.settings import Settings
from streamtally.store import (
    CLOSED_KEY,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    RedisStore,
    tokens_pattern,
)
from streamtally.topics import Topics

__all__ = ["add_parser"]

T = TypeVar("T")

#: Unplaced requests and dropped markers the text summary lists one by one (--json lists all).
SHOWN: Final = 20

_EPILOG = f"""\
layout 1 (before streamtally's layout 2) keyed a request by its request id
alone; layout 2 keys it by tenant and request id. The tenants come from the
billing topic, read to its end.
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
Stop every worker first. {LAYOUT_KEY} is "{MIGRATING}" while it runs (workers
refuse to start) and "{LAYOUT_VERSION}" at the end. Each batch moves atomically; an
interrupted run is resumed by running the command again.
exit status: 0 migrated, nothing to do, or planned (--dry-run); 1 refused
             (an unknown layout version, or Redis changed during the
             migration: a worker still running?); 2 Kafka or Redis
             unreachable, the billing topic missing or a bad argument
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="move Redis data of layout 1 (requests keyed by id alone) to layout 2",
        description=(
            "Move the Tokens keys and close markers a streamtally before layout 2 wrote "
            "(keyed by request id alone) to their tenant's keys, taking each request's "
            "tenant from the billing topic; then mark Redis as layout 2."
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
    servers: str = args.bootstrap_servers or settings.bootstrap_servers
    url: str = args.redis_url or settings.redis_url
    topic = Topics.in_namespace(settings.namespace).billing.name
    dry_run: bool = args.dry_run
    batch_size: int = args.batch_size
    every: int = args.progress_every

    def progress(done: int, total: int) -> None:
        _say(f"{done}/{total} request ids migrated")

    try:
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
    except migrate.MigrateError as exc:
        _say(str(exc))
        return 1
    if args.json:
        write_stdout(json_text(_summary_json(report, dry_run)) + "\n")
    else:
        write_stdout(_summary_text(report, dry_run))
    return 0


def _layout_after(report: migrate.Report, dry_run: bool) -> str | None:
    if dry_run:
        return report.layout_before
    return LAYOUT_VERSION


def _summary_json(report: migrate.Report, dry_run: bool) -> dict[str, Any]:
    counts = report.counts
    billing = report.billing
    unplaced = report.plan.of(migrate.Action.UNPLACE)
    dropped = report.plan.of(migrate.Action.DROP_CLOSED)
    return {
        "outcome": report.outcome.value,
        "dry_run": dry_run,
        "layout_before": report.layout_before,
        "layout": _layout_after(report, dry_run),
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
        return f"Redis is of layout {LAYOUT_VERSION} already: nothing to migrate\n"
    if report.outcome is migrate.Outcome.EMPTY:
        claimed = "" if dry_run else f"; {LAYOUT_KEY} set to {LAYOUT_VERSION}"
        return f"Redis holds no streamtally data: nothing to migrate{claimed}\n"
    counts = report.counts
    plan = report.plan
    would = "would be " if dry_run else ""
    head = (
        f"dry run, nothing written: layout 1 to {LAYOUT_VERSION}"
        if dry_run
        else f"migrated to layout {LAYOUT_VERSION}"
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
