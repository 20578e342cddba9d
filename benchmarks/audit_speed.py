"""How fast the audit proves a traffic, against one worker over the same traffic.

On the running stack (KAFKA_BOOTSTRAP_SERVERS / REDIS_URL, the local stack by
default), in one run (reports figures, never fails on them):

1. Traffic.  The pipeline benchmark's request mix (`benchmarks.pipeline_workload`:
   mostly the ~200-event ``long_text_bench`` samples, generated engine streams and
   the small engine samples), about ``--events`` raw events (or ``--requests``
   requests), of a tenant of the run's own (``auditbench-<run>``), produced
   interleaved into a namespace of the run's own (``streamtally-auditbench-<run>``,
   topics of one-day retention) before anything is timed.
2. One worker (`benchmarks.pipeline_worker`, request timeout a day) drains that
   backlog: timed from the moment it is a member of its consumer group until the
   group has committed every raw record; its CPU time over the same span and its
   peak RSS (VmHWM).  Then it is stopped, so the audits have the cores to themselves.
3. ``streamtally audit --tenant <run's>`` (one process), then ``streamtally audit
   --workers 2`` over the same topics: wall time from the command's start to its
   exit (interpreter start, snapshot, billing index, replay, comparisons, the
   merge), CPU seconds of all its processes (`resource.getrusage` of the children),
   and per process its peak RSS (VmHWM), CPU seconds and whether the compiled hot
   path was in it (its ``/proc/<pid>/maps`` names a file of ``streamtally/.native``),
   sampled every 0.1 s from ``/proc``.  Both reports must be clean and the same but
   for the time each snapshot was taken (said under ``checks``).

Raw events are the raw records on the raw topics (END markers included): the same
count for the worker and each audit.  The projection (`projected_day_seconds`) is a
day at 1,000 requests/s of this mix (its events per request stated) on 16 cores:
16 processes each at the measured wall rate per replaying process (``day``), or at the
run's raw events per CPU second, each process with a core of its own (``day CPU``: what
a quiet machine gets; a loaded one stretches the wall time, not the CPU time).

Nothing is deleted: the namespace's topics (one-day retention), and in REDIS_URL's
database the run tenant's Tokens, usage rows and close markers, as the pipeline
benchmark leaves its own.  ``python -m benchmarks.audit_speed --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.pipeline import WORKER_REQUEST_TIMEOUT
from benchmarks.pipeline_kafka import KafkaProbe
from benchmarks.pipeline_phases import produce_all
from benchmarks.pipeline_redis import check_layout, redis_client
from benchmarks.pipeline_report import Machine, describe_machine
from benchmarks.pipeline_worker import BenchWorkers
from benchmarks.pipeline_workload import (
    BenchRequest,
    Names,
    Progress,
    RequestBuilder,
    interleave,
    scratch_names,
)
from streamtally import _native
from streamtally.connection import as_connection
from streamtally.errors import StackError
from streamtally.settings import Settings, project_root
from streamtally.wire.kafka import ensure_topics, idempotent_producer

__all__ = [
    "AuditSpeed",
    "RunFigures",
    "format_report",
    "main",
    "measure",
    "projected_day_seconds",
]

#: The day projected: requests per second, seconds, cores (one process each).
DAY_RATE: Final = 1_000
DAY_SECONDS: Final = 86_400
DAY_CORES: Final = 16
#: Raw events of the default run: ~2-3 minutes in all on a loaded 2-core machine.
DEFAULT_EVENTS: Final = 250_000
_SAMPLE_EVERY: Final = 0.1


def projected_day_seconds(
    events_per_second: float,
    processes: int,
    events_per_request: float,
    *,
    requests_per_second: float = DAY_RATE,
    cores: int = DAY_CORES,
) -> float:
    """Wall seconds for `cores` processes to go through a day of `requests_per_second`
    requests of `events_per_request` raw events, each process as fast as one of the
    `processes` that together went through `events_per_second` (inf: none measured)."""
    if events_per_second <= 0 or processes < 1 or cores < 1:
        return math.inf
    per_process = events_per_second / processes
    return DAY_SECONDS * requests_per_second * events_per_request / (per_process * cores)


@dataclass(frozen=True, slots=True)
class ProcessFigures:
    """One process of a run: what it was, its CPU, its peak RSS, compiled or not."""

    role: str
    pid: int
    cpu_seconds: float
    peak_rss_mib: float
    #: Whether a compiled module of `streamtally._native` was mapped (None: not seen).
    compiled: bool | None


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One measured run (the worker, or one audit command) over the traffic."""

    name: str
    wall_seconds: float
    raw_events: int
    cpu_seconds: float
    processes: list[ProcessFigures]
    #: Processes that replayed (the worker, or the audit's shares).
    replaying: int
    events_per_request: float
    exit_code: int = 0

    @property
    def events_per_second(self) -> float:
        return self.raw_events / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def cpu_us_per_event(self) -> float:
        return 1e6 * self.cpu_seconds / self.raw_events if self.raw_events else 0.0

    @property
    def projected_day_seconds(self) -> float:
        """The day at the run's wall rate per replaying process."""
        return projected_day_seconds(
            self.events_per_second, self.replaying, self.events_per_request
        )

    @property
    def projected_day_cpu_seconds(self) -> float:
        """The day at the run's events per CPU second (each process a core of its own, as
        on a quiet machine; a loaded one stretches the wall time, not the CPU time)."""
        per_cpu_second = self.raw_events / self.cpu_seconds if self.cpu_seconds > 0 else 0.0
        return projected_day_seconds(per_cpu_second, 1, self.events_per_request)

    def to_json(self) -> dict[str, Any]:
        day, by_cpu = self.projected_day_seconds, self.projected_day_cpu_seconds
        return {
            **asdict(self),
            "events_per_second": round(self.events_per_second, 1),
            "cpu_us_per_event": round(self.cpu_us_per_event, 2),
            "projected_day_hours": None if math.isinf(day) else round(day / 3600, 2),
            "projected_day_hours_by_cpu": None if math.isinf(by_cpu) else round(by_cpu / 3600, 2),
        }


