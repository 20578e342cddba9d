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
   `seconds`; each request's latency runs from the moment its END marker's send
   future resolves to the moment its Tokens is readable in Redis.
5. Memory.  The worker's RSS is sampled all along; VmHWM is read at the end.

Readability in Redis is observed through keyspace notifications
(`notify-keyspace-events` gets `K$` for the run and its old value back after)
on `__keyspace@<db>__:st:tokens:bench-<run>-*`, timestamped with
`time.perf_counter()` in this process, like the producer side.

The worker runs in a namespace of its own (`STREAMTALLY_NAMESPACE`, default
`streamtally-bench`: topics `streamtally-bench.*` with one-day retention, and
consumer group `streamtally-bench`) on the same broker, so that no other worker
(a demo, a test) joins its consumer group and takes partitions or replays its
requests; set STREAMTALLY_NAMESPACE=streamtally to measure on the shared topics.

The benchmark writes real records: Tokens keys, usage rows of tenant `bench`,
chunks and billing events, and the scratch topic `streamtally.bench.passthrough`.
Nothing is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from benchmarks import passthrough
from benchmarks.fold import engine_stream
from streamtally.core.models import Source
from streamtally.errors import StackError
from streamtally.ops.stack.config import StackConfig
from streamtally.producers import raw_records
from streamtally.settings import Settings, project_root
from streamtally.topics import DAY_MS, Topic, Topics, encode_key
from streamtally.wire.kafka import ensure_topics

__all__ = [
    "TARGET_EVENTS_PER_SECOND",
    "TARGET_P99_MS",
    "TARGET_RATIO",
    "PipelineReport",
    "PipelineSettings",
    "format_report",
    "run",
]

TARGET_EVENTS_PER_SECOND: Final = 20_000
TARGET_RATIO: Final = 0.5
TARGET_P99_MS: Final = 250.0

TENANT: Final = "bench"
#: The namespace (topic prefix and consumer group) of the benchmark's worker, unless
#: STREAMTALLY_NAMESPACE names one: its own, so no other worker joins its group.
BENCH_NAMESPACE: Final = "streamtally-bench"
#: Request timeout given to the worker: nothing of the benchmark may time out.
WORKER_REQUEST_TIMEOUT: Final = 86_400
_LONG_SSE: Final = (Source.OPENAI, Source.ANTHROPIC, Source.OPENAI_RESPONSES, Source.GEMINI)
_ENGINES: Final = (Source.DYNAMO, Source.VLLM, Source.ATOMR)
#: Give up waiting when no request completed for this long.
_STALL_SECONDS: Final = 90.0
_PACE_SLICE: Final = 0.005
#: Width of the latency phase's time windows in the report.
WINDOW_SECONDS: Final = 5.0

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    #: Raw events of the throughput phase (whole requests: the figure is rounded up).
    events: int = 200_000
    #: Raw events per second of the latency phase.
    rate: float = 5000.0
    #: Length of the latency phase.
    seconds: float = 20.0
    #: Requests in flight (interleaved) at a time while producing.
    concurrency: int = 16
    bootstrap_servers: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"

    def __post_init__(self) -> None:
        if self.events < 1 or self.rate <= 0 or self.seconds <= 0 or self.concurrency < 1:
            raise ValueError("events, rate, seconds and concurrency must be positive")


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Machine:
    cores: int
    cpu: str
    system: str
    python: str
    #: 1-minute load average before and after the run (other work on the machine).
    load_before: float
    load_after: float
    kafka: str | None
    redis: str | None
    aiokafka: str | None
    faust: str | None


@dataclass(frozen=True, slots=True)
class Workload:
    run_id: str
    tenant: str
    #: Requests per source in the throughput + latency phases.
    requests_by_source: dict[str, int]
    encode_seconds: float
    concurrency: int
    #: Topic prefix and consumer group of the worker.
    namespace: str


