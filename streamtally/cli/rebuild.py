"""`streamtally rebuild`: rebuild lost Redis state from the Tokens and billing topics.

The logic (join, read, apply) is `streamtally.ops.rebuild`, whose docstring says
how requests (tenant and request id) are joined and what is rebuilt and what
is not.  This command checks Redis first: it must be of the layout this
streamtally writes (`RedisStore.ensure_layout`, which claims an empty Redis;
Redis of layout version 1 is refused with how to migrate it, exit 2), and when
it already holds Tokens the command refuses unless ``--yes`` (the requests
there would be left untouched, so going on is safe; the check is against
pointing the command at the wrong Redis).  Skipped requests are listed with
their tenant, when known.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import Counter
from typing import Any, Final

from streamtally.cli._args import add_kafka_to_read, kafka_of, positive
from streamtally.cli._output import escape, json_text, say, write_stdout
from streamtally.cli.tokens import add_redis_url, run_redis
from streamtally.ops import rebuild
from streamtally.redact import redact_url
from streamtally.settings import Settings
from streamtally.store import RAW_RECORD_STATS, RedisStore, tokens_pattern
from streamtally.topics import Topics

__all__ = ["add_parser"]

#: Skipped requests the text summary lists one by one (--json lists all).
SHOWN_SKIPPED: Final = 20

#: How the help and the summaries name the stats hashes and the close markers.
STATS_KEY: Final = "the shards' stats"
CLOSED_KEY: Final = "the close markers"

_EPILOG = f"""\
rebuilt: {tokens_pattern()}, the usage rows and {STATS_KEY} requests, exactly as the
         worker writes them; closing markers ({CLOSED_KEY}) are set to
         "{rebuild.CLOSED_MARKER}".
not restored: the raw-record counts ({STATS_KEY} records, duplicates,
         dead_lettered, the dead-letter marks): the topics do not hold them.
a request is its tenant and its request id: Tokens records written before
keys carried the tenant (keyed by the request id alone) join the billing
event of the one tenant billed for that id, and are skipped when several
tenants were.
requests whose Tokens are already in Redis are left untouched, so running
it again, or next to a running worker, is safe.
exit status: 0 rebuilt (skipped requests are listed), 1 refused (Redis holds
             Tokens and no --yes), 2 Kafka or Redis unreachable, Redis of
             another layout version (migrate it first), a topic missing or
             a bad argument
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "rebuild",
        help="rebuild Redis (Tokens, usage rows) from the Tokens and billing topics",
        description=(
            "Read the tokens topic (latest Tokens per request) and the billing topic (tenant, "
            "event time, cost), join them by request (tenant and request id) and write every "
            "request that Redis lacks through the worker's idempotent sink. A request's bill is "
            "the one that stands: its highest revision, as `audit --correct` corrected it "
            "(the bills `billing export --ledger` prints)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--yes", action="store_true", help="go on even when Redis already holds Tokens"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--batch-size",
        type=positive,
        default=rebuild.BATCH_SIZE,
        metavar="N",
        help=f"requests per Redis flush (default: {rebuild.BATCH_SIZE})",
    )
    parser.add_argument(
        "--progress-every",
        type=positive,
        default=1000,
        metavar="N",
        help="report progress on stderr every N requests (default: 1000)",
    )
    add_kafka_to_read(parser)
    add_redis_url(parser)
    parser.set_defaults(func=run)


def _say(text: str) -> None:
    say(f"streamtally rebuild: {text}")


async def _check_redis(store: RedisStore) -> int:
    """How many requests' Tokens Redis holds, once it is of our layout (else `LayoutError`)."""
    await store.ensure_layout()
    return await store.tokens_count()


