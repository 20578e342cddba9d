"""The pipeline benchmark's worker processes, with their memory and CPU time.

`BenchWorker` is a `streamtally.ops.worker_process.WorkerProcess` started at
once, whose resident set (sampled, and its peak) and CPU time are read from
Linux' /proc, and whose per-stage latency histograms are read from its ``/stages``
(`streamtally.processors.stages`) on a port of its own; `BenchWorkers` is several
of them in one consumer group, seen as one: CPU time summed, memory of the largest,
stage histograms added up.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.pipeline_workload import Progress
from streamtally.ops.worker_process import WorkerProcess

__all__ = ["BenchWorker", "BenchWorkers"]


class BenchWorker(WorkerProcess):
    """The worker subprocess, started at once, its RSS and CPU time (Linux /proc).

    It logs at the worker's default level, warning (the figures are those of a
    worker that formats no info lines), to a log emptied at each run; `check`
    raises `WorkerError`, a `StackError`, once it has exited.
    """

    def __init__(self, env: dict[str, str], log: Path) -> None:
        #: Where its /stages is served: a port free now (not 6066, which another worker on
        #: the machine may hold).
        self.web_port = _free_port()
        env = {
            **env,
            "STREAMTALLY_WEB_HOST": "127.0.0.1",
            "STREAMTALLY_WEB_PORT": str(self.web_port),
        }
        super().__init__(log, env, loglevel="warning", truncate_log=True)
        self.rss_samples: list[int] = []
        self.start()

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

    async def stages(self) -> dict[str, Any] | None:
        """Its stage histograms so far (``/stages``); None when it does not answer."""
        url = f"http://127.0.0.1:{self.web_port}/stages"
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                session.get(url) as response,
            ):
                response.raise_for_status()
                found: dict[str, Any] = await response.json()
                return found
        except (aiohttp.ClientError, TimeoutError):
            return None

    def shut_down(self, progress: Progress) -> None:
        """SIGTERM if it still runs, SIGKILL after 30 s; says so."""
        if self.returncode is not None:
            return
        progress(f"stopping the worker (SIGTERM to pid {self.pid})")
        code, _ = self.stop(timeout=30)
        if code is None:
            progress("the worker did not stop within 30 s: SIGKILL")


class BenchWorkers:
    """`count` workers in one consumer group, with the interface of one `BenchWorker`.

    CPU time is the sum over the workers; RSS figures are the largest worker's
    (what one worker needs); `check` raises once any worker has exited.
    """

    def __init__(self, env: dict[str, str], log: Path, count: int) -> None:
        logs = (
            [log]
            if count == 1
            else [log.with_name(f"{log.stem}-{i + 1}{log.suffix}") for i in range(count)]
        )
        self.members = [BenchWorker(env, path) for path in logs]
        self.log = logs[0]
        self.pid = self.members[0].pid
        self.rss_samples: list[int] = []

    @property
    def returncode(self) -> int | None:
        codes = [m.returncode for m in self.members]
        return next((code for code in codes if code is not None), None)

    def check(self) -> None:
        for member in self.members:
            member.check()

    def rss_kib(self) -> int | None:
        found = [rss for m in self.members if (rss := m.rss_kib()) is not None]
        return max(found) if found else None

    def hwm_kib(self) -> int | None:
        found = [hwm for m in self.members if (hwm := m.hwm_kib()) is not None]
        return max(found) if found else None

    def cpu_seconds(self) -> float:
        return sum(m.cpu_seconds() for m in self.members)

    async def sample_rss(self, every: float = 0.2) -> None:
        while True:
            rss = self.rss_kib()
            if rss is not None:
                self.rss_samples.append(rss)
            await asyncio.sleep(every)

    async def stages(self) -> dict[str, Any] | None:
        """The members' stage histograms added up (None when one does not answer)."""
        found = [await m.stages() for m in self.members]
        if any(f is None for f in found):
            return None
        return merge_stages([f for f in found if f is not None])

    def shut_down(self, progress: Progress) -> None:
        for member in self.members:
            member.shut_down(progress)


def merge_stages(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' /stages snapshots as one (counts and sums added)."""
    merged: dict[str, Any] = {**snapshots[0], "stages": {}, "batches": {}}
    for snapshot in snapshots:
        for key, n in snapshot.get("batches", {}).items():
            merged["batches"][key] = merged["batches"].get(key, 0) + n
        for stage, data in snapshot["stages"].items():
            into = merged["stages"].setdefault(
                stage, {"count": 0, "sum_seconds": 0.0, "buckets": {}}
            )
            into["count"] += data["count"]
            into["sum_seconds"] += data["sum_seconds"]
            for key, n in data["buckets"].items():
                into["buckets"][key] = into["buckets"].get(key, 0) + n
    return merged


def _free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