@dataclass(frozen=True, slots=True)
class Throughput:
    requests: int
    #: Raw events, END markers not included.
    raw_events: int
    #: Kafka messages: raw events plus one END marker per request.
    messages: int
    #: First send → last Tokens readable in Redis.
    seconds: float
    #: First send → every send acked.
    produce_seconds: float
    completed: int
    #: Billing records of the run's requests on the billing topic, and the requests they bill.
    billing_events: int
    billing_requests: int
    billing_offset_growth: int
    worker_cpu_seconds: float

    @property
    def raw_events_per_second(self) -> float:
        return self.raw_events / self.seconds if self.seconds > 0 else 0.0

    @property
    def messages_per_second(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Ceiling:
    messages: int
    seconds: float
    messages_per_second: float


@dataclass(frozen=True, slots=True)
class Latency:
    target_rate: float
    achieved_rate: float
    produce_seconds: float
    raw_events: int
    requests: int
    completed: int
    #: Milliseconds, END marker acked → Tokens readable; None when no request completed.
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    min_ms: float | None
    mean_ms: float | None
    worker_cpu_seconds: float
    #: Per window of `WINDOW_SECONDS` (by END ack time): start second, requests, p50, max (ms).
    windows: list[tuple[float, int, float, float]]


@dataclass(frozen=True, slots=True)
class Memory:
    #: VmHWM at the end of the run: the worker's peak resident set.
    peak_rss_mib: float
    #: Largest VmRSS sampled (every 0.2 s) during the run.
    sampled_peak_rss_mib: float
    #: VmRSS once the worker was warmed up, before the throughput phase.
    idle_rss_mib: float
    samples: int


@dataclass(frozen=True, slots=True)
class PipelineReport:
    machine: Machine
    workload: Workload
    throughput: Throughput
    ceiling: Ceiling
    latency: Latency
    memory: Memory
    worker_log: str
    notes: list[str]

    @property
    def ratio(self) -> float:
        """Worker messages/s end to end over pass-through messages/s."""
        ceiling = self.ceiling.messages_per_second
        return self.throughput.messages_per_second / ceiling if ceiling > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        throughput = asdict(self.throughput)
        throughput.update(
            raw_events_per_second=round(self.throughput.raw_events_per_second, 1),
            messages_per_second=round(self.throughput.messages_per_second, 1),
            requests_per_second=round(self.throughput.requests_per_second, 2),
        )
        return {
            "machine": asdict(self.machine),
            "workload": asdict(self.workload),
            "throughput": throughput,
            "passthrough": asdict(self.ceiling),
            "worker_over_passthrough": round(self.ratio, 4),
            "latency": asdict(self.latency),
            "memory": asdict(self.memory),
            "targets": {
                "raw_events_per_second": TARGET_EVENTS_PER_SECOND,
                "worker_over_passthrough": TARGET_RATIO,
                "p99_ms_below": TARGET_P99_MS,
            },
            "worker_log": self.worker_log,
            "notes": self.notes,
        }


# --------------------------------------------------------------------------- namespace


@dataclass(frozen=True, slots=True)
class Names:
    """The topics and consumer group the benchmark's worker uses."""

    topics: Topics

    @property
    def namespace(self) -> str:
        """Topic prefix and consumer group (`STREAMTALLY_NAMESPACE` of the worker)."""
        return self.topics.namespace

    @property
    def group(self) -> str:
        return self.topics.processors_group

    def partitions(self, *used: Topic) -> list[Any]:
        return [TopicPartition(t.name, p) for t in used for p in range(t.partitions)]


def bench_names(settings: Settings) -> Names:
    """`STREAMTALLY_NAMESPACE` if set, else `BENCH_NAMESPACE` with one-day retention.

    Running the worker in a namespace of its own keeps other workers on the
    broker (tests, demos) out of its consumer group: they would share its
    partitions, and their rebalances would replay its requests.
    """
    if "namespace" in settings.model_fields_set:
        return Names(Topics.in_namespace(settings.namespace))
    scratch = Topics.in_namespace(BENCH_NAMESPACE)
    one_day = [
        dataclasses.replace(t, retention_ms=DAY_MS) if t.cleanup_policy == "delete" else t
        for t in scratch.all
    ]
    return Names(Topics(BENCH_NAMESPACE, *one_day))


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    source: Source
    topic: str
    #: Encoded raw records: the events, then the END marker.
    records: list[bytes]

    @property
    def events(self) -> int:
        return len(self.records) - 1


#: One message to send: topic, key, value, and the request id when it is the END marker.
Send = tuple[str, bytes, bytes, str | None]


def _transcript_cycle(samples: Path) -> list[tuple[Source, bytes]]:
    """One cycle of the request mix: 8 long SSE streams, 3 long engine streams, 1 sample."""
    long_sse = [(s, (samples / s.value / "long_text_bench.sse").read_bytes()) for s in _LONG_SSE]
    engines = [(s, engine_stream(s, tokens=200)) for s in _ENGINES]
    return [*long_sse, *long_sse, *engines]


def _small_engine_samples(samples: Path) -> list[tuple[Source, bytes]]:
    return [
        (source, path.read_bytes())
        for source in _ENGINES
        for path in sorted((samples / source.value).glob("*.jsonl"))
    ]


class _Workload:
    """Builds and encodes the benchmark's requests, numbering them `bench-<run>-<n>`."""

    def __init__(self, run_id: str, samples: Path, names: Names) -> None:
        self.run_id = run_id
        self.names = names
        self.samples = samples
        self._cycle = _transcript_cycle(samples)
        self._small = itertools.cycle(_small_engine_samples(samples))
        self._next = 0
        self.encode_seconds = 0.0
        self.by_source: dict[str, int] = {}

    def prefix(self) -> str:
        return f"bench-{self.run_id}-"

    def _encode(self, request_id: str, source: Source, data: bytes) -> BenchRequest:
        start = time.perf_counter()
        _, records = raw_records(source, data, tenant=TENANT, request_id=request_id)
        self.encode_seconds += time.perf_counter() - start
        topic = (self.names.topics.raw_sse if source.is_sse else self.names.topics.raw_engine).name
        return BenchRequest(request_id, source, topic, records)

    def requests(self, min_events: int) -> list[BenchRequest]:
        """Whole requests of the mix, at least `min_events` raw events in all."""
        out: list[BenchRequest] = []
        events = 0
        while events < min_events:
            for source, data in [*self._cycle, next(self._small)]:
                request = self._encode(f"{self.prefix()}{self._next}", source, data)
                self._next += 1
                self.by_source[source.value] = self.by_source.get(source.value, 0) + 1
                out.append(request)
                events += request.events
                if events >= min_events:
                    break
        return out

    def warmup(self) -> list[BenchRequest]:
        """Every transcript of the manifest (short, all sources, both topics), once."""
        out = []
        for k, line in enumerate((self.samples / "manifest.jsonl").read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            data = (self.samples / row["file"]).read_bytes()
            out.append(self._encode(f"{self.prefix()}warm{k}", Source(row["source"]), data))
        return out


def interleave(requests: Sequence[BenchRequest], width: int) -> list[Send]:
    """The messages of `requests`, `width` requests in flight at a time, round robin."""
    out: list[Send] = []
    waiting = deque(requests)
    active: deque[tuple[BenchRequest, bytes, int]] = deque()
    while waiting or active:
        while waiting and len(active) < width:
            request = waiting.popleft()
            active.append((request, encode_key(request.request_id), 0))
        request, key, index = active.popleft()
        last = len(request.records) - 1
        out.append(
            (
                request.topic,
                key,
                request.records[index],
                request.request_id if index == last else None,
            )
        )
        if index < last:
            active.append((request, key, index + 1))
    return out


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _kafka_version() -> str | None:
    try:
        from streamtally.ops.stack.kafka import kafka_version

        return kafka_version()
    except (ImportError, StackError, OSError):
        return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- the worker


class _WorkerProcess:
    """The worker subprocess, its log, its RSS and CPU time (Linux /proc)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streamtally.cli", "worker"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.pid = self.process.pid
        self.rss_samples: list[int] = []

    def check(self) -> None:
        code = self.process.poll()
        if code is not None:
            tail = ""
            with contextlib.suppress(OSError):
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
            raise StackError(f"the worker exited with status {code}; see {self.log}:\n{tail}")

    def _status_kib(self, field_name: str) -> int | None:
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
        return None

    def rss_kib(self) -> int | None:
        return self._status_kib("VmRSS")

    def hwm_kib(self) -> int | None:
        return self._status_kib("VmHWM")

    def cpu_seconds(self) -> float:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()
        # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def sample_rss(self, every: float = 0.2) -> None:
        while True:
            rss = self.rss_kib()
            if rss is not None:
                self.rss_samples.append(rss)
            await asyncio.sleep(every)

    def stop(self, progress: Progress) -> None:
        if self.process.poll() is not None:
            return
        progress(f"stopping the worker (SIGTERM to pid {self.pid})")
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            progress("the worker did not stop within 30 s: SIGKILL")
            self.process.kill()
            self.process.wait(timeout=10)


# --------------------------------------------------------------------------- Redis


class _TokensWatcher:
    """Timestamps the first SET of every `st:tokens:<prefix>*` key (keyspace notifications)."""

    def __init__(self, client: aioredis.Redis, db: int, prefix: str) -> None:
        self._client = client
        self._channel_prefix = f"__keyspace@{db}__:st:tokens:".encode()
        self.pattern = f"__keyspace@{db}__:st:tokens:{prefix}*"
        self.seen: dict[str, float] = {}
        self._pending: set[str] = set()
        self._all_seen = asyncio.Event()
        self._pubsub: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._pubsub = self._client.pubsub()
        await self._pubsub.psubscribe(self.pattern)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the subscription is confirmed before any SET
            message = await self._pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == "psubscribe":
                break
        else:
            raise StackError("Redis did not confirm the keyspace subscription")
        self._task = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        cut = len(self._channel_prefix)
        async for message in self._pubsub.listen():
            now = time.perf_counter()
            if message["type"] != "pmessage" or message["data"] != b"set":
                continue
            request_id = bytes(message["channel"][cut:]).decode()
            if request_id not in self.seen:
                self.seen[request_id] = now
                self._pending.discard(request_id)
                if not self._pending:
                    self._all_seen.set()

    def expect(self, request_ids: Iterable[str]) -> None:
        self._pending = {r for r in request_ids if r not in self.seen}
        self._all_seen = asyncio.Event()
        if not self._pending:
            self._all_seen.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def wait(
        self,
        worker: _WorkerProcess,
        progress: Progress,
        label: str,
        total: int,
        status: Callable[[], str] | None = None,
    ) -> bool:
        """Wait until every expected key was seen; False when the worker stalled."""
        last_pending = self.pending
        last_change = time.monotonic()
        last_report = 0.0
        while not self._all_seen.is_set():
            if self._task is not None and self._task.done():
                self._task.result()  # raises what killed the listener
                raise StackError("the Redis keyspace listener stopped")
            worker.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_seen.wait(), timeout=0.5)
            now = time.monotonic()
            if self.pending != last_pending:
                last_pending, last_change = self.pending, now
            elif now - last_change > _STALL_SECONDS:
                progress(f"  {label}: no request completed for {_STALL_SECONDS:g} s, giving up")
                return False
            if now - last_report >= 2.0:
                last_report = now
                extra = f"; {status()}" if status is not None else ""
                progress(f"  {label}: {total - self.pending:,}/{total:,} requests in Redis{extra}")
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError):
                await self._task
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _keyspace_flags(old: str) -> str:
    """`old` plus K (keyspace events) and $ (string commands)."""
    flags = old
    for flag in "K$":
        if flag not in flags and not (flag == "$" and "A" in flags):
            flags += flag
    return flags


# --------------------------------------------------------------------------- Kafka


class _Kafka:
    """Offsets, lag and the worker group's members, from one admin client and one consumer."""

    def __init__(self, servers: str, names: Names) -> None:
        self.servers = servers
        self.names = names
        self.admin = AIOKafkaAdminClient(bootstrap_servers=servers, request_timeout_ms=15000)
        self.consumer = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)

    async def start(self) -> None:
        await self.admin.start()
        await self.consumer.start()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.consumer.stop()
        with contextlib.suppress(Exception):
            await self.admin.close()

    async def end_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return dict(await self.consumer.end_offsets(tps))

    async def lag(self) -> int:
        """Raw messages the worker group has not committed yet."""
        tps = self.names.partitions(*self.names.topics.raw)
        ends = await self.end_offsets(tps)
        begins = dict(await self.consumer.beginning_offsets(tps))
        committed = await self.admin.list_consumer_group_offsets(self.names.group, partitions=tps)
        lag = 0
        for tp in tps:
            meta = committed.get(tp)
            done = meta.offset if meta is not None and meta.offset >= 0 else begins[tp]
            lag += max(0, ends[tp] - done)
        return lag

    async def group_members(self) -> int | None:
        try:
            response = await self.admin.describe_consumer_groups([self.names.group])
            return len(response[0].groups[0][5])
        except (KafkaError, IndexError, AttributeError, TypeError):  # diagnostics only
            return None

    async def wait_caught_up(
        self, worker: _WorkerProcess, progress: Progress, timeout: float
    ) -> int:
        """Wait until the worker group has committed every raw message; the lag left."""
        deadline = time.monotonic() + timeout
        last_report = 0.0
        while True:
            worker.check()
            lag = await self.lag()
            now = time.monotonic()
            if lag == 0 or now >= deadline:
                return lag
            if now - last_report >= 2.0:
                last_report = now
                progress(f"  waiting for the worker to catch up: {lag:,} raw messages behind")
            await asyncio.sleep(0.5)

    async def count_keys(
        self, topic: str, start: dict[Any, int], end: dict[Any, int], keys: set[bytes]
    ) -> tuple[int, int]:
        """Records in `[start, end)` of `topic` with a key in `keys`, and distinct such keys."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.servers, enable_auto_commit=False)
        await consumer.start()
        try:
            remaining = {tp: end[tp] for tp in end if tp.topic == topic and end[tp] > start[tp]}
            if not remaining:
                return 0, 0
            consumer.assign(list(remaining))
            for tp in remaining:
                consumer.seek(tp, start[tp])
            found = 0
            distinct: set[bytes] = set()
            while remaining:
                batches = await consumer.getmany(*remaining, timeout_ms=500, max_records=5000)
                for tp, records in batches.items():
                    stop = remaining.get(tp)
                    if stop is None:
                        continue
                    for record in records:
                        if record.offset < stop and record.key in keys:
                            found += 1
                            distinct.add(record.key)
                    if records and records[-1].offset + 1 >= stop:
                        del remaining[tp]
                        consumer.pause(tp)
            return found, len(distinct)
        finally:
            await consumer.stop()


def _producer(servers: str, linger_ms: int) -> Any:
    return AIOKafkaProducer(
        bootstrap_servers=servers,
        acks="all",
        enable_idempotence=True,
        linger_ms=linger_ms,
        max_batch_size=1 << 20,
        max_request_size=8 << 20,
    )


# --------------------------------------------------------------------------- phases


def _percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


async def _produce_all(producer: Any, schedule: list[Send]) -> None:
    send = producer.send
    futures = []
    for n, (topic, key, value, _) in enumerate(schedule):
        futures.append(await send(topic, value, key=key))
        if n % 1000 == 999:
            await asyncio.sleep(0)  # let the keyspace listener and the sender run
    await asyncio.gather(*futures)


@dataclass(slots=True)
class _Context:
    settings: PipelineSettings
    names: Names
    progress: Progress
    worker: _WorkerProcess
    kafka: _Kafka
    watcher: _TokensWatcher
    redis: aioredis.Redis
    notes: list[str]


async def _warm_up(ctx: _Context, requests: list[BenchRequest]) -> None:
    ctx.progress(f"warming the worker up with {len(requests)} sample requests …")
    ctx.watcher.expect(r.request_id for r in requests)
    async with contextlib.AsyncExitStack() as stack:
        producer = _producer(ctx.settings.bootstrap_servers, linger_ms=5)
        await producer.start()
        stack.push_async_callback(producer.stop)
        await _produce_all(producer, interleave(requests, ctx.settings.concurrency))
    if not await ctx.watcher.wait(ctx.worker, ctx.progress, "warm-up", len(requests)):
        raise StackError(f"the worker did not process the warm-up requests: see {ctx.worker.log}")
    lag = await ctx.kafka.wait_caught_up(ctx.worker, ctx.progress, timeout=300)
    if lag:
        ctx.notes.append(f"the worker was still {lag:,} raw messages behind when timing began")
    members = await ctx.kafka.group_members()
    if members is not None and members != 1:
        ctx.notes.append(
            f"the consumer group {ctx.names.group!r} had {members} members: another worker "
            "shared the partitions, so the figures are not those of one worker"
        )


async def _throughput(
    ctx: _Context, requests: list[BenchRequest]
) -> tuple[Throughput, dict[Any, int], dict[Any, int]]:
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
    producer = _producer(ctx.settings.bootstrap_servers, linger_ms=10)
    await producer.start()
    try:
        ctx.watcher.expect(ids)
        cpu_before = ctx.worker.cpu_seconds()
        start = time.perf_counter()
        await _produce_all(producer, schedule)
        produced = time.perf_counter()
    finally:
        await producer.stop()
    ctx.progress(f"  produced and acked in {produced - start:.2f} s; waiting for Redis …")
    finished = await ctx.watcher.wait(ctx.worker, ctx.progress, "throughput", len(ids))
    cpu = ctx.worker.cpu_seconds() - cpu_before
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
    keys = {encode_key(r) for r in ids}
    billing, billed = await ctx.kafka.count_keys(
        ctx.names.topics.billing.name, billing_start, billing_end, keys
    )
    if billed != len(done):
        ctx.notes.append(
            f"throughput: {billed} requests billed on the billing topic, {len(done)} in Redis"
        )
    if billing != billed:
        ctx.notes.append(
            f"throughput: {billing - billed} duplicate billing records (same request id) for "
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
    )
    return result, raw_start, raw_end


async def _ceiling(ctx: _Context, start: dict[Any, int], end: dict[Any, int]) -> Ceiling:
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


async def _latency(ctx: _Context, requests: list[BenchRequest]) -> Latency:
    settings = ctx.settings
    lag = await ctx.kafka.wait_caught_up(ctx.worker, ctx.progress, timeout=120)
    if lag:
        ctx.notes.append(f"latency: the worker was {lag:,} raw messages behind at the start")
    schedule = interleave(requests, settings.concurrency)
    raw_events = sum(r.events for r in requests)
    ids = [r.request_id for r in requests]
    ctx.progress(
        f"latency: {len(requests):,} requests ({raw_events:,} raw events) at "
        f"{settings.rate:,.0f} raw events/s for ~{settings.seconds:g} s …"
    )
    acked: dict[str, float] = {}

    def on_ack(request_id: str) -> Callable[[asyncio.Future[Any]], None]:
        def done(future: asyncio.Future[Any]) -> None:
            if not future.cancelled() and future.exception() is None:
                acked[request_id] = time.perf_counter()

        return done

    producer = _producer(settings.bootstrap_servers, linger_ms=5)
    await producer.start()
    try:
        ctx.watcher.expect(ids)
        cpu_before = ctx.worker.cpu_seconds()
        futures: list[asyncio.Future[Any]] = []
        sent = raw_sent = 0
        start = time.perf_counter()
        last_report = start
        while sent < len(schedule):
            now = time.perf_counter()
            due = min(len(schedule), int((now - start) * settings.rate) + 1)
            while sent < due:
                topic, key, value, end_of = schedule[sent]
                future = await producer.send(topic, value, key=key)
                if end_of is not None:
                    future.add_done_callback(on_ack(end_of))
                else:
                    raw_sent += 1
                futures.append(future)
                sent += 1
            if now - last_report >= 2.0:
                last_report = now
                ctx.progress(
                    f"  latency: sent {raw_sent:,}/{raw_events:,} raw events; "
                    f"{len(ids) - ctx.watcher.pending:,}/{len(ids):,} requests in Redis"
                )
            await asyncio.sleep(_PACE_SLICE)
        last_send = time.perf_counter()
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    await ctx.watcher.wait(ctx.worker, ctx.progress, "latency", len(ids))
    cpu = ctx.worker.cpu_seconds() - cpu_before
    seconds = last_send - start
    measured = [
        (acked[r] - start, (ctx.watcher.seen[r] - acked[r]) * 1000)
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
        max_ms=round(latencies[-1], 2) if latencies else None,
        min_ms=round(latencies[0], 2) if latencies else None,
        mean_ms=round(sum(latencies) / len(latencies), 2) if latencies else None,
        worker_cpu_seconds=cpu,
        windows=windows,
    )


async def _redis_client(url: str) -> tuple[aioredis.Redis, int, str | None]:
    client = aioredis.from_url(url)
    try:
        info = await client.info("server")
    except (RedisError, OSError) as exc:
        await client.aclose()
        raise StackError(
            f"cannot reach Redis at {url}: start it with `streamtally stack up` or set REDIS_URL"
        ) from exc
    db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
    version = info.get("redis_version")
    return client, db, None if version is None else str(version)


async def _bench(
    *,
    settings: PipelineSettings,
    names: Names,
    workload: _Workload,
    warm: list[BenchRequest],
    load: list[BenchRequest],
    steady: list[BenchRequest],
    worker: _WorkerProcess,
    progress: Progress,
) -> tuple[Throughput, Ceiling, Latency, Memory, str | None, list[str]]:
    notes: list[str] = []
    client, db, redis_version = await _redis_client(settings.redis_url)
    kafka = _Kafka(settings.bootstrap_servers, names)
    old_flags: str | None = None
    sampler: asyncio.Task[None] | None = None
    watcher = _TokensWatcher(client, db, workload.prefix())
    try:
        await kafka.start()
        config = await client.config_get("notify-keyspace-events")
        old_flags = _text(next(iter(config.values()), ""))
        await client.config_set("notify-keyspace-events", _keyspace_flags(old_flags))
        await watcher.start()
        sampler = asyncio.create_task(worker.sample_rss())
        ctx = _Context(settings, names, progress, worker, kafka, watcher, client, notes)
        dead_tps = names.partitions(names.topics.deadletter)
        dead_start = await kafka.end_offsets(dead_tps)

        await _warm_up(ctx, warm)
        idle_rss = worker.rss_kib() or 0
        throughput, raw_start, raw_end = await _throughput(ctx, load)
        ceiling = await _ceiling(ctx, raw_start, raw_end)
        latency = await _latency(ctx, steady)

        members = await kafka.group_members()
        if members is not None and members != 1:
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
    progress(f"pipeline benchmark run {run_id}: encoding the requests (not timed) …")
    workload = _Workload(run_id, samples, names)
    warm = workload.warmup()
    load = workload.requests(settings.events)
    steady = workload.requests(max(1, round(settings.rate * settings.seconds)))
    progress(
        f"  {len(load) + len(steady):,} requests, "
        f"{sum(r.events for r in load) + sum(r.events for r in steady):,} raw events "
        f"encoded in {workload.encode_seconds:.1f} s"
    )
    progress(f"worker namespace {names.namespace!r} (its topics and consumer group)")
    asyncio.run(ensure_topics(settings.bootstrap_servers, names.topics.all))
    asyncio.run(passthrough.ensure_passthrough_topic(settings.bootstrap_servers))
    log = StackConfig.from_settings(app_settings).state_dir / "logs" / "bench-worker.log"
    env = dict(os.environ)
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers,
        REDIS_URL=settings.redis_url,
        STREAMTALLY_REQUEST_TIMEOUT=str(WORKER_REQUEST_TIMEOUT),
        STREAMTALLY_NAMESPACE=names.namespace,
    )
    worker = _WorkerProcess(env, log)
    progress(f"started the worker (pid {worker.pid}, log {log})")
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
            )
        )
    finally:
        worker.stop(progress)
    machine = Machine(
        cores=_cores(),
        cpu=_cpu_model(),
        system=f"{platform.system()} {platform.release()} {platform.machine()}",
        python=f"{platform.python_implementation()} {platform.python_version()}",
        load_before=round(load_before, 2),
        load_after=round(os.getloadavg()[0], 2),
        kafka=_kafka_version(),
        redis=redis_version,
        aiokafka=_version("aiokafka"),
        faust=_version("faust-streaming"),
    )
    return PipelineReport(
        machine=machine,
        workload=Workload(
            run_id=run_id,
            tenant=TENANT,
            requests_by_source=dict(sorted(workload.by_source.items())),
            encode_seconds=round(workload.encode_seconds, 2),
            concurrency=settings.concurrency,
            namespace=names.namespace,
        ),
        throughput=throughput,
        ceiling=ceiling,
        latency=latency,
        memory=memory,
        worker_log=str(log),
        notes=notes,
    )


# --------------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f} ms"


def format_report(report: PipelineReport) -> str:
    m, t, c, lat, mem = (
        report.machine,
        report.throughput,
        report.ceiling,
        report.latency,
        report.memory,
    )
    mix = ", ".join(f"{k} {v}" for k, v in report.workload.requests_by_source.items())
    rows: list[tuple[str, str, str]] = [
        ("throughput, raw events/s (end to end)", f"{t.raw_events_per_second:,.0f}",
         f">= {TARGET_EVENTS_PER_SECOND:,}"),
        ("throughput, requests/s", f"{t.requests_per_second:,.1f}", ""),
        ("throughput, messages/s (incl. END)", f"{t.messages_per_second:,.0f}", ""),
        ("pass-through ceiling, messages/s", f"{c.messages_per_second:,.0f}", ""),
        ("worker / pass-through", f"{report.ratio:.0%}", f">= {TARGET_RATIO:.0%}"),
        (f"latency p50 @ {lat.achieved_rate:,.0f} ev/s", _ms(lat.p50_ms), ""),
        ("latency p90", _ms(lat.p90_ms), ""),
        ("latency p99", _ms(lat.p99_ms), f"< {TARGET_P99_MS:.0f} ms"),
        ("latency max", _ms(lat.max_ms), ""),
        ("worker peak RSS (VmHWM)", f"{mem.peak_rss_mib:,.1f} MiB", ""),
    ]  # fmt: skip
    lines = [
        f"streamtally pipeline benchmark, run {report.workload.run_id} (one worker)",
        f"machine: {m.cores} cores ({m.cpu}), {m.system}, "
        f"load average {m.load_before:.2f} before, {m.load_after:.2f} after",
        f"         {m.python}, Kafka {m.kafka or '?'}, Redis {m.redis or '?'}, "
        f"aiokafka {m.aiokafka or '?'}, faust-streaming {m.faust or '?'}",
        f"requests: {mix} (tenant {report.workload.tenant!r}, "
        f"{report.workload.concurrency} interleaved)",
        f"worker: one process, namespace {report.workload.namespace!r} "
        "(its own topics and consumer group on the running stack)",
        "",
        f"{'figure':<40}{'measured':>16}   {'target':<12}",
    ]
    lines += [f"{name:<40}{value:>16}   {target:<12}" for name, value, target in rows]
    lines += [
        "",
        f"throughput: {t.raw_events:,} raw events / {t.completed:,} of {t.requests:,} requests "
        f"in {t.seconds:.2f} s (producing took {t.produce_seconds:.2f} s); "
        f"worker CPU {t.worker_cpu_seconds:.1f} s "
        f"({t.worker_cpu_seconds / t.seconds if t.seconds else 0:.0%} of a core)",
        f"billing: {t.billing_requests:,} of those requests billed by {t.billing_events:,} "
        f"records on the billing topic (its end offsets grew by {t.billing_offset_growth:,})",
        f"pass-through: {c.messages:,} messages in {c.seconds:.2f} s",
        f"latency: {lat.completed:,}/{lat.requests:,} requests, {lat.raw_events:,} raw events "
        f"over {lat.produce_seconds:.1f} s (target {lat.target_rate:,.0f}/s); "
        f"min {_ms(lat.min_ms)}, mean {_ms(lat.mean_ms)}; worker CPU "
        f"{lat.worker_cpu_seconds:.1f} s",
        "latency p50/max by 5 s window of END acks: "
        + ", ".join(f"{at:g}s {p50:,.0f}/{top:,.0f} ms" for at, _, p50, top in lat.windows),
        f"memory: peak {mem.peak_rss_mib:,.1f} MiB (sampled max {mem.sampled_peak_rss_mib:,.1f}, "
        f"idle after warm-up {mem.idle_rss_mib:,.1f}, {mem.samples} samples)",
        f"worker log: {report.worker_log}",
    ]
    lines += [f"note: {note}" for note in report.notes]
    lines.append("(figures only: the benchmark never fails on speed)")
    return "\n".join(lines)
