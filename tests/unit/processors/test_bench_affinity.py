"""`bench pipeline --worker-cpus`: the CPU lists, the split, and the pins on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.affinity import CpuSplit, Pinning, parse_cpus, pin, stack_pids
from streamtally.cli import main


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("1", {1}), ("0,2", {0, 2}), ("2-3", {2, 3}), ("0,2-4", {0, 2, 3, 4}), (" 1 , 3 ", {1, 3})],
)
def test_cpu_lists_are_read_as_linux_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == frozenset(cpus)


@pytest.mark.parametrize(("text", "says"), [
    ("", "write CPUs as"),
    ("a", "write CPUs as"),
    ("1-", "write CPUs as"),
    ("-1", "write CPUs as"),
    ("1;2", "write CPUs as"),
    ("3-1", "runs backwards"),
])  # fmt: skip
def test_a_bad_cpu_list_is_refused_saying_how_to_write_one(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_cpus(text)


def test_the_split_gives_the_rest_the_other_cpus() -> None:
    split = CpuSplit.of(frozenset({1}), available={0, 1, 2})
    assert split == CpuSplit(frozenset({1}), frozenset({0, 2}))
    assert split.describe() == "workers on CPU 1, the rest on CPU 0,2"


def test_a_split_that_leaves_nothing_or_asks_for_a_missing_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves no CPU for the broker"):
        CpuSplit.of(frozenset({0, 1}), available={0, 1})
    with pytest.raises(ValueError, match="CPU 5 is not one this process may use"):
        CpuSplit.of(frozenset({1, 5}), available={0, 1})


def _cpus_of_threads(pid: int) -> dict[int, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


@pytest.fixture
def threaded_child() -> Iterator[int]:
    """A process with three threads, alive until the test ends."""
    code = (
        "import threading, time, sys\n"
        "for _ in range(2): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"up\n"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _two_cpus() -> tuple[int, int]:
    have = sorted(os.sched_getaffinity(0))
    if len(have) < 2:
        pytest.skip("needs two CPUs this process may use")
    return have[0], have[1]


def test_every_thread_of_a_process_is_pinned(threaded_child: int) -> None:
    first, _ = _two_cpus()
    assert pin(threaded_child, frozenset({first})) == 3
    threads = _cpus_of_threads(threaded_child)
    assert len(threads) == 3
    assert set(threads.values()) == {str(first)}


def test_a_gone_process_pins_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pin(proc.pid, frozenset(os.sched_getaffinity(0))) == 0
    assert stack_pids({"redis": proc.pid, "kafka": None}) == {}


def test_pinning_moves_the_services_and_this_process_and_gives_their_cpus_back(
    threaded_child: int,
) -> None:
    first, second = _two_cpus()
    mine = frozenset(os.sched_getaffinity(0))
    split = CpuSplit(frozenset({second}), frozenset({first}))
    assert stack_pids({"redis": threaded_child}) == {"redis": threaded_child}
    with Pinning(split, {"redis": threaded_child}) as pinning:
        assert os.sched_getaffinity(0) == {first}
        assert set(_cpus_of_threads(threaded_child).values()) == {str(first)}
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert pinning.worker(worker.pid) >= 1
            assert set(_cpus_of_threads(worker.pid).values()) == {str(second)}
        finally:
            worker.kill()
            worker.wait()
    assert os.sched_getaffinity(0) == mine
    assert set(_cpus_of_threads(threaded_child).values()) == {
        _cpus_of_threads(os.getpid())[os.getpid()]
    }


@pytest.mark.parametrize(
    ("cpus", "says"),
    [("x", "write CPUs as"), ("", "write CPUs as"), ("4096", "is not one this process may use")],
)
def test_the_benchmark_refuses_a_bad_cpu_list_before_it_starts(
    cpus: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "pipeline", "--worker-cpus", cpus]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamtally bench pipeline: ")
    assert says in err
