"""The Redis side of a rebuild: the joined requests written through the worker's sink.

`apply` claims or checks the layout, then writes the requests in batches
through `streamtally.store.RedisBatch` (idempotent: a request already in
Redis is left untouched), each with the closing marker `CLOSED_MARKER`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from streamtally.ops.rebuild._records import Request, Skipped, SkipReason
from streamtally.store import RedisBatch, RedisStore

#: The closing marker ("offset reason") written for every rebuilt request.
CLOSED_MARKER: Final = "0 end"
#: Requests per sink flush (one Lua script call each).
BATCH_SIZE: Final = 500


@dataclass(slots=True)
class Applied:
    """What `apply` did."""

    #: Requests written by this rebuild.
    applied: int = 0
    #: Requests whose Tokens were already in Redis (left untouched).
    present: int = 0
    #: Requests the sink refused (a value that does not fit a counter).
    refused: list[Skipped] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.applied + self.present + len(self.refused)


async def apply(
    store: RedisStore,
    requests: Sequence[Request],
    *,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[Applied, int], None] | None = None,
    progress_every: int = 1000,
) -> Applied:
    """Write `requests` through the worker's sink, `batch_size` per flush.

    First `RedisStore.ensure_layout`: an empty Redis is claimed for layout
    version 2, one of another layout (v1 data, a migration under way) raises
    `LayoutError` before anything is written.  Each request is added with
    closing marker `CLOSED_MARKER` and 0 raw records and duplicates, keyed by
    its billing event's tenant and its request id.  `progress(result, total)`
    is called after the flush that crosses each multiple of `progress_every`
    requests, and after the last one.
    """
    if batch_size < 1 or progress_every < 1:
        raise ValueError("batch_size and progress_every must be >= 1")
    await store.ensure_layout()
    sink = RedisBatch(store)
    result = Applied()
    total = len(requests)
    reported = 0
    for start in range(0, total, batch_size):
        for request in requests[start : start + batch_size]:
            try:
                sink.add(
                    request.tokens, request.billing, closed=CLOSED_MARKER, records=0, duplicates=0
                )
            except ValueError as exc:
                result.refused.append(Skipped.of(request.ref, SkipReason.REFUSED, str(exc)))
        for flag in await sink.flush():
            if flag:
                result.applied += 1
            else:
                result.present += 1
        if progress is not None and (
            result.done // progress_every > reported // progress_every or result.done == total
        ):
            progress(result, total)
        reported = result.done
    return result
