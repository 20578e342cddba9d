"""End-to-end benchmark of ONE worker on the running stack (reports figures, never fails).

What it does, in one run, on the local Kafka and Redis (or KAFKA_BOOTSTRAP_SERVERS /
REDIS_URL):

1. Setup.  A run id; requests built from our own transcripts (mostly the
   ~200-event `*/long_text_bench.sse` samples, plus ~200-line generated engine
   streams and the small engine samples), each with a fresh request id
   `bench-<run>-<n>` and the tenant `bench`, encoded with
   `producers.raw_records` before anything is timed.  One worker is started as
   a subprocess (`python -m streamtally.cli worker`, request timeout a day),
   warmed up with the manifest's transcripts, and the benchmark waits until
   its consumer group has no lag.
2. Throughput.  About `events` raw events are produced as fast as possible
   (idempotent, acks=all, linger, 1 MiB batches), `concurrency` requests
   interleaved at a time.  Timed from the first send to the moment the last
   request's Tokens is readable in Redis; then the billing topic is read back
   to check one billing event per request.
3. Ceiling.  The same raw messages (their offset range) are passed through
   unchanged by plain aiokafka (`benchmarks.passthrough`).
4. Latency.  More requests are produced at a steady `rate` raw events/s for
   `seconds`; each request's latency runs from the moment its END marker is
   handed to the producer to the moment its Tokens is readable in Redis.
5. Memory.  The worker's RSS is sampled all along; VmHWM is read at the end.

Readability in Redis is observed through keyspace notifications
(`notify-keyspace-events` gets `K$` for the run and its old value back after)
on `__keyspace@<db>__:st:{s*}:tokens:bench:bench-<run>-*` (tenant `bench`, every
shard), timestamped with `time.perf_counter()` in this process, like the producer side.

The worker runs in a namespace of its own (`STREAMTALLY_NAMESPACE`, default
`streamtally-bench`: topics `streamtally-bench.*` with one-day retention, and
consumer group `streamtally-bench`) on the same broker, so that no other worker
(a demo, a test) joins its consumer group and takes partitions or replays its
requests; set STREAMTALLY_NAMESPACE=streamtally to measure on the shared topics.

The benchmark writes real records: Tokens keys, usage rows of tenant `bench`,
chunks and billing events, and the scratch topic `streamtally.bench.passthrough`.
Nothing is deleted.  Its Redis is REDIS_URL's database (the local stack's db 0
by default): empty, or of layout version 3 (``st:layout``), which the run
claims on an empty database as its worker does; it stops before anything is
timed on data of an older layout (``streamtally migrate``, or another database).

This module runs the steps in order (`run`); the parts are, by concern:
`pipeline_workload` (settings, namespace, requests), `pipeline_worker` (the
worker process, its RSS and CPU), `pipeline_kafka` (offsets, lag, group),
`pipeline_redis` (when each Tokens became readable), `pipeline_phases`
(warm-up, throughput, ceiling, latency) and `pipeline_report` (the figures
and their text).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from typing import Final

from redis.exceptions import RedisError

from benchmarks import passthrough
from benchmarks.affinity import CpuSplit, Pinning, cpu_list, stack_pids
from benchmarks.pipeline_kafka import KafkaProbe
from benchmarks.pipeline_phases import (
    PhaseContext,
    measure_ceiling,
    measure_latency,
    measure_throughput,
    warm_up,
)
from benchmarks.pipeline_redis import (
    TokensWatcher,
    as_text,
    check_layout,
    keyspace_flags,
    redis_client,
)
from benchmarks.pipeline_report import (
    TARGET_EVENTS_PER_SECOND,
    TARGET_P99_MS,
    TARGET_RATIO,
    Ceiling,
    Latency,
    Memory,
    PipelineReport,
    Throughput,
    Workload,
    describe_machine,
    format_report,
    target_p99_ms,
)
from benchmarks.pipeline_worker import BenchWorkers
from benchmarks.pipeline_workload import (
    TENANT,
    BenchRequest,
    Names,
    PipelineSettings,
    Progress,
    RequestBuilder,
    bench_names,
)
from streamtally.connection import as_connection
from streamtally.errors import StackError
from streamtally.settings import Settings, project_root
from streamtally.stack import kafka as kafka_stack
from streamtally.stack import redis as redis_stack
from streamtally.stack import registry as registry_stack
from streamtally.stack.config import StackConfig
from streamtally.wire.framing import SINGLE_OBJECT, Framing, register_topics
from streamtally.wire.kafka import ensure_topics
from streamtally.wire.registry import SchemaRegistry

__all__ = [
    "TARGET_EVENTS_PER_SECOND",
    "TARGET_P99_MS",
    "TARGET_RATIO",
    "PipelineReport",
    "PipelineSettings",
    "format_report",
    "run",
    "target_p99_ms",
]

#: Request timeout given to the worker: nothing of the benchmark may time out.
WORKER_REQUEST_TIMEOUT: Final = 86_400


async def _wait_for_members(
    kafka: KafkaProbe, workers: BenchWorkers, count: int, progress: Progress
) -> None:
    """Wait until all `count` workers are members of the group (no rebalance mid-phase)."""
    deadline = time.monotonic() + 120
    while (members := await kafka.group_members()) != count:
        workers.check()
        if time.monotonic() > deadline:
            raise StackError(f"the consumer group has {members} members, not {count}, after 120 s")
        await asyncio.sleep(0.5)
    if count > 1:
        progress(f"  the consumer group has its {count} members")


async def _bench(
    *,
    settings: PipelineSettings,
    names: Names,
    workload: RequestBuilder,
    warm: list[BenchRequest],
    load: list[BenchRequest],
    steady: list[BenchRequest],
    worker: BenchWorkers,
    progress: Progress,
    joined: Callable[[], None] = lambda: None,
) -> tuple[Throughput, Ceiling, Latency, Memory, str | None, list[str]]:
    """The phases; `joined` is called once every worker is in the group."""
    notes: list[str] = []
    client, db, redis_version = await redis_client(settings.redis_url)
    kafka = KafkaProbe(settings.bootstrap_servers, names)
    old_flags: str | None = None
    sampler: asyncio.Task[None] | None = None
    watcher = TokensWatcher(client, db, TENANT, workload.prefix())
    try:
        await kafka.start()
        config = await client.config_get("notify-keyspace-events")
        old_flags = as_text(next(iter(config.values()), ""))
        await client.config_set("notify-keyspace-events", keyspace_flags(old_flags))
        await watcher.start()
        sampler = asyncio.create_task(worker.sample_rss())
        ctx = PhaseContext(settings, names, progress, worker, kafka, watcher, client, notes)
        dead_tps = names.partitions(names.topics.deadletter)
        dead_start = await kafka.end_offsets(dead_tps)

        await _wait_for_members(kafka, worker, settings.workers, progress)
        joined()
        await warm_up(ctx, warm)
        idle_rss = worker.rss_kib() or 0
        throughput, raw_start, raw_end = await measure_throughput(ctx, load)
        ceiling = await measure_ceiling(ctx, raw_start, raw_end)
        latency = await measure_latency(ctx, steady)

        members = await kafka.group_members()
        if members is not None and members != settings.workers:
            notes.append(f"at the end, the consumer group {names.group!r} had {members} members")
        dead_end = await kafka.end_offsets(dead_tps)
        dead = sum(dead_end.values()) - sum(dead_start.values())
        if dead:
            notes.append(f"{dead} records were dead-lettered during the run")
        hwm = worker.hwm_kib() or 0
        samples = worker.rss_samples
        memory = Memory(
            peak_rss_mib=round(max(hwm, *samples, 0) / 1024, 1),
            sampled_peak_rss_mib=round(max(samples, default=0) / 1024, 1),
            idle_rss_mib=round(idle_rss / 1024, 1),
            samples=len(samples),
        )
        return throughput, ceiling, latency, memory, redis_version, notes
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        await watcher.stop()
        if old_flags is not None:
            with contextlib.suppress(RedisError, OSError):
                await client.config_set("notify-keyspace-events", old_flags)
        await kafka.stop()
        await client.aclose()


def _framing(framing: str, app_settings: Settings, names: Names) -> Framing:
    """How the raw records are framed: with ``confluent``, the raw topics' schemas are
    registered under the benchmark namespace's subjects (the worker registers its own)."""
    if framing != "confluent":
        return SINGLE_OBJECT
    registry = SchemaRegistry.from_settings(app_settings)
    if registry is None:
        raise StackError(
            "the Confluent framing needs a schema registry: set STREAMTALLY_SCHEMA_REGISTRY_URL "
            "(`streamtally stack up --registry` prints it)"
        )
    return register_topics(registry, [names.topics.raw_sse, names.topics.raw_engine])


