"""The state of a `RequestProcessor`, and which requests it knows to be open or closed.

`RequestProcessor` (`processors.requests`) is built in layers, each the base
class of the next: this state (the constructor, the open and closed requests
the agent asks about, a rebalance's forgetting), the refusals
(`processors._refusals`), the close path (`processors._closing`), and last
the processor itself, which reads records and applies them in order.
"""

from __future__ import annotations

import time
from collections import Counter as CounterOf
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping

from streamtally.core.content import FULL, ContentPolicy
from streamtally.core.identity import RequestRef, call_request_id
from streamtally.core.pricing import PriceTable
from streamtally.processors._records import _Open, _Raw
from streamtally.processors.amendable import Amendable
from streamtally.processors.clock import InputClock
from streamtally.processors.limits import Limits
from streamtally.processors.outputs import Closed, Counters

#: How many closed requests are remembered locally (Redis remembers them all).
CLOSED_MEMORY = 200_000
#: Bytes of record values of amendable requests kept locally (Redis keeps them all for the
#: state TTL; one evicted here is asked of Redis when a record for it comes).
AMENDABLE_MEMORY_BYTES = 64 << 20


class _ProcessorState:
    """What a `RequestProcessor` holds, and what it remembers of which requests closed."""

    _content: ContentPolicy = FULL
    _chunks_topic: bool = True
    #: Full content and the chunks topic on: chunks are written as folded (the hot path).
    _chunks_as_is: bool = True

    @property
    def content(self) -> ContentPolicy:
        """What of a request's text its outputs keep (`streamtally.core.content`): the
        Tokens record (Redis and the tokens topic), its chunks and its dead letters.
        Billing is made from the fold itself, the same under every policy."""
        return self._content

    @content.setter
    def content(self, policy: ContentPolicy) -> None:
        self._content = policy
        self._chunks_as_is = policy.keeps_content and self._chunks_topic

    @property
    def chunks_topic(self) -> bool:
        """False: chunks are folded but not written (`STREAMTALLY_CHUNKS=off`): no chunk is
        encoded, and `Outputs.chunks` stays empty."""
        return self._chunks_topic

    @chunks_topic.setter
    def chunks_topic(self, on: bool) -> None:
        self._chunks_topic = on
        self._chunks_as_is = self._content.keeps_content and on

    def __init__(
        self,
        prices: PriceTable,
        *,
        timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits | None = None,
        timeouts: Mapping[str, float] | None = None,
    ) -> None:
        self.prices = prices
        #: The same table without a single price (same versions and dates): what an
        #: unpriceable request is billed by.
        self._no_prices = prices.without_prices()
        #: Seconds a request may stay quiet before it closes (`timeout_of`): `timeouts` by
        #: source name (``STREAMTALLY_REQUEST_TIMEOUTS``), else `timeout`.
        self.timeout = timeout
        self.timeouts: dict[str, float] = dict(timeouts or {})
        self.limits = Limits() if limits is None else limits
        self._open_by_tenant: CounterOf[str] = CounterOf()
        self.counters = Counters()
        #: When requests went quiet: the partitions' input clocks (see `processors.clock`).
        self.input_clock = InputClock(clock)
        #: Whether a partition is caught up and answering (the worker wires its consumer in;
        #: None: every partition is, as in a test or a replay with no consumer to ask).
        self.live: Callable[[Hashable, int], bool] | None = None
        self._open: dict[RequestRef, _Open] = {}
        self._closed: OrderedDict[RequestRef, Closed] = OrderedDict()
        self._pending_close: dict[RequestRef, Closed] = {}
        #: A request id's latest call, when it is not the request of that id itself (a new
        #: call of a closed request's id: `RequestProcessor.arrive`), by the id's request.
        self._calls: OrderedDict[RequestRef, RequestRef] = OrderedDict()
        #: Requests closed at their timeout or over a gap, as their next revision starts
        #: from (`processors.amendable`), most recent last, and the bytes they hold.
        self._amendable: OrderedDict[RequestRef, Amendable] = OrderedDict()
        self._amendable_bytes = 0
        #: Bytes of record values of amendable requests kept in memory (oldest out first).
        self.amendable_memory_bytes = AMENDABLE_MEMORY_BYTES
        #: Where earlier runs closed amended requests' later revisions, by revision.
        self._planned: dict[RequestRef, dict[int, Closed]] = {}

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def timeout_of(self, source: str) -> float:
        """Seconds a request of `source` (its name: ``anthropic``) may stay quiet."""
        return self.timeouts.get(source, self.timeout)

    # -- what the agent asks Redis about ------------------------------------------------

    def unknown(self, refs: Iterable[RequestRef]) -> set[RequestRef]:
        """Requests this process knows nothing of: ask Redis whether they closed."""
        return {
            r
            for r in refs
            if r not in self._open and r not in self._closed and r not in self._pending_close
        }

    def is_open(self, ref: RequestRef) -> bool:
        return ref in self._open

    def revision_of(self, ref: RequestRef) -> int:
        """The revision an open request's close will bill (0 unless it was reopened)."""
        state = self._open.get(ref)
        return 0 if state is None else state.revision

    def to_learn(self, raws: Iterable[_Raw | None]) -> set[RequestRef]:
        """The requests the records `raws` may belong to: their own (tenant, request id),
        the latest call of that id this process knows of, and for a record of seq 0 the
        new call it would start (`call_request_id`).  Ask Redis about the `unknown` ones
        before they `arrive`: which of them an earlier run closed."""
        calls = self._calls
        refs: set[RequestRef] = set()
        for raw in raws:
            if raw is None:
                continue
            ref = raw.ref
            refs.add(ref)
            if calls:
                current = calls.get(ref)
                if current is not None:
                    refs.add(current)
            record = raw.record
            if record.seq == 0 and ref not in self._open:
                refs.add(
                    RequestRef(ref.tenant, call_request_id(ref.request_id, record.received_at))
                )
        return refs

    def to_amend(self, raws: Iterable[_Raw | None]) -> set[RequestRef]:
        """Requests the records `raws` would amend whose state is not held here: ask the
        store for it (`learn_amendable`) before they `arrive`.

        Those closed at their timeout or over a gap (as last known) with a record after
        their close, and those whose next revision an earlier run decided on but did not
        write (it starts from the revision before).
        """
        wanted: set[RequestRef] = set()
        for raw in raws:
            if raw is None:
                continue
            ref = raw.ref
            if self._calls:
                ref = self._calls.get(ref, ref)
            if ref in self._open or ref in self._amendable or ref in wanted:
                continue
            closed = self._closed.get(ref)
            if closed is not None:
                if closed.amendable and raw.position.offset > closed.offset:
                    wanted.add(ref)
                continue
            pending = self._pending_close.get(ref)
            if pending is not None and pending.revision > 0:
                wanted.add(ref)
        return wanted

    def learn_amendable(self, ref: RequestRef, amendable: Amendable | None) -> None:
        """What the store keeps of `ref` for its amendments (None: nothing, it expired: its
        late records are dead-lettered with that reason; nothing is remembered of it, so
        memory stays bounded whatever a tenant sends)."""
        if amendable is not None:
            self._keep_amendable(ref, amendable)

    def _keep_amendable(self, ref: RequestRef, amendable: Amendable) -> None:
        old = self._amendable.pop(ref, None)
        if old is not None:
            self._amendable_bytes -= old.size
        self._amendable[ref] = amendable
        self._amendable_bytes += amendable.size
        while self._amendable_bytes > self.amendable_memory_bytes and len(self._amendable) > 1:
            _, evicted = self._amendable.popitem(last=False)
            self._amendable_bytes -= evicted.size

    def _drop_amendable(self, ref: RequestRef) -> Amendable | None:
        old = self._amendable.pop(ref, None)
        if old is not None:
            self._amendable_bytes -= old.size
        return old

    def plan_closes(self, ref: RequestRef, closes: Iterable[Closed]) -> None:
        """Where an earlier run closed revisions n > 0 of `ref` (the audit's replay: the
        request's close history): each closes there again when it is reopened."""
        planned = self._planned.setdefault(ref, {})
        for closed in closes:
            if closed.revision > 0:
                planned[closed.revision] = closed

    def learn_closed(self, ref: RequestRef, closed: Closed) -> None:
        """An earlier run closed `ref` (applied) or decided to (not yet applied)."""
        if closed.applied:
            self._remember(ref, closed)
        else:
            self._pending_close[ref] = closed

    def closed_elsewhere(self, ref: RequestRef, closed: Closed) -> None:
        """Another owner of its partition decided `ref`'s close first (`closed`, applied or
        not yet): that decision stands, not the one this process made (whose outputs were
        not written).  Its later records are judged by it: replays up to its offset,
        late after."""
        self._pending_close.pop(ref, None)
        self._remember(ref, closed)

    def forget_closed(self, refs: Iterable[RequestRef]) -> None:
        """Forget these closes (decided elsewhere, not known applied, of a partition this
        worker no longer owns): should the partition come back, their records are read
        again and Redis asked, so the request is closed and applied where it was decided
        instead of its records being dropped as replays of a close nobody applied."""
        for ref in refs:
            self._closed.pop(ref, None)
            self._pending_close.pop(ref, None)

    def _release(self, tenant: str) -> None:
        left = self._open_by_tenant[tenant] - 1
        if left > 0:
            self._open_by_tenant[tenant] = left
        else:
            del self._open_by_tenant[tenant]

    def drop_partitions(self, topic_partitions: set[tuple[str, int]]) -> list[RequestRef]:
        """Forget the open requests of partitions this worker no longer owns (a rebalance).

        Their records were not acknowledged, so the partition's next owner
        receives them all again.
        """
        dropped = [r for r, s in self._open.items() if s.topic_partition in topic_partitions]
        for ref in dropped:
            state = self._open.pop(ref)
            self._release(state.tenant)
            self.counters.revoked += len(state.waiting)
        if self._calls and dropped:
            gone = set(dropped)
            for first in [r for r, call in self._calls.items() if call in gone]:
                del self._calls[first]
        self.input_clock.forget(topic_partitions)
        return dropped

    def _remember_call(self, ref: RequestRef, call: RequestRef) -> None:
        """`call` is the latest call of `ref`'s request id (bounded as closed requests are)."""
        calls = self._calls
        calls[ref] = call
        calls.move_to_end(ref)
        if len(calls) > CLOSED_MEMORY:
            calls.popitem(last=False)

    def _remember(self, ref: RequestRef, closed: Closed) -> None:
        self._closed[ref] = closed
        self._closed.move_to_end(ref)
        if len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)
