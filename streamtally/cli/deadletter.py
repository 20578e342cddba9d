"""`streamtally deadletter`: what is on the dead-letter topic, counted by reason.

The topic is read from its beginning to its current end (end offsets taken
at start: `streamtally.wire.kafka.read_topic`), so the command always terminates.
Dead letters are deduplicated by the position of the record they hold
(topic, partition, offset): after a crash the worker dead-letters the same
record again, byte-identically, and that copy is not a second failure.  The
first copy is kept and the copies are counted (``copies``).

A record of the dead-letter topic that is not a dead letter is reported on
stderr with its partition and offset, and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from streamtally.cli._args import add_kafka_to_read, kafka_of
from streamtally.cli._output import escape, format_table, json_text, say, write_stdout
from streamtally.connection import KafkaConnection
from streamtally.core.content import marked_size
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.avro import decode_dead_letter
from streamtally.wire.kafka import read_decoded
from streamtally.wire.records import DeadLetter

__all__ = [
    "Letters",
    "add_parser",
    "format_report",
    "letter_json",
    "read_dead_letters",
    "summary_json",
    "value_size",
]

#: Entries the table shows when --limit is not given (--json: all of them).
DEFAULT_LIMIT: Final = 10
#: Characters of a reason the tables show.
REASON_WIDTH: Final = 72

_EPILOG = """\
output: a count by (error type, reason), the total, and the last N dead letters
        (topic:partition:offset of the original record, request id, source,
        reason, time, value size); with --json one JSON object per dead letter
        (key and value base64, every field), or with --json --summary one
        summary object.
exit status: 0 printed, 1 some records of the topic are not dead letters
             (reported on stderr), 2 Kafka unreachable, topic missing or a
             bad argument
