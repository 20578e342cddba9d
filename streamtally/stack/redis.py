"""The stack's Redis: one server, or a Redis Cluster of three masters, as the config says.

`up`, `down`, `statuses` and `wipe` handle either: the one server
(`streamtally.stack.redis_server`, the default) or, with ``stack up
--redis-cluster``, the cluster (`streamtally.stack.redis_cluster`).  Each
refuses to start while the other shape runs, since the two keep their data
apart.

Layout of the one server under ``<state>/redis``::

    redis.conf    rewritten on every start (AOF everysec + RDB save points)
    data/         dump.rdb and appendonlydir/
    redis.log     Redis' own log;  redis.out: its stdout/stderr
    redis.pid
"""

from __future__ import annotations

import dataclasses
import shutil

from streamtally.errors import StackError
from streamtally.stack import Say, ServiceStatus, redis_cluster, redis_server, stop_services
from streamtally.stack.config import StackConfig
from streamtally.stack.redis_server import (
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    paths,
    redis_conf,
)

__all__ = [
    "READY_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "down",
    "paths",
    "redis_conf",
    "status",
    "statuses",
    "up",
    "wipe",
]


def statuses(cfg: StackConfig) -> list[ServiceStatus]:
    """The status of the one server, or of each master of the Redis Cluster."""
    if cfg.redis_cluster:
        return redis_cluster.statuses(cfg)
    return [redis_server.status(cfg)]


def status(cfg: StackConfig) -> ServiceStatus:
    """The status of the one server (of the first master of the Redis Cluster)."""
    return statuses(cfg)[0]


def up(cfg: StackConfig, say: Say, timeout: float = READY_TIMEOUT_S) -> None:
    """Start redis-server (or the cluster) unless it runs already; return once it answers."""
    if cfg.redis_cluster:
        redis_cluster.up(cfg, say, timeout)
        return
    _refuse_cluster(cfg)
    redis_server.up(cfg, say, timeout)


def _refuse_cluster(cfg: StackConfig) -> None:
    running = [st for st in redis_cluster.statuses(cfg) if st.running]
    if running:
        pids = ", ".join(str(st.pid) for st in running)
        raise StackError(
            f"redis runs as a Redis Cluster (pid {pids}): stop it with `streamtally stack down`, "
            "then `streamtally stack up --no-redis-cluster` (the cluster keeps its own data, "
            f"under {cfg.redis_cluster_dir})"
        )


def down(cfg: StackConfig, say: Say, timeout: float = STOP_TIMEOUT_S) -> None:
    stop_services(statuses(cfg), say, timeout)


def wipe(cfg: StackConfig, say: Say) -> None:
    """Remove the data and logs of the one server (plaintext and secured) and of the Redis
    Cluster."""
    secured = dataclasses.replace(cfg, brokers=1, redis_cluster=False, secure=True).redis_dir
    if secured.exists():
        shutil.rmtree(secured)
        say(f"redis: wiped the secured Redis under {secured}")
    rp = paths(dataclasses.replace(cfg, secure=False))
    if rp.data_dir.exists():
        shutil.rmtree(rp.data_dir)
    for leftover in (rp.log_file, rp.out_log, rp.conf):
        leftover.unlink(missing_ok=True)
    say(f"redis: wiped data and logs under {rp.root}")
    if cfg.redis_cluster_dir.exists():
        shutil.rmtree(cfg.redis_cluster_dir)
        say(f"redis: wiped the Redis Cluster under {cfg.redis_cluster_dir}")
