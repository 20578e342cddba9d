"""`RequestProcessor` as a pure object: raw records in, outputs out (processors/requests.py).

Raw records are built from our own transcripts (`samples/`) with
`producers.raw_records`, with a receive clock that ticks a fixed step per
record, so every run is deterministic.  Each test drives a `Run`: a processor
with a fake monotonic clock, positions made up per record, and the counters
invariant (`received == applied + duplicates + dead_lettered + replayed +
waiting`) checked after every single step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.fold import NO_FINISH
from streamtally.core.identity import RequestRef, epoch_micros
from streamtally.core.models import FinishReason, Source, Tokens
from streamtally.core.normalize import fold_stream, read_events
from streamtally.processors.limits import MAX_RECORD_BYTES
from streamtally.processors.requests import (
    Closed,
    CloseReason,
    Completed,
    Outputs,
    Position,
    RequestProcessor,
)
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key
from streamtally.wire import avro
from streamtally.wire.records import (
    EventKind,
    Provenance,
    RawEngineOutput,
    RawSseEvent,
    UsageSource,
)

TOPICS = Topics.in_namespace()

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "samples"
PRICES = PriceTable.default()
MANIFEST: dict[str, dict[str, Any]] = {
    row["file"]: row
    for row in map(json.loads, (SAMPLES / "manifest.jsonl").read_text().splitlines())
}
TIMEOUT = 60.0
#: Receive time of a transcript's first record; each next record is `STEP` later.
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
STEP = timedelta(milliseconds=250)
#: Kafka record time (seconds) of offset 0; offset n is `KAFKA_T0 + n`.
KAFKA_T0 = 1_772_366_400.0
TIMED_OUT = f"request timed out: no end-of-stream marker within {TIMEOUT:g}s"

#: One transcript of each source and each shape (n > 1, tools, reasoning, errors).
SEVERAL = [
    "openai/text_usage.sse",
    "openai/parallel_tool_calls_cached.sse",
    "openai/n2_choices.sse",
    "openai-responses/reasoning_parallel_calls.sse",
    "anthropic/thinking_then_text.sse",
    "anthropic/dropped_connection.sse",
    "gemini/thoughts_cached.sse",
    "gemini/error_raw_json_tail.sse",
    "dynamo/eos_with_usage.jsonl",
    "vllm/cumulative_length.jsonl",
    "vllm/n2_delta.jsonl",
    "atomr/parallel_tool_fragments.jsonl",
]


#: The transcripts whose stream never reports usage (their Tokens says 0 by absence).
NO_USAGE = {
    "openai/error_mid_stream.sse",
    "openai/named_tool_choice_stop.sse",
    "openai-responses/error_event_mid_stream.sse",
    "openai-responses/failed_mid_stream.sse",
}
#: The transcripts whose usage the engine adapter counts from token ids: vLLM always,
#: Dynamo without `completion_usage` (only `eos_with_usage` has it).
COUNTED = {
    file
    for file in MANIFEST
    if file.startswith("vllm/")
    or (file.startswith("dynamo/") and file != "dynamo/eos_with_usage.jsonl")
}


def usage_source_of(file: str) -> UsageSource:
    """Where the usage of a transcript comes from, by the table above."""
    if file in NO_USAGE:
        return UsageSource.MISSING
    if file in COUNTED:
        return UsageSource.ENGINE_COUNTED
    return UsageSource.PROVIDER_REPORTED


def sha256_of(values: list[bytes]) -> str:
    """The billing event's `raw_sha256`, spelled out: each value length-prefixed (8 bytes)."""
    return hashlib.sha256(b"".join(len(v).to_bytes(8, "big") + v for v in values)).hexdigest()


# --------------------------------------------------------------------------- helpers


def ticker(start: datetime = T0) -> Callable[[], datetime]:
    """A receive clock: `start`, then `STEP` later at every call."""
    state = {"n": 0}

    def now() -> datetime:
        value = start + state["n"] * STEP
        state["n"] += 1
        return value

    return now


@dataclass(frozen=True)
class Sample:
    """One transcript of `samples/` and its encoded raw records (events, then END)."""

    file: str
    source: Source
    tenant: str
    request_id: str
    model: str | None
    data: bytes
    records: list[bytes]

    @property
    def key(self) -> bytes:
        return encode_key(self.request_id)

    @property
    def ref(self) -> RequestRef:
        return RequestRef(self.tenant, self.request_id)

    @property
    def topic(self) -> str:
        return TOPICS.raw_sse.name if self.source.is_sse else TOPICS.raw_engine.name

    def received_at(self, seq: int) -> datetime:
        return T0 + seq * STEP

    def decode(self, value: bytes) -> RawSseEvent | RawEngineOutput:
        if self.source.is_sse:
            return avro.decode_raw_sse_event(value)
        return avro.decode_raw_engine_output(value)

    def events(self) -> list[Any]:
        return list(read_events(self.source, io.BytesIO(self.data)))

    def expected(self, keep: Callable[[int], bool] = lambda _: True) -> Tokens:
        """`fold_stream` of the transcript (of the events whose index `keep` accepts)."""
        events = [e for i, e in enumerate(self.events()) if keep(i)]
        return fold_stream(self.source, events, request_id=self.request_id, model=self.model)


def sample(
    file: str, *, tenant: str | None = None, request_id: str | None = None, start: datetime = T0
) -> Sample:
    row = MANIFEST[file]
    source = Source(row["source"])
    data = (SAMPLES / file).read_bytes()
    tenant = tenant or row["tenant"]
    rid, records = raw_records(
        source,
        data,
        tenant=tenant,
        request_id=request_id or row["request_id"],
        clock=ticker(start),
        model=row.get("model"),
    )
    return Sample(file, source, tenant, rid, row.get("model"), data, records)


def position(topic: str, offset: int, partition: int = 0) -> Position:
    return Position(topic, partition, offset, KAFKA_T0 + offset)


class FakeClock:
    """The processor's monotonic clock, advanced by hand."""

    def __init__(self) -> None:
        self.now = 5_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def waiting(processor: RequestProcessor) -> int:
    """Records held for a missing sequence number (the counters' `waiting`)."""
    return sum(len(state.waiting) for state in processor.table.open.values())


