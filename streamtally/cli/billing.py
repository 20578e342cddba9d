"""`streamtally billing export`: every billing event on the billing topic, up to its current end.

The end offset of each partition is taken once, at start; the export reads
each partition from its beginning to that offset (committed records only:
isolation level read_committed), so it always terminates and never waits for
new events.  No consumer group is used and no offsets are committed
(`streamtally.wire.kafka.read_topic`, through `read_decoded`).

Events are decoded with `streamtally.wire.avro.decode_billing_event`, replays
(a second record with an `event_id` already seen) are dropped unless
``--keep-replays``, and the rest is printed ordered by (event_time, event_id).
A record that does not decode is reported on stderr with its partition and
offset, the export goes on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamtally.cli import _output
from streamtally.cli._args import add_kafka_to_read, kafka_of
from streamtally.cli._output import json_text, say, write_stdout
from streamtally.connection import KafkaConnection
from streamtally.core.money import scaled_cost
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.avro import decode_billing_event
from streamtally.wire.kafka import read_decoded
from streamtally.wire.records import BillingEvent

__all__ = ["Export", "add_parser", "event_json", "read_billing_events"]

_EPILOG = """\
output: one JSON object per line with --json (cost as an exact decimal string,
        event_time ISO-8601 with offset), else a short table.
        Byte-identical replays (same event_id, same event) are dropped unless
        --keep-replays; two DIFFERENT events with one event_id are a conflict:
        both are printed and each conflict is reported on stderr.
exit status: 0 exported, 1 some records did not decode or conflict (reported
             on stderr), 2 Kafka unreachable, topic missing or a bad argument
"""


@dataclass(slots=True)
class Export:
    """What `read_billing_events` read."""

    events: list[BillingEvent] = field(default_factory=list)
    #: (partition, offset, reason) of every record that did not decode.
    bad: list[tuple[int, int, str]] = field(default_factory=list)
    #: Records dropped because their event_id was already seen (byte-identical replays).
    replays: int = 0
    #: Events whose event_id was seen with ANOTHER content: (the first, the other).
    conflicts: list[tuple[BillingEvent, BillingEvent]] = field(default_factory=list)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "billing",
        help="read billing events from Kafka",
        description="Read the billing events of the billing topic.",
    )
    commands = parser.add_subparsers(dest="billing_command", metavar="{export}", required=True)
    export = commands.add_parser(
        "export",
        help="print every billing event, up to the topic's current end",
        description=(
            "Read the billing topic ({namespace}.billing) from the beginning to its current "
            "end (end offsets taken at start, per partition) and print the events ordered by "
            "(event_time, event_id)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("--json", action="store_true", help="print one JSON object per line")
    export.add_argument(
        "--keep-replays",
        action="store_true",
        help="also print records whose event_id was already seen (default: drop them)",
    )
    add_kafka_to_read(export)
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace, settings: Settings) -> int:
    # aiokafka logs every failed connection attempt; the error raised says it in one line.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    topic = Topics.in_namespace(settings.namespace).billing.name
    result = asyncio.run(read_billing_events(servers, topic, keep_replays=args.keep_replays))
    events = sorted(result.events, key=lambda e: (e.event_time, e.event_id))
    if args.json:
        write_stdout(json_text(event_json(event)) + "\n" for event in events)
    else:
        write_stdout(format_table(events))
    if result.replays:
        say(f"streamtally billing: dropped {result.replays} replayed events (same event_id)")
    for partition, offset, reason in result.bad:
        say(f"streamtally billing: {topic}[{partition}]@{offset} is not a billing event: {reason}")
    for first, other in result.conflicts:
        say(
            f"streamtally billing: CONFLICT: two different billing events {first.event_id} for "
            f"request {first.request_id} (tenant {first.tenant}): "
            f"{first.finish_reason.value} {format(scaled_cost(first.cost), 'f')} vs "
            f"{other.finish_reason.value} {format(scaled_cost(other.cost), 'f')}; both printed"
        )
    return 1 if result.bad or result.conflicts else 0


def event_json(event: BillingEvent) -> dict[str, Any]:
    """A billing event as a JSON object: cost an exact decimal string, times ISO-8601.

    The provenance fields (BillingEvent v3) are null, and `usage_source` "unknown", for
    an event written before them; `provider_request_id` (v4) is null before v4, and when
    the request's stream named no id of its own; `revision` (v5) is 0 and `supersedes`
    null before v5 (see `BillingEvent.revision`: the highest revision stands).
    """
    return {
        "event_id": event.event_id,
        "request_id": event.request_id,
        "tenant": event.tenant,
        "model": event.model,
        "source": event.source.value,
        "finish_reason": event.finish_reason.value,
        **event.usage_counts(),
        "cost": format(scaled_cost(event.cost), "f"),
        "priced": event.priced,
        "currency": event.currency,
        "price_table_version": event.price_table_version,
        "event_time": event.event_time.isoformat(),
        "raw_topic": event.raw_topic,
        "raw_partition": event.raw_partition,
        "first_offset": event.first_offset,
        "last_offset": event.last_offset,
        "raw_sha256": event.raw_sha256,
        "usage_source": event.usage_source.value,
        "provider_request_id": event.provider_request_id,
        "revision": event.revision,
        "supersedes": event.supersedes,
    }


def format_table(events: Sequence[BillingEvent]) -> str:
    """A short table: one line per event (tenants, models, ids escaped), then a count."""
    headers = ("EVENT_TIME", "TENANT", "MODEL", "REQUEST_ID", "INPUT", "OUTPUT", "COST")
    rows = [
        (
            e.event_time.isoformat(timespec="seconds"),
            e.tenant,
            e.model or "-",
            e.request_id,
            str(e.input_tokens),
            str(e.output_tokens),
            f"{format(scaled_cost(e.cost), 'f')} {e.currency}",
        )
        for e in events
    ]
    count = f"{len(events)} billing event{'s' if len(events) != 1 else ''}\n"
    return (_output.format_table(headers, rows, right={4, 5, 6}) + count) if rows else count


def collect(events: Iterable[BillingEvent], export: Export, *, keep_replays: bool) -> None:
    """Add `events` to `export`: replays dropped (unless kept), conflicts kept and noted.

    A replay is a byte-identical copy (same event_id, same event): the
    pipeline writes at least once.  Two DIFFERENT events with one event_id
    are a conflict, never hidden as a replay: both stay, and the conflict is
    reported.
    """
    seen: dict[str, BillingEvent] = {}
    for event in events:
        first = seen.get(event.event_id)
        if first is not None and first != event:
            export.conflicts.append((first, event))
            export.events.append(event)
            continue
        if first is not None and not keep_replays:
            export.replays += 1
            continue
        seen.setdefault(event.event_id, event)
        export.events.append(event)


async def read_billing_events(
    servers: KafkaConnection | str, topic: str, *, keep_replays: bool = False
) -> Export:
    """Every billing event of `topic` up to its end offsets at the time of the call."""
    export = Export()
    reading = read_decoded(
        servers,
        topic,
        decode_billing_event,
        export.bad,
        missing_hint=(
            "nothing was billed there yet (`streamtally worker` creates the topics), "
            "or it is the wrong Kafka"
        ),
    )
    async with contextlib.aclosing(reading) as events:
        collect([event async for event in events], export, keep_replays=keep_replays)
    return export
