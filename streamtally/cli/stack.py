"""``streamtally stack up|down|status``: the local Kafka (KRaft) + Redis stack.

``up --brokers 3`` runs three Kafka nodes, ``up --redis-cluster`` a Redis Cluster
of three masters; the stack remembers its shape (`streamtally.stack.config`).
``up --registry`` also starts the schema registry (`streamtally.stack.registry`),
which ``status``, ``env`` and ``down`` then handle until it is stopped.

Also runnable on its own: ``python -m streamtally.cli.stack up``.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from streamtally.cli._args import Parser
from streamtally.cli._output import say
from streamtally.redact import redact_servers, redact_url
from streamtally.settings import (
    ENV_BOOTSTRAP_SERVERS,
    ENV_REDIS_CLUSTER,
    ENV_REDIS_URL,
    Settings,
)
from streamtally.stack import (
    ServiceStatus,
    StackConfig,
    StackError,
    kafka,
    redis,
    registry,
    secure,
)
from streamtally.stack.client_env import SECURITY_VARIABLES, client_environment
from streamtally.stack.config import (
    BROKER_COUNTS,
    KAFKA_PORT_STEP,
    REDIS_BUS_OFFSET,
    REDIS_CLUSTER_MASTERS,
    StackShape,
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NOT_RUNNING = 3
EXIT_INTERRUPTED = 130

Handler = Callable[[argparse.Namespace, Settings], int]


def _say(line: str) -> None:
    say(line, file=sys.stdout)


def _guarded(command: str, handler: Handler) -> Handler:
    """Turn expected failures into a one-line error and an exit code, not a traceback."""

    def run(args: argparse.Namespace, settings: Settings) -> int:
        try:
            return handler(args, settings)
        except (StackError, subprocess.TimeoutExpired, OSError) as exc:
            say(f"stack {command}: error: {exc}")
            return EXIT_ERROR
        except KeyboardInterrupt:
            say(f"stack {command}: interrupted")
            return EXIT_INTERRUPTED

    return run


def _env_line(cfg: StackConfig) -> str:
    """The variables that point a client at this stack (the defaults need none of them);
    the secured stack's without its passwords: `stack env` prints those."""
    if cfg.secure:
        credentials = secure.load_credentials(cfg)
        kafka = secure.client_connection(cfg, credentials).describe()
        url = redact_url(secure.redis_client_url(cfg, credentials))
        return (
            f"KAFKA_BOOTSTRAP_SERVERS={kafka} REDIS_URL={url}{_registry_env(cfg)} (TLS, CA "
            f"{secure.files(cfg).ca_cert}); the credentials: "
            '`eval "$(streamtally stack env)"`'
        )
    line = (
        f"KAFKA_BOOTSTRAP_SERVERS={cfg.all_bootstrap_servers()} REDIS_URL={cfg.local_redis_url()}"
    )
    return line + (f" {ENV_REDIS_CLUSTER}=1" if cfg.redis_cluster else "") + _registry_env(cfg)


def _registry_env(cfg: StackConfig) -> str:
    """`` STREAMTALLY_SCHEMA_REGISTRY_URL=...`` while the stack's registry runs, else ''."""
    if not registry.status(cfg).running:
        return ""
    return f" {registry.ENV_SCHEMA_REGISTRY_URL}={cfg.local_registry_url()}"


