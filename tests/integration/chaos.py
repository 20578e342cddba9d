"""The chaos run, as a program: `python -m tests.integration.chaos --requests N`.

It runs in its own process because its topics live in their own namespace
(`STREAMTALLY_NAMESPACE`, read by `Settings.load()`) and its state in
its own Redis database, so it can restart the broker and flush its database
without touching anybody else's data.  It prints one JSON report; the test
(`test_chaos.py`) asserts on it.

What happens:
1. thousands of requests, built from our own sample transcripts under fresh
   ids and four tenants, each id used by two tenants for two different
   transcripts (two requests: a request is its tenant and its id), are
   produced interleaved (many open at once), some raw records delivered
   twice (a retrying producer);
2. meanwhile the worker is killed with SIGKILL several times (and restarted)
   and the broker is stopped and started once;
3. then every request's Tokens in Redis is compared with `streamtally fold`
   of its transcript, the usage table per tenant with the sum of the folds,
   the billing topic is checked for exactly one distinct event per request,
   and the record counts are reconciled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples"


def worker_env(namespace: str, redis_url: str, timeout: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        STREAMTALLY_NAMESPACE=namespace,
        REDIS_URL=redis_url,
        STREAMTALLY_REQUEST_TIMEOUT=str(timeout),
        STREAMTALLY_BATCH_SIZE="500",
    )
    return env


def build_requests(run: str, count: int, prefix: str = "chaos") -> list[dict[str, Any]]:
    from streamtally.cli.produce import read_manifest

    entries = [
        e for e in read_manifest(SAMPLES / "manifest.jsonl") if "long_text_bench" not in e.file.name
    ]
    tenants = ["acme", "globex", "initech", "umbrella"]
    # requests 2k and 2k+1 share an id: two tenants, two different transcripts
    return [
        {
            "request_id": f"{prefix}-{run}-{i // 2}",
            "source": entries[i % len(entries)].source,
            "file": entries[i % len(entries)].file,
            "tenant": tenants[i % len(tenants)],
        }
        for i in range(count)
    ]


async def produce_interleaved(
    requests: list[dict[str, Any]],
    rng: random.Random,
    rate: float,
    progress: Any,
    *,
    running: asyncio.Event | None = None,
) -> tuple[int, int]:
    """Send every request's records interleaved; returns (messages, duplicates sent).

    `running` (when given) holds the production while it is clear: the requests in flight
    stay open meanwhile, and the rate resumes from where it was, without a burst."""
    from streamtally.producers import RawProducer, raw_records
    from streamtally.settings import Settings

    queues: list[tuple[dict[str, Any], list[bytes]]] = []
    for req in requests:
        _, records = raw_records(
            req["source"],
            req["file"].read_bytes(),
            tenant=req["tenant"],
            request_id=req["request_id"],
        )
        queues.append((req, records))
    total = sum(len(r) for _, r in queues)
    sent = duplicates = 0
    in_flight: list[tuple[dict[str, Any], list[bytes], int]] = []
    pending = list(queues)
    start = time.monotonic()
    futures: list[asyncio.Future[Any]] = []
    settings = Settings.load()
    async with RawProducer(settings.bootstrap_servers, namespace=settings.namespace) as producer:
        while pending or in_flight:
            if running is not None and not running.is_set():
                held = time.monotonic()
                await running.wait()
                start += time.monotonic() - held
            while pending and len(in_flight) < 60:
                req, records = pending.pop(0)
                in_flight.append((req, records, 0))
            i = rng.randrange(len(in_flight))
            req, records, pos = in_flight[i]
            value = records[pos]
            copies = 2 if pos < len(records) - 1 and rng.random() < 0.03 else 1
            for _ in range(copies):
                futures.append(await producer.send(req["source"], req["request_id"], value))
            if len(futures) >= 200:
                await asyncio.gather(*futures)
                futures.clear()
            sent += copies
            duplicates += copies - 1
            if pos + 1 == len(records):
                in_flight.pop(i)
            else:
                in_flight[i] = (req, records, pos + 1)
            progress(sent / (total + duplicates))
            ahead = sent / rate - (time.monotonic() - start)
            if ahead > 0.01:
                await asyncio.sleep(ahead)
        await asyncio.gather(*futures)
    return sent, duplicates


def request_ref(req: dict[str, Any]) -> Any:
    """The request's `RequestRef` (tenant, request id)."""
    from streamtally.core.identity import RequestRef

    return RequestRef(req["tenant"], req["request_id"])


