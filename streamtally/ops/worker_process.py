"""A `streamtally worker` run as a subprocess: start, wait until ready, stop, kill.

The one wrapper the demo, the pipeline benchmark and the integration tests use.
The worker runs as ``python -m streamtally.cli worker --loglevel info`` with this
interpreter, its stdout and stderr in a log file, so that a failure message can
show what it said (`describe`, `log_tail`).  It is ready once faust logs
`READY_LINE` (at info level): it has started its services and the agent runs.

The environment is the caller's: `WorkerProcess` passes `env` to the process
as it is given (None: this process's own), so whatever a caller adds
(``STREAMTALLY_NAMESPACE``, ``REDIS_URL``, ...) must already be in it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, Self

from streamtally.errors import WorkerError

__all__ = [
    "READY_LINE",
    "WorkerError",
    "WorkerProcess",
    "describe_log",
    "streamtally_command",
    "worker_command",
]

#: What faust logs (at info level) once the worker has started and its agent runs.
READY_LINE: Final = "[^Worker]: Ready"
#: How long `stop` and `kill` wait for the process to go after SIGKILL.
KILL_WAIT_S: Final = 10.0
_POLL_S: Final = 0.1


def streamtally_command(*args: str) -> list[str]:
    """The argv running ``streamtally ARGS`` with this interpreter."""
    return [sys.executable, "-m", "streamtally.cli", *args]


def worker_command(loglevel: str = "info") -> list[str]:
    """The argv of ``streamtally worker --loglevel LOGLEVEL``."""
    return streamtally_command("worker", "--loglevel", loglevel)


def describe_log(head: str, text: str, lines: int = 60) -> str:
    """`head`, the first error of `text` (a worker's log) if any, and its last `lines` lines.

    An error is a line holding ``Traceback`` or ``[ERROR]``.
    """
    log = text.splitlines()
    errors = [line for line in log if "Traceback" in line or "[ERROR]" in line]
    if errors:
        head += f"\n{len(errors)} error lines, first: {errors[0]}"
    shown = log[-lines:] if lines > 0 else []
    return f"{head}\n--- last {len(shown)} log lines ---\n" + "\n".join(shown)


class WorkerProcess:
    """One ``streamtally worker`` subprocess, its output in `log`; `start` may be called again.

    `env`: the process's whole environment (None: this process's).  `cwd`: its
    working directory (None: this process's).  `loglevel`: info unless a
    caller wants less output (`READY_LINE` is logged at info level).
    `new_session`: its own session, so that a Ctrl-C meant for the caller is
    not the worker's SIGINT.  `truncate_log`: each start empties the log
    instead of appending to it.  `command`: what to run instead of the
    worker (for tests of this class).
    """

    def __init__(
        self,
        log: Path,
        env: Mapping[str, str] | None = None,
        *,
        cwd: Path | None = None,
        loglevel: str = "info",
        new_session: bool = True,
        truncate_log: bool = False,
        command: Sequence[str] | None = None,
    ) -> None:
        self.log = log
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self.command = list(command) if command is not None else worker_command(loglevel)
        self.new_session = new_session
        self.truncate_log = truncate_log
        #: `time.monotonic()` of the last start.
        self.started_at: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # ---------------------------------------------------------------- state

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError("the worker was not started")
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""
        return self.proc.poll()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        """The last `lines` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:]) if lines > 0 else ""

    def describe(self, lines: int = 60) -> str:
        """Its pid and state, the first error line and the end of its log, for a failure message."""
        state = "running" if self.returncode is None else f"exited with {self.returncode}"
        head = f"worker pid {self.pid} {state}; log {self.log}"
        return describe_log(head, self.log_text(), lines)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Start the process (again, once the previous one has exited)."""
        if self.running:
            raise RuntimeError(f"the worker (pid {self.pid}) is already running")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb" if self.truncate_log else "ab") as out:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=self.new_session,
            )
        self.started_at = time.monotonic()
        return self

    def check(self) -> None:
        """Raise `WorkerError` (with the end of the log) if the process has exited."""
        code = self.returncode
        if code is not None:
            raise WorkerError(
                f"the worker exited with status {code}; see {self.log}:\n{self.log_tail(15)}"
            )

    def wait_for_log(self, needle: str, timeout: float) -> None:
        """Wait until the log holds `needle`; `WorkerError` if the worker exits or time runs out.

        The whole log counts, lines of an earlier run appended to it included.
        """
        self.wait_for_any((needle,), timeout)

    def wait_for_any(self, needles: Sequence[str], timeout: float) -> str:
        """Wait until the log holds one of `needles` and return it (the first of them, in
        their order, when several are there); `WorkerError` as `wait_for_log`."""
        wanted = " or ".join(repr(n) for n in needles)
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_text()
            for needle in needles:
                if needle in text:
                    return needle
            if self.returncode is not None:
                raise WorkerError(f"worker exited before logging {wanted}\n{self.describe()}")
            if time.monotonic() > deadline:
                raise WorkerError(f"no {wanted} in {timeout:g} s\n{self.describe()}")
            time.sleep(_POLL_S)

    def wait_until_ready(self, timeout: float) -> None:
        """Wait until the worker logs `READY_LINE` (it runs with loglevel info)."""
        self.wait_for_log(READY_LINE, timeout)

    def stop(self, timeout: float = 30.0) -> tuple[int | None, float]:
        """SIGTERM, then wait: (exit status, seconds); (None, timeout) if it had to be killed.

        A process that has exited already gets no signal: its status comes back.
        """
        proc = self.proc
        start = time.monotonic()
        if proc.poll() is None:
            proc.terminate()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=KILL_WAIT_S)
            return None, timeout
        return code, time.monotonic() - start

    def kill(self) -> int | None:
        """SIGKILL it if it still runs, and reap it; its exit status (None if never started)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=KILL_WAIT_S)
        return self._proc.returncode
