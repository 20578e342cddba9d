"""`streamtally produce`: send raw transcripts to Kafka, one message per raw event.

Every file is read and checked before anything is sent (`prepare`): it must
be one `streamtally fold` takes whole (every event valid for its source, no
text that is not SSE, some content; ``--allow-invalid`` lets an SSE file
through anyway, to reproduce a provider's bad stream), and no event may make
a record larger than the worker takes (`MAX_RECORD_BYTES`).  A bad file is
named with the event or line at fault, and nothing at all is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from streamtally.cli._args import bootstrap_servers, kafka_of
from streamtally.cli._output import has_surrogates, say
from streamtally.connection import KafkaConnection
from streamtally.core.adapters.base import AdapterOptions
from streamtally.core.models import Source
from streamtally.errors import InputError, StackError
from streamtally.processors.limits import MAX_RECORD_BYTES
from streamtally.producers import RawProducer, raw_records
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.framing import SINGLE_OBJECT, Framing, framing_for
from streamtally.wire.kafka import ensure_topics
from streamtally.wire.tenant_keys import ProducerKey

__all__ = [
    "ManifestEntry",
    "add_key_file_argument",
    "add_parser",
    "check_entries",
    "prepare",
    "producer_key",
    "read_manifest",
]

_EPILOG = """\
manifest lines (JSON): {"file": "openai/chat.sse", "source": "openai", "request_id": "r1",
  "tenant": "acme"}; file paths are relative to the manifest; request_id may be null;
  engines may add "model".
checks: every file is read and checked before anything is sent; a file with an
  event that is not valid for its source, with text that is not SSE, with no
  content, or with an event larger than a raw record may be (4 MiB) is refused,
  naming the event or line. --allow-invalid sends such an SSE file anyway
  (engine outputs travel as structured records and must be valid).
signing: with --key-file (or STREAMTALLY_PRODUCER_KEY) every record carries a
  signed tenant claim (Kafka header st-auth), which a worker with a trust file
  (STREAMTALLY_TENANT_KEYS) requires; see docs/tenants.md, "Tenant trust".
exit status: 0 sent, 2 a bad argument, manifest, file or key file (nothing sent),
  or Kafka unreachable (message on stderr)
"""


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    file: Path
    source: Source
    request_id: str | None
    tenant: str
    #: The model an engine served (engine outputs do not say), for pricing.
    model: str | None = None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "produce",
        help="send raw transcripts to Kafka, one message per raw event",
        description=(
            "Send each transcript's raw events (SSE events or engine lines) to the raw topic\n"
            "of its source, keyed by request id, then an end-of-stream marker. Give files\n"
            "with --source, or a manifest."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--source", type=Source, choices=list(Source), metavar="SOURCE")
    parser.add_argument("--tenant", default="default", help="tenant to bill (default: default)")
    parser.add_argument("--request-id", metavar="ID", help="request id (one FILE only)")
    parser.add_argument(
        "--model", help="model an engine served (engine outputs do not name it; for pricing)"
    )
    parser.add_argument("--manifest", type=Path, metavar="FILE.jsonl")
    parser.add_argument(
        "--allow-invalid",
        action="store_true",
        help="send SSE files with events not valid for their source or non-SSE text anyway",
    )
    parser.add_argument(
        "--bootstrap-servers", type=bootstrap_servers, metavar="HOST:PORT", help="Kafka to use"
    )
    add_key_file_argument(parser)
    parser.add_argument("files", nargs="*", type=Path, metavar="FILE")
    parser.set_defaults(func=run)


def add_key_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key-file",
        type=Path,
        metavar="FILE",
        help="sign every record with this producer key (default: STREAMTALLY_PRODUCER_KEY; "
        "none: unsigned)",
    )


def producer_key(args: argparse.Namespace, settings: Settings) -> ProducerKey | None:
    """The key of ``--key-file``, else of ``STREAMTALLY_PRODUCER_KEY``; None: unsigned."""
    path = args.key_file or settings.producer_key_path
    return None if path is None else ProducerKey.load(path)


def read_manifest(path: Path) -> list[ManifestEntry]:
    """The requests of a manifest (JSON lines); `InputError` naming the line at fault."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read manifest {path}: {exc.strerror or exc}") from exc
    entries = []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{path}:{number}: not UTF-8 text (byte {exc.start + 1} of the line)"
            ) from exc
        if not line.strip():
            continue
        try:
            entries.append(_entry(path, json.loads(line)))
        except (ValueError, RecursionError) as exc:
            raise InputError(f"{path}:{number}: not a manifest line ({exc})") from exc
    return entries


