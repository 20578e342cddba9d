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

What the gate releases is committed by `Committer`, off the batches' path: a write
hands it the committable offsets once its outputs are durable and ends there, so the
next batch's write never waits for a commit's round trip.  At most one commit is in
flight; offsets released meanwhile are coalesced into the next one, sent no sooner
than `COMMIT_INTERVAL_S` after the one before (Kafka Streams commits every 100 ms
under exactly-once too).  A commit only ever names offsets the gate released, so a
later one changes nothing of what may be committed, only when: a crash re-reads at
most that much more, which the processor recognises as replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence

from streamtally.core.identity import RequestRef
from streamtally.processors.outputs import Outputs
from streamtally.processors.stages import BatchTimes

__all__ = ["COMMIT_INTERVAL_S", "Committer", "Holds", "WriteBehind"]

log = logging.getLogger(__name__)

#: The least time between two commits' starts (seconds); what is released meanwhile is
#: committed with the next one.
COMMIT_INTERVAL_S = 0.1

#: A batch's records for the commit gate, in partition order: (partition, offset, the
#: request the record waits on, None when it waits on nothing, and the `span` of the first
#: record of a new call, else None: `CommitGate.hold`).
Holds = Sequence[tuple[Hashable, int, RequestRef | None, int | None]]


class WriteBehind:
    """At most one batch's write in flight; writes in submission order.

    `write(outputs, holds, times)` makes a batch durable and hands its holds to the commit
    gate (`times`: the batch's way through the worker, `processors.stages`; None for the
    timer's closes).  A write that raises is told to `on_failure` (the pipeline is broken: nothing
    more is committed); the next `submit` or `drain` raises the same error.
    """

    def __init__(
        self,
        write: Callable[[Outputs, Holds, BatchTimes | None], Awaitable[None]],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self._write = write
        self._on_failure = on_failure
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> bool:
        """True while a write is in flight (or done and not yet drained)."""
        return self._task is not None

    async def submit(self, outputs: Outputs, holds: Holds, times: BatchTimes | None = None) -> None:
        """Wait for the write before, then start writing this batch."""
        await self.drain()
        if times is not None:
            times.write_started = times.now()
        self._task = asyncio.ensure_future(self._run(outputs, holds, times))

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

    async def _run(self, outputs: Outputs, holds: Holds, times: BatchTimes | None) -> None:
        try:
            await self._write(outputs, holds, times)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._on_failure(exc)
            raise


class Committer:
    """Commits released offsets in the background: one commit in flight at most, the
    latest offsets wanted (coalesced), `interval` seconds at least between two.

    `commit(offsets)` sends one commit (`RawSource.commit`, which logs and counts a
    failed one: the records are read again); `committed(spans)` is told, once a commit
    ends, the `time.perf_counter` seconds each request closed by the batches it covered
    waited for it since its Tokens was written (the ``commit`` stage).
    """

    def __init__(
        self,
        commit: Callable[[Mapping[Hashable, int]], Awaitable[None]],
        interval: float = COMMIT_INTERVAL_S,
        committed: Callable[[list[float]], None] | None = None,
    ) -> None:
        self._commit = commit
        self._interval = interval
        self._committed = committed
        self._wanted: dict[Hashable, int] | None = None
        #: When the requests the wanted commit covers were written (`time.perf_counter`).
        self._stored: list[float] = []
        self._last = -float("inf")
        self._task: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()

    @property
    def pending(self) -> bool:
        """True while a commit is wanted or in flight."""
        return self._task is not None

    def request(self, offsets: Mapping[Hashable, int], stored: Sequence[float] = ()) -> None:
        """Commit `offsets` (every partition's released offset, `CommitGate.committable`)
        soon; `stored`: when the requests they complete were written."""
        self._wanted = dict(offsets)
        self._stored.extend(stored)
        if self._task is None:
            self._hurry.clear()
            self._task = asyncio.ensure_future(self._run())

    async def settle(self) -> None:
        """Send the commit wanted now (without waiting for the interval) and wait for it
        and for the one in flight: a revoke and the shutdown commit nothing concurrently."""
        task = self._task
        if task is None:
            return
        self._hurry.set()
        await asyncio.wait([task])

    async def cancel(self) -> None:
        """Forget the commit wanted and stop the one in flight (nothing more may be
        committed: the pipeline broke)."""
        task, self._task = self._task, None
        self._wanted = None
        self._stored = []
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    async def _run(self) -> None:
        try:
            while self._wanted is not None:
                wait = self._last + self._interval - time.perf_counter()
                if wait > 0 and not self._hurry.is_set():
                    # Woken early by `settle`.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._hurry.wait(), wait)
                offsets, self._wanted = self._wanted, None
                stored, self._stored = self._stored, []
                self._last = time.perf_counter()
                await self._commit(offsets)
                if stored and self._committed is not None:
                    now = time.perf_counter()
                    self._committed([now - at for at in stored])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("committing released offsets failed; they are committed with the next")
        finally:
            self._task = None
