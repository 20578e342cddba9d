"""What the proxy counts since it started: `ProxyStats`, read by its last log line and,
at scrape time, by its metrics (`streamtally.producers.proxy.metrics`)."""

from __future__ import annotations

from collections import Counter as CounterOf
from dataclasses import dataclass, field

__all__ = ["ProxyStats"]


@dataclass(slots=True)
class ProxyStats:
    """What the proxy did since it started (its last log line says it)."""

    #: Calls forwarded upstream, and those of them teed to the tap.
    forwarded: int = 0
    tapped: int = 0
    #: Calls answered by the proxy itself, never forwarded, by reason.
    refused: CounterOf[str] = field(default_factory=CounterOf)
    #: Calls forwarded to a path the proxy does not meter, by
    #: `streamtally.producers.proxy.server.unmetered_label`.
    unmetered: CounterOf[str] = field(default_factory=CounterOf)
    #: Streamed calls whose usage the proxy asked for, and usage-only chunks held back.
    usage_asked: int = 0
    usage_chunks_held: int = 0
    #: Tapped calls whose client went away before the end; of those, the ones whose
    #: upstream was cut before its end (the drain bound passed, or 0).
    clients_gone: int = 0
    drains_cut: int = 0
    #: Tapped calls whose upstream broke off (the client still there).
    upstream_broke: int = 0
