"""The stream-processing logic, free of Kafka and Redis: raw records in, outputs out.

`RequestProcessor` keeps one `_Open` state per request in flight (its
`Normalizer` and its `Fold`), keyed by the request's identity, `RequestRef`
(tenant and request id: two tenants that reuse one provider id are two
requests, neither can close or bill the other), applies each raw record in
sequence order, and
closes a request at its end-of-stream marker or when it has been quiet for
longer than the timeout (its source's, `timeout_of`: ``STREAMTALLY_REQUEST_TIMEOUTS``
over ``STREAMTALLY_REQUEST_TIMEOUT``; a keep-alive record, `KEEPALIVE_EVENT`, is a record
like any other, so a call its producer still keeps alive never goes quiet).  The faust
agents (`processors.app`) only move bytes between topics, Redis and this class;
`streamtally fold` runs the same
`Normalizer` and `Fold`, so the pipeline and the command cannot disagree.

Replays.  The worker acknowledges a request's raw records only once the
request is closed and its outputs are durable, so after a crash Kafka
redelivers every record of every request that was still open.  What the
processor cannot know by itself is which requests an earlier run already
closed: the agent `read`s a batch first (decoding tells each record's
request), asks Redis about every request it has not seen yet and hands the
answers to `closed_earlier`, then `apply`s each record.  A record of
a closed request at or before its closing offset is a replay (dropped, it was
counted when the request closed); after it, a late event (dead-lettered).  A
request an earlier run decided to close but did not finish writing is closed
again at the same offset for the same reason, so its outputs are the same.

Events in parts.  An SSE event too large for one raw record comes as part
records (`PART_EVENT`, see `streamtally.producers.tap`) and a last record under
its own name: each part is applied (counted, in the provenance, no chunk) by
keeping its data in the request's `_Open`; the last record's data is their sum,
normalised as one event.  In sequence order, so parts arriving out of order or
twice are held or dropped as any record.  The part (or last record) that takes
the joined event past `Limits.event_bytes` is dead-lettered with the reason
and the request closed at it with what it had (`CloseReason.LIMIT`), as at its
record limit: a replay closes it there again.  Parts without their last record
at the close are not billed, and the request's Tokens says so.

New calls.  A producer keyed by the provider's id can send two calls with one id
(Ollama's ids repeat).  A record of seq 0 of an id whose request closed, after its
closing offset and received after every record of it (`Closed.last_received`, kept in
the close marker), starts a new call: the request ``call_request_id(id, received_at)``
(`call_of`), with its own Tokens, close marker and billing `event_id`; later records of
the id belong to it.  A re-sent record keeps its receive time, so it never starts one.
The id is a function of the record, so a replay derives it again: the agent asks Redis
about the new calls a batch may start too (`requests_of`), and the commit gate never
stops inside a new call's offsets (`span_of`), so a replay always meets its first
record before its later ones.  Calls of one id that overlap still merge (the second's
records are duplicates), and a new call's later record that arrives before its first
is late: producers that know their calls give each its own id (`new_call_id`).

Every raw record ends in exactly one of: applied, duplicate (a re-sent
sequence number, dropped), dead-lettered (with the reason), or replayed
(counted by the run that closed its request).  Per closed request the
counts of applied records and duplicates travel with its outputs; dead
letters are counted by position, so a replay never counts twice.

Poison.  Every output is encoded here, as it is made, not later in a sink:
a record whose event cannot be decoded, validated, normalised or encoded
(a lone surrogate, a count beyond a 64-bit long, ...) is dead-lettered with
the reason before anything of it is folded, and touches nothing else of its
batch.  A request's close cannot fail on its price: a cost the billing record
cannot carry is billed as unpriced (cost 0, counted in
`Counters.unpriced`) for an operator to re-rate.  The sinks then only move
bytes, so the only failures left to them are transient (retried).  What is
refused before it is decoded, and the limits, are in `processors.limits`;
the results are in `processors.outputs`.

Parts.  `RequestProcessor` is a facade over five collaborators, each with one
job, which it builds and wires (they share its `Counters`, `Limits` and input
clock):

- `RequestTable` (`processors.table`): the open requests and what is known of
  closed ones (the state; which request a record belongs to, `call_of`);
- `Refusals` (`processors.refusals`): the edge, the limits, and every dead letter;
- `Sequencer` (`processors.sequencing`): each record put in its place (replay,
  late, new request, amendment, duplicate, waiting, or folded);
- `RecordFolder` (`processors.folding`): a request's next record folded, its
  chunks written;
- `Closer` (`processors.closing`): a request's close and its bill, and the
  closes of quiet requests (`expire`).

A record passes `examine_*` (refusals) → `admit` (refusals: counted in) →
`call_of` (table) → `apply_as` (sequencer) → `fold` (folder) → `finish` (closer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Protocol

from streamtally.billing.pricing import PriceTable
from streamtally.core.content import FULL, ContentPolicy
from streamtally.core.identity import RequestRef
from streamtally.processors._records import RawRecord, _Raw, position_of
from streamtally.processors.amendable import Amendable
from streamtally.processors.clock import InputClock
from streamtally.processors.closing import Closer
from streamtally.processors.folding import RecordFolder
from streamtally.processors.limits import Limits
from streamtally.processors.outputs import (
    Closed,
    CloseReason,
    Completed,
    Counters,
    Outputs,
    Position,
    Refused,
)
from streamtally.processors.refusals import Refusals
from streamtally.processors.sequencing import Sequencer
from streamtally.processors.table import RequestTable
from streamtally.wire import avro
from streamtally.wire.tenant_keys import TenantTrust

__all__ = [
    "CloseReason",
    "Closed",
    "Completed",
    "Counters",
    "Limits",
    "Outputs",
    "Position",
    "RawRecord",
    "Refused",
    "RequestProcessor",
]


class Message(Protocol):
    """A raw record as the agent hands it over (`processors.source.RawMessage`)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> float | None: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


