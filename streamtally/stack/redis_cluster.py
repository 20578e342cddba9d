"""A Redis Cluster of three masters for local work (``stack up --redis-cluster``).

Three Debian ``redis-server`` processes with ``cluster-enabled yes`` on
consecutive loopback ports (6379, 6380, 6381 by default; each node's cluster
bus on its port + 10000), no replicas.  The first ``up`` joins them with
``redis-cli --cluster create`` (the 16384 slots spread over the three); later
starts find each other again from their ``nodes.conf``.  Clients connect to
any master in cluster mode (``REDIS_URL=redis://127.0.0.1:6379/0
REDIS_CLUSTER=1``; redis-py's `redis.cluster.RedisCluster`).

Layout under ``<state>/redis-cluster``::

    node-1/ ...       one folder per master:
      redis.conf      rewritten on every start (AOF everysec + RDB save points)
      data/           dump.rdb, appendonlydir/ and nodes.conf (the cluster's view)
      redis.log       Redis' own log;  redis.out: its stdout/stderr
      redis.pid
    create.log        redis-cli's output when it created the cluster
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from streamtally.errors import StackError
from streamtally.stack import (
    Say,
    ServiceStatus,
    already_running,
    indent,
    port_in_use,
    port_in_use_error,
    process_status,
    redis_server,
    remove_pid_file,
    spawn_detached,
    stop_services,
    tail,
    wait_answering,
)
from streamtally.stack.config import REDIS_BUS_OFFSET, StackConfig, record_shape
from streamtally.stack.redis_server import (
    READY_TIMEOUT_S,
    REDIS_SERVER,
    STOP_TIMEOUT_S,
    RedisPaths,
    answers,
    find_redis_server,
    free_port,
    server_conf,
)

__all__ = [
    "SLOTS",
    "ClusterNode",
    "cluster_conf",
    "cluster_info",
    "down",
    "nodes",
    "statuses",
    "up",
]

#: Hash slots of a Redis Cluster.
SLOTS: Final = 16384
REDIS_CLI: Final = "redis-cli"
#: How long a master may be unreachable before the others mark it as failing.
NODE_TIMEOUT_MS: Final = 5000
_CREATE_TIMEOUT_S: Final = 120.0
_ANSI: Final = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One master of the local Redis Cluster."""

    index: int
    port: int
    paths: RedisPaths

    @property
    def name(self) -> str:
        return f"redis-{self.index}"


def nodes(cfg: StackConfig) -> list[ClusterNode]:
    return [
        ClusterNode(i, port, RedisPaths(cfg.redis_cluster_dir / f"node-{i}"))
        for i, port in enumerate(cfg.redis_cluster_ports, start=1)
    ]


def cluster_conf(cfg: StackConfig, node: ClusterNode) -> str:
    """The node's ``redis.conf``: the single server's, with cluster mode on."""
    return server_conf(
        cfg.host,
        node.port,
        node.paths,
        "cluster-enabled yes",
        'cluster-config-file "nodes.conf"',
        f"cluster-node-timeout {NODE_TIMEOUT_MS}",
        f"cluster-port {node.port + REDIS_BUS_OFFSET}",
    )


