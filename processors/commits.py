"""Which offsets may be committed: a record counts as done only with all before it.

Kafka keeps one committed offset per partition: everything below it is never
read again.  So a raw record may be committed only when its request is closed
and its outputs are durable, *and* every earlier record of its partition is
too.  `CommitGate` holds every record (just its offset) in partition order and
hands out, per partition, the offset up to which everything is done.  A record
waits on its request by the request's identity (`RequestRef`: tenant and
request id), the same key the processor folds it under.

New calls of a reused request id (`RequestProcessor.span_of`): the first record
of such a call is held until every record of its partition up to the call's
closing offset is done, so the committed offset never lies inside a new call's
offsets.  A reader that starts from the committed offset (a restarted worker,
the partition's next owner) then always meets a new call's first record before
its later ones, which belong to it only through that first record.

Closes decided elsewhere: after a rebalance two owners of a partition can close one
request, and the first close decision written to Redis stands (`Sinks.write` writes
nothing of the other).  The records of a request whose close another owner decided
are released as that owner's, but only once that close is *applied* (its Tokens, usage
and billing durable): a decision alone may be one whose owner died before applying it,
and a commit past its records would leave the request billed by nobody.  So the worker
marks such a request `elsewhere` (its records stay held), asks Redis about the requests
`waiting_elsewhere` at every write, and calls `finished` for those applied.  One never
applied (its decider died between the decision and the apply) keeps its partition's
committed offset at or before its first record until the partition is revoked (the
decider's leaving the group rebalances it): `drop` hands it back, the processor forgets
its close, and whoever reads the partition next reads the request from its first
record, finds the decision in Redis and closes it there, writing the outputs.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Hashable, Iterable, Mapping
from itertools import islice

from streamtally.core.identity import RequestRef
from streamtally.errors import CommitOrderError

__all__ = ["CommitGate", "CommitOrderError"]


class _Held:
    __slots__ = ("done", "offset", "until")

    def __init__(self, offset: int, done: bool, until: int = -1) -> None:
        self.offset = offset
        self.done = done
        #: The first record of a new call: committed past only once every record up to
        #: this offset (its call's close) is done too; -1: no such wait (yet).
        self.until = until


class CommitGate:
    """Tracks held records per partition and what has become committable."""

    def __init__(self) -> None:
        self._queues: defaultdict[Hashable, deque[_Held]] = defaultdict(deque)
        self._open: defaultdict[RequestRef, list[_Held]] = defaultdict(list)
        #: The first record of each open new call (its `until` is set when it finishes).
        self._spans: dict[RequestRef, _Held] = {}
        self._ready: dict[Hashable, int] = {}
        #: The last offset held per partition since it was (re)assigned.
        self._last: dict[Hashable, int] = {}
        #: Requests whose close another owner decided, not yet known applied: their
        #: partition (their records stay held until `finished`).
        self._elsewhere: dict[RequestRef, Hashable] = {}

    def __len__(self) -> int:
        """Records held, done or not."""
        return sum(len(q) for q in self._queues.values())

    def hold(
        self, tp: Hashable, offset: int, request: RequestRef | None, span: int | None = None
    ) -> None:
        """Hold the record at `offset`; it is done now unless `request` is still open.

        `span` (`RequestProcessor.span_of`): the record is the first of a new call, which
        ends at offset `span` (a replay of a call closed before), or is still open (-1:
        `request`, whose closing offset `finished` is told).

        Offsets of a partition come in increasing order between two `drop`s of it (one
        assignment, read from the committed offset on); `CommitOrderError` otherwise.
        """
        last = self._last.get(tp)
        if last is not None and offset <= last:
            raise CommitOrderError(
                f"record {offset} of {tp} held after record {last}: a batch of an earlier "
                "assignment was applied after the partition was revoked"
            )
        self._last[tp] = offset
        held = _Held(offset, done=request is None)
        if span is not None and span > offset:
            held.until = span
        self._queues[tp].append(held)
        if request is not None:
            self._open[request].append(held)
            if span is not None and span < 0:
                self._spans[request] = held

    def hold_all(
        self, holds: Iterable[tuple[Hashable, int, RequestRef | None, int | None]]
    ) -> None:
        """`hold` each record of a batch, in order: (partition, offset, request, span), as
        `RequestProcessor.apply_batch` lists them."""
        for tp, offset, request, span in holds:
            self.hold(tp, offset, request, span)

    def finished(
        self, requests: Iterable[RequestRef], closed_at: Mapping[RequestRef, int] | None = None
    ) -> None:
        """These requests are closed and their outputs durable: their records are done.

        `closed_at`: each request's closing offset, for the new calls among them.
        Also for a request closed `elsewhere`, once that close is applied (never before:
        see the module docstring).
        """
        for request in requests:
            self._elsewhere.pop(request, None)
            for held in self._open.pop(request, ()):
                held.done = True
            first = self._spans.pop(request, None)
            if first is not None and closed_at is not None:
                end = closed_at.get(request, -1)
                if end > first.offset:
                    first.until = end

    def elsewhere(self, requests: Iterable[RequestRef]) -> None:
        """Another owner decided these requests' close first (their outputs here were not
        written): their records stay held until `finished` is told that close is applied.
        A request with no record held here (none waits on it) is not kept."""
        for request in requests:
            held = self._open.get(request)
            if not held:
                continue
            first = held[0]
            for tp, queue in self._queues.items():  # rare: a scan is cheap enough
                if any(record is first for record in queue):
                    self._elsewhere[request] = tp
                    break

    def waiting_elsewhere(self) -> list[RequestRef]:
        """The requests `elsewhere` whose close is not yet known applied, sorted."""
        return sorted(self._elsewhere)

    def release(self) -> dict[Hashable, int]:
        """Per partition, the offset to commit (all records below it done), when it moved."""
        moved: dict[Hashable, int] = {}
        for tp, queue in self._queues.items():
            last = None
            while queue and queue[0].done:
                if queue[0].until > queue[0].offset and not _span_done(queue):
                    break
                last = queue.popleft().offset
            if last is not None:
                moved[tp] = self._ready[tp] = last + 1
        return moved

    def committable(self) -> dict[Hashable, int]:
        """Every partition's offset to commit, as of the last `release`."""
        return dict(self._ready)

    def drop(self, tps: Iterable[Hashable], requests: Iterable[RequestRef]) -> list[RequestRef]:
        """A rebalance took these partitions: forget their records (the next owner re-reads).

        `requests`: their open requests.  Returns the requests closed `elsewhere` of these
        partitions that were still waited for: their close is not known applied, so the
        processor must forget it (`RequestProcessor.forget_closed`) and ask Redis again
        when it meets their records.
        """
        gone = set(tps)
        for tp in gone:
            self._queues.pop(tp, None)
            self._ready.pop(tp, None)
            self._last.pop(tp, None)
        waited = sorted(r for r, tp in self._elsewhere.items() if tp in gone)
        for request in [*requests, *waited]:
            self._open.pop(request, None)
            self._spans.pop(request, None)
            self._elsewhere.pop(request, None)
        return waited


def _span_done(queue: deque[_Held]) -> bool:
    """Whether every record after the head up to its `until` is done, and, for a new call
    among them, every record up to that one's `until` too (so the gate never stops
    inside a call's span after passing the head)."""
    horizon = queue[0].until
    for held in islice(queue, 1, None):
        if held.offset > horizon:
            return True
        if not held.done:
            return False
        horizon = max(horizon, held.until)
    return True
