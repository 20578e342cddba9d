"""The cyclic garbage collector's settings for the long-running processes.

A worker, an audit's replay and the tap's sender hold many young objects alive for a
while (a decoded batch, open requests' state, records in flight to Kafka).  With
CPython's default thresholds most of them survive a first-generation pass, are
promoted, and are scanned again and again: a seventh of the worker's CPU in a profile
under the pipeline benchmark, a quarter of the sender process's under the proxy
benchmark.  `tune_gc` moves everything allocated while starting (modules, the app,
schemas, prices) out of the collector's sight with `gc.freeze`, and collects the first
generation every `GC_YOUNG_THRESHOLD` allocations instead of 700.  Reference counting
still frees almost everything at once; only cyclic garbage waits a little longer.
"""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["GC_YOUNG_THRESHOLD", "tune_gc"]

#: First-generation threshold of the cyclic garbage collector (CPython's default is 700
#: allocations).
GC_YOUNG_THRESHOLD: Final = 50_000


def tune_gc() -> None:
    """Freeze what is allocated so far and collect the first generation less often."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
