"""`streamtally.audit._replay`: raw records through the processors' own processor, without
Kafka or Redis.  Each request must end in the one outcome the audit owes it: closed with the
billing event `fold` + pricing give, partial (straddling the start, open at the end, not yet
processed), or dead-lettered."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from streamtally.audit import TimeRange
from streamtally.audit._replay import Replay
from streamtally.billing.events import bill, event_id
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef, call_request_id
from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream, read_events
from streamtally.processors.requests import Limits, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics
from streamtally.wire import avro
from streamtally.wire.kafka import TopicRecord
from streamtally.wire.records import BillingEvent, Provenance, RawSseEvent, UsageSource
from streamtally.wire.tenant_keys import HEADER, ProducerKey, TenantTrust

SAMPLES = Path(__file__).resolve().parents[3] / "samples"
TOPICS = Topics.in_namespace()
SSE, ENGINE = TOPICS.raw_sse.name, TOPICS.raw_engine.name
PRICES = PriceTable.default()
TIMEOUT = 60.0
T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
STEP = timedelta(milliseconds=250)


class Recorder:
    """The outcomes the replay hands over, as lists."""

    def __init__(self) -> None:
        self.bills: list[BillingEvent] = []
        self.partials: list[tuple[RequestRef, str, str]] = []
        self.dead: list[RequestRef] = []

    def closed(self, expected: BillingEvent, superseded: BillingEvent | None = None) -> None:
        assert (superseded is None) == (expected.revision == 0)
        self.bills.append(expected)

    def partial(self, ref: RequestRef, day: str, reason: str, revision: int = 0) -> None:
        del revision
        self.partials.append((ref, day, reason))

    def dead_lettered(self, ref: RequestRef) -> None:
        self.dead.append(ref)


@dataclass(frozen=True)
class Request:
    file: str
    source: Source
    ref: RequestRef
    model: str | None
    records: list[bytes]
    #: Receive time of each record.
    times: list[datetime]

    def expected(self, placed: list[TopicRecord] | None = None) -> BillingEvent:
        """What `streamtally fold` prints, priced as the worker prices it.

        With `placed` (where `Log.put` wrote every record of the request) the event
        carries the provenance the replay must give it; without, none.
        """
        data = (SAMPLES / self.file).read_bytes()
        tokens = fold_stream(
            self.source,
            read_events(self.source, io.BytesIO(data)),
            request_id=self.ref.request_id,
            model=self.model,
        )
        if placed is None:
            return bill(tokens, self.ref.tenant, self.times[-1], PRICES)
        assert [r.value for r in placed] == self.records  # whole, in seq order
        ((topic, partition),) = {(r.topic, r.partition) for r in placed}
        hashed = b"".join(len(v).to_bytes(8, "big") + v for v in self.records)
        provenance = Provenance(
            raw_topic=topic,
            raw_partition=partition,
            first_offset=min(r.offset for r in placed),
            last_offset=max(r.offset for r in placed),
            raw_sha256=hashlib.sha256(hashed).hexdigest(),
            usage_source=(
                UsageSource.ENGINE_COUNTED
                if self.source is Source.VLLM
                else UsageSource.PROVIDER_REPORTED
            ),
        )
        return bill(tokens, self.ref.tenant, self.times[-1], PRICES, provenance)


def request(
    file: str,
    request_id: str,
    *,
    tenant: str = "acme",
    start: datetime = T0,
    model: str | None = None,
) -> Request:
    source = Source(file.split("/", maxsplit=1)[0])
    times: list[datetime] = []

    def clock() -> datetime:
        times.append(start + len(times) * STEP)
        return times[-1]

    _, records = raw_records(
        source,
        (SAMPLES / file).read_bytes(),
        tenant=tenant,
        request_id=request_id,
        model=model,
        clock=clock,
    )
    return Request(file, source, RequestRef(tenant, request_id), model, records, times)


class Log:
    """Partitions of the raw topics: records get the next offset of their partition."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}
        #: The records put, by request id.
        self.placed: dict[str, list[TopicRecord]] = {}

    def put(
        self, req: Request, indexes: range | list[int] | None = None, *, partition: int = 0
    ) -> list[TopicRecord]:
        topic = SSE if req.source.is_sse else ENGINE
        out = []
        for i in indexes if indexes is not None else range(len(req.records)):
            offset = self.next.get((topic, partition), 0)
            self.next[(topic, partition)] = offset + 1
            appended = int((req.times[i] + timedelta(milliseconds=10)).timestamp() * 1000)
            out.append(
                TopicRecord(
                    topic, partition, offset, req.ref.request_id.encode(), req.records[i], appended
                )
            )
        self.placed.setdefault(req.ref.request_id, []).extend(out)
        return out


