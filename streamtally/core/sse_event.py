"""What the SSE decoder (`streamtally.core.sse`) gives: `SseEvent`, and `NonSseLine` on
its side channel.

A module of their own because the decoder is compiled (`streamtally._native.MODULES`)
and these stay Python classes whichever runs: the same types, frozen and hashable, for
the adapters, the tap and the tests.  `streamtally.core.sse` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NOT_A_FIELD", "NonSseLine", "SseEvent"]

#: The reason of every `NonSseLine`: the line is no SSE field, comment or blank line.
NOT_A_FIELD = "not an SSE field"


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One dispatched event: its type (default "message"), data and last event id."""

    data: str
    event: str = "message"
    id: str | None = None


@dataclass(frozen=True, slots=True)
class NonSseLine:
    """A line of the stream that is not SSE: reported on the side channel, never an event."""

    #: 1-based number of the line in the stream.
    number: int
    #: The whole line, without its line end.
    text: str
    #: Why it is not SSE (starts with `NOT_A_FIELD`).
    reason: str