def _entry(manifest: Path, row: Any) -> ManifestEntry:
    if not isinstance(row, dict):
        raise ValueError("a line is a JSON object")
    file = row.get("file")
    if not isinstance(file, str) or not file or "\0" in file:
        raise ValueError('"file" must be a file name')
    try:
        source = Source(str(row.get("source")))
    except ValueError:
        raise ValueError(f'"source" must be one of {", ".join(s.value for s in Source)}') from None
    return ManifestEntry(
        file=manifest.parent / file,
        source=source,
        request_id=_optional_text(row, "request_id"),
        tenant=_optional_text(row, "tenant") or "default",
        model=_optional_text(row, "model"),
    )


def _optional_text(row: dict[str, Any], name: str) -> str | None:
    value = row.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or has_surrogates(value):
        raise ValueError(f'"{name}" must be a string of Unicode text, or null')
    return value or None


def _entries(args: argparse.Namespace) -> list[ManifestEntry]:
    if args.manifest is not None:
        if args.files or args.source or args.request_id:
            raise InputError("give either --manifest or --source with FILEs, not both")
        entries = read_manifest(args.manifest)
        if not entries:
            raise InputError(f"{args.manifest}: no requests in the manifest")
        return entries
    if args.source is None or not args.files:
        raise InputError("give --source SOURCE and at least one FILE (or --manifest FILE.jsonl)")
    if args.request_id and len(args.files) > 1:
        raise InputError("--request-id names one request: give exactly one FILE")
    if not args.tenant:
        raise InputError("--tenant must not be empty")
    return [
        ManifestEntry(f, args.source, args.request_id, args.tenant, args.model) for f in args.files
    ]


def prepare(entry: ManifestEntry, *, allow_invalid: bool = False) -> tuple[str, list[bytes]]:
    """The request id and encoded records of one entry's file, checked (`InputError` if not).

    The checks are `raw_records`'s: `strict` unless `allow_invalid` (for SSE
    files: engine outputs are always checked), and no record over the
    worker's `MAX_RECORD_BYTES`.  The message names the file.
    """
    try:
        data = entry.file.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {entry.file}: {exc.strerror or exc}") from exc
    try:
        return raw_records(
            entry.source,
            data,
            tenant=entry.tenant,
            request_id=entry.request_id,
            options=AdapterOptions(),
            model=entry.model,
            strict=not allow_invalid,
            max_record_bytes=MAX_RECORD_BYTES,
        )
    except InputError as exc:
        raise InputError(f"{entry.file} ({entry.source.value}): {exc}") from exc


def check_entries(entries: list[ManifestEntry], *, allow_invalid: bool = False) -> None:
    """`prepare` every entry, keeping nothing: raises at the first bad file, before any send."""
    for entry in entries:
        prepare(entry, allow_invalid=allow_invalid)


async def _produce(
    servers: KafkaConnection,
    namespace: str,
    entries: list[ManifestEntry],
    *,
    allow_invalid: bool,
    key: ProducerKey | None = None,
    framing: Framing = SINGLE_OBJECT,
) -> int:
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    total = 0
    async with RawProducer(servers, namespace=namespace, key=key, framing=framing) as producer:
        for number, entry in enumerate(entries, start=1):
            try:
                rid, records = prepare(entry, allow_invalid=allow_invalid)
            except InputError as exc:  # it was fine a moment ago: the file changed
                raise InputError(
                    f"{exc} (it changed while producing: {number - 1} of {len(entries)} "
                    "requests were sent)"
                ) from exc
            try:
                await producer.send_records(entry.source, rid, records)
            except KafkaError as exc:
                raise StackError(
                    f"Kafka at {servers} failed while sending {entry.file} ({exc!r}): "
                    f"{number - 1} of {len(entries)} requests were sent before it"
                ) from exc
            total += len(records)
            say(
                f"[{number}/{len(entries)}] {rid}: {len(records) - 1} events "
                f"({entry.source.value}, tenant {entry.tenant}) from {entry.file}"
            )
    say(f"produced {len(entries)} requests, {total} messages")
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    entries = _entries(args)
    key = producer_key(args, settings)
    # Every file is checked before Kafka is even asked: a bad one sends nothing.
    check_entries(entries, allow_invalid=args.allow_invalid)
    # aiokafka logs every failed connection attempt and retried send (a new topic's first
    # leader election); retries are automatic and failures raise, with one line each.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    try:
        return asyncio.run(
            _produce(
                servers,
                settings.namespace,
                entries,
                allow_invalid=args.allow_invalid,
                key=key,
                framing=framing_for(settings, Topics.in_namespace(settings.namespace).raw),
            )
        )
    except KafkaError as exc:  # creating the topics, or stopping the producer
        raise StackError(f"Kafka at {servers} failed: {exc!r}") from exc
