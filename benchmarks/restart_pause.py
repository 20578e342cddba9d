"""How long a worker restart leaves partitions unread, with and without static membership.

A group of `--workers` workers (1 or 2) reads the raw topics of a namespace of
its own; once it has settled, the first worker is restarted in place, as a
supervisor restarts a service: SIGTERM (a clean stop) or SIGKILL, then the
same command again at once.  With static membership each worker has an
instance id (``STREAMTALLY_WORKER_INSTANCE_ID``: ``w1``, ``w2``) and the
default static session timeout (45 s); without, each start is a new dynamic
member and the session timeout is the dynamic default (10 s).

The pause is read from the workers' logs (info level), per raw partition: a
partition is read by a worker from the moment it logs the partition assigned
(``raw partitions assigned: [...]``) until it revokes its partitions
(aiokafka's ``Revoking previously assigned partitions``, eager: all of them)
or, for the restarted worker, until the signal is sent (a stopping worker
reads nothing more).  For each restart:

- ``pause_s``: the longest time any one partition was read by no worker,
  from the signal until the group has settled again;
- ``partitions_paused``: how many of the partitions were unread for a while;
- ``others_pause_s``: the longest such time of a partition the other worker
  held (two workers): nonzero when the restart stopped the whole group (a
  rebalance), zero when it moved no partition;
- ``startup_s``: from the new process's start to its first assignment (the
  floor of any restart in place: interpreter, imports, topics, Redis, join).

Figures only, never a test: ``python -m benchmarks.restart_pause [--runs N]
[--workers 1 2] [--json]``.  Needs the stack (``KAFKA_BOOTSTRAP_SERVERS``,
``REDIS_URL``); it creates its own topics and writes nothing to Redis.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Final

from streamtally.ops.worker_process import WorkerProcess
from streamtally.settings import Settings, project_root

__all__ = ["Held", "RestartPause", "longest_unread", "main", "measure", "read_holdings"]

Partition = tuple[str, int]

#: A worker's log line: ``[time] [pid] [LEVEL] logger: message``.
_LINE: Final = re.compile(r"^\[(?P<ts>[^\]]+)\] \[\d+\] \[\w+\] [\w.]+: (?P<msg>.*)$")
_ASSIGNED: Final = "raw partitions assigned: "
_REVOKING: Final = "Revoking previously assigned partitions "
#: The group has settled once no worker logged a change for this long (seconds).
QUIET_S: Final = 3.0
#: The longest a restart may take to settle (a dynamic SIGKILL waits a session out).
SETTLE_TIMEOUT_S: Final = 90.0


@dataclass(frozen=True, slots=True)
class Held:
    """A worker process read these partitions from `start` until `end` (epoch seconds)."""

    start: float
    end: float
    partitions: frozenset[Partition]


def read_holdings(log: str, until: float) -> list[Held]:
    """What one worker process's log says it held, and when; held to `until` if it still
    holds partitions at its end."""
    held: list[Held] = []
    since: float | None = None
    current: frozenset[Partition] = frozenset()
    for line in log.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        msg = match["msg"]
        assigned = msg.startswith(_ASSIGNED)
        revoked = msg.startswith(_REVOKING) and not msg.startswith(_REVOKING + "set()")
        if not assigned and not revoked:
            continue
        at = datetime.fromisoformat(match["ts"]).timestamp()
        if since is not None and current:
            held.append(Held(since, at, current))
        if assigned:
            parts = ast.literal_eval(msg.removeprefix(_ASSIGNED))
            current, since = frozenset((str(t), int(p)) for t, p in parts), at
        else:
            current, since = frozenset(), None
    if since is not None and current and until >= since:
        held.append(Held(since, until, current))
    return held


def longest_unread(
    holdings: Iterable[Held], partitions: Iterable[Partition], window: tuple[float, float]
) -> dict[Partition, float]:
    """Per partition, the longest time within `window` that no holding covered it."""
    start, end = window
    spans: dict[Partition, list[tuple[float, float]]] = {p: [] for p in partitions}
    for held in holdings:
        for partition in held.partitions:
            if partition in spans:
                spans[partition].append((held.start, held.end))
    gaps: dict[Partition, float] = {}
    for partition, covered in spans.items():
        longest, reached = 0.0, start
        for a, b in sorted(covered):
            if b <= reached:
                continue
            if a > reached:
                longest = max(longest, min(a, end) - reached)
            reached = max(reached, b)
            if reached >= end:
                break
        longest = max(longest, end - reached)
        gaps[partition] = round(max(longest, 0.0), 3)
    return gaps


# --------------------------------------------------------------------------- the group


@dataclass
class _Worker:
    """One worker of the group: its process now, and the logs of all its processes."""

    name: str
    env: dict[str, str]
    directory: Path
    runs: list[WorkerProcess] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    ended: list[float | None] = field(default_factory=list)

    @property
    def now(self) -> WorkerProcess:
        return self.runs[-1]

    def start(self) -> None:
        log = self.directory / f"{self.name}-{len(self.runs)}.log"
        self.started.append(time.time())
        run = WorkerProcess(log, self.env, cwd=project_root(), truncate_log=True)
        self.runs.append(run.start())
        self.ended.append(None)

    def holdings(self, until: float) -> list[Held]:
        found = []
        for run, ended in zip(self.runs, self.ended, strict=True):
            found.extend(read_holdings(run.log_text(), until if ended is None else ended))
        return found

    def current(self, until: float) -> frozenset[Partition] | None:
        """What the running process holds now (None: it holds nothing, or is rebalancing)."""
        held = read_holdings(self.now.log_text(), until)
        return held[-1].partitions if held and held[-1].end >= until else None

    def last_change(self) -> float:
        """When the running process last logged an assignment or a revoke (0: never)."""
        latest = 0.0
        for line in self.now.log_text().splitlines():
            match = _LINE.match(line)
            if match and match["msg"].startswith((_ASSIGNED, _REVOKING)):
                latest = datetime.fromisoformat(match["ts"]).timestamp()
        return latest


def _settled(workers: Sequence[_Worker], partitions: set[Partition]) -> bool:
    now = time.time()
    held: list[Partition] = []
    for worker in workers:
        worker.now.check()
        current = worker.current(now)
        if current is None:
            return False
        held.extend(current)
    quiet = now - max(w.last_change() for w in workers) >= QUIET_S
    return quiet and sorted(held) == sorted(partitions)


def _settle(workers: Sequence[_Worker], partitions: set[Partition]) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not _settled(workers, partitions):
        if time.monotonic() > deadline:
            logs = "\n".join(w.now.describe(20) for w in workers)
            raise RuntimeError(f"the group did not settle in time:\n{logs}")
        time.sleep(0.2)


@dataclass(frozen=True, slots=True)
class RestartPause:
    membership: str  # "static" or "dynamic"
    workers: int
    kind: str  # "sigterm" or "sigkill"
    pause_s: float
    partitions_paused: int
    partitions: int
    others_pause_s: float | None
    startup_s: float
    settled_after_s: float


def _restart(
    workers: Sequence[_Worker], partitions: set[Partition], kind: str, membership: str
) -> RestartPause:
    first = workers[0]
    others_held: set[Partition] = set()
    for worker in workers[1:]:
        others_held |= worker.current(time.time()) or frozenset()
    signalled = time.time()
    if kind == "sigterm":
        first.now.proc.send_signal(signal.SIGTERM)
        first.now.proc.wait(timeout=60)
    else:
        first.now.kill()
    first.ended[-1] = signalled  # it reads nothing more once signalled
    first.start()
    _settle(workers, partitions)
    settled = max(w.last_change() for w in workers)
    holdings = [held for worker in workers for held in worker.holdings(settled)]
    gaps = longest_unread(holdings, partitions, (signalled, settled))
    assigned = [h.start for h in read_holdings(first.now.log_text(), settled)]
    return RestartPause(
        membership=membership,
        workers=len(workers),
        kind=kind,
        pause_s=max(gaps.values()),
        partitions_paused=sum(gap > 0 for gap in gaps.values()),
        partitions=len(partitions),
        others_pause_s=max((gaps[p] for p in others_held), default=0.0) if workers[1:] else None,
        startup_s=round(min(assigned) - first.started[-1], 3),
        settled_after_s=round(settled - signalled, 3),
    )


def measure(
    workers: int, static: bool, runs: int, directory: Path, environ: Mapping[str, str]
) -> list[RestartPause]:
    """`runs` clean restarts and `runs` SIGKILL-and-restarts of the first of `workers`."""
    from streamtally.topics import Topics

    namespace = f"restart-{uuid.uuid4().hex[:8]}"
    topics = Topics.in_namespace(namespace)
    partitions = {(t.name, p) for t in topics.raw for p in range(t.partitions)}
    group: list[_Worker] = []
    for number in range(1, workers + 1):
        env = {
            **environ,
            "STREAMTALLY_NAMESPACE": namespace,
            "STREAMTALLY_WEB_PORT": "0",  # several workers, and others' on this machine
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("STREAMTALLY_WORKER_INSTANCE_ID", None)
        env.pop("STREAMTALLY_SESSION_TIMEOUT", None)
        if static:
            env["STREAMTALLY_WORKER_INSTANCE_ID"] = f"w{number}"
        group.append(_Worker(f"{namespace}-w{number}", env, directory))
    membership = "static" if static else "dynamic"
    found: list[RestartPause] = []
    try:
        for worker in group:
            worker.start()
        _settle(group, partitions)
        for kind in ("sigterm", "sigkill"):
            for _ in range(runs):
                pause = _restart(group, partitions, kind, membership)
                print(json.dumps(asdict(pause)), file=sys.stderr)
                found.append(pause)
    finally:
        for worker in group:
            worker.now.stop(timeout=30)
    return found


def _summary(pauses: Sequence[RestartPause]) -> list[dict[str, object]]:
    rows: dict[tuple[str, int, str], list[RestartPause]] = {}
    for pause in pauses:
        rows.setdefault((pause.kind, pause.workers, pause.membership), []).append(pause)
    out: list[dict[str, object]] = []
    for (kind, workers, membership), runs in sorted(rows.items()):
        others = [r.others_pause_s for r in runs if r.others_pause_s is not None]
        out.append(
            {
                "restart": kind,
                "workers": workers,
                "membership": membership,
                "runs": len(runs),
                "pause_s_median": round(statistics.median(r.pause_s for r in runs), 2),
                "pause_s_min": min(r.pause_s for r in runs),
                "pause_s_max": max(r.pause_s for r in runs),
                "others_pause_s_max": max(others) if others else None,
                "partitions_paused_max": max(r.partitions_paused for r in runs),
                "startup_s_median": round(statistics.median(r.startup_s for r in runs), 2),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="restarts of each kind per group")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    parser.add_argument("--json", action="store_true", help="every restart, one JSON per line")
    args = parser.parse_args(argv)
    settings = Settings.load()
    directory = settings.state_dir / "logs" / f"restart-pause-{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True, exist_ok=True)
    pauses: list[RestartPause] = []
    for workers in args.workers:
        for static in (False, True):
            pauses.extend(measure(workers, static, args.runs, directory, os.environ))
    if args.json:
        for pause in pauses:
            print(json.dumps(asdict(pause)))
    print(f"worker logs: {directory}")
    print("restart  workers  membership  runs  pause s (median, range)  others' pause s  startup s")
    for row in _summary(pauses):
        others = "-" if row["others_pause_s_max"] is None else f"{row['others_pause_s_max']:.2f}"
        print(
            f"{row['restart']:<8} {row['workers']:>7}  {row['membership']:<10} {row['runs']:>5}"
            f"  {row['pause_s_median']:>6.2f} ({row['pause_s_min']:.2f}-{row['pause_s_max']:.2f})"
            f"  {others:>15}  {row['startup_s_median']:>9.2f}"
        )


if __name__ == "__main__":
    main()