def cluster_info(host: str, port: int) -> dict[str, str] | None:
    """``CLUSTER INFO`` of the node on ``host:port`` as a dict (None: it does not answer)."""
    import redis
    import redis.exceptions

    client = redis.Redis(host=host, port=port, socket_timeout=2.0, socket_connect_timeout=1.0)
    try:
        raw = client.cluster("INFO")
    except (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        redis.exceptions.ResponseError,  # loading, or not in cluster mode
    ):
        return None
    finally:
        client.close()
    if isinstance(raw, dict):  # redis-py parsed it
        return {str(key): str(value) for key, value in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    info = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return info


def _healthy(info: dict[str, str] | None, masters: int) -> bool:
    return (
        info is not None
        and info.get("cluster_state") == "ok"
        and info.get("cluster_slots_ok") == str(SLOTS)
        and info.get("cluster_known_nodes") == str(masters)
    )


def _fresh(info: dict[str, str] | None) -> bool:
    """A node that never joined a cluster: knows only itself, serves no slot."""
    return (
        info is not None
        and info.get("cluster_known_nodes") == "1"
        and info.get("cluster_slots_assigned") == "0"
    )


# --------------------------------------------------------------------------- lifecycle


def _status(node: ClusterNode) -> ServiceStatus:
    return process_status(node.name, node.paths.pid_file, REDIS_SERVER, node.port)


def statuses(cfg: StackConfig) -> list[ServiceStatus]:
    return [_status(node) for node in nodes(cfg)]


def _refuse_single(cfg: StackConfig) -> None:
    single = redis_server.status(dataclasses.replace(cfg, redis_cluster=False))
    if single.running:
        raise StackError(
            f"redis runs as one server (pid {single.pid}): stop it with `streamtally stack down`, "
            "then `streamtally stack up --redis-cluster` (the cluster keeps its own data, "
            f"under {cfg.redis_cluster_dir})"
        )


def _check_ports_free(cfg: StackConfig, missing: Sequence[ClusterNode], say: Say) -> None:
    remedy = "pick other ports with STREAMTALLY_REDIS_PORT"
    for node in missing:
        free_port(cfg.host, node.port, say)
        bus = node.port + REDIS_BUS_OFFSET
        if port_in_use(cfg.host, bus):
            raise port_in_use_error(cfg.host, bus, remedy, what=f" ({node.name} cluster bus)")


def _startup_failure(node: ClusterNode, what: str) -> StackError:
    rp = node.paths
    details = tail(rp.log_file) or tail(rp.out_log)
    return StackError(
        f"{node.name} {what}. See {rp.log_file} and {rp.out_log}"
        + (f"; last lines:\n{indent(details)}" if details else "")
    )


def _wait_answering(
    cfg: StackConfig,
    every_node: Sequence[ClusterNode],
    started: Sequence[tuple[ClusterNode, subprocess.Popen[bytes]]],
    timeout: float,
) -> float:
    """Poll until every node answers PING; a started one that exits first fails it."""
    pending = list(every_node)

    def all_answer() -> bool:
        for node, proc in started:
            if proc.poll() is not None:
                remove_pid_file(node.paths.pid_file)
                raise _startup_failure(node, f"exited with code {proc.returncode} while starting")
        pending[:] = [node for node in pending if not answers(cfg.host, node.port)]
        return not pending

    return wait_answering(
        all_answer,
        timeout=timeout,
        every=0.1,
        timed_out=lambda: _startup_failure(
            pending[0], f"did not answer PING on {cfg.host}:{pending[0].port} within {timeout:g} s"
        ),
    )


def _create(cfg: StackConfig, every_node: Sequence[ClusterNode], say: Say) -> None:
    """``redis-cli --cluster create`` of fresh nodes: the slots spread over the masters."""
    cli = shutil.which(REDIS_CLI)
    if cli is None:
        raise StackError(
            "redis-cli not found: install Debian's redis-tools (apt-get install -y redis-tools)"
        )
    addresses = [f"{cfg.host}:{node.port}" for node in every_node]
    say(f"redis: creating the cluster of {len(addresses)} masters ({', '.join(addresses)}) ...")
    argv = [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
    result = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=_CREATE_TIMEOUT_S
    )
    log = cfg.redis_cluster_dir / "create.log"
    log.write_text(_ANSI.sub("", result.stdout + result.stderr), encoding="utf-8")
    if result.returncode != 0:
        raise StackError(
            f"`redis-cli --cluster create` failed (exit {result.returncode}); full output: {log}\n"
            f"{indent(tail(log))}\n`streamtally stack down --wipe` resets the cluster's nodes."
        )


def _wait_healthy(cfg: StackConfig, every_node: Sequence[ClusterNode], timeout: float) -> None:
    masters = len(every_node)
    infos: dict[str, dict[str, str] | None] = {}

    def healthy() -> bool:
        for node in every_node:
            infos[node.name] = cluster_info(cfg.host, node.port)
        return all(_healthy(info, masters) for info in infos.values())

    def timed_out() -> StackError:
        seen = "; ".join(
            f"{name}: "
            + (
                "no answer"
                if info is None
                else f"state {info.get('cluster_state')}, {info.get('cluster_known_nodes')} "
                f"known nodes, {info.get('cluster_slots_ok')} slots ok"
            )
            for name, info in infos.items()
        )
        return StackError(
            f"the Redis Cluster under {cfg.redis_cluster_dir} did not become healthy within "
            f"{timeout:g} s ({seen}). `streamtally stack down --wipe` resets it"
        )

    wait_answering(healthy, timeout=timeout, every=0.2, timed_out=timed_out)


def up(cfg: StackConfig, say: Say, timeout: float = READY_TIMEOUT_S) -> None:
    """Start the masters that do not run, create the cluster once; return once it is ok."""
    _refuse_single(cfg)
    record_shape(cfg.state_dir, redis_cluster=True)
    every_node = nodes(cfg)
    start = time.monotonic()
    missing = [
        node
        for node in every_node
        if not already_running(node.name, _status(node), f"{cfg.host}:{node.port}", say)
    ]
    started = []
    if missing:
        server = find_redis_server(say)
        _check_ports_free(cfg, missing, say)
        for node in missing:
            rp = node.paths
            rp.data_dir.mkdir(parents=True, exist_ok=True)
            rp.conf.write_text(cluster_conf(cfg, node), encoding="utf-8")
            say(f"{node.name}: starting {server} (cluster mode) on {cfg.host}:{node.port} ...")
            proc = spawn_detached(
                [server, str(rp.conf)], cwd=rp.root, log_file=rp.out_log, pid_file=rp.pid_file
            )
            started.append((node, proc))
    _wait_answering(cfg, every_node, started, timeout)
    fresh = [node.name for node in every_node if _fresh(cluster_info(cfg.host, node.port))]
    if len(fresh) == len(every_node):
        _create(cfg, every_node, say)
    elif fresh:
        raise StackError(
            f"{', '.join(fresh)} of the Redis Cluster under {cfg.redis_cluster_dir} lost its "
            "cluster state (nodes.conf) while the others kept theirs: `streamtally stack down "
            "--wipe` resets the cluster"
        )
    _wait_healthy(cfg, every_node, timeout)
    pids = ", ".join(str(_status(node).pid) for node in every_node)
    say(
        f"redis: cluster of {len(every_node)} masters ready in {time.monotonic() - start:.1f} s "
        f"(pids {pids}; {cfg.local_redis_url()}, cluster mode)"
    )


def down(cfg: StackConfig, say: Say, timeout: float = STOP_TIMEOUT_S) -> None:
    stop_services(statuses(cfg), say, timeout)