@dataclass
class Run:
    """A processor, every output it produced, and the counters invariant after each step."""

    timeout: float = TIMEOUT
    clock: FakeClock = field(default_factory=FakeClock)
    out: Outputs = field(default_factory=Outputs)
    processor: RequestProcessor = field(init=False)

    def __post_init__(self) -> None:
        self.processor = RequestProcessor(PRICES, timeout=self.timeout, clock=self.clock)

    def feed(
        self,
        source: Source,
        value: bytes,
        offset: int,
        *,
        key: bytes | None,
        partition: int = 0,
    ) -> Outputs:
        handle = self.processor.handle_sse if source.is_sse else self.processor.handle_engine
        topic = TOPICS.raw_sse.name if source.is_sse else TOPICS.raw_engine.name
        out = handle(key, value, position(topic, offset, partition))
        self.out.extend(out)
        self.check()
        return out

    def send(self, s: Sample, seq: int, offset: int, *, partition: int = 0) -> Outputs:
        """Record `seq` of `s` at `offset`, keyed by its request id."""
        return self.feed(s.source, s.records[seq], offset, key=s.key, partition=partition)

    def send_all(self, s: Sample, seqs: list[int] | None = None, *, first: int = 0) -> Outputs:
        """Records `seqs` of `s` (default all) at consecutive offsets from `first`."""
        out = Outputs()
        for i, seq in enumerate(range(len(s.records)) if seqs is None else seqs):
            out.extend(self.send(s, seq, first + i))
        return out

    def expire(self, after: float | None = None) -> Outputs:
        self.clock.advance(self.timeout + 1 if after is None else after)
        out = self.processor.expire()
        self.out.extend(out)
        self.check()
        return out

    def check(self) -> None:
        c = self.processor.counters
        assert c.received == (
            c.applied
            + c.duplicates
            + c.dead_lettered
            + c.replayed
            + c.revoked
            + waiting(self.processor)
        ), c

    def completed(self, request_id: str) -> list[Completed]:
        return [done for done in self.out.completed if done.tokens.request_id == request_id]

    def only(self, request_id: str) -> Completed:
        done = self.completed(request_id)
        assert len(done) == 1, done
        return done[0]

    def encoded(self) -> dict[str, list[bytes]]:
        """Every output, Avro-encoded (what the sinks write)."""
        return {
            "chunks": [avro.encode_chunk(c) for c in self.out.chunks],
            "tokens": [avro.encode_tokens(d.tokens) for d in self.out.completed],
            "billing": [avro.encode_billing_event(d.billing) for d in self.out.completed],
            "dead_letters": [avro.encode_dead_letter(d) for d in self.out.dead_letters],
            "completed": [
                repr((d.closed, d.records, d.duplicates)).encode() for d in self.out.completed
            ],
        }


def seqs_of(run: Run, request_id: str) -> list[int]:
    return [c.seq for c in run.out.chunks if c.request_id == request_id]


# --------------------------------------------------------------------------- whole requests


@pytest.mark.parametrize("file", sorted(MANIFEST))
def test_a_whole_request_completes_once_with_the_fold_of_its_transcript(file: str) -> None:
    s = sample(file)
    run = Run()
    last = len(s.records) - 1
    before_end = run.send_all(s, list(range(last)))
    assert before_end.completed == []
    assert run.processor.is_open(s.ref)
    at_end = run.send(s, last, last)

    assert len(at_end.completed) == 1
    done = at_end.completed[0]
    expected = s.expected()
    assert done.tokens == expected
    latest = epoch_micros(s.received_at(last))  # its records' latest receive time
    assert done.closed == Closed(last, CloseReason.END, applied=False, last_received=latest)
    assert done.records == len(s.records)
    assert done.duplicates == 0
    end_time = s.received_at(last)
    provenance = Provenance(
        raw_topic=s.topic,
        raw_partition=0,
        first_offset=0,
        last_offset=last,
        raw_sha256=sha256_of(s.records),
        usage_source=usage_source_of(file),
    )
    assert done.billing == bill(expected, s.tenant, end_time, PRICES, provenance)
    assert done.billing.event_id == bill(expected, s.tenant, end_time, PRICES).event_id
    assert done.billing.tenant == s.tenant
    assert done.billing.usage == expected.usage
    # The chunks of the request: contiguous from 0, as many as the Tokens says.
    assert seqs_of(run, s.request_id) == list(range(expected.chunks))
    assert all(c.source is s.source for c in run.out.chunks)
    assert run.out.dead_letters == []
    counters = run.processor.counters
    assert counters.received == counters.applied == len(s.records)
    assert (counters.duplicates, counters.dead_lettered, counters.replayed) == (0, 0, 0)
    assert counters.requests_completed == 1
    assert counters.requests_timed_out == 0
    assert run.processor.open_requests == 0
    assert run.processor.unknown([s.ref]) == set()


def test_engine_requests_are_priced_by_the_model_their_records_carry() -> None:
    s = sample("dynamo/eos_with_usage.jsonl")
    assert s.model is not None
    run = Run()
    run.send_all(s)
    done = run.only(s.request_id)
    assert done.tokens.model == s.model
    assert done.billing.model == s.model


def test_several_interleaved_requests_each_complete_once() -> None:
    samples = [sample(f) for f in SEVERAL]
    run = Run()
    cursors = {s.request_id: 0 for s in samples}
    offsets = {True: 0, False: 0}
    rng = random.Random(7)
    while cursors:
        rid = rng.choice(sorted(cursors))
        s = next(x for x in samples if x.request_id == rid)
        run.send(s, cursors[rid], offsets[s.source.is_sse])
        offsets[s.source.is_sse] += 1
        cursors[rid] += 1
        if cursors[rid] == len(s.records):
            del cursors[rid]
    for s in samples:
        done = run.only(s.request_id)
        assert done.tokens == s.expected()
        assert seqs_of(run, s.request_id) == list(range(done.tokens.chunks))
    assert run.processor.open_requests == 0
    assert run.processor.counters.requests_completed == len(samples)


# --------------------------------------------------------------------------- duplicates, order


@pytest.mark.parametrize("file", SEVERAL)
def test_a_re_sent_record_is_dropped_and_counted(file: str) -> None:
    s = sample(file)
    run = Run()
    n = len(s.records)
    order = list(range(n - 1))
    # Re-send seq 1 right after it, and seq 0 again later: both are duplicates.
    order[2:2] = [1]
    order.insert(len(order) // 2 + 1, 0)
    offset = 0
    for seq in order:
        before = run.processor.counters.duplicates
        out = run.send(s, seq, offset)
        offset += 1
        if run.processor.counters.duplicates > before:
            assert not out  # a duplicate produces nothing
    run.send(s, n - 1, offset)
    assert run.processor.counters.duplicates == 2
    done = run.only(s.request_id)
    assert done.duplicates == 2
    assert done.records == n
    assert done.tokens == s.expected()
    assert seqs_of(run, s.request_id) == list(range(done.tokens.chunks))
    assert run.out.dead_letters == []


def test_a_re_sent_record_ahead_of_a_gap_is_a_duplicate_too() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s, [0, 1, 3])  # seq 2 missing: seq 3 waits
    assert run.send(s, 3, 3) == Outputs()
    assert run.processor.counters.duplicates == 1
    assert waiting(run.processor) == 1
    run.send(s, 2, 4)
    run.send_all(s, list(range(4, len(s.records))), first=5)
    done = run.only(s.request_id)
    assert done.duplicates == 1
    assert done.tokens == s.expected()


@pytest.mark.parametrize("file", SEVERAL)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_out_of_order_records_are_applied_in_seq_order(file: str, seed: int) -> None:
    s = sample(file)
    in_order = Run()
    in_order.send_all(s)
    order = list(range(len(s.records)))
    random.Random(seed).shuffle(order)
    shuffled = Run()
    for offset, seq in enumerate(order):
        out = shuffled.send(s, seq, offset)
        if offset < len(order) - 1:
            assert out.completed == []  # not before the last missing record came
    done = shuffled.only(s.request_id)
    assert done.tokens == s.expected()
    assert done.records == len(s.records)
    assert waiting(shuffled.processor) == 0
    assert shuffled.processor.open_requests == 0
    # Each record keeps its own receive time: the very same chunks, the very same bill.
    assert shuffled.encoded()["chunks"] == in_order.encoded()["chunks"]
    assert shuffled.encoded()["billing"] == in_order.encoded()["billing"]


