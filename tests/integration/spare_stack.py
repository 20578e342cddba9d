"""Stacks of a test's own: ``streamtally stack up`` in a temporary state dir, on spare ports.

`own_stack` starts one with the CLI (the shape given: brokers, a Redis Cluster), yields
its `StackConfig`, and stops it afterwards; then no java or redis-server process of it
may be left (pgrep).  `stack_env` is the environment that points streamtally commands
at it (its state dir and ports, and no ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` of
another stack).  The ports are picked at random and reserved for the stack's life
(`reserve_ports`), so parallel test processes never pick the same ones; none is the
shared stack's, and all are below Linux's ephemeral range (32768-60999), Redis bus ports
(+10000) included: an outgoing connection may take any port in it between the pick and
the start.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest

from streamtally.settings import ENV_BOOTSTRAP_SERVERS, ENV_REDIS_CLUSTER, ENV_REDIS_URL
from streamtally.stack import StackConfig, kafka, port_in_use, redis
from tests.integration.isolation import reserve_ports
from tests.integration.worker import streamtally

#: What a local stack needs on the machine.
TOOLS: Final = ("java", "mvn", "redis-server", "redis-cli")


def require_tools() -> None:
    """Skip the test (fail it on CI) when the machine lacks what a local stack needs."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        message = f"the local stack needs {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def claim_spare(
    held: contextlib.ExitStack,
    candidate: Callable[[], StackConfig],
    ports_of: Callable[[StackConfig], list[int]] = lambda cfg: [p for _, p in cfg.named_ports()],
    *,
    what: str,
) -> StackConfig:
    """The first config `candidate` makes whose ports (`ports_of`) nothing listens on now,
    with those ports reserved (`reserve_ports`) until `held` closes."""
    for _ in range(50):
        cfg = candidate()
        ports = ports_of(cfg)
        reserved = reserve_ports(ports)
        if reserved is None:
            continue
        if any(port_in_use(cfg.host, port) for port in ports):
            reserved.close()
            continue
        held.enter_context(reserved)
        return cfg
    pytest.fail(f"no spare ports for {what}")


def spare_config(
    state_dir: Path, held: contextlib.ExitStack, *, brokers: int = 1, redis_cluster: bool = False
) -> StackConfig:
    """A config of the given shape on spare ports, reserved until `held` closes."""

    def candidate() -> StackConfig:
        kafka_port = random.randrange(25000, 29000, 10)
        return StackConfig(
            state_dir,
            kafka_port=kafka_port,
            controller_port=kafka_port + 1,
            redis_port=random.randrange(11000, 13000, 10),
            # Not the stack's registry port (8081), which a registry of the session may hold.
            registry_port=kafka_port + 9,
            brokers=brokers,
            redis_cluster=redis_cluster,
        )

    return claim_spare(held, candidate, what=f"a stack of {brokers} broker(s)")


def stack_variables(cfg: StackConfig) -> dict[str, str]:
    """The variables that make streamtally commands use the stack of `cfg` (its state dir
    and ports), when no ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` names another one."""
    return {
        "STREAMTALLY_STATE_DIR": str(cfg.state_dir),
        "STREAMTALLY_KAFKA_PORT": str(cfg.kafka_port),
        "STREAMTALLY_CONTROLLER_PORT": str(cfg.controller_port),
        "STREAMTALLY_REDIS_PORT": str(cfg.redis_port),
    }


def stack_env(cfg: StackConfig) -> dict[str, str]:
    """This process's environment, pointed at the stack of `cfg` (and at no other)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL, ENV_REDIS_CLUSTER)
    }
    env.update(stack_variables(cfg))
    return env


def run_stack(
    cfg: StackConfig, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``streamtally stack ARGS`` on the stack of `cfg`."""
    return subprocess.run(
        streamtally("stack", *args),
        env=stack_env(cfg),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def leftovers(cfg: StackConfig) -> list[str]:
    """The java and redis-server processes of this stack still running (pgrep)."""
    patterns = [f"kafka.Kafka {cfg.state_dir}/"]
    patterns += [f"redis-server {cfg.host}:{port}" for port in cfg.redis_cluster_ports]
    if not cfg.redis_cluster:
        patterns.append(f"redis-server {cfg.host}:{cfg.redis_port}")
    found = []
    for pattern in patterns:
        result = subprocess.run(
            ["pgrep", "-a", "-f", pattern], capture_output=True, text=True, check=False
        )
        found += [line[:160] for line in result.stdout.splitlines()]
    return found


def _kill_what_is_left(cfg: StackConfig) -> None:
    """SIGKILL the nodes `stack down` left running (only processes that are this stack's)."""
    for st in [*kafka.statuses(cfg), *redis.statuses(cfg)]:
        if st.running and st.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(st.pid, signal.SIGKILL)


def stop(cfg: StackConfig) -> None:
    """``stack down``, then SIGKILL what it left; asserts that no process of it is left."""
    down = run_stack(cfg, "down", "--timeout", "30", timeout=180)
    _kill_what_is_left(cfg)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 10
    while leftovers(cfg) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(cfg) == []


@contextlib.contextmanager
def own_stack(
    state_dir: Path, *, brokers: int = 1, redis_cluster: bool = False
) -> Iterator[StackConfig]:
    """A stack of the caller's own in `state_dir` (see the module docstring)."""
    require_tools()
    shape = [] if brokers == 1 else ["--brokers", str(brokers)]
    shape += ["--redis-cluster"] if redis_cluster else []
    with contextlib.ExitStack() as held:
        cfg = spare_config(state_dir, held, brokers=brokers, redis_cluster=redis_cluster)
        held.callback(stop, cfg)  # (before the ports are freed)
        start = time.monotonic()
        up = run_stack(cfg, "up", *shape)
        print(up.stdout, up.stderr, f"(up took {time.monotonic() - start:.1f} s)")
        assert up.returncode == 0, up.stdout + up.stderr
        yield cfg
