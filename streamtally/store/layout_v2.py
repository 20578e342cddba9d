"""Redis layout version 2, frozen: the keys `streamtally migrate` reads and moves to layout 3.

Nothing but the migrations (`streamtally.ops.migrate`) uses this module; the
current layout is `streamtally.store.layout`.  Version 2 kept every request's
state under one key per kind, which Redis Cluster cannot hold in one script
call (the keys span hash slots):

==============================  ====================================================
``st:layout``                   ``"2"`` (``"1>2"`` while version 1 is migrated)
``st:tokens:{ref}``             the request's Tokens JSON (string, no TTL)
``st:closed``                   hash ``{ref}`` -> ``"offset reason"``
``st:usage:{day}:{tenant}:{model}``  a usage row (hash, the fields of layout 3)
``st:usage:rows``               set of the rows, as layout 3's row members
``st:stats``                    hash of raw-record counts
``st:deadletter:seen``          set of ``topic:partition:offset`` dead-lettered
==============================  ====================================================

Keep it exactly as the data of version 2 is: it is a contract with old data.
"""

from __future__ import annotations

from typing import Final

from streamtally.core.identity import RequestRef, tenant_part

__all__ = [
    "CLOSED_KEY",
    "DEAD_SEEN_KEY",
    "MIGRATING_FROM_1",
    "ROWS_KEY",
    "STATS_KEY",
    "TOKENS_PREFIX",
    "VERSION",
    "closed_field",
    "parse_tokens_key",
    "tokens_key",
    "tokens_pattern",
    "usage_key",
]

#: The version this module spells.
VERSION: Final = "2"
#: ``st:layout`` while ``streamtally migrate`` moves version-1 data to version 2.
MIGRATING_FROM_1: Final = "1>2"
TOKENS_PREFIX: Final = "st:tokens:"
CLOSED_KEY: Final = "st:closed"
ROWS_KEY: Final = "st:usage:rows"
STATS_KEY: Final = "st:stats"
DEAD_SEEN_KEY: Final = "st:deadletter:seen"


def tokens_key(ref: RequestRef) -> str:
    """``st:tokens:{ref}``."""
    return f"{TOKENS_PREFIX}{ref.text}"


def parse_tokens_key(key: bytes | str) -> RequestRef:
    """The request a version-2 Tokens key names; ValueError when `key` is not one."""
    text = key.decode("utf-8") if isinstance(key, bytes) else key
    if not text.startswith(TOKENS_PREFIX):
        raise ValueError(f"not a layout-2 Tokens key: {text!r}")
    return RequestRef.parse(text[len(TOKENS_PREFIX) :])


def tokens_pattern() -> str:
    """The SCAN glob of every version-2 Tokens key."""
    return f"{TOKENS_PREFIX}*"


def closed_field(ref: RequestRef) -> str:
    """The field of `CLOSED_KEY` holding the close decision of `ref`."""
    return ref.text


def usage_key(day: str, tenant: str, model: str) -> str:
    """``st:usage:{day}:{tenant}:{model}`` (tenant percent-escaped, model as is)."""
    return f"st:usage:{day}:{tenant_part(tenant)}:{model}"
