"""The pipeline benchmark's worker process, with its memory and CPU time.

`BenchWorker` is a `streamtally.ops.worker_process.WorkerProcess` started at
once, whose resident set (sampled, and its peak) and CPU time are read from
Linux' /proc.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from benchmarks.pipeline_workload import Progress
from streamtally.ops.worker_process import WorkerProcess

__all__ = ["BenchWorker"]


class BenchWorker(WorkerProcess):
    """The worker subprocess, started at once, its RSS and CPU time (Linux /proc).

    It logs at the worker's default level, warning (the figures are those of a
    worker that formats no info lines), to a log emptied at each run; `check`
    raises `WorkerError`, a `StackError`, once it has exited.
    """

    def __init__(self, env: dict[str, str], log: Path) -> None:
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

    def shut_down(self, progress: Progress) -> None:
        """SIGTERM if it still runs, SIGKILL after 30 s; says so."""
        if self.returncode is not None:
            return
        progress(f"stopping the worker (SIGTERM to pid {self.pid})")
        code, _ = self.stop(timeout=30)
        if code is None:
            progress("the worker did not stop within 30 s: SIGKILL")
