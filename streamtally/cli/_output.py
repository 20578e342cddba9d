"""What the command line prints: control characters made visible, JSON kept to one line, tables.

Tenants, models, request ids, file names, reasons and error messages come
from outside (a producer, a provider, a manifest, argv, Redis, Kafka).
Printed raw, a newline in a tenant forges a row of a table, an ANSI escape
(``\\x1b[2J``) rewrites the terminal, a bidi override reorders what the
reader sees, and a lone surrogate (an undecodable byte of argv) makes
printing itself fail.  So every value a command prints for people goes
through `escape`, which writes each such character visibly, as Python
would in a string literal: ``\\n``, ``\\x1b``, ``\\u2028``, ``\\udcff``.
The result holds no line end, so a one-line message stays one line.

JSON output goes through `json_text`: `json.dumps` already escapes C0
controls; `json_text` also escapes what it leaves raw and a line-oriented
reader (``str.splitlines``, JavaScript) or a terminal would act on: DEL and
the C1 controls (``\\x85`` is a line end to ``splitlines``), U+2028 and
U+2029, the bidi overrides and lone surrogates.  Each becomes a ``\\uXXXX``
escape inside its JSON string, so the value parses back unchanged and one
JSON object per line stays one line.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final, TextIO

from streamtally.redact import hiding, redacted

__all__ = [
    "escape",
    "format_table",
    "has_surrogates",
    "hiding",
    "json_text",
    "redacted",
    "safe_json",
    "say",
    "write_stdout",
]

#: Characters `escape` writes visibly: C0, DEL and C1, the line and paragraph
#: separators, the bidi embeddings/overrides and isolates, and lone surrogates.
_UNSAFE: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
#: What `json.dumps(ensure_ascii=False)` leaves raw of the above (it escapes C0 itself).
_JSON_UNSAFE: Final = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
_SHORT: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(match: re.Match[str]) -> str:
    char = match.group()
    short = _SHORT.get(char)
    if short is not None:
        return short
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape(text: str) -> str:
    """`text` with every control, separator, bidi and surrogate character written visibly.

    Idempotent: what it returns has no such character left.
    """
    return _UNSAFE.sub(_visible, text) if _UNSAFE.search(text) else text


def has_surrogates(text: str) -> bool:
    """Whether `text` holds a lone surrogate (an undecodable byte of argv or a file name)."""
    return _SURROGATE.search(text) is not None


def json_text(value: Any, *, indent: int | None = None) -> str:
    """`value` as JSON (UTF-8 kept as it is), with nothing a line reader or terminal acts on."""
    return safe_json(json.dumps(value, ensure_ascii=False, indent=indent))


def safe_json(text: str) -> str:
    """A JSON text (as `json.dumps` writes it) with the characters of `json_text` escaped.

    Such characters can only stand inside JSON strings there, where a
    ``\\uXXXX`` escape means the same character.
    """
    return _JSON_UNSAFE.sub(_json_escape, text) if _JSON_UNSAFE.search(text) else text


def say(text: str, *, file: TextIO | None = None) -> None:
    """One line for people (stderr unless `file`): credentials hidden, control characters
    escaped, flushed."""
    print(escape(redacted(text)), file=sys.stderr if file is None else file, flush=True)


def write_stdout(text: str | Iterable[str]) -> None:
    """Write `text` (or each of its pieces) to stdout; a reader that went away (``| head``)
    is not an error."""
    try:
        for piece in (text,) if isinstance(text, str) else text:
            sys.stdout.write(piece)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def format_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    right: Collection[int] = (),
    footer: Iterable[Sequence[str]] = (),
    ruled: bool = False,
) -> str:
    """An aligned text table, every cell escaped; columns in `right` are aligned right.

    `ruled` draws a rule of dashes under the headers and above the `footer`
    rows (when there are any).
    """
    body = [[escape(cell) for cell in row] for row in rows]
    feet = [[escape(cell) for cell in row] for row in footer]
    heads = [escape(cell) for cell in headers]
    widths = [len(max(column, key=len)) for column in zip(heads, *body, *feet, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return (
            "  ".join(
                cell.rjust(width) if i in right else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
            + "\n"
        )

    rule = "  ".join("-" * width for width in widths) + "\n" if ruled else ""
    out = line(heads) + rule + "".join(line(row) for row in body)
    if feet:
        out += rule + "".join(line(row) for row in feet)
    return out