def test_the_closing_offset_covers_every_record_applied_when_the_end_came_early() -> None:
    """END (seq 5) arrives before seq 4: the request closes when seq 4 arrives, at offset 5.

    Every record at or before the closing offset counts as a replay later, every
    one after it as a late event, so the offset must cover all records counted.
    """
    s = sample("dynamo/eos_with_usage.jsonl")
    assert len(s.records) == 6
    order = [0, 1, 2, 3, 5, 4]  # offsets 0..5
    first = Run()
    for offset, seq in enumerate(order):
        first.send(s, seq, offset)
    done = first.only(s.request_id)
    assert done.tokens == s.expected()

    # A restarted worker re-reads the same records after learning the close.
    again = Run()
    again.processor.closed_earlier(s.ref, Closed(done.closed.offset, done.closed.reason))
    for offset, seq in enumerate(order):
        again.send(s, seq, offset)
    assert [d.reason for d in again.out.dead_letters] == []
    assert again.processor.counters.replayed == len(order)
    assert done.closed.offset == max(range(len(order)))


def test_records_beyond_the_end_marker_are_not_lost() -> None:
    """A record whose seq lies past END still waits when END closes the request.

    Every raw record must end as applied, duplicate, dead-lettered or replayed.
    """
    s = sample("openai/text_usage.sse")
    end_seq = len(s.records) - 1
    beyond = encode_record(dataclasses.replace(s.decode(s.records[3]), seq=end_seq + 2))
    run = Run()
    run.send_all(s, list(range(end_seq)))
    run.feed(s.source, beyond, end_seq, key=s.key)
    run.send(s, end_seq, end_seq + 1)  # END: the request closes, the stray still waits
    run.only(s.request_id)
    c = run.processor.counters
    assert c.received == end_seq + 2
    assert c.received == c.applied + c.duplicates + c.dead_lettered + c.replayed


# --------------------------------------------------------------------------- gaps, timeouts


def test_a_missing_seq_holds_the_request_until_the_timeout_then_closes_with_the_gap() -> None:
    s = sample("openai/text_usage.sse")
    missing = 3
    seqs = [q for q in range(len(s.records)) if q != missing]
    run = Run()
    at_end = run.send_all(s, seqs)
    assert at_end.completed == []  # END came, but seq 3 did not
    assert run.processor.is_open(s.ref)
    assert waiting(run.processor) == len(s.records) - 1 - missing
    assert run.expire(after=TIMEOUT - 1) == Outputs()  # not yet
    assert run.processor.is_open(s.ref)

    out = run.expire(after=2)
    assert len(out.completed) == 1
    done = out.completed[0]
    assert done.closed.reason is CloseReason.GAP
    assert done.closed.offset == len(seqs) - 1
    assert done.records == len(s.records) - 1
    # What came after the gap is applied ...
    without_gap = s.expected(lambda i: i != missing)
    assert done.tokens.text == without_gap.text
    assert done.tokens.usage == without_gap.usage
    # ... and the request says it is incomplete, naming the gap.
    assert done.tokens.finish_reason is FinishReason.ERROR
    assert done.tokens.error is not None
    assert f"seq {missing}" in done.tokens.error
    assert run.processor.counters.requests_timed_out == 1
    assert not run.processor.is_open(s.ref)
    assert waiting(run.processor) == 0


def test_a_missing_seq_without_end_closes_with_the_gap_at_the_timeout() -> None:
    s = sample("openai/text_usage.sse")
    seqs = [0, 1, 2, 4, 5, 6, 7]
    run = Run()
    run.send_all(s, seqs)
    assert run.out.completed == []
    out = run.expire()
    assert len(out.completed) == 1
    done = out.completed[0]
    latest = epoch_micros(s.received_at(7))
    assert done.closed == Closed(len(seqs) - 1, CloseReason.GAP, False, latest)
    assert done.tokens.text == s.expected(lambda i: i in seqs).text
    assert "Kafka keeps in ordered partitions" in done.tokens.text
    assert done.tokens.finish_reason is FinishReason.ERROR
    assert done.tokens.error is not None
    assert "seq 3" in done.tokens.error
    assert f"{TIMEOUT:g}s" in done.tokens.error
    assert done.billing.event_time == s.received_at(7)
    assert run.processor.counters.requests_timed_out == 1