async def wait_all(store: Any, refs: list[Any], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    waiting = list(refs)
    while waiting and time.monotonic() < deadline:
        waiting = await store.missing_tokens(waiting)
        if waiting:
            await asyncio.sleep(1.0)
    return waiting


async def _topic_records(topic: str) -> list[tuple[int, int, bytes | None, bytes]]:
    """(partition, offset, key, value) of every record of `topic` with a value, to its end."""
    from streamtally.settings import Settings
    from streamtally.wire.kafka import read_topic

    async with contextlib.aclosing(read_topic(Settings.load().bootstrap_servers, topic)) as records:
        return [
            (r.partition, r.offset, r.key, r.value) async for r in records if r.value is not None
        ]


async def verify(requests: list[dict[str, Any]], redis_url: str) -> dict[str, Any]:
    from streamtally.billing.events import bill
    from streamtally.billing.pricing import PriceTable
    from streamtally.core.identity import RequestRef
    from streamtally.core.models import USAGE_FIELDS
    from streamtally.core.normalize import fold_stream, read_events
    from streamtally.settings import Settings
    from streamtally.store import RedisStore
    from streamtally.topics import Topics
    from streamtally.wire import avro

    topics = Topics.in_namespace(Settings.load().namespace)
    prices = PriceTable.default()
    store = RedisStore.from_url(redis_url)
    mismatched: list[str] = []
    per_request: dict[RequestRef, dict[str, Any]] = {}
    truth: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    try:
        stored = await store.tokens_texts([request_ref(req) for req in requests])
        for req, text in zip(requests, stored, strict=True):
            with req["file"].open("rb") as stream:
                tokens = fold_stream(
                    req["source"], read_events(req["source"], stream), request_id=req["request_id"]
                )
            if text is None or json.loads(text) != tokens.to_json_dict():
                mismatched.append(request_ref(req).text)
            row = truth[req["tenant"]]
            row["requests"] += 1
            for name, count in zip(USAGE_FIELDS, tokens.usage.counts(), strict=True):
                row[name] += count
            # the cost the pipeline should have charged (the event time only sets the day)
            cost = bill(tokens, req["tenant"], _EPOCH, prices).cost
            row["cost"] += cost
            per_request[request_ref(req)] = {
                "tenant": req["tenant"],
                "model": tokens.model,
                "finish_reason": tokens.finish_reason.value,
                **dict(zip(USAGE_FIELDS, tokens.usage.counts(), strict=True)),
                "cost": str(cost.normalize()),
            }
        # what the commands print: `streamtally usage --json`, `billing export --json`
        got: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
        for row_ in json.loads(_command("usage", "--json")):
            for name in ("requests", *USAGE_FIELDS):
                got[row_["tenant"]][name] += Decimal(row_[name])
            got[row_["tenant"]]["cost"] += Decimal(row_["cost"])
        usage_mismatch = {
            t: {
                "expected": {k: str(v) for k, v in truth[t].items()},
                "got": {k: str(v) for k, v in got[t].items()},
            }
            for t in set(truth) | set(got)
            if dict(truth[t]) != dict(got[t])
        }
        exported: dict[RequestRef, list[dict[str, Any]]] = defaultdict(list)
        for line in _command("billing", "export", "--json", "--keep-replays").splitlines():
            event = json.loads(line)
            exported[RequestRef(event["tenant"], event["request_id"])].append(event)
        billing_mismatch = [
            ref.text
            for ref, expected in per_request.items()
            if [_billing_fields(e) for e in exported.get(ref, [])][:1] != [expected]
            or any(e != exported[ref][0] for e in exported[ref])
        ]
        counts = await store.stats()
    finally:
        await store.aclose()
    billing = await _topic_records(topics.billing.name)
    by_request: dict[RequestRef, set[bytes]] = defaultdict(set)
    for _, _, _, value in billing:
        event = avro.decode_billing_event(value)
        by_request[RequestRef(event.tenant, event.request_id)].add(value)
    refs = {request_ref(r) for r in requests}
    raw_in = len(await _topic_records(topics.raw_sse.name))
    raw_in += len(await _topic_records(topics.raw_engine.name))
    dead = {(p, o) for p, o, _, _ in await _topic_records(topics.deadletter.name)}
    return {
        "tokens_mismatches": mismatched,
        "usage_mismatches": usage_mismatch,
        "billing_export_mismatches": billing_mismatch[:5],
        "billing_export_mismatch_count": len(billing_mismatch),
        "billing_events_delivered": len(billing),
        "billing_requests": len(by_request),
        "requests_without_billing": [r.text for r in sorted(refs - set(by_request))[:5]],
        "requests_with_two_different_billing_events": sorted(
            r.text for r, values in by_request.items() if len(values) != 1
        ),
        "request_ids_of_two_tenants": sum(
            n == 2 for n in Counter(r["request_id"] for r in requests).values()
        ),
        "raw_records_in": raw_in,
        "stats": counts,
        "dead_letter_messages": len(dead),
    }


_EPOCH = __import__("datetime").datetime(2026, 1, 1, tzinfo=__import__("datetime").UTC)


def _command(*args: str) -> str:
    """What `streamtally ARGS` prints (same environment: namespace and Redis database)."""
    from streamtally.ops.worker_process import streamtally_command

    proc = subprocess.run(
        streamtally_command(*args),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=300,
    )
    return proc.stdout


def _billing_fields(event: dict[str, Any]) -> dict[str, Any]:
    from streamtally.core.models import USAGE_FIELDS

    keys = ("tenant", "model", "finish_reason", *USAGE_FIELDS)
    return {**{k: event[k] for k in keys}, "cost": str(Decimal(event["cost"]).normalize())}


async def _restart_broker(say: Any) -> float:
    from streamtally.settings import Settings
    from streamtally.stack import kafka
    from streamtally.stack.config import StackConfig

    cfg = StackConfig.from_settings(Settings.load())
    start = time.monotonic()
    kafka.down(cfg, say)
    await asyncio.sleep(1.0)
    await asyncio.to_thread(kafka.up, cfg, say)
    return time.monotonic() - start


async def _wait_busy(url: str, requests: int, timeout: float = 60.0) -> None:
    """Return once the worker is writing requests to Redis (or all are there)."""
    from streamtally.store import RedisStore

    store = RedisStore.from_url(url)
    try:
        deadline = time.monotonic() + timeout
        first: int | None = None
        while time.monotonic() < deadline:
            count = await store.closed_count()
            if count >= requests or (first is not None and count >= first + 20):
                return
            first = count if first is None else first
            await asyncio.sleep(0.1)
    finally:
        await store.aclose()


async def _restart_redis(say: Any) -> float:
    from streamtally.settings import Settings
    from streamtally.stack import redis
    from streamtally.stack.config import StackConfig

    cfg = StackConfig.from_settings(Settings.load())
    start = time.monotonic()
    await asyncio.to_thread(redis.down, cfg, say)
    await asyncio.sleep(1.0)
    await asyncio.to_thread(redis.up, cfg, say)
    return time.monotonic() - start


async def run(count: int, rate: float, db: int, seed: int) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from streamtally.ops.worker_process import WorkerProcess
    from streamtally.settings import Settings
    from streamtally.store import RedisStore
    from streamtally.topics import Topics
    from streamtally.wire.kafka import ensure_topics

    run_id = uuid.uuid4().hex[:8]
    namespace = os.environ["STREAMTALLY_NAMESPACE"]
    url = Settings.load().redis_url
    client = aioredis.from_url(url)
    await client.flushdb()  # this run's own database
    await client.aclose()
    await ensure_topics(
        Settings.load().bootstrap_servers, Topics.in_namespace(Settings.load().namespace).all
    )
    requests = build_requests(run_id, count)
    rng = random.Random(seed)
    log = REPO / ".stack" / "logs" / f"chaos-{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # in this run's session: a Ctrl-C of the run is the worker's SIGINT too
    worker = WorkerProcess(
        log, worker_env(namespace, url, timeout=300), cwd=REPO, new_session=False
    )
    worker.start()
    kills = 0
    kill_at = [0.2, 0.45, 0.75]
    restart_broker_at = 0.6 if os.environ.get("STREAMTALLY_CHAOS_BROKER_RESTART", "1") == "1" else 0
    broker_restarts = 0
    redis_restarts = 0
    events: list[str] = []
    chaos_tasks: list[asyncio.Task[Any]] = []

    def say(text: str) -> None:
        events.append(text)

    def progress(done: float) -> None:
        nonlocal broker_restarts, kills
        # kill a worker that has had time to join its group and do some work
        if kill_at and done >= kill_at[0] and time.monotonic() - (worker.started_at or 0) >= 6.0:
            kill_at.pop(0)
            worker.kill()
            kills += 1
            events.append(f"SIGKILL worker at {done:.0%}")
            worker.start()
        if restart_broker_at and done >= restart_broker_at and not broker_restarts:
            broker_restarts = 1
            events.append(f"restarting broker at {done:.0%}")
            chaos_tasks.append(asyncio.create_task(_restart_broker(say)))

    started = time.monotonic()
    messages, duplicates = await produce_interleaved(requests, rng, rate, progress)
    for task in chaos_tasks:
        await task
    if restart_broker_at:
        # once the worker is busy draining the backlog: its Redis writes must wait and retry
        await _wait_busy(url, len(requests))
        events.append("restarting Redis while the worker drains the backlog")
        await _restart_redis(say)
        redis_restarts = 1
    produced_in = time.monotonic() - started
    store = RedisStore.from_url(url)
    print(f"produced {messages} messages in {time.monotonic() - started:.1f}s", file=sys.stderr)
    waiting = await wait_all(store, [request_ref(r) for r in requests], timeout=240)
    print(f"{len(waiting)} requests not in Redis", file=sys.stderr)
    await store.aclose()
    drained_in = time.monotonic() - started
    code, _ = worker.stop(timeout=60)
    exit_code = -9 if code is None else code  # None: SIGKILLed after 60 s
    report = await verify(requests, url)
    report.update(
        requests=count,
        raw_messages_sent=messages,
        duplicates_sent=duplicates,
        worker_kills=kills,
        broker_restarts=broker_restarts,
        redis_restarts=redis_restarts,
        worker_retries_logged=sum("retrying in" in line for line in log.read_text().splitlines()),
        never_finished=[ref.text for ref in waiting[:5]],
        never_finished_count=len(waiting),
        worker_exit_code=exit_code,
        seconds_producing=round(produced_in, 1),
        seconds_until_all_in_redis=round(drained_in, 1),
        chaos=events,
        worker_log=str(log),
        redis_db=db,
        namespace=namespace,
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=800.0, help="raw messages per second")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    db = int(os.environ["REDIS_URL"].rsplit("/", 1)[1])
    print(json.dumps(asyncio.run(run(args.requests, args.rate, db, args.seed)), default=str))


if __name__ == "__main__":
    main()
