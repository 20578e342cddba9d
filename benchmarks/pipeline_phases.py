"""The timed phases of the pipeline benchmark: warm-up, throughput, ceiling, latency.

Each takes the run's `PhaseContext` (settings, names, worker, Kafka probe,
Tokens watcher, notes) and returns its figures: `measure_throughput`
produces as fast as possible and times until the last Tokens is readable,
`measure_ceiling` passes the same raw messages through plain aiokafka,
`measure_latency` produces at a steady rate and times each request from its
END marker's ack to its Tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis

from benchmarks import passthrough
from benchmarks.pipeline_kafka import KafkaProbe
from benchmarks.pipeline_redis import TokensWatcher
from benchmarks.pipeline_report import WINDOW_SECONDS, Ceiling, Latency, Throughput
from benchmarks.pipeline_worker import BenchWorkers
from benchmarks.pipeline_workload import (
    TENANT,
    BenchRequest,
    Names,
    PipelineSettings,
    Progress,
    Send,
    interleave,
)
from streamtally.core.identity import RequestRef
from streamtally.errors import StackError
from streamtally.processors.stages import batch_summary, difference, summarise
from streamtally.producers.batches import Batches
from streamtally.topics import output_key
from streamtally.wire.kafka import MAX_REQUEST_BYTES, idempotent_producer

__all__ = [
    "PhaseContext",
    "measure_ceiling",
    "measure_latency",
    "measure_throughput",
    "produce_all",
    "warm_up",
]

_PACE_SLICE: Final = 0.005


def _percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


async def produce_all(producer: Any, schedule: list[Send]) -> None:
    """Send every message of `schedule` (in order), then wait until all are acknowledged.

    In batches (`Batches`, as the tap's sender sends them), not by ``send`` one at a
    time: ``send`` costs some 15-30 µs of Python per record, CPU the worker under test
    would otherwise lose to its load generator on a machine of two cores.  The records,
    their partitions and the idempotent producer are the same."""
    batches = Batches(producer, max_request_bytes=MAX_REQUEST_BYTES)
    queue = batches.queue
    futures = []
    for n, (topic, key, value, _) in enumerate(schedule):
        futures.append(queue(topic, key, value))
        if n % 1000 == 999:
            await asyncio.sleep(0)  # let the keyspace listener and the batches' lanes run
    await batches.drain()
    await asyncio.gather(*futures)


@dataclass(slots=True)
class PhaseContext:
    """What every phase uses; `notes` collects what the report should mention."""

    settings: PipelineSettings
    names: Names
    progress: Progress
    worker: BenchWorkers
    kafka: KafkaProbe
    watcher: TokensWatcher
    redis: aioredis.Redis
    notes: list[str]


async def warm_up(ctx: PhaseContext, requests: list[BenchRequest]) -> None:
    """Put `requests` through, then wait until the worker's group has no lag."""
    ctx.progress(f"warming the worker up with {len(requests)} sample requests …")
    ctx.watcher.expect(r.request_id for r in requests)
    async with contextlib.AsyncExitStack() as stack:
        producer = idempotent_producer(ctx.settings.bootstrap_servers, linger_ms=5)
        await producer.start()
        stack.push_async_callback(producer.stop)
        await produce_all(producer, interleave(requests, ctx.settings.concurrency))
    if not await ctx.watcher.wait(ctx.worker, ctx.progress, "warm-up", len(requests)):
        raise StackError(f"the worker did not process the warm-up requests: see {ctx.worker.log}")
    lag = await ctx.kafka.wait_caught_up(ctx.worker, ctx.progress, timeout=300)
    if lag:
        ctx.notes.append(f"the worker was still {lag:,} raw messages behind when timing began")
    members = await ctx.kafka.group_members()
    wanted = ctx.settings.workers
    if members is not None and members != wanted:
        ctx.notes.append(
            f"the consumer group {ctx.names.group!r} had {members} members, not {wanted}: "
            "another worker shared the partitions, so the figures are not those of the run's"
        )


async def measure_throughput(
    ctx: PhaseContext, requests: list[BenchRequest]
) -> tuple[Throughput, dict[Any, int], dict[Any, int]]:
    """`requests` as fast as possible; the figures and the raw end offsets before and after."""
    raw_tps = ctx.names.partitions(*ctx.names.topics.raw)
    billing_tps = ctx.names.partitions(ctx.names.topics.billing)
    raw_start = await ctx.kafka.end_offsets(raw_tps)
    billing_start = await ctx.kafka.end_offsets(billing_tps)
    schedule = interleave(requests, ctx.settings.concurrency)
    raw_events = sum(r.events for r in requests)
    ids = [r.request_id for r in requests]
    ctx.progress(
        f"throughput: producing {raw_events:,} raw events ({len(schedule):,} messages, "
        f"{len(requests):,} requests) as fast as possible …"
    )
    producer = idempotent_producer(ctx.settings.bootstrap_servers, linger_ms=10)
    await producer.start()
    try:
        ctx.watcher.expect(ids)
        stages_before = await ctx.worker.stages()
        cpu_before = ctx.worker.cpu_seconds()
        start = time.perf_counter()
        await produce_all(producer, schedule)
        produced = time.perf_counter()
    finally:
        await producer.stop()
    ctx.progress(f"  produced and acked in {produced - start:.2f} s; waiting for Redis …")
    finished = await ctx.watcher.wait(ctx.worker, ctx.progress, "throughput", len(ids))
    cpu = ctx.worker.cpu_seconds() - cpu_before
    stages_after = await ctx.worker.stages()
    batches = (
        {}
        if stages_before is None or stages_after is None
        else batch_summary(difference(stages_after, stages_before))
    )
    done = [ctx.watcher.seen[r] for r in ids if r in ctx.watcher.seen]
    end = max(done) if done else time.perf_counter()
    if not finished:
        ctx.notes.append(
            f"throughput: only {len(done)}/{len(ids)} requests reached Redis; the figure "
            "is over the time until the last one that did"
        )
    raw_end = await ctx.kafka.end_offsets(raw_tps)
    # Billing events are produced (and acked) before the Redis write of the same batch.
    billing_end = await ctx.kafka.end_offsets(billing_tps)
    keys = {output_key(RequestRef(TENANT, r)) for r in ids}  # the billing topic's keys
    billing, billed = await ctx.kafka.count_keys(
        ctx.names.topics.billing.name, billing_start, billing_end, keys
    )
    if billed != len(done):
        ctx.notes.append(
            f"throughput: {billed} requests billed on the billing topic, {len(done)} in Redis"
        )
    if billing != billed:
        ctx.notes.append(
            f"throughput: {billing - billed} duplicate billing records (same request) for "
            f"{billed} requests, from one worker process that ran throughout"
        )
    result = Throughput(
        requests=len(requests),
        raw_events=raw_events,
        messages=len(schedule),
        seconds=end - start,
        produce_seconds=produced - start,
        completed=len(done),
        billing_events=billing,
        billing_requests=billed,
        billing_offset_growth=sum(billing_end.values()) - sum(billing_start.values()),
        worker_cpu_seconds=cpu,
        batches=batches,
    )
    return result, raw_start, raw_end


async def measure_ceiling(ctx: PhaseContext, start: dict[Any, int], end: dict[Any, int]) -> Ceiling:
    """The raw messages in `[start, end)` through plain aiokafka (`benchmarks.passthrough`)."""
    total = sum(end.values()) - sum(start.values())
    ctx.progress(
        f"ceiling: plain aiokafka pass-through of the same {total:,} raw messages to "
        f"{passthrough.PASSTHROUGH_TOPIC} …"
    )
    result = await passthrough.run(
        ctx.settings.bootstrap_servers, start, end, progress=ctx.progress
    )
    if result.messages != total:
        ctx.notes.append(f"pass-through moved {result.messages:,} of {total:,} messages")
    return Ceiling(result.messages, result.seconds, result.messages_per_second)


async def measure_latency(ctx: PhaseContext, requests: list[BenchRequest]) -> Latency:
    """`requests` at `settings.rate` raw events/s; per request, END sent to Tokens readable.

    A request's latency starts when its END marker is handed to the producer,
    which is always before the worker can see it, and ends when its Tokens is
    readable in Redis.  (It used to start when the send's acknowledgement was
    handled here, which can come after the worker has already written the
    Tokens: negative latencies.)  Only requests whose END was acknowledged count.
    """
    settings = ctx.settings
    lag = await ctx.kafka.wait_caught_up(ctx.worker, ctx.progress, timeout=120)
    if lag:
        ctx.notes.append(f"latency: the worker was {lag:,} raw messages behind at the start")
    schedule = interleave(requests, settings.concurrency)
    raw_events = sum(r.events for r in requests)
    ids = [r.request_id for r in requests]
    stages_before = await ctx.worker.stages()
    ctx.progress(
        f"latency: {len(requests):,} requests ({raw_events:,} raw events) at "
        f"{settings.rate:,.0f} raw events/s for ~{settings.seconds:g} s …"
    )
    sent_at: dict[str, float] = {}
    acked: set[str] = set()
    failed: list[BaseException] = []

    def on_done(future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            failed.append(future.exception())  # type: ignore[arg-type]

    def on_ack(request_id: str) -> Callable[[asyncio.Future[Any]], None]:
        def done(future: asyncio.Future[Any]) -> None:
            if not future.cancelled() and future.exception() is None:
                acked.add(request_id)

        return done

    # aiokafka's ``send`` here, not `Batches`: a batch handed over waits in the producer
    # taking no more records, so with `Batches` a record can wait one produce request more
    # (p50 at 5,000/s was about 50 ms longer).  Latency is what this phase measures.
    producer = idempotent_producer(settings.bootstrap_servers, linger_ms=5)
    await producer.start()
    try:
        ctx.watcher.expect(ids)
        cpu_before = ctx.worker.cpu_seconds()
        sent = raw_sent = 0
        start = time.perf_counter()
        last_report = start
        while sent < len(schedule):
            now = time.perf_counter()
            due = min(len(schedule), int((now - start) * settings.rate) + 1)
            while sent < due:
                topic, key, value, end_of = schedule[sent]
                if end_of is not None:
                    sent_at[end_of] = time.perf_counter()
                future = await producer.send(topic, value, key=key)
                if end_of is not None:
                    future.add_done_callback(on_ack(end_of))
                else:
                    raw_sent += 1
                    future.add_done_callback(on_done)
                sent += 1
            if now - last_report >= 2.0:
                last_report = now
                ctx.progress(
                    f"  latency: sent {raw_sent:,}/{raw_events:,} raw events; "
                    f"{len(ids) - ctx.watcher.pending:,}/{len(ids):,} requests in Redis"
                )
            await asyncio.sleep(_PACE_SLICE)
        last_send = time.perf_counter()
        # Not a gather over every send of the phase: its setup, one callback per future
        # in one go, held this process's loop for some 300 ms after the last sends, while
        # their records waited in the producer and the Tokens' notifications here (the
        # phase's last requests measured that much slower).
        await producer.flush()
    finally:
        await producer.stop()
    await ctx.watcher.wait(ctx.worker, ctx.progress, "latency", len(ids))
    cpu = ctx.worker.cpu_seconds() - cpu_before
    stages_after = await ctx.worker.stages()
    if stages_before is None or stages_after is None:
        ctx.notes.append("latency: the worker's /stages did not answer: no per-stage figures")
        stages: dict[str, Any] = {}
        batches: dict[str, Any] = {}
    else:
        between = difference(stages_after, stages_before)
        stages = summarise(between)
        batches = batch_summary(between)
    seconds = last_send - start
    measured = [
        (sent_at[r] - start, (ctx.watcher.seen[r] - sent_at[r]) * 1000)
        for r in ids
        if r in ctx.watcher.seen and r in acked
    ]
    latencies = sorted(ms for _, ms in measured)
    by_window: dict[int, list[float]] = {}
    for at, ms in measured:
        by_window.setdefault(int(at // WINDOW_SECONDS), []).append(ms)
    windows = [
        (k * WINDOW_SECONDS, len(v), round(_percentile(sorted(v), 50), 1), round(max(v), 1))
        for k, v in sorted(by_window.items())
    ]
    if failed:
        ctx.notes.append(f"latency: {len(failed)} raw events were not acknowledged ({failed[0]})")
    if len(latencies) != len(ids):
        ctx.notes.append(f"latency: {len(ids) - len(latencies)} requests have no latency figure")

    def pick(p: float) -> float | None:
        return round(_percentile(latencies, p), 2) if latencies else None

    return Latency(
        target_rate=settings.rate,
        achieved_rate=raw_events / seconds if seconds > 0 else 0.0,
        produce_seconds=seconds,
        raw_events=raw_events,
        requests=len(ids),
        completed=len(latencies),
        p50_ms=pick(50),
        p90_ms=pick(90),
        p99_ms=pick(99),
        p999_ms=pick(99.9),
        max_ms=round(latencies[-1], 2) if latencies else None,
        min_ms=round(latencies[0], 2) if latencies else None,
        mean_ms=round(sum(latencies) / len(latencies), 2) if latencies else None,
        worker_cpu_seconds=cpu,
        windows=windows,
        stages=stages,
        batches=batches,
    )