def no_markers(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
    return {}


def replay(
    *batches: list[TopicRecord],
    window: TimeRange | None = None,
    tenants: frozenset[str] | None = None,
    markers: Callable[[list[RequestRef]], Mapping[RequestRef, tuple[str, bool]]] = no_markers,
    committed: Mapping[tuple[str, int], int] | None = None,
    trust: TenantTrust | None = None,
    timeouts: Mapping[str, float] | None = None,
) -> tuple[Recorder, Replay]:
    outcomes = Recorder()
    processor = RequestProcessor(
        PRICES,
        timeout=TIMEOUT,
        timeouts=timeouts,
        clock=lambda: 0.0,
        limits=Limits(open_requests=sys.maxsize, open_per_tenant=sys.maxsize),
    )
    processor.trust = trust
    asked: list[list[RequestRef]] = []

    async def lookup(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
        asked.append(refs)
        return markers(refs)

    everything = [r for batch in batches for r in batch]
    ends = {}
    for r in everything:
        ends[(r.topic, r.partition)] = max(ends.get((r.topic, r.partition), 0), r.offset + 1)
    machine = Replay(
        processor,
        sse_topic=SSE,
        window=window or TimeRange(),
        tenants=tenants,
        lookup=lookup,
        committed=ends if committed is None else committed,
        outcomes=outcomes,
    )

    async def run() -> None:
        for batch in batches:
            await machine.feed(batch)
        machine.finish()

    asyncio.run(run())
    return outcomes, machine


FILES = [
    "openai/text_usage.sse",
    "openai/parallel_tool_calls_cached.sse",
    "anthropic/thinking_then_text.sse",
    "gemini/thoughts_cached.sse",
    "openai-responses/reasoning_parallel_calls.sse",
    "vllm/delta_stop_cached.jsonl",
    "atomr/text_stop.jsonl",
]


def test_the_replay_bills_what_fold_prints() -> None:
    log = Log()
    reqs = [
        request(f, f"r{i}", tenant=f"t{i % 2}", start=T0 + i * STEP) for i, f in enumerate(FILES)
    ]
    # interleaved on two partitions of each topic, in small batches
    records = []
    for step in range(max(len(r.records) for r in reqs)):
        for i, req in enumerate(reqs):
            if step < len(req.records):
                records += log.put(req, [step], partition=i % 2)
    batches = [records[i : i + 7] for i in range(0, len(records), 7)]
    outcomes, machine = replay(*batches)
    assert sorted(outcomes.bills, key=lambda e: e.request_id) == sorted(
        (r.expected(log.placed[r.ref.request_id]) for r in reqs), key=lambda e: e.request_id
    )
    assert (outcomes.partials, outcomes.dead) == ([], [])
    assert machine.processor.open_requests == 0


def test_a_request_begun_before_the_range_is_partial() -> None:
    log = Log()
    cut = request("openai/text_usage.sse", "cut")
    whole = request("anthropic/text_end_turn.sse", "whole", start=T0 + timedelta(seconds=1))
    records = log.put(cut, range(2, len(cut.records))) + log.put(whole)
    outcomes, machine = replay(records)
    assert [e.request_id for e in outcomes.bills] == ["whole"]
    assert outcomes.partials == [(cut.ref, "2026-11-23", "straddles the start")]
    assert machine.stats.straddling == len(cut.records) - 2
    # Cut by --since: its first records are received before the range.
    since = cut.times[2]
    outcomes, _ = replay(log.put(cut), window=TimeRange(since))
    assert outcomes.partials == [(cut.ref, "2026-11-23", "straddles the start")]
    assert outcomes.bills == []


def test_a_request_still_open_at_the_end_is_partial() -> None:
    log = Log()
    req = request("openai/text_usage.sse", "open")
    outcomes, _ = replay(log.put(req, range(len(req.records) - 1)))
    assert outcomes.partials == [(req.ref, "2026-11-23", "open at the snapshot")]
    # Cut by --until before its end marker: the same.
    outcomes, _ = replay(Log().put(req), window=TimeRange(None, req.times[-1]))
    assert outcomes.partials == [(req.ref, "2026-11-23", "open at the snapshot")]
    assert outcomes.bills == []


def test_a_quiet_request_closes_by_the_input_clock_of_its_partition() -> None:
    log = Log()
    quiet = request("openai/text_usage.sse", "quiet", tenant="acme")
    later = request(
        "anthropic/text_end_turn.sse",
        "later",
        tenant="globex",
        start=T0 + timedelta(seconds=TIMEOUT + 5),
    )
    head = log.put(quiet, range(len(quiet.records) - 1))
    outcomes, _ = replay(head, log.put(later, [0]))
    (closed,) = outcomes.bills
    assert closed.request_id == "quiet"
    assert closed.usage == quiet.expected().usage
    assert closed.event_time == quiet.times[-2]
    # Another tenant's records move the clock even when only acme is audited.
    outcomes, _ = replay(
        Log().put(quiet, range(len(quiet.records) - 1)) + log.put(later, [1]),
        tenants=frozenset({"acme"}),
    )
    assert [e.request_id for e in outcomes.bills] == ["quiet"]
    assert [p[0].tenant for p in outcomes.partials] == []


def test_a_request_is_closed_where_the_worker_decided() -> None:
    req = request("openai/text_usage.sse", "timed-out")
    records = Log().put(req, range(len(req.records) - 1))
    last = records[-1].offset

    def markers(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
        return {req.ref: (f"{last} timeout", True)} if req.ref in refs else {}

    outcomes, _ = replay(records, markers=markers)
    (closed,) = outcomes.bills
    assert closed.usage == req.expected().usage
    assert closed.event_time == req.times[-2]  # its last record: no end marker came
    # A worker that closed it at its third record, in this very place: the rest is late.
    early = records[2].offset

    def at_three(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
        return {req.ref: (f"{early} timeout", True)}

    # The rest came after that close at its timeout: it amends the request (revision 1),
    # still open at the snapshot (no end marker came), as in the worker.
    outcomes, machine = replay(records, markers=at_three)
    (closed,) = outcomes.bills
    assert (closed.event_time, closed.revision) == (req.times[2], 0)
    assert [p[0] for p in outcomes.partials] == [req.ref]
    assert machine.processor.counters.dead_lettered == 0
    assert machine.processor.counters.applied == len(records)


def test_a_marker_before_a_request_makes_its_records_late() -> None:
    log = Log()
    other = request("anthropic/text_end_turn.sse", "other")
    req = request("openai/text_usage.sse", "again", start=T0 + timedelta(seconds=5))
    records = log.put(other) + log.put(req)

    def markers(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
        return {req.ref: ("3 end", True)} if req.ref in refs else {}

    outcomes, machine = replay(records, markers=markers)
    assert [e.request_id for e in outcomes.bills] == ["other"]
    assert outcomes.partials == []
    assert machine.processor.counters.dead_lettered == len(req.records)


@pytest.mark.parametrize("marker", ["0 end", "garbage", "7 sideways"])
def test_a_marker_that_names_no_close_is_ignored(marker: str) -> None:
    """The marker a rebuild writes ("0 end": no offset known), or one no worker writes."""
    req = request("openai/text_usage.sse", "rebuilt")

    def markers(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
        return {req.ref: (marker, True)}

    log = Log()
    outcomes, _ = replay(log.put(req), markers=markers)
    assert outcomes.bills == [req.expected(log.placed["rebuilt"])]


def test_a_request_past_the_committed_offsets_is_not_yet_processed() -> None:
    req = request("openai/text_usage.sse", "fresh")
    records = Log().put(req)
    end = records[-1].offset
    outcomes, _ = replay(records, committed={(SSE, 0): end})
    assert outcomes.partials == [(req.ref, "2026-11-23", "not yet processed")]
    outcomes, _ = replay(records, committed={(SSE, 0): end + 1})
    assert outcomes.bills == [req.expected(records)]


def test_a_lone_end_marker_is_a_dead_lettered_request() -> None:
    end = RawSseEvent.end(
        request_id="lone", seq=0, source=Source.OPENAI, tenant="acme", received_at=T0
    )
    value = avro.encode_raw_sse_event(end)
    outcomes, _ = replay([TopicRecord(SSE, 0, 0, b"lone", value, int(T0.timestamp() * 1000))])
    assert outcomes.dead == [RequestRef("acme", "lone")]
    assert (outcomes.bills, outcomes.partials) == ([], [])


def test_other_tenants_and_other_times_are_not_audited() -> None:
    log = Log()
    mine = request("openai/text_usage.sse", "mine", tenant="acme")
    theirs = request("openai/text_usage.sse", "theirs", tenant="globex")
    outcomes, machine = replay(log.put(mine) + log.put(theirs), tenants=frozenset({"acme"}))
    assert [e.request_id for e in outcomes.bills] == ["mine"]
    assert machine.stats.other_tenants == len(theirs.records)
    before = TimeRange(None, T0)
    outcomes, machine = replay(Log().put(mine), window=before)
    assert (outcomes.bills, outcomes.partials) == ([], [])
    assert machine.stats.outside == len(mine.records)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_batches_do_not_change_the_outcome(size: int) -> None:
    log = Log()
    reqs = [request(f, f"b{i}", start=T0 + i * STEP) for i, f in enumerate(FILES[:4])]
    records = [r for req in reqs for r in log.put(req)]
    outcomes, _ = replay(*[records[i : i + size] for i in range(0, len(records), size)])
    assert outcomes.bills == [r.expected(log.placed[r.ref.request_id]) for r in reqs]


def test_with_a_trust_file_the_replay_refuses_what_the_worker_refused() -> None:
    """Headers reach the processor: a signed request is billed, an unsigned one is not."""
    secret = bytes(range(32))
    trust = TenantTrust.from_document(
        {"keys": {"k1": {"secret": secret.hex(), "tenants": ["acme"]}}}
    )
    key = ProducerKey("k1", secret)
    log = Log()
    signed = request("openai/text_usage.sse", "signed-1")
    unsigned = request("openai/text_usage.sse", "unsigned-1")
    batch = []
    for rec in log.put(signed):
        record = avro.decode_raw_sse_event(rec.value or b"")
        auth = key.sign(
            tenant="acme", request_id="signed-1", seq=record.seq, value=rec.value or b""
        )
        batch.append(rec._replace(headers=((HEADER, auth),)))
    batch += log.put(unsigned)
    outcomes, _ = replay(batch, trust=trust)
    assert [bill.request_id for bill in outcomes.bills] == ["signed-1"]
    outcomes, _ = replay(batch)  # without the trust file both are billed, as by the worker
    assert sorted(bill.request_id for bill in outcomes.bills) == ["signed-1", "unsigned-1"]


def test_a_new_call_of_a_closed_id_is_replayed_as_its_own_request() -> None:
    """The worker's rule (`RequestProcessor.call_of`): the same provider id an hour later is
    another request, billed under its own id; the audit finds the bill the worker wrote."""
    log = Log()
    first = request("openai/text_usage.sse", "chatcmpl-x")
    second = request("openai/text_usage.sse", "chatcmpl-x", start=T0 + timedelta(hours=1))
    records = log.put(first) + log.put(second)
    outcomes, _ = replay(*(records[i : i + 5] for i in range(0, len(records), 5)))
    new_id = call_request_id("chatcmpl-x", second.times[0])
    assert [b.request_id for b in outcomes.bills] == ["chatcmpl-x", new_id]
    assert outcomes.bills[1].event_id == event_id("acme", new_id)
    assert outcomes.bills[1].usage == outcomes.bills[0].usage
    assert (outcomes.partials, outcomes.dead) == ([], [])


def test_a_new_call_is_closed_where_the_worker_decided() -> None:
    """The worker closed the new call by timeout (its marker names the offset): the replay
    asks for the new call's marker too, and closes it there, as the worker did."""
    log = Log()
    first = request("openai/text_usage.sse", "chatcmpl-y")
    second = request("openai/text_usage.sse", "chatcmpl-y", start=T0 + timedelta(hours=1))
    records = log.put(first) + log.put(second, range(4))  # the second never ends
    new_ref = RequestRef("acme", call_request_id("chatcmpl-y", second.times[0]))
    closed_at = records[-2].offset  # where the worker's timer closed it

    def markers(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
        return {new_ref: (f"{closed_at} timeout", True)} if new_ref in refs else {}

    outcomes, _ = replay(records, markers=markers)
    new = next(b for b in outcomes.bills if b.request_id == new_ref.request_id)
    assert new.last_offset == closed_at
    assert (new.finish_reason.value, new.revision) == ("error", 0)
    # Its record after that close amends it: open again (revision 1) at the snapshot.
    assert [p[0] for p in outcomes.partials] == [new_ref]


def with_keepalives(req: Request, after: int, times: list[datetime]) -> Request:
    """`req` with a keep-alive record at each of `times` after its record `after`, renumbered
    (what the tap sends while the call is silent)."""
    decoded = [avro.decode_raw_sse_event(value) for value in req.records]
    alive = [
        RawSseEvent.keepalive(
            request_id=req.ref.request_id,
            seq=0,
            source=req.source,
            tenant=req.ref.tenant,
            received_at=at,
        )
        for at in times
    ]
    records = decoded[: after + 1] + alive + decoded[after + 1 :]
    values = [
        avro.encode_raw_sse_event(dataclasses.replace(r, seq=i)) for i, r in enumerate(records)
    ]
    return dataclasses.replace(req, records=values, times=[r.received_at for r in records])


def test_keepalives_replay_as_the_worker_applied_them() -> None:
    """A call silent for three timeouts, kept alive: the replay closes it by its END and bills
    the fold of its transcript, with the keep-alives in its provenance, as the worker did;
    without them it closes by timeout; with its source's own longer timeout it does not."""
    silence = timedelta(seconds=3 * TIMEOUT)
    plain = request("anthropic/text_end_turn.sse", "thinking")
    # Its first two events, then the rest after the silence.
    decoded = [avro.decode_raw_sse_event(value) for value in plain.records]
    decoded[2:] = [dataclasses.replace(r, received_at=r.received_at + silence) for r in decoded[2:]]
    thinking = dataclasses.replace(
        plain,
        records=[avro.encode_raw_sse_event(r) for r in decoded],
        times=[r.received_at for r in decoded],
    )
    kept = with_keepalives(
        thinking,
        1,
        [T0 + timedelta(seconds=s) for s in range(30, int(silence.total_seconds()), 30)],
    )
    # Other calls on the partition move its clock through the silence.
    movers = [
        request("openai/text_usage.sse", f"m{i}", tenant="globex", start=T0 + timedelta(seconds=s))
        for i, s in enumerate(range(45, int(silence.total_seconds()), 45))
    ]

    def batches(req: Request) -> list[list[TopicRecord]]:
        """In receive-time order, one batch per second of input (each ends in an expiry)."""
        log = Log()
        placed: list[tuple[datetime, TopicRecord]] = []
        for one in (req, *movers):
            put = log.put(one)
            placed += [(one.times[i], record) for i, record in enumerate(put)]
        placed.sort(key=lambda pair: pair[0])
        out: dict[int, list[TopicRecord]] = {}
        for at, record in placed:
            out.setdefault(int(at.timestamp()), []).append(record)
        ordered = [record for batch in out.values() for record in batch]
        renumbered = [record._replace(offset=offset) for offset, record in enumerate(ordered)]
        by_offset = iter(renumbered)
        return [[next(by_offset) for _ in batch] for batch in out.values()]

    def bill_of(outcomes: Recorder, request_id: str) -> BillingEvent:
        (found,) = [e for e in outcomes.bills if e.request_id == request_id]
        return found

    outcomes, _ = replay(*batches(kept))
    billed = bill_of(outcomes, "thinking")
    assert billed.finish_reason == plain.expected().finish_reason
    assert billed.usage == plain.expected().usage
    assert billed.event_time == plain.times[-1] + silence  # its END's time
    kept_values = b"".join(len(v).to_bytes(8, "big") + v for v in kept.records)
    assert billed.raw_sha256 == hashlib.sha256(kept_values).hexdigest()
    assert len(outcomes.bills) == 1 + len(movers)
    assert (outcomes.partials, outcomes.dead) == ([], [])
    # Without them: closed by timeout in the silence, then amended by the rest (revision 1).
    outcomes, _ = replay(*batches(thinking))
    first, amended = sorted(
        (e for e in outcomes.bills if e.request_id == "thinking"), key=lambda e: e.revision
    )
    assert (first.finish_reason.value, first.revision) == ("error", 0)
    assert (amended.usage, amended.revision) == (plain.expected().usage, 1)
    # Without them, but with the source's own timeout longer than the silence: its END.
    outcomes, _ = replay(*batches(thinking), timeouts={"anthropic": 4 * TIMEOUT})
    assert bill_of(outcomes, "thinking").usage == plain.expected().usage
    assert bill_of(outcomes, "thinking").finish_reason == plain.expected().finish_reason


def test_the_audit_replays_with_the_workers_request_timeouts() -> None:
    from streamtally.audit._run import replay_processor
    from streamtally.settings import Settings

    settings = Settings(request_timeout=120, request_timeouts={"anthropic": 900})
    processor = replay_processor(settings, PRICES)
    assert (processor.timeout_of("anthropic"), processor.timeout_of("openai")) == (900, 120)


def test_the_audit_makes_chunks_as_the_worker_does() -> None:
    """The worker's chunks setting and content policy: with the chunks topic off neither
    encodes a chunk (nor dead-letters a record whose chunk would not encode)."""
    from streamtally.audit._run import replay_processor
    from streamtally.settings import Settings

    off = replay_processor(Settings(chunks_topic=False, content="none"), PRICES)
    assert not off.chunks_topic
    assert off.content.content.value == "none"
    assert replay_processor(Settings(), PRICES).chunks_topic


def test_an_amended_request_is_closed_where_each_revision_was() -> None:
    """The worker closed revision 0 at its third record and, records later, revision 1 at
    its sixth (both by timeout): the close history the audit looks up (one marker per line)
    makes the replay close each revision at its offset, as the worker did."""
    req = request("openai/text_usage.sse", "amended")
    records = Log().put(req, range(len(req.records) - 1))
    at_three, at_six = records[2].offset, records[5].offset

    def markers(refs: list[RequestRef]) -> Mapping[RequestRef, tuple[str, bool]]:
        history = f"{at_three} timeout\n{at_six} timeout - 1"
        return {req.ref: (history, True)} if req.ref in refs else {}

    outcomes, machine = replay(records, markers=markers)
    first, second = outcomes.bills
    assert (first.revision, first.last_offset) == (0, at_three)
    assert (second.revision, second.last_offset, second.supersedes) == (
        1,
        at_six,
        first.event_id,
    )
    # What came after revision 1's close amends it again: open at the snapshot.
    assert [p[0] for p in outcomes.partials] == [req.ref]
    assert machine.processor.revision_of(req.ref) == 2
    assert machine.processor.counters.dead_lettered == 0
