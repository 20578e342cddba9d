"""Local development stack: Kafka (KRaft, each node a broker and a controller) and Redis.

By default one Kafka node and one Redis; ``stack up --brokers 3`` runs three
Kafka nodes (a 3-voter quorum) and ``--redis-cluster`` a Redis Cluster of three
masters (`streamtally.stack.config` has the ports and the remembered shape).

``streamtally stack up|down|status`` drives it (see :mod:`streamtally.cli.stack`);
:mod:`streamtally.stack.kafka` (with ``kafka_jars`` and ``kafka_node``) and
:mod:`streamtally.stack.redis` (the one server in ``redis_server``, the cluster in
``redis_cluster``) hold the services.
Application code reads the endpoints from `streamtally.settings.Settings`
(``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` / ``REDIS_CLUSTER``, else this stack's).

This module also holds the small process toolkit the services share: pid files,
detached start (own session, output to a log file), liveness, the wait until a
started service answers, stop with SIGTERM then SIGKILL, port checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from streamtally.errors import StackError
from streamtally.stack.config import StackConfig

__all__ = [
    "Say",
    "ServiceState",
    "ServiceStatus",
    "StackConfig",
    "StackError",
    "already_running",
    "indent",
    "port_in_use",
    "port_in_use_error",
    "port_open",
    "process_status",
    "read_pid",
    "remove_pid_file",
    "spawn_detached",
    "stop_process",
    "stop_service",
    "stop_services",
    "tail",
    "wait_answering",
    "write_pid_file",
]

Say = Callable[[str], None]
"""Where progress lines go (``print`` in the CLI)."""

_POLL_S = 0.1
_KILL_WAIT_S = 5.0


class ServiceState(enum.Enum):
    RUNNING = "running"
    STOPPED = "stopped"
    STALE = "stale pid file"


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    name: str
    state: ServiceState
    pid: int | None
    port: int
    pid_file: Path

    @property
    def running(self) -> bool:
        return self.state is ServiceState.RUNNING

    def describe(self) -> str:
        if self.state is ServiceState.RUNNING:
            return f"{self.name}: running (pid {self.pid}, port {self.port})"
        if self.state is ServiceState.STALE:
            who = "unreadable pid" if self.pid is None else f"pid {self.pid} is not {self.name}"
            return f"{self.name}: stale pid file {self.pid_file} ({who}); `stack up` replaces it"
        return f"{self.name}: stopped"


def _proc_file(pid: int, name: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def _is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_file(pid, "stat")
    if stat is None:
        return True
    # /proc/PID/stat is "pid (comm) S ...": the state letter follows the last ')'.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _cmdline(pid: int) -> str:
    raw = _proc_file(pid, "cmdline") or b""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is our own exited child (only when started in-process)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text(encoding="ascii").strip())
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None


def process_status(name: str, pid_file: Path, marker: str, port: int) -> ServiceStatus:
    """Status from ``pid_file``: running only if the pid lives and its command line has ``marker``.

    The marker guards against a recycled pid now used by an unrelated process.
    """
    if not pid_file.exists():
        return ServiceStatus(name, ServiceState.STOPPED, None, port, pid_file)
    pid = read_pid(pid_file)
    if pid is not None:
        _reap(pid)
    if pid is not None and _is_alive(pid) and marker in _cmdline(pid):
        return ServiceStatus(name, ServiceState.RUNNING, pid, port, pid_file)
    return ServiceStatus(name, ServiceState.STALE, pid, port, pid_file)


def write_pid_file(pid_file: Path, pid: int) -> None:
    tmp = pid_file.with_name(pid_file.name + ".tmp")
    tmp.write_text(f"{pid}\n", encoding="ascii")
    tmp.replace(pid_file)


def remove_pid_file(pid_file: Path) -> None:
    pid_file.unlink(missing_ok=True)


def spawn_detached(
    argv: Sequence[str],
    *,
    cwd: Path,
    log_file: Path,
    pid_file: Path,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session (outlives the CLI); stdout+stderr go to ``log_file``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    if log_file.exists():  # keep one previous run's output, so tails show only this run
        log_file.replace(log_file.with_name(log_file.name + ".prev"))
    with log_file.open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=None if env is None else dict(env),
        )
    write_pid_file(pid_file, proc.pid)
    return proc


def already_running(name: str, current: ServiceStatus, address: str, say: Say) -> bool:
    """True if the service runs already (and says so); else clears a stale pid file of it."""
    if current.running:
        say(f"{name}: already running (pid {current.pid}, {address})")
        return True
    if current.pid_file.exists():
        say(f"{name}: removing stale pid file {current.pid_file}")
        remove_pid_file(current.pid_file)
    return False


def wait_answering(
    answers: Callable[[], bool],
    *,
    timeout: float,
    every: float,
    timed_out: Callable[[], StackError],
    proc: subprocess.Popen[bytes] | None = None,
    pid_file: Path | None = None,
    exited: Callable[[int], StackError] | None = None,
) -> float:
    """Poll `answers` every `every` s until it is true; returns the seconds waited.

    `proc` is the process just started (None: one found running, or `answers`
    watches the processes itself).  If it exits first, its `pid_file` is removed
    and `exited(exit status)` raised; after `timeout` s, `timed_out()` is raised.
    """
    start = time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            if pid_file is not None:
                remove_pid_file(pid_file)
            if exited is not None:
                raise exited(proc.returncode)
            raise StackError(f"{proc.args!r} exited with code {proc.returncode} while starting")
        if answers():
            return time.monotonic() - start
        time.sleep(every)
    raise timed_out()


def _signal(pid: int, sig: signal.Signals) -> None:
    """Signal the process group ``pid`` leads (we start services with their own session)."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        _reap(pid)
        if not _is_alive(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def stop_process(pid: int, timeout: float) -> bool:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL. True if it stopped on SIGTERM."""
    _signal(pid, signal.SIGTERM)
    if _wait_gone(pid, timeout):
        return True
    _signal(pid, signal.SIGKILL)
    if not _wait_gone(pid, _KILL_WAIT_S):
        raise StackError(f"pid {pid} survived SIGKILL; check it with `ps -o pid,stat,cmd -p {pid}`")
    return False


def stop_service(name: str, current: ServiceStatus, say: Say, timeout: float) -> None:
    """Stop a service of the stack: SIGTERM, then SIGKILL after `timeout`; clear its pid file."""
    stop_services([dataclasses.replace(current, name=name)], say, timeout)


def stop_services(services: Sequence[ServiceStatus], say: Say, timeout: float) -> None:
    """Stop several services at once: SIGTERM to all, SIGKILL to those still there after
    `timeout` s; clear their pid files.

    At once, so that the nodes of a cluster shut down while their peers still answer.
    """
    running = []
    for current in services:
        if current.pid is None or not current.running:
            if current.pid_file.exists():
                say(f"{current.name}: removing stale pid file {current.pid_file}")
                remove_pid_file(current.pid_file)
            say(f"{current.name}: not running")
        else:
            say(f"{current.name}: stopping (pid {current.pid}) ...")
            running.append((current, current.pid))
    start = time.monotonic()
    for _, pid in running:
        _signal(pid, signal.SIGTERM)
    for current, pid in running:
        graceful = _wait_gone(pid, max(0.0, start + timeout - time.monotonic()))
        if not graceful:
            _signal(pid, signal.SIGKILL)
            if not _wait_gone(pid, _KILL_WAIT_S):
                raise StackError(
                    f"{current.name}: pid {pid} survived SIGKILL; check it with "
                    f"`ps -o pid,stat,cmd -p {pid}`"
                )
        remove_pid_file(current.pid_file)
        how = "stopped" if graceful else f"killed (no exit within {timeout:.0f} s of SIGTERM)"
        say(f"{current.name}: {how} in {time.monotonic() - start:.1f} s")


def port_in_use(host: str, port: int) -> bool:
    """True if something already listens on ``host:port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def port_in_use_error(host: str, port: int, remedy: str, what: str = "") -> StackError:
    """The error of a port the service needs but another process listens on.

    `what` names the port (``" (controller)"``); `remedy` is how to pick others.
    """
    return StackError(
        f"port {port}{what} on {host} is already in use by another process "
        f"(see `ss -ltnp 'sport = :{port}'`): stop it, or {remedy}"
    )


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True if a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