def _local_stack(app_settings: Settings) -> dict[str, int]:
    """The broker(s), Redis server(s) and registry `streamtally stack` runs on this
    machine, by name (none when the stack runs in containers or elsewhere)."""
    cfg = StackConfig.from_settings(app_settings)
    found = [*kafka_stack.statuses(cfg), *redis_stack.statuses(cfg), registry_stack.status(cfg)]
    return stack_pids({s.name: s.pid for s in found if s.running})


def _describe_pinning(split: CpuSplit, services: dict[str, int]) -> str:
    moved = ", ".join(f"{name} (pid {pid})" for name, pid in sorted(services.items()))
    return f"{split.describe()}: this benchmark and " + (
        moved if moved else "no local stack process (the stack runs elsewhere)"
    )


def run(
    settings: PipelineSettings, app_settings: Settings, progress: Progress = print
) -> PipelineReport:
    """Run the whole benchmark (see the module docstring); the worker is always stopped."""
    run_id = uuid.uuid4().hex[:8]
    load_before = os.getloadavg()[0]
    root = project_root()
    if root is None:
        raise StackError("the pipeline benchmark runs from a clone (it replays samples/)")
    samples = root / "samples"
    names = bench_names(app_settings)
    framing = _framing(settings.framing, app_settings, names)
    progress(
        f"pipeline benchmark run {run_id} ({framing.name} framing): "
        "encoding the requests (not timed) …"
    )
    workload = RequestBuilder(run_id, samples, names, framing)
    warm = workload.warmup()
    load = workload.requests(settings.events, settings.poison_every)
    steady = workload.requests(max(1, round(settings.rate * settings.seconds)))
    progress(
        f"  {len(load) + len(steady):,} requests, "
        f"{sum(r.events for r in load) + sum(r.events for r in steady):,} raw events "
        f"encoded in {workload.encode_seconds:.1f} s"
    )
    progress(f"worker namespace {names.namespace!r} (its topics and consumer group)")
    asyncio.run(check_layout(settings.redis_url))  # the worker would refuse another layout
    asyncio.run(ensure_topics(settings.bootstrap_servers, names.topics.all))
    asyncio.run(passthrough.ensure_passthrough_topic(settings.bootstrap_servers))
    log = StackConfig.from_settings(app_settings).state_dir / "logs" / "bench-worker.log"
    env = dict(os.environ)
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=as_connection(settings.bootstrap_servers).servers,
        REDIS_URL=settings.redis_url,
        STREAMTALLY_REQUEST_TIMEOUT=str(WORKER_REQUEST_TIMEOUT),
        STREAMTALLY_NAMESPACE=names.namespace,
        STREAMTALLY_AVRO_FRAMING=settings.framing,
    )
    split = CpuSplit.of(settings.worker_cpus) if settings.worker_cpus else None
    services = _local_stack(app_settings) if split is not None else {}
    pinning = Pinning(split, services) if split is not None else None
    pinned = _describe_pinning(split, services) if split is not None else ""
    with pinning or contextlib.nullcontext():
        worker = BenchWorkers(env, log, settings.workers)
        pids = ", ".join(str(m.pid) for m in worker.members)
        progress(f"started {settings.workers} worker(s) (pid {pids}, log {log})")

        def pin_workers() -> None:
            # Again once they have joined: a thread made before the first pin is caught.
            if pinning is not None:
                for member in worker.members:
                    pinning.worker(member.pid)

        pin_workers()
        if pinned:
            progress(f"CPUs: {pinned}")
        try:
            throughput, ceiling, latency, memory, redis_version, notes = asyncio.run(
                _bench(
                    settings=settings,
                    names=names,
                    workload=workload,
                    warm=warm,
                    load=load,
                    steady=steady,
                    worker=worker,
                    progress=progress,
                    joined=pin_workers,
                )
            )
        finally:
            worker.shut_down(progress)
    if split is not None:
        notes.append(
            "the pass-through ran in this benchmark's process, beside the broker on CPU "
            f"{cpu_list(split.others)}: its ceiling, and the worker / pass-through ratio, do not "
            "compare with a run without --worker-cpus"
        )
    return PipelineReport(
        machine=describe_machine(load_before, redis_version, pinned),
        workload=Workload(
            run_id=run_id,
            tenant=TENANT,
            requests_by_source=dict(sorted(workload.by_source.items())),
            encode_seconds=round(workload.encode_seconds, 2),
            concurrency=settings.concurrency,
            namespace=names.namespace,
            poison_events=workload.poison_events,
            workers=settings.workers,
            framing=settings.framing,
        ),
        throughput=throughput,
        ceiling=ceiling,
        latency=latency,
        memory=memory,
        worker_log=str(log),
        notes=notes,
    )
