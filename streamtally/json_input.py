"""A JSON file given on the command line, read with one clear error.

Every file an operator names (``--api-keys``, ``--provider-map``, an audit part) is read
the same way: a missing or unreadable file and a file that is not JSON are each an
`InputError` of one line that starts with what the file was given as (``where``, for
example ``--api-keys keys.json``), so the message says which option to fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streamtally.errors import InputError

__all__ = ["read_json_file"]


def read_json_file(where: str, path: str | Path) -> Any:
    """The parsed contents of ``path``; `InputError` ``"{where}: cannot read it (…)"`` or
    ``"{where}: not JSON (…)"``.  The shape is the caller's to check."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text ({exc.reason})") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InputError(f"{where}: not JSON ({exc})") from exc
