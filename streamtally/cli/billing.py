"""`streamtally billing export`: the billing topic up to its current end, every record or
the ledger as it stands.

The end offset of each partition is taken once, at start; the export reads
each partition from its beginning to that offset (committed records only:
isolation level read_committed), so it always terminates and never waits for
new events.  No consumer group is used and no offsets are committed
(`streamtally.wire.kafka.read_topic`, through `read_decoded_at`).

Events are decoded with `streamtally.wire.avro.decode_billing_event` into a
`streamtally.billing.ledger.BillingLedger`, which tells replays (a second record
equal to an `event_id`'s bill) from conflicts (a different one).  By default
every record is printed, every revision of a bill included, replays dropped
unless ``--keep-replays``.  With ``--ledger`` the corrections topic is read too
and the ledger is settled by its rule: one bill per request, the one that stands
(the highest revision, as ``audit --correct`` corrected it).  Both are printed
ordered by (event_time, event_id).  A record that does not decode is reported
on stderr with its partition and offset, the export goes on, and the exit
status is 1; so it is for a conflict, and with ``--ledger`` for a request with
several bills at its highest revision.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamtally.billing.ledger import BillingLedger, Seen, Settled, Standing
from streamtally.billing.reading import read_ledger
from streamtally.cli import _output
from streamtally.cli._args import add_kafka_to_read, kafka_of
from streamtally.cli._output import json_text, say, write_stdout
from streamtally.connection import KafkaConnection
from streamtally.core.money import scaled_cost
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.avro import decode_billing_event
from streamtally.wire.kafka import Decoded, read_decoded_at
from streamtally.wire.records import BillingEvent

__all__ = ["Export", "add_parser", "event_json", "read_billing_events", "standing_json"]

_MISSING_HINT = (
    "nothing was billed there yet (`streamtally worker` creates the topics), "
    "or it is the wrong Kafka"
)

_EPILOG = """\
output: one JSON object per line with --json (cost as an exact decimal string,
        event_time ISO-8601 with offset), else a short table.
        Byte-identical replays (same event_id, same event) are dropped unless
        --keep-replays; two DIFFERENT events with one event_id are a conflict,
        reported on stderr: both are printed (with --ledger, the first stands).
records and revisions: a request closed at its timeout or over a gap and
        amended by records arriving later has several bills, revision 0, 1,
        ...; each carries the request's whole usage and cost, and revision n
        names revision n-1's event_id in "supersedes". By default every
        record is printed: do not sum them as they are.
--ledger: the bills as they stand, one per request: the highest revision of
        each request, the corrections topic ({namespace}.billing.corrections,
        written by `streamtally audit --correct`) applied; its --json lines add
        "correction_id" (null unless a correction put the bill in place). These
        sum to the usage rows of `streamtally usage` (the rule: docs/billing.md,
        "One ledger, one rule").