def run(args: argparse.Namespace, settings: Settings) -> int:
    # aiokafka logs every failed connection attempt; the error raised says it in one line.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    url: str = args.redis_url or settings.redis_url
    present = run_redis(url, _check_redis, cluster=settings.redis_cluster)
    if present and not args.yes:
        _say(
            f"Redis at {redact_url(url)} already holds the Tokens of {present} "
            f"request{'s' if present != 1 else ''}; the rebuild would leave them untouched "
            "and add only what is missing: pass --yes to go on"
        )
        return 1
    topics = Topics.in_namespace(settings.namespace)
    inputs = asyncio.run(
        rebuild.read_inputs(
            servers,
            tokens_topic=topics.tokens.name,
            billing_topic=topics.billing.name,
            corrections_topic=topics.corrections.name,
        )
    )
    plan = rebuild.join(inputs.tokens, inputs.billing)
    _say(
        f"read {len(inputs.tokens)} Tokens records from {topics.tokens.name} and "
        f"{inputs.billing_records} billing records from {topics.billing.name}: "
        f"{len(inputs.billing)} bills stand ({inputs.revised} superseded by a later revision, "
        f"{inputs.superseded} by {inputs.corrections} corrections): "
        f"{len(plan.requests)} requests to write"
    )
    for first, _other in inputs.conflicts:
        _say(
            f"two different billing events {first.event_id} for request {first.request_id} "
            f"(tenant {first.tenant}): the first read stands, as the ledger's rule says; "
            "`streamtally audit` tells which is right"
        )

    def progress(done: rebuild.Applied, total: int) -> None:
        _say(
            f"{done.done}/{total} requests ({done.applied} applied, {done.present} already present)"
        )

    batch_size: int = args.batch_size
    every: int = args.progress_every
    result = run_redis(
        url,
        lambda store: rebuild.apply(
            store, plan.requests, batch_size=batch_size, progress=progress, progress_every=every
        ),
        cluster=settings.redis_cluster,
        state_ttl_s=settings.state_ttl,
    )
    skipped = inputs.bad + plan.skipped + result.refused
    if args.json:
        write_stdout(json_text(_summary_json(inputs, plan, result, skipped)) + "\n")
    else:
        write_stdout(_summary_text(plan, result, skipped, inputs))
    return 0


def _summary_json(
    inputs: rebuild.Inputs,
    plan: rebuild.Plan,
    result: rebuild.Applied,
    skipped: list[rebuild.Skipped],
) -> dict[str, Any]:
    return {
        "tokens_records": len(inputs.tokens),
        "billing_records": inputs.billing_records,
        "billing_events": len(inputs.billing),
        "corrections": inputs.corrections,
        "billing_superseded": inputs.superseded,
        "billing_revised": inputs.revised,
        "billing_conflicts": len(inputs.conflicts),
        "tokens_superseded": plan.tokens_superseded,
        "billing_replays": inputs.replays + plan.billing_replays,
        "applied": result.applied,
        "already_present": result.present,
        "skipped": [
            {
                "tenant": s.tenant,
                "request_id": s.request_id,
                "reason": s.reason.value,
                "detail": s.detail,
            }
            for s in skipped
        ],
        "closed_marker": rebuild.CLOSED_MARKER,
        "not_restored": [f"{STATS_KEY} {name}" for name in RAW_RECORD_STATS],
    }


def _who(skipped: rebuild.Skipped) -> str:
    """The skipped request for the text summary: its id and tenant, as much as is known."""
    request_id = skipped.request_id or "?"
    return request_id if skipped.tenant is None else f"{request_id} (tenant {skipped.tenant})"


def _summary_text(
    plan: rebuild.Plan,
    result: rebuild.Applied,
    skipped: list[rebuild.Skipped],
    inputs: rebuild.Inputs | None = None,
) -> str:
    out = (
        f"rebuilt from the tokens and billing topics: {result.applied} applied, "
        f"{result.present} already present, {len(skipped)} skipped"
    )
    drops = []
    if plan.tokens_superseded:
        drops.append(f"{plan.tokens_superseded} superseded Tokens records")
    replays = plan.billing_replays + (0 if inputs is None else inputs.replays)
    if replays:
        drops.append(f"{replays} replayed billing events")
    if inputs is not None and inputs.revised:
        drops.append(f"{inputs.revised} billing events superseded by a later revision")
    if drops:
        out += f" ({', '.join(drops)} ignored)"
    out += "\n"
    if skipped:
        for reason, n in Counter(s.reason for s in skipped).most_common():
            out += f"  {n:>6}  {reason.value}\n"
        for s in skipped[:SHOWN_SKIPPED]:
            detail = f": {s.detail}" if s.detail else ""
            out += escape(f"  skipped {_who(s)}: {s.reason.value}{detail}") + "\n"
        if len(skipped) > SHOWN_SKIPPED:
            out += f"  ... and {len(skipped) - SHOWN_SKIPPED} more (--json lists all)\n"
    out += (
        f"not restored: raw-record counts ({STATS_KEY} {', '.join(RAW_RECORD_STATS)}); "
        f'closing markers set to "{rebuild.CLOSED_MARKER}"\n'
    )
    return out
