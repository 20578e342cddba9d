"""`streamtally demo`: the whole pipeline on the bundled sample traffic, in one command.

Starts the local stack (or uses KAFKA_BOOTSTRAP_SERVERS / REDIS_URL), runs a
worker, produces `samples/manifest.jsonl`, waits until every request's Tokens
is in Redis, then shows a few Tokens, the usage table and the billing events.

On the local stack the demo is a new deployment: its topics are written in the
Confluent framing, with the stack's schema registry (`stack up --registry`),
unless `--framing single-object`.  On a stack of your own it follows
STREAMTALLY_AVRO_FRAMING (single-object unless set).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from streamtally.cli._output import say
from streamtally.cli.produce import ManifestEntry, check_entries, prepare, read_manifest
from streamtally.cli.tokens import redacted_error
from streamtally.connection import KafkaConnection
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError, StackError
from streamtally.ops.worker_process import WorkerProcess, worker_command
from streamtally.producers import RawProducer
from streamtally.redact import redact_url
from streamtally.settings import Settings, export, project_root
from streamtally.stack.config import StackConfig
from streamtally.store import RedisStore
from streamtally.topics import Topics
from streamtally.wire.framing import SINGLE_OBJECT, Framing, framing_for
from streamtally.wire.kafka import ensure_topics

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the pipeline end to end on the bundled sample traffic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="requests to produce (default: samples/manifest.jsonl)",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait (180)")
    parser.add_argument("--no-stack", action="store_true", help="do not start the local stack")
    parser.add_argument(
        "--framing",
        choices=("confluent", "single-object"),
        default=None,
        help=(
            "framing of the values written (default: confluent on the local stack, with its "
            "schema registry; else STREAMTALLY_AVRO_FRAMING)"
        ),
    )
    parser.set_defaults(func=run)


def _with_framing(settings: Settings, framing: str, local: bool) -> Settings:
    """The settings of this run and of the commands it starts (their environment): the
    framing chosen and, on the local stack, its registry unless one is named."""
    values = {"STREAMTALLY_AVRO_FRAMING": framing}
    if framing == "confluent" and local and not settings.schema_registry_url:
        values["STREAMTALLY_SCHEMA_REGISTRY_URL"] = StackConfig.from_settings(
            settings
        ).local_registry_url()
    return export(values)


def _samples_manifest() -> Path:
    root = project_root()
    if root is None:
        raise InputError(
            "the sample traffic lives in a clone of streamtally (samples/manifest.jsonl): "
            "run the demo from a clone, or give --manifest FILE.jsonl"
        )
    return root / "samples" / "manifest.jsonl"


def _step(text: str) -> None:
    say(f"==> {text}")


def _streamtally(*args: str) -> int:
    from streamtally.cli import main

    return main(list(args))


def run(args: argparse.Namespace, settings: Settings) -> int:
    manifest = args.manifest or _samples_manifest()
    entries = read_manifest(manifest)
    if not entries:
        raise InputError(f"{manifest}: no requests in the manifest")
    check_entries(entries)  # before anything starts: a bad file is named, nothing is sent
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # see `streamtally produce`
    local = not args.no_stack and not settings.uses_external_stack
    framing = args.framing or ("confluent" if local else settings.avro_framing)
    settings = _with_framing(settings, framing, local)
    if local:
        registry = framing == "confluent" and settings.schema_registry_url == (
            StackConfig.from_settings(settings).local_registry_url()
        )
        _step(
            "starting the local stack (Kafka + Redis" + (" + schema registry)" if registry else ")")
        )
        if _streamtally("stack", "up", *(["--registry"] if registry else [])) != 0:
            raise StackError("the local stack did not start: see `streamtally stack status`")
    servers, url = settings.kafka, settings.redis_url
    asyncio.run(ensure_topics(servers, Topics.in_namespace(settings.namespace).all))
    log = StackConfig.from_settings(settings).state_dir / "logs" / "demo-worker.log"
    _step(f"starting a worker (values in the {framing} framing; log: {log})")
    # this process's environment, its own session, this command's log format
    command = [*worker_command("info"), "--log-format", args.log_format]
    worker = WorkerProcess(log, command=command).start()
    try:
        waiting = asyncio.run(
            _produce_and_wait(
                servers,
                url,
                settings.namespace,
                entries,
                args.timeout,
                cluster=settings.redis_cluster,
                framing=framing_for(settings, Topics.in_namespace(settings.namespace).raw),
            )
        )
    except KafkaError as exc:
        raise StackError(f"Kafka at {servers} failed: {exc!r}") from exc
    except (RedisError, OSError) as exc:
        raise StackError(f"Redis at {redact_url(url)} failed: {redacted_error(exc, url)}") from exc
    finally:
        _step("stopping the worker (SIGTERM)")
        worker.stop(timeout=30)  # SIGKILL after 30 s
    if waiting:
        raise StackError(
            f"{len(waiting)} requests never reached Redis (e.g. {min(waiting)}): see {log}"
        )
    shown = [(e.request_id, e.tenant) for e in entries if e.request_id][:3]
    for request_id, tenant in shown:
        _step(f"streamtally tokens get {request_id} --tenant {tenant}")
        _streamtally("tokens", "get", request_id, "--tenant", tenant)
    _step("streamtally usage")
    _streamtally("usage")
    _step("streamtally billing export")
    _streamtally("billing", "export")
    _step(f"done: {len(entries)} requests through Kafka into Redis and billing")
    return 0


async def _produce_and_wait(
    servers: KafkaConnection,
    url: str,
    namespace: str,
    entries: list[ManifestEntry],
    timeout: float,
    *,
    cluster: bool,
    framing: Framing = SINGLE_OBJECT,
) -> set[RequestRef]:
    store = RedisStore.from_url(url, cluster=cluster)
    try:
        ids: set[RequestRef] = set()
        async with RawProducer(servers, namespace=namespace, framing=framing) as producer:
            for entry in entries:
                known = RequestRef(entry.tenant, entry.request_id or "")
                if entry.request_id and await store.has_tokens(known):
                    ids.add(known)
                    continue  # already processed by an earlier run: nothing to redo
                request_id, records = prepare(entry)
                await producer.send_records(entry.source, request_id, records)
                ids.add(RequestRef(entry.tenant, request_id))
        _step(f"produced {len(entries)} requests; waiting for their Tokens in Redis")
        deadline = time.monotonic() + timeout
        waiting = set(ids)
        last = -1
        while waiting and time.monotonic() < deadline:
            waiting = set(await store.missing_tokens(sorted(waiting)))
            if len(waiting) != last:
                last = len(waiting)
                say(f"    {len(ids) - len(waiting)}/{len(ids)} requests in Redis")
            await asyncio.sleep(0.5)
        return waiting
    finally:
        await store.aclose()