@pytest.mark.parametrize(
    "file", ["openai/text_usage.sse", "anthropic/text_end_turn.sse", "dynamo/length.jsonl"]
)
def test_a_quiet_request_without_end_closes_at_the_timeout(file: str) -> None:
    s = sample(file)
    prefix = list(range(max(1, (len(s.records) - 1) // 2)))
    run = Run()
    run.send_all(s, prefix)
    # Activity keeps it open: quiet for less than the timeout, twice.
    assert run.expire(after=TIMEOUT * 0.75) == Outputs()
    run.send(s, prefix[-1], len(prefix))  # a duplicate is activity too
    assert run.expire(after=TIMEOUT * 0.75) == Outputs()
    assert run.expire(after=TIMEOUT * 0.25) == Outputs()  # exactly the timeout: not yet
    out = run.expire(after=0.5)

    assert len(out.completed) == 1
    done = out.completed[0]
    # it closes at the highest offset it counted: the duplicate's, after the prefix
    latest = epoch_micros(s.received_at(prefix[-1]))
    assert done.closed == Closed(len(prefix), CloseReason.TIMEOUT, False, latest)
    assert done.closed.reason is CloseReason.TIMEOUT
    assert done.tokens.finish_reason is FinishReason.ERROR
    assert done.tokens.error == TIMED_OUT
    expected = s.expected(lambda i: i in prefix)
    assert done.tokens.text == expected.text
    assert done.tokens.usage == expected.usage
    assert done.records == len(prefix)
    assert done.duplicates == 1
    assert done.billing.event_time == s.received_at(prefix[-1])
    counters = run.processor.counters
    assert counters.requests_timed_out == counters.requests_completed == 1
    assert run.processor.open_requests == 0
    assert run.expire() == Outputs()  # closed once


def test_a_request_that_ended_without_a_finish_signal_is_an_error_not_a_timeout() -> None:
    s = sample("dynamo/truncated_no_finish.jsonl")
    run = Run()
    run.send_all(s)
    done = run.only(s.request_id)
    assert done.closed.reason is CloseReason.END
    assert done.tokens.finish_reason is FinishReason.ERROR
    assert done.tokens.error == NO_FINISH
    assert run.processor.counters.requests_timed_out == 0


# --------------------------------------------------------------------------- after close


@pytest.mark.parametrize("file", ["openai/text_usage.sse", "atomr/text_stop.jsonl"])
def test_events_after_close_are_dead_lettered_with_their_original_bytes(file: str) -> None:
    s = sample(file)
    run = Run()
    run.send_all(s)
    run.only(s.request_id)
    end_offset = len(s.records) - 1
    late = [(2, end_offset + 1), (end_offset, end_offset + 2)]  # an event, END again
    for seq, offset in late:
        out = run.send(s, seq, offset)
        assert out.chunks == []
        assert out.completed == []
        assert len(out.dead_letters) == 1
        letter = out.dead_letters[0]
        assert "already closed" in letter.reason
        assert letter.value == s.records[seq]
        assert letter.key == s.key
        assert (letter.topic, letter.partition, letter.offset) == (s.topic, 0, offset)
        assert letter.request_id == s.request_id
        assert letter.source == s.source.value
        assert letter.error_type == "InputError"
        assert letter.dead_lettered_at == datetime.fromtimestamp(KAFKA_T0 + offset, UTC)
        assert avro.decode_dead_letter(avro.encode_dead_letter(letter)) == letter
    assert run.processor.counters.dead_lettered == 2
    assert len(run.completed(s.request_id)) == 1


# --------------------------------------------------------------------------- replays


def test_records_of_a_request_closed_by_an_earlier_run_are_replays_up_to_its_offset() -> None:
    s = sample("anthropic/text_end_turn.sse")
    k = 5
    run = Run()
    assert run.processor.unknown([s.ref]) == {s.ref}
    run.processor.closed_earlier(s.ref, Closed(offset=k, reason=CloseReason.END))
    assert run.processor.unknown([s.ref]) == set()
    run.send_all(s)
    n = len(s.records)
    assert run.out.completed == []
    assert run.out.chunks == []
    assert run.processor.counters.replayed == k + 1
    assert run.processor.counters.dead_lettered == n - k - 1
    assert [d.offset for d in run.out.dead_letters] == list(range(k + 1, n))
    assert all("already closed" in d.reason for d in run.out.dead_letters)
    assert [d.value for d in run.out.dead_letters] == s.records[k + 1 :]
    assert not run.processor.is_open(s.ref)
    assert run.processor.counters.requests_completed == 0


def _timed_out_then_replayed(s: Sample, prefix: int) -> tuple[Run, Run]:
    """The original run: `prefix` records, the timeout, then the rest arriving late.

    The replay: a fresh processor that learned the close decision (not applied)
    receives the very same records at the very same positions.
    """
    original = Run()
    original.send_all(s, list(range(prefix)))
    timed_out = original.expire()
    assert len(timed_out.completed) == 1
    closed = timed_out.completed[0].closed
    latest = epoch_micros(s.received_at(prefix - 1))
    assert closed == Closed(prefix - 1, CloseReason.TIMEOUT, False, latest)
    original.send_all(s, list(range(prefix, len(s.records))), first=prefix)

    replay = Run()
    replay.processor.closed_earlier(s.ref, Closed.from_marker(closed.marker(), applied=False))
    assert replay.processor.unknown([s.ref]) == set()
    for seq in range(prefix):
        out = replay.send(s, seq, seq)
        # Closed right after the record at the marker's offset, without waiting.
        assert len(out.completed) == (1 if seq == prefix - 1 else 0)
    assert not replay.processor.is_open(s.ref)
    replay.send_all(s, list(range(prefix, len(s.records))), first=prefix)
    return original, replay


@pytest.mark.parametrize(
    "file",
    [
        "openai/parallel_tool_calls_cached.sse",
        "anthropic/thinking_then_text.sse",
        "gemini/thoughts_cached.sse",
        "dynamo/eos_with_usage.jsonl",
        "atomr/reasoning_length.jsonl",
    ],
)
def test_a_timeout_decided_by_an_earlier_run_is_replayed_to_the_same_outputs(file: str) -> None:
    s = sample(file)
    prefix = max(1, len(s.records) // 2)
    original, replay = _timed_out_then_replayed(s, prefix)
    # The late records amend it: revision 0 at the timeout, revision 1 at its END.
    (a, amended_a), (b, amended_b) = (
        original.completed(s.request_id),
        replay.completed(s.request_id),
    )
    assert b.tokens == a.tokens
    assert b.tokens.error == TIMED_OUT
    assert avro.encode_billing_event(b.billing) == avro.encode_billing_event(a.billing)
    assert avro.encode_tokens(b.tokens) == avro.encode_tokens(a.tokens)
    assert b.closed == a.closed
    assert (b.records, b.duplicates) == (a.records, a.duplicates)
    assert (amended_a.billing.revision, amended_a.billing.supersedes) == (1, a.billing.event_id)
    assert amended_a.tokens.error is None
    assert amended_a.tokens == s.expected()
    assert amended_a.records == len(s.records) - prefix
    assert amended_b.closed == amended_a.closed
    assert original.processor.counters.dead_lettered == 0
    # Everything else too: the chunks and the amendment.
    assert replay.encoded() == original.encoded()


def test_a_timeout_replay_keeps_the_duplicate_count_of_the_original() -> None:
    """The original counted a re-sent record after its last applied one as a duplicate."""
    s = sample("openai/text_usage.sse")
    original = Run()
    original.send_all(s, [0, 1, 2, 3, 2])  # offset 4 re-sends seq 2
    a = original.expire().completed[0]
    assert a.duplicates == 1

    replay = Run()
    replay.processor.closed_earlier(s.ref, Closed(a.closed.offset, a.closed.reason, False))
    replay.send_all(s, [0, 1, 2, 3, 2])
    b = replay.only(s.request_id)
    assert b.tokens == a.tokens
    assert (b.closed, b.records, b.duplicates) == (a.closed, a.records, a.duplicates)
    assert replay.encoded() == original.encoded()


def test_a_gap_decided_by_an_earlier_run_is_replayed_to_the_same_outputs() -> None:
    s = sample("openai/text_usage.sse")
    seqs = [0, 1, 2, 4, 5, 6, 7]  # seq 3 never arrives
    original = Run()
    original.send_all(s, seqs)
    a = original.expire().completed[0]
    assert a.closed.reason is CloseReason.GAP

    replay = Run()
    replay.processor.closed_earlier(s.ref, Closed(a.closed.offset, a.closed.reason, False))
    replay.send_all(s, seqs)
    if not replay.out.completed:
        replay.expire()
    b = replay.only(s.request_id)
    assert (b.closed.offset, b.closed.reason) == (a.closed.offset, a.closed.reason)
    assert b.tokens == a.tokens
    assert avro.encode_billing_event(b.billing) == avro.encode_billing_event(a.billing)


def _mixed_traffic(run: Run) -> None:
    """Several requests with duplicates, disorder, a gap, garbage and late events."""
    text = sample("openai/text_usage.sse")
    tools = sample("anthropic/parallel_tool_use_cache.sse")
    dynamo = sample("dynamo/abort.jsonl")
    gap = sample("gemini/max_tokens.sse")
    sse_offset = engine_offset = 0

    def sse(s: Sample, seq: int) -> None:
        nonlocal sse_offset
        run.send(s, seq, sse_offset)
        sse_offset += 1

    def engine(s: Sample, seq: int) -> None:
        nonlocal engine_offset
        run.send(s, seq, engine_offset)
        engine_offset += 1

    rng = random.Random(99)
    tool_order = list(range(len(tools.records)))
    rng.shuffle(tool_order)
    for i in range(max(len(text.records), len(tools.records))):
        if i < len(text.records):
            sse(text, i)
            if i == 4:
                sse(text, 2)  # duplicate
        if i < len(tools.records):
            sse(tools, tool_order[i])
        if i < len(dynamo.records):
            engine(dynamo, i)
        if i < len(gap.records) - 1 and i != 1:
            sse(gap, i)  # seq 1 and END never come: closed with the gap at the timeout
        if i == 3:
            run.feed(Source.OPENAI, b"\xc3\x01garbage", sse_offset, key=b"nobody")
            sse_offset += 1
            run.feed(Source.DYNAMO, text.records[0], engine_offset, key=text.key)
            engine_offset += 1
    sse(text, 1)  # late: already closed
    run.expire()


def test_the_same_raw_records_give_byte_identical_outputs() -> None:
    first, second = Run(), Run()
    _mixed_traffic(first)
    _mixed_traffic(second)
    assert len(first.out.completed) == 4
    assert first.out.dead_letters  # the garbage, the wrong topic, the late event
    assert first.encoded() == second.encoded()
    assert first.processor.counters == second.processor.counters


# --------------------------------------------------------------------------- dead letters

CONFLUENT_RAW = avro.to_confluent(
    raw_records(Source.OPENAI, b"data: {}\n\n", tenant="acme", request_id="req-x")[1][0], 42
)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (b"", "too short"),
        (b"garbage", "too short"),
        (b"\x01\x01not avro at all", "bad marker"),
        (b"\x00\x01not avro at all", "unknown schema id 24014708 (Confluent framing)"),
        (b"\xc3\x01" + b"\xff" * 8 + b"body", "fingerprint"),
        # A whole raw record in the Confluent wire format (00, schema id 42) of an id
        # no registry gave (none is set): refused as an unknown fingerprint is.
        (CONFLUENT_RAW, "unknown schema id 42 (Confluent framing)"),
    ],
    ids=["empty", "short", "marker", "magic", "fingerprint", "confluent"],
)
@pytest.mark.parametrize("source", [Source.OPENAI, Source.VLLM])
def test_a_garbage_value_is_dead_lettered(value: bytes, needle: str, source: Source) -> None:
    run = Run()
    out = run.feed(source, value, 7, key=b"req-x")
    assert out.chunks == []
    assert out.completed == []
    (letter,) = out.dead_letters
    assert needle in letter.reason
    assert letter.error_type == "AvroDecodeError"
    assert letter.value == value
    assert letter.key == b"req-x"
    assert letter.offset == 7
    assert run.processor.counters.dead_lettered == 1
    assert run.processor.open_requests == 0


def test_a_truncated_record_is_dead_lettered() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    cut = s.records[1][:-3]
    (letter,) = run.feed(s.source, cut, 0, key=s.key).dead_letters
    assert "RawSseEvent" in letter.reason
    assert letter.value == cut


def test_a_record_on_the_wrong_topic_is_dead_lettered() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    (letter,) = run.feed(Source.DYNAMO, s.records[0], 0, key=s.key).dead_letters
    assert "expected a RawEngineOutput message" in letter.reason
    assert letter.value == s.records[0]


def test_a_record_larger_than_the_limit_is_dead_lettered_undecoded() -> None:
    s = sample("openai/text_usage.sse")
    first = s.decode(s.records[0])
    assert isinstance(first, RawSseEvent)
    huge = avro.encode_raw_sse_event(
        RawSseEvent(
            request_id=s.request_id,
            seq=0,
            source=s.source,
            tenant=s.tenant,
            received_at=first.received_at,
            data="x" * MAX_RECORD_BYTES,
        )
    )
    assert len(huge) > MAX_RECORD_BYTES
    run = Run()
    out = run.feed(s.source, huge, 0, key=s.key)
    (letter,) = out.dead_letters
    assert f"{len(huge)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit" in letter.reason
    assert letter.value == huge
    assert run.processor.open_requests == 0
    # Exactly at the limit is decoded (then applied or not on its own merits).
    at_limit = b"\x00" * MAX_RECORD_BYTES
    (letter,) = run.feed(s.source, at_limit, 1, key=s.key).dead_letters
    assert "limit" not in letter.reason


def test_a_key_that_is_not_the_records_request_id_is_dead_lettered() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    out = run.feed(s.source, s.records[0], 0, key=b"someone-else")
    (letter,) = out.dead_letters
    assert "message key b'someone-else' is not the record's request id" in letter.reason
    assert repr(s.request_id) in letter.reason
    assert letter.request_id == s.request_id
    assert letter.key == b"someone-else"
    assert letter.value == s.records[0]
    assert run.processor.unknown([s.ref]) == {s.ref}  # nothing opened
    # A message without a key is refused at the edge (the commit gate keys on it).
    (keyless,) = run.feed(s.source, s.records[0], 1, key=None).dead_letters
    assert keyless.reason == "record has no key: a raw record is keyed by its request id"
    assert not run.processor.is_open(s.ref)


def test_another_tenants_records_with_the_same_request_id_are_another_request() -> None:
    # Before, a record of another tenant carrying the request's id was folded into it or
    # dead-lettered as a tenant switch: either way one tenant could spoil another's bill.
    s = sample("openai/text_usage.sse", tenant="acme")
    other = sample("openai/text_usage.sse", tenant="globex")
    assert other.request_id == s.request_id
    run = Run()
    run.send(s, 0, 0)
    out = run.feed(s.source, other.records[0], 1, key=s.key)
    assert out.dead_letters == []
    assert run.processor.is_open(s.ref)
    assert run.processor.is_open(other.ref)
    run.send_all(s, list(range(1, len(s.records))), first=2)
    run.send_all(other, list(range(1, len(other.records))), first=2 + len(s.records))
    billed = {done.billing.tenant: done for done in run.out.completed}
    assert sorted(billed) == ["acme", "globex"]
    for tenant, done in billed.items():
        assert done.tokens == s.expected()
        assert done.ref == RequestRef(tenant, s.request_id)
    assert billed["acme"].billing.event_id != billed["globex"].billing.event_id
    run.check()


def test_a_record_switching_source_mid_request_is_dead_lettered() -> None:
    s = sample("openai/text_usage.sse")
    other = sample("anthropic/text_end_turn.sse", request_id=s.request_id, tenant=s.tenant)
    run = Run()
    run.send(s, 0, 0)
    (letter,) = run.feed(other.source, other.records[1], 1, key=s.key).dead_letters
    assert "changed source mid-stream" in letter.reason
    assert letter.source == "anthropic"


def encode_record(record: RawSseEvent | RawEngineOutput) -> bytes:
    if isinstance(record, RawSseEvent):
        return avro.encode_raw_sse_event(record)
    return avro.encode_raw_engine_output(record)


def with_inserted(s: Sample, at: int, value: bytes) -> list[bytes]:
    """The records of `s` with the record `value` inserted at seq `at`, renumbered."""
    records = [s.decode(r) for r in s.records]
    records.insert(at, s.decode(value))
    return [encode_record(dataclasses.replace(r, seq=i)) for i, r in enumerate(records)]


#: An event each source's adapter refuses (SSE data, or an engine payload), and why.
INVALID: dict[Source, tuple[Any, str]] = {
    Source.OPENAI: ('{"type":"message_start","message":{}}', "not an OpenAI-compatible"),
    Source.ANTHROPIC: ('{"type":"content_block_delta","index":0}', "without a delta object"),
    Source.DYNAMO: ({"token_ids": [9], "finish_reason": ""}, "unknown finish_reason"),
}


@pytest.mark.parametrize(
    "file", ["openai/text_usage.sse", "anthropic/text_end_turn.sse", "dynamo/eos_with_usage.jsonl"]
)
def test_an_invalid_event_is_dead_lettered_and_the_request_goes_on(file: str) -> None:
    s = sample(file)
    content, needle = INVALID[s.source]
    template = s.decode(s.records[2])
    bad_record = (
        dataclasses.replace(template, data=content)
        if isinstance(template, RawSseEvent)
        else dataclasses.replace(template, payload=content)
    )
    records = with_inserted(s, 3, encode_record(bad_record))
    run = Run()
    for offset, value in enumerate(records):
        out = run.feed(s.source, value, offset, key=s.key)
        if offset == 3:
            (letter,) = out.dead_letters
            assert needle in letter.reason
            assert letter.error_type == "InvalidEvent"
            assert letter.value == value
            assert letter.offset == 3
            assert letter.request_id == s.request_id
    assert len(run.out.dead_letters) == 1
    done = run.only(s.request_id)
    assert done.tokens == s.expected()
    assert done.records == len(s.records)  # the invalid one is not counted as applied
    assert seqs_of(run, s.request_id) == list(range(done.tokens.chunks))


def _engine_record(version: int | None, **fields: Any) -> bytes:
    """A RawEngineOutput written with a given released schema (None: the current one)."""
    return avro.encode("RawEngineOutput", fields, version=version)


@pytest.mark.parametrize("version", [None, 1], ids=["current-schema", "schema-v1"])
def test_an_invalid_event_that_waited_is_dead_lettered_with_its_original_bytes(
    version: int | None,
) -> None:
    s = sample("dynamo/eos_with_usage.jsonl")
    common = {
        "request_id": s.request_id,
        "source": "DYNAMO",
        "tenant": s.tenant,
        "received_at": T0,
        "kind": "EVENT",
    }
    first = _engine_record(version, **common, seq=0, payload={"token_ids": [1], "text": "a"})
    bad = _engine_record(version, **common, seq=1, payload={"token_ids": [2], "finish_reason": ""})
    end = _engine_record(version, **{**common, "kind": "END"}, seq=2, payload=None)
    run = Run()
    run.feed(s.source, bad, 0, key=s.key)  # seq 1 before seq 0: it waits
    assert run.out.dead_letters == []
    run.feed(s.source, first, 1, key=s.key)  # seq 0, then seq 1 from the buffer
    (letter,) = run.out.dead_letters
    assert "unknown finish_reason" in letter.reason
    assert letter.offset == 0
    assert letter.key == s.key
    assert letter.value == bad
    run.feed(s.source, end, 2, key=s.key)
    assert run.only(s.request_id).tokens.text == "a"


# --------------------------------------------------------------------------- counters


def test_every_record_is_accounted_for_at_every_step() -> None:
    """`Run.check` asserts the invariant after each step; here the outcomes add up too."""
    run = Run()
    _mixed_traffic(run)
    c = run.processor.counters
    assert waiting(run.processor) == 0
    assert run.processor.open_requests == 0
    assert c.received == c.applied + c.duplicates + c.dead_lettered + c.replayed
    assert c.duplicates == 1
    assert c.dead_lettered == len(run.out.dead_letters) == 3
    assert c.requests_completed == 4
    assert c.requests_timed_out == 1
    assert sum(d.records for d in run.out.completed) == c.applied
    assert sum(d.duplicates for d in run.out.completed) == c.duplicates


def test_counters_hold_while_records_wait_for_a_gap() -> None:
    s = sample("openai-responses/text_cached.sse")
    run = Run()
    order = [0, 5, 4, 3, 6, 2, 1, *range(7, len(s.records))]
    for offset, seq in enumerate(order):
        run.send(s, seq, offset)
        c = run.processor.counters
        if 0 < offset < 6:
            assert waiting(run.processor) == offset
            assert c.applied == 1
    assert run.only(s.request_id).tokens == s.expected()


# --------------------------------------------------------------------------- rebalances


def test_drop_partitions_forgets_the_open_requests_of_those_partitions() -> None:
    a = sample("openai/text_usage.sse")
    b = sample("anthropic/text_end_turn.sse")
    run = Run()
    for seq in range(4):
        run.send(a, seq, seq, partition=0)
        run.send(b, seq, seq, partition=1)
    assert run.processor.open_requests == 2
    dropped = run.processor.drop_partitions({(TOPICS.raw_sse.name, 0)})
    run.check()
    assert dropped == [a.ref]
    assert not run.processor.is_open(a.ref)
    assert run.processor.is_open(b.ref)
    assert run.processor.unknown([a.ref, b.ref]) == {a.ref}
    assert (
        run.processor.drop_partitions({(TOPICS.raw_sse.name, 7), (TOPICS.raw_engine.name, 0)}) == []
    )
    # The partition's next owner (here: this one again) reads it all from the start.
    run.send_all(a)
    run.send_all(b, list(range(4, len(b.records))), first=4)
    for s in (a, b):
        done = run.only(s.request_id)
        assert done.tokens == s.expected()
        assert done.records == len(s.records)
        assert done.duplicates == 0
    assert run.expire() == Outputs()


def test_drop_partitions_keeps_the_counters_balanced() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s, [0, 1, 3, 4])  # two records wait for seq 2
    assert waiting(run.processor) == 2
    run.processor.drop_partitions({(TOPICS.raw_sse.name, 0)})
    run.check()


# --------------------------------------------------------------------------- unknown ids


def test_unknown_excludes_open_and_known_closed_requests() -> None:
    opened = sample("openai/text_usage.sse")
    finished = sample("gemini/text_stop.sse")
    run = Run()
    fresh, applied, pending = (RequestRef("t", r) for r in ("fresh", "applied", "pending"))
    ids = {fresh, applied, pending, opened.ref, finished.ref}
    assert run.processor.unknown(ids) == ids
    run.send(opened, 0, 0)
    run.send_all(finished, first=1)
    run.processor.closed_earlier(applied, Closed(3, CloseReason.END, applied=True))
    run.processor.closed_earlier(pending, Closed(4, CloseReason.TIMEOUT, applied=False))
    assert run.processor.unknown(ids) == {fresh}
    # The same request id of another tenant is another request: still unknown.
    assert run.processor.unknown([RequestRef("other", "applied")]) == {
        RequestRef("other", "applied")
    }
    assert run.processor.unknown([]) == set()
    assert run.processor.unknown(iter([fresh, fresh])) == {fresh}


def test_close_markers_round_trip() -> None:
    for reason in CloseReason:
        closed = Closed(42, reason, applied=False)
        assert Closed.from_marker(closed.marker(), applied=False) == closed
    assert Closed.from_marker("17", applied=True) == Closed(17, CloseReason.END, True)
    # Since new calls of a reused id are recognised, the marker carries the latest
    # receive time of the request's records; a marker without it still reads.
    timed = Closed(42, CloseReason.GAP, False, 1_772_366_400_250_001)
    assert timed.marker() == "42 gap 1772366400250001"
    assert Closed.from_marker(timed.marker(), applied=False) == timed
    assert Closed.from_marker("42 gap", applied=False).last_received is None


# --------------------------------------------------------------------------- provenance


def test_provenance_covers_the_applied_records_in_seq_order_not_duplicates() -> None:
    """Records arrive out of order with a duplicate, on partition 3 from offset 100:
    the hash is of the applied values in seq order, the offsets the lowest and highest
    of the records applied (the duplicate's is neither hashed nor counted)."""
    s = sample("openai/text_usage.sse")
    n = len(s.records)
    order = [0, 2, 1, 1, *range(3, n)]  # seq 2 waits for 1; seq 1 is then re-sent
    run = Run()
    offsets = {}
    for i, seq in enumerate(order):
        run.send(s, seq, 100 + i, partition=3)
        offsets.setdefault(seq, 100 + i)
    done = run.only(s.request_id)
    assert done.duplicates == 1
    billing = done.billing
    assert (billing.raw_topic, billing.raw_partition) == (TOPICS.raw_sse.name, 3)
    assert (billing.first_offset, billing.last_offset) == (100, 100 + n)
    assert billing.raw_sha256 == sha256_of(s.records)
    assert billing.usage_source is UsageSource.PROVIDER_REPORTED
    # In order, without the duplicate, elsewhere: the same hash (the input is the same).
    plain = Run()
    plain.send_all(s, first=7)
    again = plain.only(s.request_id).billing
    assert again.raw_sha256 == billing.raw_sha256
    assert again.event_id == billing.event_id
    assert (again.first_offset, again.last_offset) == (7, 7 + n - 1)


def test_a_record_left_out_changes_the_hash_of_a_request_closed_over_the_gap() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    seqs = [i for i in range(len(s.records)) if i != 2]
    run.send_all(s, seqs)
    run.expire()
    done = run.only(s.request_id)
    assert done.closed.reason is CloseReason.GAP
    kept = [s.records[i] for i in seqs]
    assert done.billing.raw_sha256 == sha256_of(kept)
    assert done.billing.raw_sha256 != sha256_of(s.records)


def _atomr(seq: int, payload: dict[str, Any] | None) -> bytes:
    record = RawEngineOutput(
        request_id="r-atomr",
        seq=seq,
        source=Source.ATOMR,
        tenant="acme",
        received_at=T0 + seq * STEP,
        kind=EventKind.EVENT if payload is not None else EventKind.END,
        payload=payload,
        model="atomr-1",
    )
    return avro.encode_raw_engine_output(record)


def _atomr_request(usage: dict[str, int] | None) -> Completed:
    run = Run()
    chunk: dict[str, Any] = {
        "request_id": "r-atomr",
        "text_delta": "hi",
        "finish_reason": "stop",
    }
    if usage is not None:
        chunk["usage"] = usage
    run.feed(Source.ATOMR, _atomr(0, chunk), 0, key=encode_key("r-atomr"))
    run.feed(Source.ATOMR, _atomr(1, None), 1, key=encode_key("r-atomr"))
    return run.only("r-atomr")


def test_no_usage_reported_is_missing_never_a_request_that_used_zero_tokens() -> None:
    missing = _atomr_request(None).billing
    zero = _atomr_request({"input_tokens": 0, "output_tokens": 0}).billing
    some = _atomr_request({"input_tokens": 5, "output_tokens": 2}).billing
    assert missing.usage_counts() == zero.usage_counts()  # both bill 0 tokens ...
    assert missing.usage_source is UsageSource.MISSING  # ... but only one reported it
    assert zero.usage_source is UsageSource.PROVIDER_REPORTED
    assert (some.usage_source, some.input_tokens) == (UsageSource.PROVIDER_REPORTED, 5)
    back = avro.decode_billing_event(avro.encode_billing_event(missing))
    assert back.usage_source is UsageSource.MISSING


@pytest.mark.parametrize(
    ("file", "source"),
    [
        ("openai/text_usage.sse", UsageSource.PROVIDER_REPORTED),
        ("openai/named_tool_choice_stop.sse", UsageSource.MISSING),
        ("openai-responses/failed_mid_stream.sse", UsageSource.MISSING),
        ("anthropic/text_end_turn.sse", UsageSource.PROVIDER_REPORTED),
        ("gemini/text_stop.sse", UsageSource.PROVIDER_REPORTED),
        ("dynamo/eos_with_usage.jsonl", UsageSource.PROVIDER_REPORTED),
        ("dynamo/eos_no_usage.jsonl", UsageSource.ENGINE_COUNTED),
        ("vllm/delta_stop_cached.jsonl", UsageSource.ENGINE_COUNTED),
        ("atomr/text_stop.jsonl", UsageSource.PROVIDER_REPORTED),
    ],
)
def test_usage_source_per_source_family(file: str, source: UsageSource) -> None:
    run = Run()
    run.send_all(sample(file))
    assert run.only(sample(file).request_id).billing.usage_source is source


def test_dynamo_usage_counted_until_the_engine_reports_it() -> None:
    """Dynamo without `completion_usage` counts the emitted token ids; once it reports
    usage, the report wins (and the source says so)."""
    s = sample("dynamo/eos_with_usage.jsonl")
    lines = s.data.decode().splitlines()
    reported = [i for i, line in enumerate(lines) if "completion_usage" in line]
    assert reported == [len(lines) - 1]  # only the last event reports usage
    before = Run()
    before.send_all(s, list(range(len(s.records) - 2)))
    before.send(s, len(s.records) - 1, len(s.records) - 2)  # END without the report: a gap
    before.expire()
    assert before.only(s.request_id).billing.usage_source is UsageSource.ENGINE_COUNTED


# ------------------------------------------------------------------------- examine, then admit


def test_examining_a_message_changes_nothing_taking_it_counts_it_in() -> None:
    """The worker examines (decodes, checks) the next batch while one is written: examining
    must leave the processor as it was; only `admit` counts a message and dead-letters it."""
    processor = RequestProcessor(PRICES, timeout=TIMEOUT)
    _, records = raw_records(
        Source.OPENAI,
        (SAMPLES / "openai/text_usage.sse").read_bytes(),
        tenant="acme",
        request_id="ex-1",
    )
    messages = [
        (b"ex-1", records[0]),  # a good record
        (b"other", records[1]),  # its key is not its request id
        (b"ex-2", b"\x00not avro"),  # does not decode
        (b"ex-3", None),  # a tombstone
    ]
    examined = [processor.examine_sse(key, value) for key, value in messages]
    assert processor.counters == RequestProcessor(PRICES, timeout=TIMEOUT).counters
    assert isinstance(examined[0], RawSseEvent)
    assert [type(e).__name__ for e in examined[1:]] == ["Refused"] * 3
    out = Outputs()
    taken = [
        processor.admit(e, key, value, Position(TOPICS.raw_sse.name, 0, offset), out)
        for offset, (e, (key, value)) in enumerate(zip(examined, messages, strict=True))
    ]
    assert taken[0] is not None
    assert taken[0].ref == RequestRef("acme", "ex-1")
    assert taken[1:] == [None, None, None]
    assert processor.counters.received == 4
    assert processor.counters.dead_lettered == 3
    assert [d.offset for d in out.dead_letters] == [1, 2, 3]
    assert out.dead_letters[0].request_id == "ex-1"  # decoded: named in its dead letter


# --------------------------------------------------------------------------- keep-alives


def keepalive_of(s: Sample, seq: int, at: datetime) -> bytes:
    """A keep-alive record of `s`'s request (what the tap sends for a call in flight)."""
    if s.source.is_sse:
        return avro.encode_raw_sse_event(
            RawSseEvent.keepalive(
                request_id=s.request_id, seq=seq, source=s.source, tenant=s.tenant, received_at=at
            )
        )
    return avro.encode_raw_engine_output(
        RawEngineOutput.keepalive(
            request_id=s.request_id,
            seq=seq,
            source=s.source,
            tenant=s.tenant,
            received_at=at,
            model=s.model,
        )
    )


@pytest.mark.parametrize(
    "file", ["openai/text_usage.sse", "anthropic/text_end_turn.sse", "dynamo/eos_with_usage.jsonl"]
)
def test_keepalives_keep_a_silent_request_open_and_change_nothing_of_its_bill(file: str) -> None:
    s = sample(file)
    half = max(1, (len(s.records) - 1) // 2)
    last = s.received_at(half - 1)
    # The first half, a silence of 2.25 timeouts kept alive twice, then the rest.
    records = with_inserted(s, half, keepalive_of(s, half, last + timedelta(seconds=45)))
    records = with_inserted(
        dataclasses.replace(s, records=records),
        half + 1,
        keepalive_of(s, half + 1, last + timedelta(seconds=90)),
    )
    run = Run()
    for offset in range(half):
        run.feed(s.source, records[offset], offset, key=s.key)
    assert run.expire(after=TIMEOUT * 0.75) == Outputs()
    run.feed(s.source, records[half], half, key=s.key)
    assert run.expire(after=TIMEOUT * 0.75) == Outputs()
    run.feed(s.source, records[half + 1], half + 1, key=s.key)
    assert run.expire(after=TIMEOUT * 0.75) == Outputs()
    assert run.processor.is_open(s.ref)
    for offset in range(half + 2, len(records)):
        run.feed(s.source, records[offset], offset, key=s.key)

    done = run.only(s.request_id)
    assert done.closed.reason is CloseReason.END  # closed once, by its END
    assert run.out.dead_letters == []
    assert done.tokens == s.expected()  # the fold of the transcript, keep-alives or not
    assert seqs_of(run, s.request_id) == list(range(done.tokens.chunks))  # no chunk of theirs
    assert done.records == len(records)  # applied: in = processed
    assert run.processor.counters.requests_timed_out == 0
    # Provenance: every applied record, the keep-alives included, in seq order.
    assert done.billing.raw_sha256 == sha256_of(records)
    # The bill is the one of the same request without keep-alives (but its provenance).
    plain = Run()
    plain.send_all(s)
    alone = plain.only(s.request_id).billing
    assert dataclasses.replace(done.billing, raw_sha256=alone.raw_sha256, last_offset=0) == (
        dataclasses.replace(alone, last_offset=0)
    )


def test_a_request_without_keepalives_times_out_in_the_same_silence() -> None:
    """The control of the test above: the same silence, nothing in it, closes the request."""
    s = sample("openai/text_usage.sse")
    half = (len(s.records) - 1) // 2
    run = Run()
    run.send_all(s, list(range(half)))
    assert run.expire(after=TIMEOUT * 0.75) == Outputs()
    out = run.expire(after=TIMEOUT * 0.75)
    (done,) = out.completed
    assert done.closed.reason is CloseReason.TIMEOUT


def test_a_keepalive_is_a_record_like_any_other_duplicate_late_or_lone() -> None:
    s = sample("openai/text_usage.sse")
    n = len(s.records)
    at = s.received_at(2)
    alive = keepalive_of(s, 2, at)
    records = with_inserted(s, 2, alive)
    run = Run()
    run.send_all(s, [0, 1])
    run.feed(s.source, records[2], 2, key=s.key)
    run.feed(s.source, records[2], 3, key=s.key)  # re-sent: a duplicate
    for offset in range(3, n + 1):
        run.feed(s.source, records[offset], offset + 1, key=s.key)
    done = run.only(s.request_id)
    assert (done.records, done.duplicates) == (n + 1, 1)
    assert done.tokens == s.expected()
    # After its END: late, dead-lettered with its bytes, the request closed once.
    late = keepalive_of(s, n + 1, at)
    (letter,) = run.feed(s.source, late, n + 2, key=s.key).dead_letters
    assert "already closed" in letter.reason
    assert letter.value == late
    assert len(run.completed(s.request_id)) == 1
    # A request's first record: nothing to bill, no request opened (as a lone END marker).
    other = sample("openai/text_usage.sse", request_id="lone-keepalive")
    lone = keepalive_of(other, 0, at)
    (letter,) = run.feed(other.source, lone, n + 3, key=other.key).dead_letters
    assert "keep-alive of request" in letter.reason
    assert not run.processor.is_open(other.ref)
    assert run.expire().completed == []


def test_a_source_of_its_own_times_out_after_its_own_timeout() -> None:
    """``STREAMTALLY_REQUEST_TIMEOUTS``: anthropic requests may stay quiet ten times longer."""
    openai = sample("openai/text_usage.sse")
    anthropic = sample("anthropic/text_end_turn.sse")
    run = Run()
    run.processor = RequestProcessor(
        PRICES, timeout=TIMEOUT, clock=run.clock, timeouts={"anthropic": TIMEOUT * 10}
    )
    assert run.processor.timeout_of("anthropic") == TIMEOUT * 10
    assert run.processor.timeout_of("openai") == TIMEOUT
    run.send_all(openai, [0, 1])
    run.send_all(anthropic, [0, 1], first=2)
    (closed,) = run.expire(after=TIMEOUT + 1).completed  # the default: openai's
    assert closed.tokens.request_id == openai.request_id
    assert run.processor.is_open(anthropic.ref)
    assert run.expire(after=TIMEOUT * 8).completed == []
    (late,) = run.expire(after=TIMEOUT * 2).completed
    assert late.tokens.request_id == anthropic.request_id
    assert late.closed.reason is CloseReason.TIMEOUT
    assert late.tokens.error == (
        f"request timed out: no end-of-stream marker within {TIMEOUT * 10:g}s"
    )
