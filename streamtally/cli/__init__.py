"""The `streamtally` command line: one module per command, each with `add_parser`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

from streamtally import __version__
from streamtally.errors import StreamtallyError
from streamtally.settings import Settings

__all__ = ["main"]

#: Command modules, in the order `--help` lists them.
COMMANDS = (
    "fold",
    "produce",
    "worker",
    "tokens",
    "usage",
    "billing",
    "deadletter",
    "rebuild",
    "demo",
    "bench",
    "stack",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamtally",
        description=(
            "Exact per-request token records, usage tables and billing events "
            "from LLM provider and inference-engine streams."
        ),
    )
    parser.add_argument("--version", action="version", version=f"streamtally {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        import_module(f"streamtally.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # The one place the environment is read: every command gets these settings.
        settings = Settings.load()
        code: int = args.func(args, settings)
    except StreamtallyError as exc:
        print(f"streamtally {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