@dataclass(slots=True)
class AuditSpeed:
    machine: Machine
    run_id: str
    namespace: str
    tenant: str
    requests: int
    raw_events: int
    requests_by_source: dict[str, int]
    runs: list[RunFigures] = field(default_factory=list)
    #: Whether both audits were clean and reported the same (but for the snapshot time).
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def events_per_request(self) -> float:
        return self.raw_events / self.requests if self.requests else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": asdict(self.machine),
            "run_id": self.run_id,
            "namespace": self.namespace,
            "tenant": self.tenant,
            "requests": self.requests,
            "raw_events": self.raw_events,
            "events_per_request": round(self.events_per_request, 1),
            "requests_by_source": self.requests_by_source,
            "projection": {
                "requests_per_second": DAY_RATE,
                "seconds": DAY_SECONDS,
                "cores": DAY_CORES,
                "raw_events": round(DAY_RATE * DAY_SECONDS * self.events_per_request),
            },
            "runs": [r.to_json() for r in self.runs],
            "checks": self.checks,
            "notes": self.notes,
        }


# --------------------------------------------------------------------------- /proc


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of `pid`, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state), [1] the parent; utime and stime are fields 14 and 15.
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _compiled(pid: int) -> bool | None:
    """Whether `pid` has a file of the compiled build mapped (None: cannot tell)."""
    try:
        return str(_native.BUILD_DIR) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None


def _role(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv]
    if "--share" in words:
        return f"share {words[words.index('--share') + 1]}"
    return "audit"


@dataclass(slots=True)
class _Seen:
    role: str
    cpu: float = 0.0
    hwm_kib: int = 0
    compiled: bool | None = None


