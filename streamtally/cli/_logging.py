"""The command line's logging: one handler on stderr, text or JSON lines, nothing forged.

``--log-format text`` (the default) writes one line per record::

    [2026-01-02T03:04:05.678901Z] [4242] [WARNING] aiokafka: Unable connect to ...

with the message's control characters escaped (`streamtally.cli._output.escape`),
so a value quoted in a message cannot start a line of its own; an exception's
traceback follows on lines indented by four spaces (each escaped too), so
every record, and only a record, starts a line with ``[``.

In both, credentials are hidden (`streamtally.cli._output.redacted`): those of
any ``scheme://`` URL in the message or traceback, and the command's own Redis
password wherever it is quoted.

``--log-format json`` writes one JSON object per record and per line:
``time`` (RFC 3339, UTC), ``level``, ``logger``, ``message``, and
``exception`` (the formatted traceback) when there is one; no value can end
the line (`streamtally.cli._output.json_text`).

`install` sets this up for a command run by `streamtally.cli.main`;
`dict_config` is the same set-up as a `logging.config.dictConfig` dict, which
the worker hands to `faust.Worker(logging_config=...)`, so that faust's,
mode's and aiokafka's records go through the same formatter.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final, TextIO

from streamtally.cli._output import escape, json_text, redacted

__all__ = [
    "LOG_FORMATS",
    "STATUS_LOGGER",
    "JsonFormatter",
    "TextFormatter",
    "add_log_format",
    "dict_config",
    "install",
    "make_formatter",
]

LOG_FORMATS: Final = ("text", "json")
#: The logger of a command's status lines that are logged (the worker's start line):
#: at INFO, whatever the root level, so they always show.
STATUS_LOGGER: Final = "streamtally.cli"
#: Loggers a command may quiet while it runs (`install` restores their levels).
_QUIETED: Final = ("aiokafka",)
#: What begins each line of a text record's traceback.
_INDENT: Final = "    "


def _time(record: logging.LogRecord) -> str:
    """RFC 3339, UTC, microseconds: ``2026-01-02T03:04:05.678901Z``."""
    return datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TextFormatter(logging.Formatter):
    """``[time] [pid] [LEVEL] logger: message``, escaped; a traceback follows, indented."""

    def format(self, record: logging.LogRecord) -> str:
        head = (
            f"[{_time(record)}] [{record.process}] [{record.levelname}] "
            f"{escape(record.name)}: {escape(redacted(record.getMessage()))}"
        )
        detail = _detail(self, record)
        if not detail:
            return head
        return head + "".join(
            f"\n{_INDENT}{escape(line)}" for line in redacted(detail).splitlines()
        )


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": redacted(record.getMessage()),
        }
        if record.exc_info or record.exc_text:
            if not record.exc_text and record.exc_info:
                record.exc_text = self.formatException(record.exc_info)
            out["exception"] = redacted(record.exc_text or "")
        if record.stack_info:
            out["stack"] = redacted(self.formatStack(record.stack_info))
        return json_text(out)


def _detail(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    """The record's traceback and stack, as `logging.Formatter.format` adds them."""
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    parts = [record.exc_text] if record.exc_text else []
    if record.stack_info:
        parts.append(formatter.formatStack(record.stack_info))
    return "\n".join(parts)


def make_formatter(log_format: str) -> logging.Formatter:
    """The formatter of `log_format` (one of `LOG_FORMATS`)."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {log_format!r}: one of {', '.join(LOG_FORMATS)}")


class _StderrHandler(logging.StreamHandler[TextIO]):
    """A stream handler on whatever `sys.stderr` is when a record is written."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        del value  # always sys.stderr


def add_log_format(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-format text|json`` to a command's parser."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="log records on stderr as text lines (default) or one JSON object per line",
    )


@contextmanager
def install(log_format: str, level: int = logging.WARNING) -> Iterator[logging.Handler]:
    """Log to stderr in `log_format` while the block runs (the root logger at `level`).

    Warnings (`warnings.warn`) are logged too, so nothing else writes free
    text to stderr.  On exit the root logger is as it was.  Inside another
    `install` (a command the demo runs) the outer set-up stays as it is.
    """
    root = logging.getLogger()
    for present in root.handlers:
        if isinstance(present, _StderrHandler):  # a command run by a command (the demo)
            yield present
            return
    handler = _StderrHandler()
    handler.setFormatter(make_formatter(log_format))
    saved = root.level
    status = logging.getLogger(STATUS_LOGGER)
    saved_status = status.level
    # Commands quiet aiokafka (their errors say it in one line): for the command only.
    quieted = {name: logging.getLogger(name).level for name in _QUIETED}
    root.addHandler(handler)
    root.setLevel(level)
    status.setLevel(logging.INFO)
    logging.captureWarnings(True)
    try:
        yield handler
    finally:
        logging.captureWarnings(False)
        for name, level_before in quieted.items():
            logging.getLogger(name).setLevel(level_before)
        status.setLevel(saved_status)
        root.setLevel(saved)
        root.removeHandler(handler)


def dict_config(log_format: str, level: int | str) -> dict[str, Any]:
    """The same set-up as `install`, for `logging.config.dictConfig` (faust's worker).

    The handler writes to the `sys.stderr` of the moment the configuration
    is applied: faust then points `sys.stdout` and `sys.stderr` at a logger
    (so that stray prints become records), and a handler writing there
    would write to itself.
    """
    formatter = make_formatter(log_format)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {
            "streamtally": {"()": lambda: _configured(formatter)},
        },
        "root": {"level": level, "handlers": ["streamtally"]},
        "loggers": {STATUS_LOGGER: {"level": "INFO"}},
    }


def _configured(formatter: logging.Formatter) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    return handler
