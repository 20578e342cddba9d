"""One Redis server for local work: Debian's ``redis-server``, run by us on a loopback port.

The stack's Redis is this one server by default, or a Redis Cluster of three
masters with ``stack up --redis-cluster`` (`streamtally.stack.redis_cluster`,
which starts its nodes with this module's pieces); `streamtally.stack.redis`
chooses between the two as the config says.

Layout under ``<state>/redis``::

    redis.conf    rewritten on every start (AOF everysec + RDB save points)
    data/         dump.rdb and appendonlydir/
    redis.log     Redis' own log;  redis.out: its stdout/stderr
    redis.pid
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamtally.errors import StackError
from streamtally.stack import (
    Say,
    ServiceStatus,
    already_running,
    indent,
    port_in_use,
    port_in_use_error,
    process_status,
    read_pid,
    secure,
    spawn_detached,
    tail,
    wait_answering,
)
from streamtally.stack.config import StackConfig, record_shape
from streamtally.store.acl import worker_acl_rule

REDIS_SERVER = "redis-server"
DEBIAN_PACKAGE = "redis-server"
DEBIAN_SERVICE_PID = Path("/run/redis/redis-server.pid")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_APT_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class RedisPaths:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "redis.conf"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "redis.log"

    @property
    def out_log(self) -> Path:
        return self.root / "redis.out"

    @property
    def pid_file(self) -> Path:
        return self.root / "redis.pid"


def paths(cfg: StackConfig) -> RedisPaths:
    return RedisPaths(cfg.redis_dir)


# --------------------------------------------------------------------------- install


def _run_logged(argv: list[str], say: Say) -> None:
    say(f"redis: running `{' '.join(argv)}` ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run(
        argv, env=env, capture_output=True, text=True, check=False, timeout=_APT_TIMEOUT_S
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip().splitlines()[-20:]
        raise StackError(
            f"`{' '.join(argv)}` failed (exit {result.returncode}):\n{indent(chr(10).join(output))}"
        )


def _debian_service_pid() -> int | None:
    pid = read_pid(DEBIAN_SERVICE_PID)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def stop_debian_service(say: Say) -> None:
    """Stop (and under systemd disable) the distro's redis-server service if it runs."""
    pid = _debian_service_pid()
    if pid is None:
        return
    systemctl = shutil.which("systemctl")
    service = shutil.which("service")
    if systemctl is not None and Path("/run/systemd/system").is_dir():
        _run_logged([systemctl, "disable", "--now", "redis-server.service"], say)
    elif service is not None:
        _run_logged([service, "redis-server", "stop"], say)
    else:
        say(f"redis: stopping the distro's redis-server (pid {pid}) with SIGTERM")
        os.kill(pid, signal.SIGTERM)


def find_redis_server(say: Say) -> str:
    """``redis-server`` from PATH, installed with apt-get when missing."""
    found = shutil.which(REDIS_SERVER)
    if found is not None:
        return found
    apt_get = shutil.which("apt-get")
    if apt_get is None:
        raise StackError(
            "redis-server not found and no apt-get: install Redis 7 and put redis-server on PATH"
        )
    if os.geteuid() != 0:
        raise StackError(f"redis-server not found: run `sudo apt-get install -y {DEBIAN_PACKAGE}`")
    say("redis: redis-server not found on PATH; installing Debian's package")
    _run_logged([apt_get, "update"], say)
    _run_logged([apt_get, "install", "-y", DEBIAN_PACKAGE], say)
    # Debian's postinst may start its own service on 6379; ours must own the port.
    stop_debian_service(say)
    found = shutil.which(REDIS_SERVER)
    if found is None:
        raise StackError(f"apt-get installed {DEBIAN_PACKAGE} but redis-server is not on PATH")
    return found


# --------------------------------------------------------------------------- config


def _quote(value: Path | str) -> str:
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def server_conf(host: str, port: int, rp: RedisPaths, *extra: str) -> str:
    """A ``redis.conf`` on ``host:port`` with its files in `rp`: AOF everysec + RDB saves."""
    lines = [
        "# Written by `streamtally stack up` on every start.",
        f"bind {host}",
        f"port {port}",
        "protected-mode yes",
        "daemonize no",
        "supervised no",
        f"pidfile {_quote(rp.pid_file)}",
        f"logfile {_quote(rp.log_file)}",
        "loglevel notice",
        f"dir {_quote(rp.data_dir)}",
        "dbfilename dump.rdb",
        "save 3600 1 300 100 60 10000",
        "appendonly yes",
        "appendfsync everysec",
        'appendfilename "appendonly.aof"',
        'appenddirname "appendonlydir"',
        *extra,
    ]
    return "\n".join(lines) + "\n"


def redis_conf(cfg: StackConfig, rp: RedisPaths) -> str:
    if not cfg.secure:
        return server_conf(cfg.host, cfg.redis_port, rp)
    return server_conf(cfg.host, 0, rp, *_secure_lines(cfg))


