"""The pipeline benchmark's figures: the result records, the machine, and the report text.

`PipelineReport` holds one run's `Throughput`, `Ceiling`, `Latency` and
`Memory`, with the `Machine` they were measured on; `to_json` and
`format_report` print it, beside the targets (`TARGET_*`).
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from streamtally import _native
from streamtally.errors import StackError

__all__ = [
    "TARGET_EVENTS_PER_SECOND",
    "TARGET_P99_MS",
    "TARGET_RATIO",
    "WINDOW_SECONDS",
    "Ceiling",
    "Latency",
    "Machine",
    "Memory",
    "PipelineReport",
    "Throughput",
    "Workload",
    "describe_machine",
    "format_report",
]

TARGET_EVENTS_PER_SECOND: Final = 20_000
#: One worker against the plain pass-through (the median of five runs is what counts).
TARGET_RATIO: Final = 0.6
#: The latency p99 targets of one worker: (up to this rate of raw events/s, p99 below ms).
TARGET_P99_MS: Final = ((5_000.0, 100.0), (20_000.0, 300.0))


def target_p99_ms(rate: float) -> float | None:
    """The p99 target at `rate` raw events/s (None: above every rate with a target)."""
    return next((ms for upto, ms in TARGET_P99_MS if rate <= upto), None)


#: Width of the latency phase's time windows in the report.
WINDOW_SECONDS: Final = 5.0


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
    #: Whether the worker ran the compiled hot path (`streamtally._native`), and if not why.
    hot_path: str = ""
    #: Which CPUs the workers and the rest ran on (``--worker-cpus``); "": not pinned.
    pinning: str = ""


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
    #: Poison raw events among the throughput phase's (``--poison-every``), each dead-lettered.
    poison_events: int = 0
    #: Worker processes in the consumer group (``--workers``).
    workers: int = 1
    #: Framing of every value (``--framing``): single-object or confluent.
    framing: str = "single-object"


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
    #: Batches the worker fetched in the phase and their raw messages (`batch_summary`).
    batches: dict[str, Any] = field(default_factory=dict)

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
    #: Milliseconds, END marker handed to the producer → Tokens readable in Redis;
    #: None when no request completed.
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    max_ms: float | None
    min_ms: float | None
    mean_ms: float | None
    worker_cpu_seconds: float
    #: Per window of `WINDOW_SECONDS` (by END send time): start second, requests, p50, max (ms).
    windows: list[tuple[float, int, float, float]]
    #: Inside the worker, per stage of a request's close (`streamtally.processors.stages`):
    #: requests, mean, p50, p90, p99 and p99.9 (ms), over the requests this phase closed.
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Batches the worker fetched in the phase and their raw messages (`batch_summary`).
    batches: dict[str, Any] = field(default_factory=dict)


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
                "p99_ms_below": target_p99_ms(self.latency.target_rate),
            },
            "worker_log": self.worker_log,
            "notes": self.notes,
        }


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
        from streamtally.stack.kafka import kafka_version

        return kafka_version()
    except (ImportError, StackError, OSError):
        return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe_machine(load_before: float, redis_version: str | None, pinning: str = "") -> Machine:
    """This machine and the versions of what ran; the load average is read again now."""
    return Machine(
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
        hot_path=_native.status().describe(),
        pinning=pinning,
    )


# --------------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f} ms"


def format_stages(stages: dict[str, dict[str, Any]]) -> list[str]:
    """The latency phase's per-stage table (the worker's /stages), one line per stage."""
    if not stages:
        return []
    lines = [
        "latency inside the worker, by stage (per request closed; END record's Kafka "
        "timestamp to Tokens in Redis):",
        f"  {'stage':<14}{'p50':>10}{'p90':>10}{'p99':>10}{'p99.9':>10}{'mean':>10}",
    ]
    for stage, row in stages.items():
        cells = "".join(
            f"{'n/a' if row[k] is None else format(row[k], ',.1f'):>10}"
            for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "mean_ms")
        )
        lines.append(f"  {stage:<14}{cells}")
    lines.append("  (ms; buckets 5 % wide; total spans fetch to redis, commit follows the Tokens)")
    return lines


def format_batches(phase: str, batches: dict[str, Any], cpu_seconds: float) -> list[str]:
    """A phase's batches: how many, their mean size, the worker's CPU per batch."""
    count = batches.get("batches") or 0
    if not count:
        return []
    return [
        f"{phase} batches: {count:,} of {batches['mean_messages']:,.1f} raw messages on "
        f"average; worker CPU {cpu_seconds / count * 1000:,.2f} ms per batch"
    ]


def _us(cpu_seconds: float, events: int) -> str:
    return f"{cpu_seconds / events * 1e6:,.1f} µs" if events else "-"


def format_report(report: PipelineReport) -> str:
    m, t, c, lat, mem = (
        report.machine,
        report.throughput,
        report.ceiling,
        report.latency,
        report.memory,
    )
    mix = ", ".join(f"{k} {v}" for k, v in report.workload.requests_by_source.items())
    p99_target = target_p99_ms(lat.target_rate)
    rows: list[tuple[str, str, str]] = [
        ("throughput, raw events/s (end to end)", f"{t.raw_events_per_second:,.0f}",
         f">= {TARGET_EVENTS_PER_SECOND:,}"),
        ("throughput, requests/s", f"{t.requests_per_second:,.1f}", ""),
        ("throughput, messages/s (incl. END)", f"{t.messages_per_second:,.0f}", ""),
        ("pass-through ceiling, messages/s", f"{c.messages_per_second:,.0f}", ""),
        ("worker / pass-through", f"{report.ratio:.0%}", f">= {TARGET_RATIO:.0%}"),
        ("worker CPU per raw event (throughput)", _us(t.worker_cpu_seconds, t.raw_events), ""),
        (f"latency p50 @ {lat.achieved_rate:,.0f} ev/s", _ms(lat.p50_ms), ""),
        ("latency p90", _ms(lat.p90_ms), ""),
        ("latency p99", _ms(lat.p99_ms), "" if p99_target is None else f"< {p99_target:.0f} ms"),
        ("latency p99.9", _ms(lat.p999_ms), ""),
        ("worker CPU per raw event (latency)", _us(lat.worker_cpu_seconds, lat.raw_events), ""),
        ("latency max", _ms(lat.max_ms), ""),
        ("worker peak RSS (VmHWM)", f"{mem.peak_rss_mib:,.1f} MiB", ""),
    ]  # fmt: skip
    workers = report.workload.workers
    lines = [
        f"streamtally pipeline benchmark, run {report.workload.run_id} "
        + (f"({workers} workers)" if workers > 1 else "(one worker)"),
        f"machine: {m.cores} cores ({m.cpu}), {m.system}, "
        f"load average {m.load_before:.2f} before, {m.load_after:.2f} after",
        f"         {m.python}, Kafka {m.kafka or '?'}, Redis {m.redis or '?'}, "
        f"aiokafka {m.aiokafka or '?'}, faust-streaming {m.faust or '?'}",
        f"         hot path: {m.hot_path}",
        f"         CPUs: {m.pinning or 'not pinned (every process on any core)'}",
        f"requests: {mix} (tenant {report.workload.tenant!r}, "
        f"{report.workload.concurrency} interleaved)"
        + (
            f"; {report.workload.poison_events:,} poison events among them"
            if report.workload.poison_events
            else ""
        ),
        (
            "worker: one process"
            if report.workload.workers == 1
            else f"workers: {report.workload.workers} processes in one consumer group (CPU "
            "summed, memory of the largest)"
        )
        + f", namespace {report.workload.namespace!r} "
        "(its own topics and consumer group on the running stack)",
        f"framing: {report.workload.framing} (raw records and the worker's outputs)",
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
        *format_batches("throughput", t.batches, t.worker_cpu_seconds),
        f"pass-through: {c.messages:,} messages in {c.seconds:.2f} s",
        f"latency: {lat.completed:,}/{lat.requests:,} requests, {lat.raw_events:,} raw events "
        f"over {lat.produce_seconds:.1f} s (target {lat.target_rate:,.0f}/s); "
        f"min {_ms(lat.min_ms)}, mean {_ms(lat.mean_ms)}; worker CPU "
        f"{lat.worker_cpu_seconds:.1f} s",
        "latency p50/max by 5 s window of END sends: "
        + ", ".join(f"{at:g}s {p50:,.0f}/{top:,.0f} ms" for at, _, p50, top in lat.windows),
        *format_batches("latency", lat.batches, lat.worker_cpu_seconds),
        *format_stages(lat.stages),
        f"memory: peak {mem.peak_rss_mib:,.1f} MiB (sampled max {mem.sampled_peak_rss_mib:,.1f}, "
        f"idle after warm-up {mem.idle_rss_mib:,.1f}, {mem.samples} samples)",
        f"worker log: {report.worker_log}",
    ]
    lines += [f"note: {note}" for note in report.notes]
    lines.append("(figures only: the benchmark never fails on speed)")
    return "\n".join(lines)