"""


@dataclass(slots=True)
class Letters:
    """What `read_dead_letters` read."""

    #: The dead-letter topic read.
    topic: str
    #: One per source position, in dead-letter topic order.
    letters: list[DeadLetter] = field(default_factory=list)
    #: Copies of each kept letter (1 = dead-lettered once), by source position.
    copies: Counter[tuple[str, int, int]] = field(default_factory=Counter)
    #: (partition, offset, reason) of every record that is not a dead letter.
    bad: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def duplicates(self) -> int:
        """Copies dropped: records of a source position already seen."""
        return sum(self.copies.values()) - len(self.copies)


def _position(letter: DeadLetter) -> tuple[str, int, int]:
    return (letter.topic, letter.partition, letter.offset)


async def read_dead_letters(servers: KafkaConnection | str, topic: str) -> Letters:
    """Every dead letter of `topic` up to its current end, one per source position."""
    out = Letters(topic)
    async with contextlib.aclosing(
        read_decoded(servers, topic, decode_dead_letter, out.bad)
    ) as letters:
        async for letter in letters:
            position = _position(letter)
            if position not in out.copies:
                out.letters.append(letter)
            out.copies[position] += 1
    return out


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "deadletter",
        help="count and list the records on the dead-letter topic",
        description=(
            "Read the dead-letter topic ({namespace}.deadletter) from the beginning to its "
            "current end, drop re-sent copies (same original topic, partition and offset) "
            "and print a count by reason and the last dead letters."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per dead letter")
    parser.add_argument(
        "--summary",
        action="store_true",
        help="only the counts (with --json: one summary object)",
    )
    parser.add_argument(
        "--limit",
        type=_non_negative,
        metavar="N",
        help=f"only the last N dead letters (default: {DEFAULT_LIMIT} in the table, all in JSON)",
    )
    add_kafka_to_read(parser)
    parser.set_defaults(func=run)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def run(args: argparse.Namespace, settings: Settings) -> int:
    # aiokafka logs every failed connection attempt; the error raised says it in one line.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    topic = Topics.in_namespace(settings.namespace).deadletter.name
    result = asyncio.run(read_dead_letters(servers, topic))
    limit: int | None = args.limit
    if args.json and args.summary:
        write_stdout(json_text(summary_json(result)) + "\n")
    elif args.json:
        write_stdout(
            json_text(letter_json(letter, copies=result.copies[_position(letter)])) + "\n"
            for letter in _last(result.letters, limit)
        )
    else:
        last = 0 if args.summary else (DEFAULT_LIMIT if limit is None else limit)
        write_stdout(format_report(result, last))
    for partition, offset, reason in result.bad:
        say(f"streamtally deadletter: {topic}[{partition}]@{offset} is not a dead letter: {reason}")
    return 1 if result.bad else 0


def _last(letters: Sequence[DeadLetter], limit: int | None) -> Sequence[DeadLetter]:
    if limit is None:
        return letters
    return letters[len(letters) - limit :] if limit else []


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def letter_json(letter: DeadLetter, *, copies: int = 1) -> dict[str, Any]:
    """A dead letter as a JSON object: key and value base64, time ISO-8601."""
    return {
        "topic": letter.topic,
        "partition": letter.partition,
        "offset": letter.offset,
        "key": _b64(letter.key),
        "value": _b64(letter.value),
        "value_size": value_size(letter),
        "reason": letter.reason,
        "error_type": letter.error_type,
        "source": letter.source,
        "request_id": letter.request_id,
        "dead_lettered_at": letter.dead_lettered_at.isoformat(),
        "copies": copies,
    }


def value_size(letter: DeadLetter) -> int:
    """The size of the record dead-lettered: its value's, or the one its content-policy
    marker stands for (``STREAMTALLY_CONTENT`` redacted or none: `marked_size`)."""
    size = marked_size(letter.value)
    return len(letter.value) if size is None else size


def _by_reason(letters: Sequence[DeadLetter]) -> list[tuple[int, str, str]]:
    """(count, error_type, reason), most frequent first."""
    counts = Counter((letter.error_type, letter.reason) for letter in letters)
    return sorted(
        ((n, error_type, reason) for (error_type, reason), n in counts.items()),
        key=lambda row: (-row[0], row[1], row[2]),
    )


def summary_json(result: Letters) -> dict[str, Any]:
    """The counts as one JSON object."""
    return {
        "topic": result.topic,
        "total": len(result.letters),
        "duplicates_dropped": result.duplicates,
        "not_dead_letters": len(result.bad),
        "by_reason": [
            {"count": n, "error_type": error_type, "reason": reason}
            for n, error_type, reason in _by_reason(result.letters)
        ],
    }


def _cut(text: str, width: int = REASON_WIDTH) -> str:
    """`text` escaped (so one line), cut to `width` characters."""
    text = escape(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_report(result: Letters, last: int) -> str:
    """The count by reason, the total, and the `last` most recent dead letters."""
    total = len(result.letters)
    out = ""
    if total:
        counts = [(str(n), t, _cut(r)) for n, t, r in _by_reason(result.letters)]
        out += format_table(("COUNT", "ERROR_TYPE", "REASON"), counts, right={0})
    out += f"{total} dead letter{'s' if total != 1 else ''} on {escape(result.topic)}"
    if result.duplicates:
        out += f" ({result.duplicates} re-sent cop{'ies' if result.duplicates != 1 else 'y'})"
    out += "\n"
    shown = _last(result.letters, last)
    if shown:
        rows = [
            (
                f"{letter.topic}:{letter.partition}:{letter.offset}",
                letter.request_id or "-",
                letter.source or "-",
                _cut(letter.reason, 48),
                letter.dead_lettered_at.isoformat(timespec="seconds"),
                str(value_size(letter)),
            )
            for letter in shown
        ]
        out += f"\nlast {len(shown)}:\n"
        out += format_table(
            ("POSITION", "REQUEST_ID", "SOURCE", "REASON", "TIME", "SIZE"), rows, right={5}
        )
    return out
