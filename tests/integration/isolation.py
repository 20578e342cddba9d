"""What keeps integration tests apart when several pytest processes share one stack.

`make test` runs the integration tier in parallel (pytest-xdist): each process has
its own topic namespace for the module worker (`process_namespace`), and a test that
needs a Redis database of its own leases one (`leased_db`) instead of naming a fixed
number, so two processes never empty each other's data.  Services a session starts
once for everyone (the schema registry, the local stack) are started under a lock
(`machine_lock`), so two processes never start them twice; the spare ports of a stack
of a test's own are reserved (`reserve_ports`), so two processes never pick the same.

The leases and locks are ``flock`` locks on files in `LOCK_DIR`: the kernel drops
them when their process dies, so a killed run leaves nothing held.  They separate
the processes of one machine, which is where the stack of a test run lives (the
local stack, or containers of this machine's Docker engine).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

#: The scope of the `FAULT_STACK_MODULES` in a parallel run (`tests.conftest.scope_of`).
FAULT_STACK: Final = "fault-stack"
#: The modules of the tests marked ``fault_stack`` (checked against the marks when the heavy
#: tier is collected): in a parallel run they are one work unit, so one process, one fault
#: stack, runs them one after the other (tests/integration/heavy/conftest.py).
FAULT_STACK_MODULES: Final = frozenset(
    f"tests/integration/heavy/{name}.py"
    for name in ("test_chaos", "test_outage", "test_tap_outage")
)
#: Where the lock files live (one directory per user; the files are left in place).
LOCK_DIR: Final = Path(tempfile.gettempdir()) / f"streamtally-tests-{os.getuid()}"
#: The databases a test may lease: Redis' default 16, but database 0, the shared one.
LEASABLE_DBS: Final = range(1, 16)
#: Seconds `leased_db` waits for a database to be free before it fails.
LEASE_WAIT_S: Final = 300.0


def db_url(redis_url: str, db: int) -> str:
    """`redis_url` naming database `db` instead of its own."""
    return urlsplit(redis_url)._replace(path=f"/{db}").geturl()


def _server_tag(redis_url: str) -> str:
    """A file-name-safe tag of the Redis server `redis_url` names (host and port)."""
    netloc = urlsplit(redis_url).netloc.rsplit("@", 1)[-1]
    return re.sub(r"[^A-Za-z0-9.-]", "_", netloc)


def _lock_file(name: str) -> int:
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    return os.open(LOCK_DIR / name, os.O_RDWR | os.O_CREAT, 0o600)


def _try_lock(name: str) -> int | None:
    """The descriptor of the lock file `name`, locked, or None when another holds it."""
    fd = _lock_file(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def leased_db(redis_url: str, *, wait_s: float = LEASE_WAIT_S) -> Iterator[int]:
    """A database number of `redis_url`'s server that no other test process holds.

    Held until the block ends (or the process dies).  The caller empties it before
    use: the last holder may have been killed before it cleaned up.
    """
    tag = _server_tag(redis_url)
    deadline = time.monotonic() + wait_s
    while True:
        for db in LEASABLE_DBS:
            fd = _try_lock(f"redis-{tag}-db{db}.lock")
            if fd is None:
                continue
            try:
                yield db
            finally:
                _unlock(fd)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no Redis database of {tag} was free for {wait_s:.0f} s "
                f"(databases {LEASABLE_DBS.start}-{LEASABLE_DBS.stop - 1}, locks in {LOCK_DIR})"
            )
        time.sleep(0.2)


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Hold the machine-wide lock `name` (blocking) for the block: one process at a time."""
    fd = _lock_file(f"{name}.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        _unlock(fd)


def reserve_ports(ports: Iterable[int]) -> contextlib.ExitStack | None:
    """Hold the lock files of `ports` (none of them waited for): an `ExitStack` that frees
    them when closed, or None when another process holds one of them.  Two processes that
    pick spare ports at random then never start services on the same ones, and neither
    waits for the other's start."""
    held = contextlib.ExitStack()
    for port in sorted(set(ports)):
        fd = _try_lock(f"port-{port}.lock")
        if fd is None:
            held.close()
            return None
        held.callback(_unlock, fd)
    return held


def process_namespace(base: str, worker_id: str | None) -> str:
    """The topic namespace of one pytest process: `base` alone when the run is not
    parallel, else `base` with the xdist worker's id (``gw0``, ``gw1``...)."""
    return f"{base}-{worker_id}" if worker_id else base
