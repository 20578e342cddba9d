"""`streamtally.ops.worker_process`: the command, the failure text, and the lifecycle.

The lifecycle runs small Python stand-ins for the worker (`command=`), no
Kafka or Redis: one that logs the ready line and exits 0 on SIGTERM, one
that ignores SIGTERM, one that fails at once.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from streamtally.errors import StackError
from streamtally.ops.worker_process import (
    READY_LINE,
    WorkerError,
    WorkerProcess,
    describe_log,
    streamtally_command,
    worker_command,
)

#: What the stand-in logs when it starts.
STARTED = f"starting\n[2026-01-01 00:00:00,000] [1] [INFO] {READY_LINE}.\n"
#: Logs the ready line, then waits; SIGTERM: logs "bye" and exits 0.
GRACEFUL = f"""
import signal, sys, time
def bye(*_):
    print("bye", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print({STARTED!r}, end="", flush=True)
while True:
    time.sleep(0.05)
"""
#: Ignores SIGTERM.
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("up", flush=True)
while True:
    time.sleep(0.05)
"""
#: Fails before it is ready.
FAILING = """
import sys
print("Traceback (most recent call last):", flush=True)
print("RuntimeError: no broker", flush=True)
sys.exit(3)
"""


def _python(script: str) -> list[str]:
    return [sys.executable, "-c", script]


def _wait_for_output(worker: WorkerProcess, text: str) -> None:
    deadline = time.monotonic() + 10
    while text not in worker.log_text():
        assert time.monotonic() < deadline, worker.describe()
        time.sleep(0.02)


# --------------------------------------------------------------------------- pure parts


def test_the_worker_command_runs_this_interpreter_at_info_level() -> None:
    assert worker_command() == [
        sys.executable, "-m", "streamtally.cli", "worker", "--loglevel", "info",
    ]  # fmt: skip
    assert worker_command("warning")[-2:] == ["--loglevel", "warning"]
    assert streamtally_command("usage", "--json") == [
        sys.executable, "-m", "streamtally.cli", "usage", "--json",
    ]  # fmt: skip
    assert WorkerProcess(Path("w.log")).command == worker_command()


def test_ready_line_is_what_faust_logs() -> None:
    assert READY_LINE == "[^Worker]: Ready"


def test_describe_log_shows_the_first_error_and_the_last_lines() -> None:
    text = "one\n[ERROR] first\ntwo\nTraceback (most recent call last):\nthree\n"
    assert describe_log("head", text, lines=2) == (
        "head\n2 error lines, first: [ERROR] first\n--- last 2 log lines ---\n"
        "Traceback (most recent call last):\nthree"
    )


def test_describe_log_of_a_short_or_empty_log() -> None:
    assert describe_log("head", "a\nb\n", lines=60) == "head\n--- last 2 log lines ---\na\nb"
    assert describe_log("head", "", lines=60) == "head\n--- last 0 log lines ---\n"


def test_worker_error_is_a_stack_error() -> None:
    assert issubclass(WorkerError, StackError)


def test_a_worker_not_started_has_no_state(tmp_path: Path) -> None:
    worker = WorkerProcess(tmp_path / "w.log")
    assert not worker.running
    assert worker.kill() is None
    with pytest.raises(RuntimeError, match="not started"):
        _ = worker.returncode
    assert worker.log_text() == ""


# --------------------------------------------------------------------------- lifecycle


def test_ready_then_sigterm_exits_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "worker.log"  # the folder is created
    worker = WorkerProcess(log, command=_python(GRACEFUL)).start()
    assert worker.started_at is not None
    worker.wait_until_ready(timeout=10)
    assert worker.running
    worker.check()  # still running: no error
    assert f"worker pid {worker.pid} running; log {log}" in worker.describe()
    code, took = worker.stop(timeout=10)
    assert (code, worker.returncode) == (0, 0)
    assert 0 <= took < 10
    assert worker.log_tail(1) == "bye"
    assert "exited with 0" in worker.describe()


def test_sigterm_ignored_is_killed_after_the_timeout(tmp_path: Path) -> None:
    worker = WorkerProcess(tmp_path / "w.log", command=_python(STUBBORN)).start()
    _wait_for_output(worker, "up")
    assert worker.stop(timeout=0.3) == (None, 0.3)
    assert worker.returncode == -signal.SIGKILL


def test_kill_and_start_again_appends_to_the_log(tmp_path: Path) -> None:
    worker = WorkerProcess(tmp_path / "w.log", command=_python(GRACEFUL)).start()
    worker.wait_until_ready(timeout=10)
    with pytest.raises(RuntimeError, match="already running"):
        worker.start()
    first = worker.pid
    assert worker.kill() == -signal.SIGKILL
    assert worker.kill() == -signal.SIGKILL  # once dead, nothing more happens
    worker.start()
    assert worker.pid != first
    _wait_for_output(worker, STARTED * 2)
    assert worker.stop(timeout=10)[0] == 0


def test_truncate_log_starts_each_run_with_an_empty_log(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("an earlier run\n")
    worker = WorkerProcess(log, command=_python(STUBBORN), truncate_log=True).start()
    _wait_for_output(worker, "up")
    assert worker.log_text() == "up\n"
    worker.kill()


def test_exit_before_ready_is_a_worker_error_with_the_log(tmp_path: Path) -> None:
    worker = WorkerProcess(tmp_path / "w.log", command=_python(FAILING)).start()
    with pytest.raises(WorkerError, match="worker exited before logging") as caught:
        worker.wait_until_ready(timeout=10)
    assert "exited with 3" in str(caught.value)
    assert "1 error lines, first: Traceback" in str(caught.value)
    assert "RuntimeError: no broker" in str(caught.value)
    with pytest.raises(WorkerError, match=r"the worker exited with status 3; see .*w\.log:\n"):
        worker.check()
    assert worker.stop(timeout=1)[0] == 3  # no signal to a process that has exited


def test_not_ready_in_time_is_a_worker_error(tmp_path: Path) -> None:
    worker = WorkerProcess(tmp_path / "w.log", command=_python(STUBBORN)).start()
    try:
        with pytest.raises(WorkerError, match=r"no '\[\^Worker\]: Ready' in 0.2 s"):
            worker.wait_until_ready(timeout=0.2)
    finally:
        worker.kill()


def test_the_environment_and_directory_are_the_callers(tmp_path: Path) -> None:
    script = "import os; print(os.getcwd(), os.environ.get('STREAMTALLY_X'), flush=True)"
    worker = WorkerProcess(
        tmp_path / "w.log",
        {"STREAMTALLY_X": "given", "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        command=_python(script),
    ).start()
    assert worker.proc.wait(timeout=10) == 0
    assert worker.log_text() == f"{tmp_path} given\n"


def test_wait_for_any_returns_the_line_logged_and_names_all_when_none_comes(
    tmp_path: Path,
) -> None:
    worker = WorkerProcess(tmp_path / "w.log", command=_python(GRACEFUL)).start()
    try:
        assert worker.wait_for_any(("port taken", READY_LINE), timeout=10) == READY_LINE
        with pytest.raises(WorkerError, match=r"no 'port taken' or 'listening' in 0.2 s"):
            worker.wait_for_any(("port taken", "listening"), timeout=0.2)
    finally:
        assert worker.stop(timeout=10)[0] == 0
