"""CPUs of their own for the pipeline benchmark's workers (``bench pipeline --worker-cpus``).

On a small machine the worker shares its cores with the broker, Redis and the
benchmark's own producer, and its tail latency follows whoever else runs.
`CpuSplit` gives the workers some CPUs and everything else the others: the
benchmark process itself, and the broker, Redis and registry that
`streamtally stack` runs on this machine (found through their pid files; a
stack in containers or elsewhere is not touched, and the report says which
were pinned).  `Pinning` applies the split and gives the stack's processes
back the CPUs they had once the run ends.

Linux only (``os.sched_setaffinity``): a process's threads each have a mask of
their own, so every thread (``/proc/<pid>/task``) is set, and threads made later
inherit the mask of the thread that makes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["CpuSplit", "Pinning", "cpu_list", "parse_cpus", "pin", "stack_pids"]


def parse_cpus(text: str) -> frozenset[int]:
    """CPUs written as Linux lists them: ``1``, ``0,2``, ``2-3``, ``0,2-3``.

    `ValueError`, saying what is wrong, for anything else.
    """
    cpus: set[int] = set()
    for written in text.split(","):
        part = written.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"CPU list {text!r}: write CPUs as 1, 0,2 or 2-3")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"CPU list {text!r}: the range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """The workers' CPUs and everyone else's: disjoint, neither empty."""

    workers: frozenset[int]
    others: frozenset[int]

    @classmethod
    def of(cls, workers: frozenset[int], available: Iterable[int] | None = None) -> CpuSplit:
        """`workers` and the rest of `available` (this process's CPUs by default);
        `ValueError` when a CPU is not available or none would be left for the rest."""
        have = frozenset(os.sched_getaffinity(0) if available is None else available)
        missing = sorted(workers - have)
        if missing:
            raise ValueError(
                f"CPU {', '.join(map(str, missing))} is not one this process may use "
                f"(it may use {cpu_list(have)})"
            )
        others = have - workers
        if not others:
            raise ValueError(
                f"--worker-cpus {cpu_list(workers)} leaves no CPU for the broker, Redis and "
                f"the benchmark (this process may use {cpu_list(have)})"
            )
        return cls(workers, others)

    def describe(self) -> str:
        return f"workers on CPU {cpu_list(self.workers)}, the rest on CPU {cpu_list(self.others)}"


def cpu_list(cpus: Iterable[int]) -> str:
    """CPUs as Linux lists them, one by one: ``0,2,3``."""
    return ",".join(str(c) for c in sorted(cpus))


def _threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


def pin(pid: int, cpus: frozenset[int]) -> int:
    """Set every thread of `pid` to run on `cpus`; how many threads were set (0: the
    process is gone).  A thread that ends meanwhile is passed over."""
    done = 0
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue
        done += 1
    return done


def stack_pids(state: Mapping[str, int | None]) -> dict[str, int]:
    """The running services of `state` (name → pid or None) whose process exists here."""
    return {
        name: pid
        for name, pid in state.items()
        if pid is not None and Path(f"/proc/{pid}").exists()
    }


@dataclass
class Pinning:
    """The split applied: this process and `services` (name → pid) on the others' CPUs,
    each worker on the workers' CPUs as it is handed to `worker`.  On leaving, this
    process and the services get back the CPUs they had (the workers are gone by then)."""

    split: CpuSplit
    services: dict[str, int]
    _before: dict[int, frozenset[int]] = field(default_factory=dict)

    def __enter__(self) -> Pinning:
        for pid in (os.getpid(), *self.services.values()):
            try:
                self._before[pid] = frozenset(os.sched_getaffinity(pid))
            except ProcessLookupError:
                continue
            pin(pid, self.split.others)
        return self

    def worker(self, pid: int) -> int:
        """Pin a worker (again: a thread made before the first call is caught by a second);
        how many of its threads were set."""
        return pin(pid, self.split.workers)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for pid, cpus in self._before.items():
            pin(pid, cpus)
        self._before.clear()
