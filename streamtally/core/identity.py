"""Who a request is: its tenant and its request id, together (`RequestRef`).

A provider's request id is unique only within the account that made the
request; two tenants of one gateway can, by accident or on purpose, send the
same id.  So a request is never keyed by its id alone: the fold state, the
commit gate, the Redis layout, the output topics' keys and the billing
``event_id`` all key it by `RequestRef`.  Two tenants that reuse one id are
two requests: neither can close, pre-empt or bill the other.

`RequestRef.text` is the identity as one string, the form Redis keys and
Kafka keys carry: the tenant with ``%`` and ``:`` percent-escaped (``%25``,
``%3A``; an ordinary tenant is written as is), a ``:``, then the request id
as is.  The escaped tenant holds no ``:``, so the first ``:`` splits the text
unambiguously (`RequestRef.parse`) whatever the request id holds.

One call, one request.  A producer that knows its calls gives each one an id
of its own, `new_call_id` (``call-`` and 32 hex digits laid out as a UUIDv7:
unique, and ordered by creation time as text), and the provider's id travels
in the stream (`Tokens.provider_request_id`).  A producer that keys requests by
the provider's id can reuse one (Ollama numbers its ids below 1,000): a new call
of a closed request's id is another request, keyed `call_request_id(id,
received_at)` (the worker's rule: `processors.requests`).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Final, NamedTuple

__all__ = [
    "CALL_ID_PREFIX",
    "CALL_SEPARATOR",
    "RequestRef",
    "call_request_id",
    "epoch_micros",
    "new_call_id",
    "tenant_part",
]

#: What `new_call_id` starts with.
CALL_ID_PREFIX: Final = "call-"
#: Between a reused request id and the receive time of its new call's first record.
CALL_SEPARATOR: Final = "~"

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)
_RAND_BITS: Final = 74  # a UUIDv7's rand_a (12 bits) and rand_b (62 bits)
_last_call: list[int] = [0, 0]  # (milliseconds, random bits) of the last id made here
_call_lock = threading.Lock()


def epoch_micros(when: datetime) -> int:
    """Microseconds since the Unix epoch of an aware datetime, exactly (no float)."""
    return (when - _EPOCH) // _MICROSECOND


def call_request_id(request_id: str, received_at: datetime) -> str:
    """The id of a later call that reused `request_id` once its request had closed:
    ``{request_id}~{microseconds since the epoch of its first record's receive time}``.

    A function of that record alone, so every replay derives the same id.
    """
    return f"{request_id}{CALL_SEPARATOR}{epoch_micros(received_at)}"


def new_call_id(now_ms: int | None = None) -> str:
    """A new call's own id: ``call-`` and 32 lower-case hex digits in the UUIDv7 layout.

    48 bits of Unix time in milliseconds, the version (7), 12 + 62 random bits and the
    variant (binary 10).  Unique (74 random bits per millisecond) and time-ordered as
    text: within one process each id sorts after the one before, even within one
    millisecond or when the clock steps back (the random bits of the last id are then
    counted up, RFC 9562 section 6.2, method 2).  `now_ms` replaces the clock (tests).
    """
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    if not 0 <= ms < 1 << 48:
        raise ValueError(f"a call id's time must fit 48 bits of milliseconds, got {ms}")
    with _call_lock:
        last_ms, last_rand = _last_call
        if ms > last_ms:
            rand = int.from_bytes(os.urandom(10), "big") >> (80 - _RAND_BITS)
        else:  # the same millisecond, or the clock went back: after the last one
            ms = last_ms
            rand = last_rand + 1 + (int.from_bytes(os.urandom(4), "big") >> 8)
            if rand >> _RAND_BITS:
                ms, rand = ms + 1, rand & ((1 << (_RAND_BITS - 1)) - 1)
        _last_call[0], _last_call[1] = ms, rand
    rand_a, rand_b = rand >> 62, rand & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return f"{CALL_ID_PREFIX}{value:032x}"


def tenant_part(tenant: str) -> str:
    """The tenant as a key component: ``%`` → ``%25`` and ``:`` → ``%3A``, nothing else."""
    return tenant.replace("%", "%25").replace(":", "%3A")


def _unescape(part: str) -> str:
    return part.replace("%3A", ":").replace("%25", "%")


class RequestRef(NamedTuple):
    """A request's identity: (tenant, request id).  Hashable, ordered, cheap."""

    tenant: str
    request_id: str

    @property
    def text(self) -> str:
        """``{escaped tenant}:{request id}``: the identity as one unambiguous string."""
        return f"{tenant_part(self.tenant)}:{self.request_id}"

    @classmethod
    def parse(cls, text: str) -> RequestRef:
        """The reference a `text` spells; ValueError when it is not one."""
        part, sep, request_id = text.partition(":")
        tenant = _unescape(part)
        if not sep or not request_id or tenant_part(tenant) != part:
            raise ValueError(f"not a request reference (tenant:request_id): {text!r}")
        return cls(tenant, request_id)

    def __str__(self) -> str:
        """For messages: the request id and its tenant, with control characters escaped."""
        return f"{self.request_id!r} of tenant {self.tenant!r}"
