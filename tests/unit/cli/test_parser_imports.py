"""A run of one command builds only its own parser, so it imports only its own module."""

from __future__ import annotations

import argparse
import subprocess
import sys

from streamtally.cli import COMMANDS, build_parser, command_of


def _imported_after(code: str) -> set[str]:
    shown = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return set(shown)


def test_the_audit_does_not_import_the_proxy_or_the_api() -> None:
    modules = _imported_after("from streamtally.cli import build_parser; build_parser('audit')")
    assert "streamtally.cli.audit" in modules
    assert "streamtally.producers.proxy.server" not in modules
    assert "streamtally.cli.proxy" not in modules
    assert "aiohttp.web" not in modules


def test_the_command_is_the_first_word_when_it_names_one() -> None:
    assert command_of(["audit", "--json"]) == "audit"
    assert command_of(["--help"]) is None
    assert command_of(["nope"]) is None
    assert command_of([]) is None


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_one_commands_parser_is_the_whole_ones() -> None:
    whole = build_parser()
    for name in COMMANDS:
        alone = _subcommand(build_parser(name), name)
        assert alone.format_help() == _subcommand(whole, name).format_help(), name