def _note_overrides(settings: Settings, cfg: StackConfig) -> None:
    for name, value in (
        (ENV_BOOTSTRAP_SERVERS, settings.kafka_bootstrap_servers),
        (ENV_REDIS_URL, settings.redis_url_setting),
    ):
        if value:
            shown = redact_url(value) if name == ENV_REDIS_URL else redact_servers(value)
            _say(f"note: {name}={shown} is set, so the app uses that, not this local stack")
    if cfg.redis_cluster and not settings.redis_cluster:
        _say(
            f"note: Redis is a Redis Cluster: export {ENV_REDIS_CLUSTER}=1 so that clients use "
            "cluster mode"
        )
    elif settings.redis_cluster and not cfg.redis_cluster and not settings.redis_url_setting:
        _say(f"note: {ENV_REDIS_CLUSTER}=1 is set but this stack runs one Redis, not a cluster")


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    cfg = StackConfig.from_settings(
        settings, brokers=args.brokers, redis_cluster=args.redis_cluster, secure=args.secure
    )  # not sticky: a plain `up` is the plaintext stack that every default points at
    start = time.monotonic()
    _say(f"stack: state dir {cfg.state_dir}")
    if cfg.shape != StackShape():
        _say(f"stack: {cfg.shape.describe()}")
    kafka.up(cfg, _say, timeout=args.timeout)
    redis.up(cfg, _say, timeout=args.timeout)
    if args.registry:
        registry.up(cfg, _say, java_override=settings.registry_java, timeout=args.timeout)
    _say(f"stack: up in {time.monotonic() - start:.1f} s: {_env_line(cfg)}")
    _note_overrides(settings, cfg)
    return EXIT_OK


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    cfg = StackConfig.from_settings(settings)
    registry.down(cfg, _say, timeout=args.timeout)
    kafka.down(cfg, _say, timeout=args.timeout)
    redis.down(cfg, _say, timeout=args.timeout)
    if args.wipe:
        registry.wipe(cfg, _say)
        kafka.wipe(cfg, _say)
        redis.wipe(cfg, _say)
        secure.wipe(cfg, _say)
    return EXIT_OK


def _statuses(cfg: StackConfig) -> list[ServiceStatus]:
    """Every service of the stack: the registry once `up --registry` started it."""
    statuses = [*kafka.statuses(cfg), *redis.statuses(cfg)]
    return statuses + ([registry.status(cfg)] if registry.started(cfg) else [])


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    del args
    cfg = StackConfig.from_settings(settings)
    statuses = _statuses(cfg)
    for st in statuses:
        _say(st.describe())
    _say(f"state dir: {cfg.state_dir} ({cfg.shape.describe()})")
    running = all(st.running for st in statuses)
    if running:
        _say(_env_line(cfg))
    return EXIT_OK if running else EXIT_NOT_RUNNING


def cmd_env(args: argparse.Namespace, settings: Settings) -> int:
    """The ``export`` lines a client needs for the running stack, secrets included."""
    del args
    cfg = StackConfig.from_settings(settings)
    if not all(st.running for st in _statuses(cfg)):
        say("stack env: the stack is not running: `streamtally stack up` starts it")
        return EXIT_NOT_RUNNING
    env = client_environment(cfg)
    if registry.started(cfg):
        env.append((registry.ENV_SCHEMA_REGISTRY_URL, cfg.local_registry_url()))
    lines = [f"export {name}={shlex.quote(value)}" for name, value in env]
    if not cfg.secure:  # what a secured stack's `eval` left behind would still apply
        lines.append(f"unset {' '.join(SECURITY_VARIABLES)}")
    # Printed as they are, not through `say`: this is the one place meant to show them.
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()
    return EXIT_OK


_DESCRIPTION = (
    "Local Kafka (KRaft; each node a broker and a controller, jars from Maven Central) and "
    "Redis under $STREAMTALLY_STATE_DIR (default <repo>/.stack), and with `up --registry` a "
    "schema registry (Apicurio Registry, built from Maven Central). Ports: "
    "STREAMTALLY_KAFKA_PORT (9092), STREAMTALLY_CONTROLLER_PORT (9093), STREAMTALLY_REDIS_PORT "
    "(6379), STREAMTALLY_REGISTRY_PORT (8081). With --brokers "
    f"N, node i listens on those + {KAFKA_PORT_STEP}(i-1) (3 brokers: 9092/9093, 9094/9095, "
    "9096/9097); with --redis-cluster, master i on the redis port + (i-1) (6379, 6380, 6381) and "
    f"its cluster bus on that + {REDIS_BUS_OFFSET}. `up` remembers the shape in "
    "<state>/stack.json: `status`, `down` and a plain `up` use it."
)

_UP_EPILOG = (
    "Three brokers: streamtally's topics are created with replication factor 3, and "
    "min.insync.replicas 2 on the topics the worker writes. Each broker count and the Redis "
    "Cluster keep their own data; change the shape after `streamtally stack down`. "
    f"Clients of the Redis Cluster need {ENV_REDIS_CLUSTER}=1."
)