class _Tree:
    """The processes of one command (it and its descendants), sampled from /proc."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, _Seen] = {}

    def sample(self) -> None:
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (found := _stat(int(entry.name))) is not None:
                parents[int(entry.name)], cpu[int(entry.name)] = found
        mine = {self.root}
        grew = True
        while grew:
            more = {p for p, parent in parents.items() if parent in mine} - mine
            grew = bool(more)
            mine |= more
        for pid in mine & set(cpu):
            seen = self.seen.get(pid)
            if seen is None:
                seen = self.seen[pid] = _Seen(_role(pid))
            seen.cpu = cpu[pid]
            seen.hwm_kib = max(seen.hwm_kib, _hwm_kib(pid) or 0)
            if not seen.compiled:
                seen.compiled = _compiled(pid)

    def figures(self) -> list[ProcessFigures]:
        return [
            ProcessFigures(s.role, pid, round(s.cpu, 2), round(s.hwm_kib / 1024, 1), s.compiled)
            for pid, s in sorted(self.seen.items())
        ]


# --------------------------------------------------------------------------- the runs


async def _produce(servers: Any, requests: list[BenchRequest], width: int) -> None:
    producer = idempotent_producer(servers, linger_ms=10)
    await producer.start()
    try:
        await produce_all(producer, interleave(requests, width))
    finally:
        await producer.stop()


async def _drain(
    servers: Any, names: Names, worker: BenchWorkers, progress: Progress, timeout: float
) -> tuple[float, float]:
    """Wait until the worker is in its group, then until it has committed everything:
    (seconds, CPU seconds) in between."""
    kafka = KafkaProbe(servers, names)
    await kafka.start()
    try:
        deadline = time.monotonic() + 120
        while await kafka.group_members() != 1:
            worker.check()
            if time.monotonic() > deadline:
                raise StackError("the worker did not join its consumer group within 120 s")
            await asyncio.sleep(_SAMPLE_EVERY)
        start, cpu = time.perf_counter(), worker.cpu_seconds()
        lag = await kafka.wait_caught_up(worker, progress, timeout)
        if lag:
            raise StackError(f"the worker is still {lag:,} raw records behind after {timeout} s")
        return time.perf_counter() - start, worker.cpu_seconds() - cpu
    finally:
        await kafka.stop()


def _audit(
    name: str,
    argv: Sequence[str],
    *,
    env: dict[str, str],
    out: Path,
    events_per_request: float,
    progress: Progress,
) -> tuple[RunFigures, dict[str, Any] | None]:
    """Run one audit command to its end, its processes sampled; its figures and report."""
    progress(f"{name}: {' '.join(argv)} …")
    command = [sys.executable, "-m", "streamtally.cli", "audit", *argv, "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    log = out.with_suffix(".log")  # its warnings (a sample's unpriced model) kept apart
    with log.open("wb") as err:
        child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
        tree = _Tree(child.pid)
        while child.poll() is None:
            tree.sample()
            time.sleep(_SAMPLE_EVERY)
    wall = time.perf_counter() - start
    if child.returncode not in (0, 1):
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        progress(f"  {name} exited with status {child.returncode}: " + " / ".join(tail))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = json.loads(out.read_text()) if out.exists() else None
    read = 0 if report is None else int(report["snapshot"]["raw_records"]["read"])
    processes = tree.figures()
    shares = sum(p.role.startswith("share") for p in processes) or 1
    figures = RunFigures(
        name,
        round(wall, 2),
        read,
        round(cpu, 2),
        processes,
        shares,
        events_per_request,
        child.returncode,
    )
    return figures, report


def _same_but_when(one: dict[str, Any] | None, two: dict[str, Any] | None) -> bool:
    if one is None or two is None:
        return False
    one, two = json.loads(json.dumps(one)), json.loads(json.dumps(two))
    del one["snapshot"]["taken_at"], two["snapshot"]["taken_at"]
    return one == two


def measure(
    *,
    events: int,
    requests: int | None = None,
    concurrency: int = 16,
    settings: Settings | None = None,
    progress: Progress = print,
) -> AuditSpeed:
    """The whole run (see the module docstring); the worker is always stopped."""
    settings = settings or Settings.load()
    root = project_root()
    if root is None:
        raise StackError("the audit benchmark runs from a clone (it replays samples/)")
    run_id = uuid.uuid4().hex[:8]
    load_before = os.getloadavg()[0]
    names: Names = scratch_names(f"streamtally-auditbench-{run_id}")
    tenant = f"auditbench-{run_id}"
    builder = RequestBuilder(run_id, root / "samples", names, tenant=tenant)
    progress(f"audit benchmark run {run_id}: encoding the traffic (not timed) …")
    if requests is None:
        load = builder.requests(events)
    else:  # one whole request per call
        load = []
        while len(load) < requests:
            load += builder.requests(1)
    raw_events = sum(len(r.records) for r in load)  # END markers included
    progress(
        f"  {len(load):,} requests, {raw_events:,} raw records; namespace {names.namespace}, "
        f"tenant {tenant}"
    )
    servers = settings.kafka
    redis_url = settings.redis_url
    asyncio.run(check_layout(redis_url))
    asyncio.run(ensure_topics(servers, names.topics.all))
    started = time.perf_counter()
    asyncio.run(_produce(servers, load, concurrency))
    progress(f"  produced in {time.perf_counter() - started:.1f} s (not timed)")
    env = dict(os.environ)
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=as_connection(servers).servers,
        REDIS_URL=redis_url,
        STREAMTALLY_REQUEST_TIMEOUT=str(WORKER_REQUEST_TIMEOUT),
        STREAMTALLY_NAMESPACE=names.namespace,
    )
    speed = AuditSpeed(
        machine=describe_machine(load_before, None),
        run_id=run_id,
        namespace=names.namespace,
        tenant=tenant,
        requests=len(load),
        raw_events=raw_events,
        requests_by_source=dict(sorted(builder.by_source.items())),
    )
    epr = speed.events_per_request
    with tempfile.TemporaryDirectory(prefix="streamtally-auditbench-") as folder:
        log = Path(folder) / "worker.log"
        worker = BenchWorkers(env, log, 1)
        progress(f"worker (pid {worker.pid}): draining the backlog …")
        try:
            seconds, cpu = asyncio.run(_drain(servers, names, worker, progress, timeout=1800))
            member = worker.members[0]
            proc = ProcessFigures(
                "worker",
                member.pid,
                round(cpu, 2),
                round((member.hwm_kib() or 0) / 1024, 1),
                _compiled(member.pid),
            )
        finally:
            worker.shut_down(progress)
        speed.runs.append(
            RunFigures("worker", round(seconds, 2), raw_events, round(cpu, 2), [proc], 1, epr)
        )
        reports: list[dict[str, Any] | None] = []
        for name, argv in (
            ("audit", ["--tenant", tenant]),
            ("audit --workers 2", ["--tenant", tenant, "--workers", "2"]),
        ):
            out = Path(folder) / f"report-{len(reports)}.json"
            figures, report = _audit(
                name, argv, env=env, out=out, events_per_request=epr, progress=progress
            )
            speed.runs.append(figures)
            reports.append(report)
            if figures.raw_events != raw_events:
                speed.notes.append(
                    f"{name} read {figures.raw_events:,} raw records, {raw_events:,} produced"
                )
    speed.checks = {
        "audits_clean": all(r.exit_code == 0 for r in speed.runs[1:]),
        "same_report": _same_but_when(reports[0], reports[1]),
    }
    _, _, redis_version = asyncio.run(redis_client(redis_url))
    speed.machine = describe_machine(load_before, redis_version)
    return speed


# --------------------------------------------------------------------------- the report


def _hours(seconds: float) -> str:
    return "n/a" if math.isinf(seconds) else f"{seconds / 3600:,.1f} h"


def format_report(speed: AuditSpeed) -> str:
    """The table of the runs, and what it stands on."""
    m = speed.machine
    lines = [
        f"audit speed, run {speed.run_id}: {speed.requests:,} requests, {speed.raw_events:,} "
        f"raw events ({speed.events_per_request:,.1f} per request), namespace {speed.namespace}",
        f"machine: {m.cores} cores, {m.cpu}; load {m.load_before} before, {m.load_after} after; "
        f"hot path: {m.hot_path}",
        "",
    ]
    header = (
        f"{'run':20} {'wall s':>8} {'events/s':>10} {'CPU s':>8} {'µs CPU/ev':>10} "
        f"{'day*':>8} {'day CPU*':>8}  processes (CPU s, peak RSS MiB, compiled)"
    )
    lines += [header, "-" * len(header)]
    for run in speed.runs:
        procs = "; ".join(
            f"{p.role} {p.cpu_seconds:.1f} s, {p.peak_rss_mib:.0f} MiB, "
            + {True: "compiled", False: "plain", None: "?"}[p.compiled]
            for p in run.processes
        )
        lines.append(
            f"{run.name:20} {run.wall_seconds:8.1f} {run.events_per_second:10,.0f} "
            f"{run.cpu_seconds:8.1f} {run.cpu_us_per_event:10.1f} "
            f"{_hours(run.projected_day_seconds):>8} {_hours(run.projected_day_cpu_seconds):>8}  "
            f"{procs}"
        )
    lines += [
        "",
        f"* a day at {DAY_RATE:,} requests/s of this mix ({speed.events_per_request:,.1f} raw "
        f"events per request: {DAY_RATE * DAY_SECONDS * speed.events_per_request:,.0f} events) "
        f"on {DAY_CORES} cores, {DAY_CORES} processes each at the run's wall rate per "
        "replaying process (day), or at its raw events per CPU second (day CPU: a core each)",
        "checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in speed.checks.items()),
        *(f"note: {n}" for n in speed.notes),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.audit_speed",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Needs the running stack (streamtally stack up) and a clone (samples/).",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--events",
        type=int,
        default=DEFAULT_EVENTS,
        help=f"raw events of the traffic, in whole requests (default {DEFAULT_EVENTS:,})",
    )
    size.add_argument("--requests", type=int, help="requests of the traffic instead")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="requests interleaved while producing"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.events < 1 or (args.requests is not None and args.requests < 1):
        parser.error("--events and --requests must be positive")
    try:
        speed = measure(events=args.events, requests=args.requests, concurrency=args.concurrency)
    except StackError as exc:
        print(f"audit benchmark: {exc}", file=sys.stderr)
        return 2
    text = format_report(speed)
    print(text, end="")
    if args.json:
        Path(args.json).write_text(json.dumps(speed.to_json(), indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
