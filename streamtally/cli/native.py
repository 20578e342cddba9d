"""``streamtally native build|status``: the compiled hot path (`streamtally._native`)."""

from __future__ import annotations

import argparse
import sys

from streamtally import _native
from streamtally.cli._output import say
from streamtally.ops import native
from streamtally.settings import Settings

_DESCRIPTION = (
    "The worker's per-record modules (the adapters, the fold, the normaliser, the raw "
    "decoders and the chunk writer) compiled with mypyc from the same sources: less CPU "
    "per record (figures in docs/scaling.md). They are used only while they match the "
    "sources and this Python exactly; after any change streamtally runs as plain Python "
    "until built again. "
    "STREAMTALLY_NATIVE=off runs plain Python regardless."
)


def cmd_build(args: argparse.Namespace, settings: Settings) -> int:
    try:
        result = native.build(
            force=args.force,
            progress=lambda line: say(line, file=sys.stdout),
            cache=settings.native_cache,
        )
    except native.NativeBuildError as exc:
        if args.optional:
            say(f"native build skipped: {exc}", file=sys.stdout)
            return 0
        raise
    if result.cached is not None:
        say(
            f"took the {len(result.modules)} compiled modules built from these sources "
            f"from the cache {result.cached} (STREAMTALLY_NATIVE_CACHE=off: always compile) "
            f"into {result.build_dir}",
            file=sys.stdout,
        )
    elif result.built:
        say(
            f"built {len(result.modules)} compiled modules in {result.seconds:.0f} s "
            f"into {result.build_dir}",
            file=sys.stdout,
        )
    else:
        say(f"the compiled modules are up to date ({result.build_dir})", file=sys.stdout)
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    del args, settings
    status = _native.status()
    say(f"this process: {status.describe()}", file=sys.stdout)
    if not status.active and native.fresh():
        say("the build is fresh: new processes use it", file=sys.stdout)
    return 0 if status.active else 3


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``native`` with its ``build`` and ``status`` subcommands."""
    parser = subparsers.add_parser(
        "native", help="compile the per-record hot path with mypyc", description=_DESCRIPTION
    )
    commands = parser.add_subparsers(dest="native_command", metavar="COMMAND", required=True)
    build = commands.add_parser(
        "build",
        help="compile the hot modules unless a fresh build exists (make setup runs it)",
        description="Compile the hot modules into streamtally/.native (about 25 s on 2 cores; "
        "needs mypy's mypyc, setuptools and a C compiler) unless the build there is fresh.",
    )
    build.add_argument("--force", action="store_true", help="build even when it is fresh")
    build.add_argument(
        "--optional", action="store_true",
        help="without a C compiler or mypyc, say so and exit 0 (plain Python is used)",
    )  # fmt: skip
    build.set_defaults(func=cmd_build)
    status = commands.add_parser(
        "status", help="say whether this Python runs the compiled modules, and if not why; "
        "exit 3 when it does not",
    )  # fmt: skip
    status.set_defaults(func=cmd_status)