exit status: 0 exported, 1 some records did not decode or conflict, or (with
             --ledger) a request has several bills at its highest revision
             (reported on stderr), 2 Kafka unreachable, topic missing or a bad
             argument
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
    #: The records read, as the ledger's rule sees them.
    ledger: BillingLedger = field(default_factory=BillingLedger)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "billing",
        help="read billing events from Kafka",
        description="Read the billing events of the billing topic.",
    )
    commands = parser.add_subparsers(dest="billing_command", metavar="{export}", required=True)
    export = commands.add_parser(
        "export",
        help="print every billing event, or the bills as they stand, up to the topic's end",
        description=(
            "Read the billing topic ({namespace}.billing) from the beginning to its current "
            "end (end offsets taken at start, per partition) and print the events ordered by "
            "(event_time, event_id): every record (every revision of an amended bill), or "
            "with --ledger one bill per request, the one that stands."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("--json", action="store_true", help="print one JSON object per line")
    which = export.add_mutually_exclusive_group()
    which.add_argument(
        "--keep-replays",
        action="store_true",
        help="also print records whose event_id was already seen (default: drop them)",
    )
    which.add_argument(
        "--ledger",
        action="store_true",
        help=(
            "print the ledger as it stands: one bill per request (its highest revision, the "
            "corrections of `audit --correct` applied) instead of every record"
        ),
    )
    add_kafka_to_read(export)
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace, settings: Settings) -> int:
    # aiokafka logs every failed connection attempt; the error raised says it in one line.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    topics = Topics.in_namespace(settings.namespace)
    topic = topics.billing.name
    if args.ledger:
        return _export_ledger(args, servers, topic, topics.corrections.name)
    result = asyncio.run(read_billing_events(servers, topic, keep_replays=args.keep_replays))
    events = sorted(result.events, key=lambda e: (e.event_time, e.event_id))
    if args.json:
        write_stdout(json_text(event_json(event)) + "\n" for event in events)
    else:
        write_stdout(format_table(events))
    if result.replays:
        say(f"streamtally billing: dropped {result.replays} replayed events (same event_id)")
    _say_bad(topic, result.bad)
    _say_conflicts(result.conflicts, "both printed")
    return 1 if result.bad or result.conflicts else 0


def _export_ledger(
    args: argparse.Namespace, servers: KafkaConnection | str, topic: str, corrections: str
) -> int:
    bad: list[tuple[int, int, str]] = []
    bad_corrections: list[tuple[int, int, str]] = []
    ledger = asyncio.run(
        read_ledger(
            servers,
            billing_topic=topic,
            corrections_topic=corrections,
            bad_billing=bad,
            bad_corrections=bad_corrections,
            missing_hint=_MISSING_HINT,
        )
    )
    settled = ledger.settle()
    if args.json:
        write_stdout(json_text(standing_json(bill)) + "\n" for bill in settled.bills)
    else:
        write_stdout(format_table(settled.events(), standing=True))
    say(f"streamtally billing: {_ledger_summary(ledger, settled)}")
    _say_bad(topic, bad)
    _say_bad(corrections, bad_corrections, what="correction")
    _say_conflicts(ledger.conflicts, "the first stands")
    for ref in settled.split:
        bills = [b.event.event_id for b in settled.bills if b.ref == ref]
        say(
            f"streamtally billing: CONFLICT: request {ref.request_id} (tenant {ref.tenant}) has "
            f"{len(bills)} bills at its highest revision ({', '.join(bills)}); all printed"
        )
    failed = bad or bad_corrections or ledger.conflicts or settled.split
    return 1 if failed else 0


def _ledger_summary(ledger: BillingLedger, settled: Settled) -> str:
    requests = len({bill.ref for bill in settled.bills})
    return (
        f"{len(settled.bills)} bill{'s' if len(settled.bills) != 1 else ''} stand for "
        f"{requests} request{'s' if requests != 1 else ''}, from {ledger.records} billing "
        f"records ({ledger.replays} replays, {settled.revised} superseded by a later revision) "
        f"and {ledger.corrections.records} corrections ({settled.corrected} bills corrected)"
    )


def _say_bad(topic: str, bad: Sequence[tuple[int, int, str]], what: str = "billing event") -> None:
    for partition, offset, reason in bad:
        say(f"streamtally billing: {topic}[{partition}]@{offset} is not a {what}: {reason}")


def _say_conflicts(conflicts: Sequence[tuple[BillingEvent, BillingEvent]], outcome: str) -> None:
    for first, other in conflicts:
        say(
            f"streamtally billing: CONFLICT: two different billing events {first.event_id} for "
            f"request {first.request_id} (tenant {first.tenant}): "
            f"{first.finish_reason.value} {format(scaled_cost(first.cost), 'f')} vs "
            f"{other.finish_reason.value} {format(scaled_cost(other.cost), 'f')}; {outcome}"
        )


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


def standing_json(bill: Standing) -> dict[str, Any]:
    """A standing bill (``--ledger``) as a JSON object: `event_json`, and the id of the
    correction that put it in place (null: the billing record stands as written)."""
    return {
        **event_json(bill.event),
        "correction_id": None if bill.correction is None else bill.correction.correction_id,
    }


def format_table(events: Sequence[BillingEvent], *, standing: bool = False) -> str:
    """A short table: one line per event (tenants, models, ids escaped), then a count
    (`standing`: of the bills that stand, ``--ledger``)."""
    headers = ("EVENT_TIME", "TENANT", "MODEL", "REQUEST_ID", "REV", "INPUT", "OUTPUT", "COST")
    rows = [
        (
            e.event_time.isoformat(timespec="seconds"),
            e.tenant,
            e.model or "-",
            e.request_id,
            str(e.revision),
            str(e.input_tokens),
            str(e.output_tokens),
            f"{format(scaled_cost(e.cost), 'f')} {e.currency}",
        )
        for e in events
    ]
    plural = "s" if len(events) != 1 else ""
    noun = f"standing bill{plural}, one per request" if standing else f"billing event{plural}"
    count = f"{len(events)} {noun}\n"
    return (_output.format_table(headers, rows, right={4, 5, 6, 7}) + count) if rows else count


def collect(
    records: Iterable[Decoded[BillingEvent]], export: Export, *, keep_replays: bool
) -> None:
    """Add `records` to `export`: replays dropped (unless kept), conflicts kept and noted.

    A replay is a byte-identical copy (same event_id, same event): the
    pipeline writes at least once.  Two DIFFERENT events with one event_id
    are a conflict, never hidden as a replay: both stay, and the conflict is
    reported.  Which is which the ledger says (`BillingLedger.add`).
    """
    for record in records:
        event = record.value
        seen = export.ledger.add(event, record.partition, record.offset)
        if seen is Seen.CONFLICT:
            export.conflicts.append(export.ledger.conflicts[-1])
        elif seen is Seen.REPLAY and not keep_replays:
            export.replays += 1
            continue
        export.events.append(event)


async def read_billing_events(
    servers: KafkaConnection | str, topic: str, *, keep_replays: bool = False
) -> Export:
    """Every billing event of `topic` up to its end offsets at the time of the call."""
    export = Export()
    reading = read_decoded_at(
        servers, topic, decode_billing_event, export.bad, missing_hint=_MISSING_HINT
    )
    async with contextlib.aclosing(reading) as records:
        collect([record async for record in records], export, keep_replays=keep_replays)
    return export
