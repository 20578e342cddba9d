"""The `streamtally` command line: one module per command, each with `add_parser`.

Every command's output for people escapes control characters
(`streamtally.cli._output`), its log records go to stderr as text or JSON
lines (``--log-format``, `streamtally.cli._logging`), and what a user can get
wrong (an argument, a file, a setting, an unreachable Kafka or Redis) ends in
one line on stderr and exit status 2, never a traceback.  An exception of
any other kind is a bug: it still shows its traceback, to be reported.
Messages and log records never show a credential (`streamtally.redact`):
URLs are redacted, and the password of the command's Redis URL is hidden
wherever a library quotes it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

from streamtally import __version__
from streamtally.cli._args import Parser, check_settings, check_text_arguments, leaf_parsers
from streamtally.cli._logging import add_log_format, install
from streamtally.cli._output import hiding, say
from streamtally.errors import StreamtallyError
from streamtally.redact import url_secrets
from streamtally.settings import Settings
from streamtally.wire.framing import install_registry
from streamtally.wire.registry import SchemaRegistry

__all__ = ["main"]

#: Command modules, in the order `--help` lists them.
COMMANDS = (
    "fold",
    "produce",
    "proxy",
    "worker",
    "tokens",
    "usage",
    "api",
    "billing",
    "audit",
    "deadletter",
    "rebuild",
    "migrate",
    "demo",
    "bench",
    "stack",
    "native",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` alone (a run of one command imports
    only its module: `streamtally audit` does not import the proxy's aiohttp server)."""
    parser = Parser(
        prog="streamtally",
        description=(
            "Exact per-request token records, usage tables and billing events "
            "from LLM provider and inference-engine streams."
        ),
    )
    parser.add_argument("--version", action="version", version=f"streamtally {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS if command is None else (command,):
        import_module(f"streamtally.cli.{name}").add_parser(subparsers)
    for leaf in leaf_parsers(parser):
        add_log_format(leaf)
        check_text_arguments(leaf)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` runs, if its first word names one; else None (``--help``,
    ``--version``, a mistyped command: the whole parser answers)."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_of(given))
    args = parser.parse_args(given)
    # The password of --redis-url, then those of REDIS_URL and KAFKA_SASL_PASSWORD once the
    # settings are read, are hidden from every message and log record (the settings' own
    # errors redact them).
    given_url: str = getattr(args, "redis_url", None) or ""
    with install(args.log_format), hiding(url_secrets(given_url)):
        try:
            # The one place the environment is read: every command gets these settings.
            settings = Settings.load()
        except StreamtallyError as exc:
            return _failed(args.command, exc)
        except KeyboardInterrupt:
            return 130
        with hiding(url_secrets(settings.redis_url) | settings.kafka.secrets | _registry(settings)):
            try:
                check_settings(settings)
                # Every reader of the process reads Confluent-framed values: their schema
                # ids are asked of the registry (if one is set) as they are met.
                install_registry(SchemaRegistry.from_settings(settings))
                code: int = args.func(args, settings)
            except StreamtallyError as exc:
                return _failed(args.command, exc)
            except KeyboardInterrupt:
                return 130
    return code


def _registry(settings: Settings) -> frozenset[str]:
    """The schema registry's secrets: its password, and any in its URL."""
    found = url_secrets(settings.schema_registry_url or "")
    password = settings.schema_registry_password
    if password is not None and password.get_secret_value():
        found |= {password.get_secret_value()}
    return found


def _failed(command: str, exc: StreamtallyError) -> int:
    say(f"streamtally {command}: {exc}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
