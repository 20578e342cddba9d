"""`streamtally produce`: send raw transcripts to Kafka, one message per raw event."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from streamtally.core.adapters.base import AdapterOptions
from streamtally.core.models import Source
from streamtally.errors import InputError
from streamtally.producers import RawProducer
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics

__all__ = ["ManifestEntry", "add_parser", "read_manifest"]


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
            "Send each transcript's raw events (SSE events or engine lines) to the raw "
            "topic of its source, keyed by request id, then an end-of-stream marker. "
            "Give files with --source, or a manifest."
        ),
        epilog=(
            "manifest lines (JSON): "
            '{"file": "openai/chat.sse", "source": "openai", "request_id": "r1", "tenant": "acme"}'
            "; file paths are relative to the manifest; request_id may be null."
        ),
    )
    parser.add_argument("--source", type=Source, choices=list(Source), metavar="SOURCE")
    parser.add_argument("--tenant", default="default", help="tenant to bill (default: default)")
    parser.add_argument("--request-id", metavar="ID", help="request id (one FILE only)")
    parser.add_argument(
        "--model", help="model an engine served (engine outputs do not name it; for pricing)"
    )
    parser.add_argument("--manifest", type=Path, metavar="FILE.jsonl")
    parser.add_argument("--bootstrap-servers", metavar="HOST:PORT", help="Kafka to use")
    parser.add_argument("files", nargs="*", type=Path, metavar="FILE")
    parser.set_defaults(func=run)


def read_manifest(path: Path) -> list[ManifestEntry]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(f"cannot read manifest {path}: {exc.strerror}") from exc
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            entries.append(
                ManifestEntry(
                    file=path.parent / row["file"],
                    source=Source(row["source"]),
                    request_id=row.get("request_id"),
                    tenant=row.get("tenant") or "default",
                    model=row.get("model"),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{path}:{number}: not a manifest line ({exc})") from exc
    return entries


def _entries(args: argparse.Namespace) -> list[ManifestEntry]:
    if args.manifest is not None:
        if args.files or args.source or args.request_id:
            raise InputError("give either --manifest or --source with FILEs, not both")
        return read_manifest(args.manifest)
    if args.source is None or not args.files:
        raise InputError("give --source SOURCE and at least one FILE (or --manifest FILE.jsonl)")
    if args.request_id and len(args.files) > 1:
        raise InputError("--request-id names one request: give exactly one FILE")
    return [
        ManifestEntry(f, args.source, args.request_id, args.tenant, args.model) for f in args.files
    ]


async def _produce(servers: str, namespace: str, entries: list[ManifestEntry]) -> int:
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    total = 0
    async with RawProducer(servers, namespace=namespace) as producer:
        for number, entry in enumerate(entries, start=1):
            try:
                data = entry.file.read_bytes()
            except OSError as exc:
                raise InputError(f"cannot read {entry.file}: {exc.strerror}") from exc
            sent = await producer.send_transcript(
                entry.source,
                data,
                tenant=entry.tenant,
                request_id=entry.request_id,
                options=AdapterOptions(),
                model=entry.model,
            )
            total += sent.events + 1
            print(
                f"[{number}/{len(entries)}] {sent.request_id}: {sent.events} events "
                f"({entry.source.value}, tenant {entry.tenant}) from {entry.file}",
                file=sys.stderr,
            )
    print(f"produced {len(entries)} requests, {total} messages", file=sys.stderr)
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    entries = _entries(args)
    # aiokafka warns of every retried send (a new topic's first leader election);
    # retries are automatic and failures still raise, so only errors are shown.
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    servers = args.bootstrap_servers or settings.bootstrap_servers
    return asyncio.run(_produce(servers, settings.namespace, entries))