def _add_commands(stack: argparse.ArgumentParser) -> None:
    commands = stack.add_subparsers(dest="stack_command", metavar="{up,down,status,env}")
    commands.required = True

    up = commands.add_parser(
        "up",
        help="start Kafka and Redis (idempotent), wait until ready",
        description="Start the local Kafka and Redis (what is running already is kept) and "
        "wait until every node answers.",
        epilog=_UP_EPILOG,
    )
    up.add_argument(
        "--brokers", type=int, choices=BROKER_COUNTS, default=None, metavar="N",
        help="Kafka nodes, each a broker and a KRaft controller: "
        f"{', '.join(map(str, BROKER_COUNTS))} (default: as last started, else 1)",
    )  # fmt: skip
    up.add_argument(
        "--redis-cluster", action=argparse.BooleanOptionalAction, default=None,
        help=f"a Redis Cluster of {REDIS_CLUSTER_MASTERS} masters instead of one Redis "
        "(default: as last started, else one Redis)",
    )  # fmt: skip
    up.add_argument(
        "--secure", action="store_true",
        help="Kafka on SASL_SSL with SCRAM-SHA-512 users and Redis on TLS with an ACL user "
        "(one broker, one Redis); a local CA, certificates and passwords are made under "
        "<state>/secure; `streamtally stack env` prints what clients need (default: plaintext)",
    )  # fmt: skip
    up.add_argument(
        "--registry", action="store_true",
        help="also the schema registry: Apicurio Registry on STREAMTALLY_REGISTRY_PORT (8081), "
        "its Confluent-compatible API at /apis/ccompat/v7, schemas kept under <state>/registry "
        "(built with Maven under a JDK 17+ the first time: ~1 min; STREAMTALLY_REGISTRY_JAVA "
        "picks the Java); not remembered: a plain `up` leaves it as it is (default: no registry)",
    )  # fmt: skip
    up.add_argument(
        "--timeout", type=float, default=kafka.READY_TIMEOUT_S, metavar="SECONDS",
        help="how long to wait for each service to answer (default %(default)s)",
    )  # fmt: skip
    up.set_defaults(func=_guarded("up", cmd_up))

    down = commands.add_parser(
        "down", help="stop Kafka and Redis, every node, and the registry (data is kept)"
    )
    down.add_argument(
        "--wipe", action="store_true",
        help="also delete topics, data and logs (of every broker count, the Redis Cluster and "
        "the registry's schemas)",
    )  # fmt: skip
    down.add_argument(
        "--timeout", type=float, default=kafka.STOP_TIMEOUT_S, metavar="SECONDS",
        help="seconds to wait after SIGTERM before SIGKILL (default %(default)s)",
    )  # fmt: skip
    down.set_defaults(func=_guarded("down", cmd_down))

    status = commands.add_parser("status", help="show each node; exit 3 unless all run")
    status.set_defaults(func=_guarded("status", cmd_status))

    env = commands.add_parser(
        "env",
        help="print the export lines a client needs for the running stack",
        description="Print `export NAME=value` lines that point a client (the worker, every "
        "command, your own code) at the running stack: its Kafka and Redis, and on the secured "
        "stack the SASL user and password, the TLS CA and the Redis user: "
        '`eval "$(streamtally stack env)"`. The passwords are printed here and nowhere else. '
        "Exit 3 when the stack is not running.",
    )
    env.set_defaults(func=_guarded("env", cmd_env))


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``stack`` with its ``up``, ``down``, ``status`` and ``env`` subcommands."""
    stack = subparsers.add_parser(
        "stack", help="run the local Kafka (KRaft) + Redis stack", description=_DESCRIPTION
    )
    _add_commands(stack)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m streamtally.cli.stack up|down|status``."""
    parser = Parser(prog="streamtally stack", description=_DESCRIPTION)
    _add_commands(parser)
    args = parser.parse_args(argv)
    handler: Handler = args.func
    return handler(args, Settings.load())


if __name__ == "__main__":
    raise SystemExit(main())