class RequestProcessor:
    """Applies raw records of many interleaved requests; see the module docstring."""

    def __init__(
        self,
        prices: PriceTable,
        *,
        timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits | None = None,
        timeouts: Mapping[str, float] | None = None,
    ) -> None:
        self.limits = Limits() if limits is None else limits
        self.counters = Counters()
        #: When requests went quiet: the partitions' input clocks (see `processors.clock`).
        clock_ = InputClock(clock)
        self._input_clock = clock_
        #: Whether a partition is caught up and answering (the worker wires its consumer in;
        #: None: every partition is, as in a test or a replay with no consumer to ask).
        self.live: Callable[[Hashable, int], bool] | None = None
        self._content: ContentPolicy = FULL
        self.table = RequestTable(self.counters, clock_)
        self.refusals = Refusals(self.table, self.limits, self.counters, clock_)
        self.folder = RecordFolder(self.refusals, self.limits, self.counters)
        self.closer = Closer(
            self.table,
            self.folder,
            self.refusals,
            prices,
            timeout=timeout,
            timeouts=timeouts,
            limits=self.limits,
            counters=self.counters,
            input_clock=clock_,
        )
        self.sequencer = Sequencer(
            self.table,
            self.refusals,
            self.folder,
            self.closer,
            limits=self.limits,
            counters=self.counters,
            input_clock=clock_,
        )

    # -- settings, shared with the parts ------------------------------------------------

    @property
    def content(self) -> ContentPolicy:
        """What of a request's text its outputs keep (`streamtally.core.content`): the
        Tokens record (Redis and the tokens topic), its chunks and its dead letters.
        Billing is made from the fold itself, the same under every policy."""
        return self._content

    @content.setter
    def content(self, policy: ContentPolicy) -> None:
        self._content = policy
        self.refusals.content = policy
        self.folder.content = policy
        self.closer.content = policy

    @property
    def chunks_topic(self) -> bool:
        """False: chunks are folded but not written (`STREAMTALLY_CHUNKS=off`): no chunk is
        encoded, and `Outputs.chunks` stays empty."""
        return self.folder.chunks_topic

    @chunks_topic.setter
    def chunks_topic(self, on: bool) -> None:
        self.folder.chunks_topic = on

    @property
    def trust(self) -> TenantTrust | None:
        """The worker's trust file (`Refusals.trust`; None: every producer is trusted)."""
        return self.refusals.trust

    @trust.setter
    def trust(self, trust: TenantTrust | None) -> None:
        self.refusals.trust = trust

    @property
    def input_clock(self) -> InputClock:
        """When requests went quiet: the partitions' input clocks (`processors.clock`)."""
        return self._input_clock

    @input_clock.setter
    def input_clock(self, clock: InputClock) -> None:
        self._input_clock = clock
        self.table.input_clock = clock
        self.refusals.input_clock = clock
        self.closer.input_clock = clock
        self.sequencer.input_clock = clock

    @property
    def amendable_memory_bytes(self) -> int:
        """Bytes of record values of amendable requests kept in memory (oldest out first)."""
        return self.table.amendable_memory_bytes

    @amendable_memory_bytes.setter
    def amendable_memory_bytes(self, size: int) -> None:
        self.table.amendable_memory_bytes = size

    @property
    def prices(self) -> PriceTable:
        return self.closer.prices

    @property
    def timeout(self) -> float:
        return self.closer.timeout

    @property
    def timeouts(self) -> dict[str, float]:
        return self.closer.timeouts

    @property
    def open_requests(self) -> int:
        return len(self.table.open)

    def timeout_of(self, source: str) -> float:
        """Seconds a request of `source` (its name: ``anthropic``) may stay quiet."""
        return self.closer.timeout_of(source)

    # -- records ------------------------------------------------------------------------
    #
    # A message is first `read` (refused at the edge, or decoded: a `_Raw` whose `ref`
    # says which request it belongs to), then, once the agent has asked Redis about
    # the batch's unknown requests, `apply`'d.  `handle_sse` and `handle_engine` do both.
    # `read` is `examine` (decoding and the edge's checks: pure, so the worker does it
    # for the next batch while one is being written) and `admit` (counting it in).

    def examine_sse(
        self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> RawRecord | Refused:
        """What a message of the raw SSE topic holds, or why it is refused; changes nothing.

        `headers` are the record's Kafka headers (its ``st-auth`` claim, checked when the
        processor has a `trust` file).
        """
        return self.refusals.examine(avro.decode_raw_sse_event, key, value, headers)

    def examine_engine(
        self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> RawRecord | Refused:
        """What a message of the raw engine topic holds, or why it is refused."""
        return self.refusals.examine(avro.decode_raw_engine_output, key, value, headers)

    def admit(
        self,
        examined: RawRecord | Refused,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
    ) -> _Raw | None:
        """Count a message in: its record, or None when it was refused (dead-lettered into
        `out`).  `examined` is what `examine_sse` or `examine_engine` made of it."""
        return self.refusals.admit(examined, key, value, position, out)

    def read_sse(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> _Raw | None:
        """Decode one message of the raw SSE topic; None when it was dead-lettered into `out`."""
        refusals = self.refusals
        examined = refusals.examine(avro.decode_raw_sse_event, key, value, headers)
        return refusals.admit(examined, key, value, position, out)

    def read_engine(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> _Raw | None:
        """Decode one message of the raw engine topic; None when it was dead-lettered."""
        refusals = self.refusals
        examined = refusals.examine(avro.decode_raw_engine_output, key, value, headers)
        return refusals.admit(examined, key, value, position, out)

    def call_of(self, raw: _Raw) -> RequestRef:
        """The request a record belongs to: its own, or a new call of its request id
        (`RequestTable.call_of`)."""
        return self.table.call_of(raw)

    def apply(self, out: Outputs, raw: _Raw) -> RequestRef:
        """Apply a record `read` returned (in partition order), adding its outputs to `out`;
        returns the request it was a record of (its own, or a new call of its id)."""
        call = self.table.call_of(raw)
        self.sequencer.apply_as(out, raw, call)
        return call

    def apply_as(self, out: Outputs, raw: _Raw, ref: RequestRef) -> None:
        """`apply`, the record taken as one of the request `ref` (`call_of`)."""
        self.sequencer.apply_as(out, raw, ref)

    def handle_sse(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> Outputs:
        """One message of the raw SSE topic; its outputs are added to `out` (or a new one)."""
        out = Outputs() if out is None else out
        raw = self.read_sse(key, value, position, out, headers=headers)
        if raw is not None:
            self.apply(out, raw)
        return out

    def handle_engine(
        self,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> Outputs:
        """One message of the raw engine-output topic; its outputs are added to `out`."""
        out = Outputs() if out is None else out
        raw = self.read_engine(key, value, position, out, headers=headers)
        if raw is not None:
            self.apply(out, raw)
        return out

    def expire(self) -> Outputs:
        """Close every request that has been quiet for longer than its timeout (its
        source's, `timeout_of`)."""
        return self.closer.close_quiet(self.live)

    # -- a batch at a time: the agent's loops, here so that they run compiled too -------

    def examine_batch(
        self, messages: Sequence[Message], sse_topic: str
    ) -> list[RawRecord | Refused]:
        """`examine_sse` (a message of `sse_topic`) or `examine_engine` every message."""
        examine = self.refusals.examine
        sse, engine = avro.decode_raw_sse_event, avro.decode_raw_engine_output
        return [
            examine(sse if m.topic == sse_topic else engine, m.key, m.value, m.headers)
            for m in messages
        ]

    def admit_batch(
        self, messages: Sequence[Message], examined: Sequence[RawRecord | Refused], out: Outputs
    ) -> list[_Raw | None]:
        """`admit` every message of a batch (in order) with what `examine_*` made of it."""
        admit = self.refusals.admit
        return [
            admit(
                seen, m.key, m.value, position_of(m.topic, m.partition, m.offset, m.timestamp), out
            )
            for m, seen in zip(messages, examined, strict=True)
        ]

    def apply_batch(
        self,
        out: Outputs,
        messages: Sequence[Message],
        raws: Sequence[_Raw | None],
        partitions: dict[tuple[str, int], Hashable],
        partition: Callable[[str, int], Hashable],
    ) -> list[tuple[Hashable, int, RequestRef | None, int | None]]:
        """`apply` every record `admit_batch` returned; per message, what the commit gate
        holds: (its partition, named by `partitions` or else `partition(topic, number)`,
        its offset, its request while that is open, and `span`): see `span_of`."""
        table, sequencer = self.table, self.sequencer
        open_ = table.open
        holds: list[tuple[Hashable, int, RequestRef | None, int | None]] = []
        for m, raw in zip(messages, raws, strict=True):
            ref = None
            span = None
            if raw is not None:
                call = table.call_of(raw)
                was_open = call in open_
                sequencer.apply_as(out, raw, call)
                if call in open_:
                    ref = call
                if raw.record.seq == 0 and call != raw.ref:
                    span = table.span_of(call, m.offset, was_open)
            key = (m.topic, m.partition)
            tp = partitions.get(key)
            if tp is None:
                tp = partitions[key] = partition(m.topic, m.partition)
            holds.append((tp, m.offset, ref, span))
        return holds

    def span_of(self, call: RequestRef, offset: int, was_open: bool) -> int | None:
        """Where the commit gate may not stop inside a new call (`RequestTable.span_of`)."""
        return self.table.span_of(call, offset, was_open)

    # -- what the agent asks Redis about, and tells ---------------------------------------

    def unknown(self, refs: Iterable[RequestRef]) -> set[RequestRef]:
        """Requests this process knows nothing of: ask Redis whether they closed."""
        return self.table.unknown(refs)

    def requests_of(self, raws: Iterable[_Raw | None]) -> set[RequestRef]:
        """The requests the records `raws` may belong to (`RequestTable.requests_of`): ask
        Redis about the `unknown` ones before they are applied."""
        return self.table.requests_of(raws)

    def closed_earlier(self, ref: RequestRef, closed: Closed) -> None:
        """An earlier run closed `ref` (applied) or decided to (not yet applied)."""
        self.table.closed_earlier(ref, closed)

    def amendable_to_fetch(self, raws: Iterable[_Raw | None]) -> set[RequestRef]:
        """Requests the records `raws` would amend whose state is not held here
        (`RequestTable.amendable_to_fetch`): ask the store before they are applied."""
        return self.table.amendable_to_fetch(raws)

    def amendable_fetched(self, ref: RequestRef, amendable: Amendable | None) -> None:
        """What the store keeps of `ref` for its amendments (None: nothing, it expired)."""
        self.table.amendable_fetched(ref, amendable)

    def plan_closes(self, ref: RequestRef, closes: Iterable[Closed]) -> None:
        """Where an earlier run closed revisions n > 0 of `ref` (`RequestTable.plan_closes`)."""
        self.table.plan_closes(ref, closes)

    def closed_elsewhere(self, ref: RequestRef, closed: Closed) -> None:
        """Another owner of its partition decided `ref`'s close first: that decision stands
        (`RequestTable.closed_elsewhere`)."""
        self.table.closed_elsewhere(ref, closed)

    def forget_closed(self, refs: Iterable[RequestRef]) -> None:
        """Forget these closes decided elsewhere and not known applied
        (`RequestTable.forget_closed`)."""
        self.table.forget_closed(refs)

    def drop_partitions(self, topic_partitions: set[tuple[str, int]]) -> list[RequestRef]:
        """Forget the open requests of partitions this worker no longer owns (a rebalance)."""
        return self.table.drop_partitions(topic_partitions)

    def is_open(self, ref: RequestRef) -> bool:
        return self.table.is_open(ref)

    def revision_of(self, ref: RequestRef) -> int:
        """The revision an open request's close will bill (0 unless it was reopened)."""
        return self.table.revision_of(ref)