def _secure_lines(cfg: StackConfig) -> list[str]:
    """TLS only, on the stack's Redis port (``port 0``: no plaintext port); the default user
    off; the worker's ACL user (`streamtally.store.acl`) and an administrator."""
    sf = secure.files(cfg)
    credentials = secure.load_credentials(cfg)
    return [
        f"tls-port {cfg.redis_port}",
        f"tls-cert-file {_quote(sf.server_cert)}",
        f"tls-key-file {_quote(sf.server_key)}",
        f"tls-ca-cert-file {_quote(sf.ca_cert)}",
        "tls-auth-clients no",
        "user default off",
        f"user {secure.REDIS_CLIENT_USER} on >{credentials.redis_client} {worker_acl_rule()}",
        f"user {secure.REDIS_ADMIN_USER} on >{credentials.redis_admin} ~* &* +@all",
    ]


# --------------------------------------------------------------------------- readiness


def answers(host: str, port: int, **tls_and_user: Any) -> bool:
    """True if a redis-server on ``host:port`` answers PING (not while it loads its data).

    `tls_and_user`: more arguments of ``redis.Redis`` (TLS, user and password).
    """
    import redis
    import redis.exceptions

    client = redis.Redis(
        host=host, port=port, socket_timeout=1.0, socket_connect_timeout=1.0, **tls_and_user
    )
    try:
        return bool(client.ping())
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        return False  # includes BusyLoadingError while the AOF is replayed
    finally:
        client.close()


def redis_answers(cfg: StackConfig) -> bool:
    if not cfg.secure:
        return answers(cfg.host, cfg.redis_port)
    return answers(
        cfg.host,
        cfg.redis_port,
        ssl=True,
        ssl_ca_certs=str(secure.files(cfg).ca_cert),
        username=secure.REDIS_CLIENT_USER,
        password=secure.load_credentials(cfg).redis_client,
    )


def _startup_failure(rp: RedisPaths, what: str) -> StackError:
    details = tail(rp.log_file) or tail(rp.out_log)
    return StackError(
        f"redis {what}. See {rp.log_file} and {rp.out_log}"
        + (f"; last lines:\n{indent(details)}" if details else "")
    )


def wait_ready(
    cfg: StackConfig, rp: RedisPaths, proc: subprocess.Popen[bytes] | None, timeout: float
) -> float:
    """Poll until redis-server answers PING; returns the seconds waited."""
    return wait_answering(
        lambda: redis_answers(cfg),
        proc=proc,
        pid_file=rp.pid_file,
        timeout=timeout,
        every=0.1,
        exited=lambda code: _startup_failure(rp, f"exited with code {code} while starting"),
        timed_out=lambda: _startup_failure(
            rp, f"did not answer PING on {cfg.host}:{cfg.redis_port} within {timeout:g} s"
        ),
    )


# --------------------------------------------------------------------------- lifecycle


def status(cfg: StackConfig) -> ServiceStatus:
    """The status of the one server (whatever the config says of a Redis Cluster)."""
    return process_status("redis", paths(cfg).pid_file, REDIS_SERVER, cfg.redis_port)


def free_port(host: str, port: int, say: Say) -> None:
    """Make sure nothing listens on ``host:port``: stop the distro's service if it does."""
    if not port_in_use(host, port):
        return
    if _debian_service_pid() is not None:
        say(f"redis: the distro's redis-server service holds port {port}; stopping it")
        stop_debian_service(say)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while port_in_use(host, port) and time.monotonic() < deadline:
            time.sleep(0.1)
    if port_in_use(host, port):
        raise port_in_use_error(host, port, "pick another port with STREAMTALLY_REDIS_PORT")


def _refuse_other_security(cfg: StackConfig) -> None:
    try:
        other = dataclasses.replace(cfg, brokers=1, secure=not cfg.secure)
    except StackError:
        return
    current = status(other)
    if current.running:
        now, wanted = ("secured", "") if other.secure else ("plaintext", " --secure")
        raise StackError(
            f"redis runs {now} (pid {current.pid}): stop it with `streamtally stack down`, "
            f"then `streamtally stack up{wanted}`"
        )


def up(cfg: StackConfig, say: Say, timeout: float = READY_TIMEOUT_S) -> None:
    """Start redis-server unless it runs already; return once it answers."""
    _refuse_other_security(cfg)
    record_shape(cfg.state_dir, redis_cluster=False)
    rp = paths(cfg)
    if already_running("redis", status(cfg), cfg.local_redis_url(), say):
        wait_ready(cfg, rp, None, timeout)
        return
    server = find_redis_server(say)
    free_port(cfg.host, cfg.redis_port, say)
    rp.data_dir.mkdir(parents=True, exist_ok=True)
    if cfg.secure:
        secure.ensure_material(cfg, say)
    # Mode 0600: the secured Redis's holds its users' passwords.
    rp.conf.touch(mode=0o600)
    rp.conf.chmod(0o600)
    rp.conf.write_text(redis_conf(cfg, rp), encoding="utf-8")
    say(f"redis: starting {server} on {cfg.host}:{cfg.redis_port} ...")
    proc = spawn_detached(
        [server, str(rp.conf)], cwd=rp.root, log_file=rp.out_log, pid_file=rp.pid_file
    )
    waited = wait_ready(cfg, rp, proc, timeout)
    say(f"redis: ready in {waited:.1f} s (pid {proc.pid}, {cfg.local_redis_url()})")
