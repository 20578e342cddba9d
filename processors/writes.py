"""One batch's outputs written while the agent applies the next (`WriteBehind`).

A batch's writes (Kafka acks, then the Redis script) are waits, not work: about
a quarter of the agent's time under the pipeline benchmark.  While they are in
flight the agent can apply the next batch, which touches no store.  So the agent
hands each applied batch to `WriteBehind.submit`, which first waits for the
write before it (writes stay in order, and at most one batch waits to be written)
and then starts this one.

What a batch's records may commit is decided only after its outputs are durable:
the batch's `Holds` (each record with the request it still waits on) reach the
commit gate in the write itself, after the sinks have written, so no record is
ever released ahead of its own batch's outputs (its dead letter, its request's
close).  A revoke, the timer's closes and the shutdown first `drain` (or `cancel`)
the write in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence

from streamtally.core.identity import RequestRef
from streamtally.processors.outputs import Outputs

__all__ = ["Holds", "WriteBehind"]

log = logging.getLogger(__name__)

#: A batch's records for the commit gate, in partition order: (partition, offset, the
#: request the record waits on, None when it waits on nothing, and the `span` of the first
#: record of a new call, else None: `CommitGate.hold`).
Holds = Sequence[tuple[Hashable, int, RequestRef | None, int | None]]


class WriteBehind:
    """At most one batch's write in flight; writes in submission order.

    `write(outputs, holds)` makes a batch durable and hands its holds to the commit
    gate.  A write that raises is told to `on_failure` (the pipeline is broken: nothing
    more is committed); the next `submit` or `drain` raises the same error.
    """

    def __init__(
        self,
        write: Callable[[Outputs, Holds], Awaitable[None]],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self._write = write
        self._on_failure = on_failure
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> bool:
        """True while a write is in flight (or done and not yet drained)."""
        return self._task is not None

    async def submit(self, outputs: Outputs, holds: Holds) -> None:
        """Wait for the write before, then start writing this batch."""
        await self.drain()
        self._task = asyncio.ensure_future(self._run(outputs, holds))

    async def drain(self) -> None:
        """Wait for the write in flight; raises what it raised."""
        task, self._task = self._task, None
        if task is not None:
            await task

    async def settle(self) -> None:
        """Wait for the write in flight, however it ends (a failure was told to
        `on_failure` already): a revoke commits what is done, if anything may be."""
        await self._end(cancel=False)

    async def finish_within(self, seconds: float) -> bool:
        """Let the write in flight finish, for `seconds` at most; whether it has (a `cancel`
        afterwards stops what has not, and says how a finished one ended)."""
        task = self._task
        if task is None:
            return True
        done, _ = await asyncio.wait([task], timeout=seconds)
        return bool(done)

    async def cancel(self) -> None:
        """Stop the write in flight (the worker stops): nothing of it is committed, its
        records are read again by the partitions' next owner."""
        await self._end(cancel=True)

    async def _end(self, *, cancel: bool) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if cancel and not task.done():
            task.cancel()
            log.info("stopping a batch's write in flight; its records stay uncommitted")
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            log.info("the write in flight had failed (%s)", task.exception())

    async def _run(self, outputs: Outputs, holds: Holds) -> None:
        try:
            await self._write(outputs, holds)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._on_failure(exc)
            raise
