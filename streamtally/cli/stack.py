"""``streamtally stack up|down|status``: the local Kafka (KRaft) + Redis stack.

Also runnable on its own: ``python -m streamtally.cli.stack up``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from streamtally.cli._args import Parser
from streamtally.cli._output import say
from streamtally.ops.stack import StackConfig, StackError, kafka, redis
from streamtally.settings import Settings

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


def _note_overrides(settings: Settings) -> None:
    for name, value in (
        ("KAFKA_BOOTSTRAP_SERVERS", settings.kafka_bootstrap_servers),
        ("REDIS_URL", settings.redis_url_setting),
    ):
        if value:
            _say(f"note: {name}={value} is set, so the app uses that, not this local stack")


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    cfg = StackConfig.from_settings(settings)
    start = time.monotonic()
    _say(f"stack: state dir {cfg.state_dir}")
    kafka.up(cfg, _say, timeout=args.timeout)
    redis.up(cfg, _say, timeout=args.timeout)
    _say(
        f"stack: up in {time.monotonic() - start:.1f} s: "
        f"KAFKA_BOOTSTRAP_SERVERS={cfg.local_bootstrap_servers()} "
        f"REDIS_URL={cfg.local_redis_url()}"
    )
    _note_overrides(settings)
    return EXIT_OK


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    cfg = StackConfig.from_settings(settings)
    kafka.down(cfg, _say, timeout=args.timeout)
    redis.down(cfg, _say, timeout=args.timeout)
    if args.wipe:
        kafka.wipe(cfg, _say)
        redis.wipe(cfg, _say)
    return EXIT_OK


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    del args
    cfg = StackConfig.from_settings(settings)
    statuses = [kafka.status(cfg), redis.status(cfg)]
    for st in statuses:
        _say(st.describe())
    _say(f"state dir: {cfg.state_dir}")
    return EXIT_OK if all(st.running for st in statuses) else EXIT_NOT_RUNNING


_DESCRIPTION = (
    "Local single-node Kafka (broker+controller, jars from Maven Central) and Redis under "
    "$STREAMTALLY_STATE_DIR (default <repo>/.stack). Ports: STREAMTALLY_KAFKA_PORT (9092), "
    "STREAMTALLY_CONTROLLER_PORT (9093), STREAMTALLY_REDIS_PORT (6379)."
)


def _add_commands(stack: argparse.ArgumentParser) -> None:
    commands = stack.add_subparsers(dest="stack_command", metavar="{up,down,status}")
    commands.required = True

    up = commands.add_parser("up", help="start Kafka and Redis (idempotent), wait until ready")
    up.add_argument(
        "--timeout", type=float, default=kafka.READY_TIMEOUT_S, metavar="SECONDS",
        help="how long to wait for each service to answer (default %(default)s)",
    )  # fmt: skip
    up.set_defaults(func=_guarded("up", cmd_up))

    down = commands.add_parser("down", help="stop Kafka and Redis (data is kept)")
    down.add_argument("--wipe", action="store_true", help="also delete topics, data and logs")
    down.add_argument(
        "--timeout", type=float, default=kafka.STOP_TIMEOUT_S, metavar="SECONDS",
        help="seconds to wait after SIGTERM before SIGKILL (default %(default)s)",
    )  # fmt: skip
    down.set_defaults(func=_guarded("down", cmd_down))

    status = commands.add_parser("status", help="show each service; exit 3 unless both run")
    status.set_defaults(func=_guarded("status", cmd_status))


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``stack`` with its ``up``, ``down`` and ``status`` subcommands."""
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
