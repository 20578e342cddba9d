"""Checks of what a user types: argv text, Kafka addresses, and a parser whose errors are one line.

argv strings are decoded from bytes with ``surrogateescape``: a byte that is
not UTF-8 arrives as a lone surrogate (``$'\\xff'`` is ``'\\udcff'``).  A
file name may hold one (the file is opened with the same bytes), but a
tenant, a request id, a model or a URL is text that goes into Kafka keys,
Avro strings and Redis keys, where it cannot be encoded: such an argument is
refused when it is parsed, with one line naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from collections.abc import Iterator
from typing import NoReturn

from streamtally.cli._output import escape, has_surrogates
from streamtally.connection import KafkaConnection
from streamtally.errors import InputError
from streamtally.redact import redact_servers, redact_url
from streamtally.settings import ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL, Settings

__all__ = [
    "Parser",
    "bootstrap_servers",
    "check_settings",
    "check_text_arguments",
    "file_or_stdin",
    "kafka_of",
    "leaf_parsers",
    "positive",
    "servers_problem",
    "text",
]


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{escape(self.prog)}: {escape(message)} (see `{escape(self.prog)} --help`)\n")


def leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parsers of every command (those without subcommands, or whose subcommands are
    optional: ``audit`` and its steps), depth first."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not commands or not any(a.required for a in commands):
        yield parser
    if not commands:
        return
    for action in commands:
        seen: set[int] = set()
        for sub in action.choices.values():
            if id(sub) not in seen:  # aliases share a parser
                seen.add(id(sub))
                yield from leaf_parsers(sub)


def check_text_arguments(parser: argparse.ArgumentParser) -> None:
    """Give every plain string argument of `parser` the `text` check (typed ones keep theirs)."""
    for action in parser._actions:
        if action.type is None and action.nargs != 0:  # not the flags (nor -h)
            action.type = text


def text(value: str) -> str:
    """An argument that is text: refused when it holds bytes that are not UTF-8."""
    if has_surrogates(value):
        raise argparse.ArgumentTypeError(
            f"'{escape(value)}' is not UTF-8 text (each \\udcXX stands for a byte that is not)"
        )
    return value


def file_or_stdin(value: str) -> str:
    """A file name, or ``-`` for standard input (any bytes: the file is opened by its name)."""
    return value


def servers_problem(value: str) -> str | None:
    """What is wrong with a Kafka ``host[:port][,...]`` list; None when nothing is.

    An entry is quoted with any credentials hidden (`streamtally.redact.redact_servers`).
    """
    if has_surrogates(value):
        return "not UTF-8 text"
    for entry in value.split(","):
        if "@" in entry:
            return f"{redact_servers(entry.strip())!r}: no user or password here (HOST[:PORT])"
        item = entry.strip()
        if not item:
            return "an empty host in the list (HOST[:PORT][,HOST[:PORT]...])"
        port: str | None = None
        if item.startswith("["):
            host, closed, rest = item[1:].partition("]")
            if not closed or (rest and not rest.startswith(":")):
                return f"{item!r} is not [IPv6]:PORT"
            port = rest[1:] if rest else None
            valid = _is_ipv6(host)
        elif _is_ipv6(item):  # a bare IPv6 address, on the default port
            host, valid = item, True
        else:
            host, _, port = item.rpartition(":") if ":" in item else (item, "", None)
            valid = bool(host) and ":" not in host
        if not valid or any(c.isspace() or not c.isprintable() for c in host):
            return f"{item!r} has no valid host (an IPv6 address with a port goes in brackets)"
        if port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            return f"{item!r}: the port must be a number from 1 to 65535"
    return None


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def bootstrap_servers(value: str) -> str:
    """``--bootstrap-servers``: a Kafka ``host[:port][,...]`` list (blank: the default)."""
    if value.strip():
        problem = servers_problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
    return value


def add_kafka_to_read(parser: argparse.ArgumentParser) -> None:
    """``--bootstrap-servers`` of a command that reads topics (checked by `bootstrap_servers`)."""
    parser.add_argument(
        "--bootstrap-servers",
        type=bootstrap_servers,
        metavar="HOST:PORT[,...]",
        help="Kafka to read (default: $KAFKA_BOOTSTRAP_SERVERS, else the local stack's)",
    )


def kafka_of(args: argparse.Namespace, settings: Settings) -> KafkaConnection:
    """The Kafka a command uses: ``--bootstrap-servers`` if given, with the security of the
    settings (``KAFKA_SECURITY_PROTOCOL``, SASL, TLS) either way."""
    given: str | None = getattr(args, "bootstrap_servers", None)
    if given and given.strip():
        return dataclasses.replace(settings.kafka, servers=given.strip())
    return settings.kafka


def check_settings(settings: Settings) -> None:
    """Refuse endpoints from the environment that no client could use, naming the variable."""
    servers = settings.kafka_bootstrap_servers
    if servers and servers.strip():
        problem = servers_problem(servers)
        if problem is not None:
            raise InputError(f"{ENV_BOOTSTRAP_SERVERS}: {problem}")
    url = settings.redis_url_setting
    if url and has_surrogates(url):
        raise InputError(f"{ENV_REDIS_URL}: '{escape(redact_url(url))}' is not UTF-8 text")
