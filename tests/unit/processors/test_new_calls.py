"""One call, one bill: a new call of a closed request's id is a request of its own.

The worker's rule for any producer (`RequestProcessor.call_of`): a record of seq 0 of a
request id whose request has closed, after its close and received after every record of
it, starts a new call, the request ``call_request_id(id, received_at)``; a re-sent record
of the closed request keeps its receive time and stays late.  Replays derive the same
ids, and the commit gate never stops inside a new call (`CommitGate`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from streamtally.billing.events import event_id
from streamtally.core.identity import RequestRef, call_request_id
from streamtally.core.models import FinishReason
from streamtally.processors.commits import CommitGate
from streamtally.processors.requests import Closed, Outputs, RequestProcessor
from streamtally.processors.source import RawMessage
from streamtally.wire import avro
from streamtally.wire.records import UsageSource
from tests.unit.processors.test_requests import (
    PRICES,
    T0,
    TIMEOUT,
    FakeClock,
    Run,
    Sample,
    position,
    sample,
)

HOUR = timedelta(hours=1)
FILE = "openai/text_usage.sse"


def at(s: Sample, seq: int) -> datetime:
    """The receive time record `seq` of `s` carries."""
    return s.decode(s.records[seq]).received_at


def calls(n: int, file: str = FILE) -> list[Sample]:
    """`n` calls of one tenant with the same provider id, an hour apart."""
    return [sample(file, start=T0 + i * HOUR) for i in range(n)]


def test_two_sequential_calls_with_the_same_provider_id_are_two_bills() -> None:
    first, second = calls(2)
    assert first.request_id == second.request_id == "chatcmpl-st0001"
    run = Run()
    run.send_all(first)
    run.send_all(second, first=len(first.records))
    a, b = run.out.completed
    new_id = call_request_id(first.request_id, at(second, 0))
    assert (a.tokens.request_id, b.tokens.request_id) == (first.request_id, new_id)
    # The first is billed as before (same id, same event_id); the second on its own.
    assert a.billing.event_id == event_id(first.tenant, first.request_id)
    assert b.billing.event_id == event_id(first.tenant, new_id) != a.billing.event_id
    assert a.tokens.usage == b.tokens.usage == first.expected().usage
    assert b.tokens.text == first.expected().text
    # The provider's id is kept on both, and the Tokens JSON shows it where it differs.
    for done in (a, b):
        assert done.tokens.provider_request_id == first.request_id
        assert done.billing.provider_request_id == first.request_id
    assert "provider_request_id" not in a.tokens.to_json_dict()
    assert b.tokens.to_json_dict()["provider_request_id"] == first.request_id
    assert b.billing.first_offset == len(first.records)
    assert run.out.dead_letters == []
    assert {c.request_id for c in run.out.chunks} == {first.request_id, new_id}
    assert run.processor.counters.applied == 2 * len(first.records)


def test_a_third_call_after_the_second_is_a_third_bill() -> None:
    three = calls(3)
    run = Run()
    offset = 0
    for call in three:
        run.send_all(call, first=offset)
        offset += len(call.records)
    ids = [done.tokens.request_id for done in run.out.completed]
    assert ids == [
        three[0].request_id,
        call_request_id(three[0].request_id, at(three[1], 0)),
        call_request_id(three[0].request_id, at(three[2], 0)),
    ]
    assert len({done.billing.event_id for done in run.out.completed}) == 3


def test_overlapping_calls_with_the_same_id_still_merge_as_duplicates() -> None:
    """A call that starts while another of its id is open cannot be told from a re-send:
    its records are duplicates of the open one (as before), and its END closes it.  A
    producer that gives each call its own id (the proxy: `new_call_id`) never has two
    calls of one id open at once."""
    first, second = calls(2)
    n = len(first.records)
    run = Run()
    run.send_all(first, list(range(n - 1)))  # all but its END
    run.send_all(second, first=n - 1)  # the whole second call while the first is open
    done = run.only(first.request_id)
    assert done.duplicates == n - 1
    assert len(run.out.completed) == 1
    assert done.tokens.usage == first.expected().usage  # one call's usage: one is lost


def test_a_re_sent_first_record_after_the_close_stays_late() -> None:
    """The same record again (its own receive time) is not a new call."""
    (first,) = calls(1)
    run = Run()
    run.send_all(first)
    end = len(first.records) - 1
    out = run.send(first, 0, end + 1)
    assert out.completed == []
    assert out.chunks == []
    (letter,) = out.dead_letters
    assert "already closed" in letter.reason
    assert not run.processor.is_open(
        RequestRef(first.tenant, call_request_id(first.request_id, at(first, 0)))
    )
    assert run.processor.expire().completed == []  # nothing was opened to time out


def test_a_first_record_received_no_later_than_the_closed_request_is_late() -> None:
    """Received at (or before) the closed request's latest record: not a new call."""
    first = sample(FILE)
    same_time = sample(FILE, start=at(first, len(first.records) - 1))
    run = Run()
    run.send_all(first)
    out = run.send(same_time, 0, len(first.records))
    assert len(out.dead_letters) == 1
    assert out.completed == []


def test_a_later_record_of_a_new_call_ahead_of_its_first_is_late() -> None:
    """The limit of the rule: a new call is recognised by its first record; a record of it
    that arrives before it cannot be told from a late record of the closed request."""
    first, second = calls(2)
    run = Run()
    run.send_all(first)
    n = len(first.records)
    out = run.send(second, 1, n)
    assert len(out.dead_letters) == 1


def test_a_new_call_aborted_before_usage_is_billed_aborted_not_missing() -> None:
    first = sample("openai/named_tool_choice_stop.sse")  # reports no usage
    run = Run()
    run.send_all(first)
    assert run.only(first.request_id).billing.usage_source is UsageSource.MISSING
    # The same id again, an hour later, cut short: its END marker says cancelled.
    again = sample("openai/named_tool_choice_stop.sse", start=T0 + HOUR)
    cancelled = _cancelled_end(again, seq=2)
    run.send_all(again, [0, 1], first=len(first.records))
    run.feed(again.source, cancelled, len(first.records) + 2, key=again.key)
    done = run.out.completed[-1]
    assert done.tokens.request_id == call_request_id(first.request_id, at(again, 0))
    assert done.tokens.finish_reason is FinishReason.CANCELLED
    assert done.billing.usage_source is UsageSource.ABORTED
    assert avro.decode_billing_event(done.billing_value).usage_source is UsageSource.ABORTED


def _cancelled_end(s: Sample, seq: int) -> bytes:
    from streamtally.wire.records import RawSseEvent

    end = RawSseEvent.end(
        request_id=s.request_id,
        seq=seq,
        source=s.source,
        tenant=s.tenant,
        received_at=at(s, seq),
        cancelled=True,
    )
    return avro.encode_raw_sse_event(end)


# --------------------------------------------------------------------------- replays

TOPIC = "streamtally.raw.sse"


def _traffic() -> list[tuple[Sample, int]]:
    """One partition: three calls of one id; another request that opens inside the second
    call and stays open past its close (so a commit could stop inside the second call),
    a re-send of the first call's first record after the second closed, and records of
    the second out of order."""
    a, b, c = calls(3)
    x = sample("anthropic/text_end_turn.sse", request_id="msg_other")
    n, m = len(a.records), len(x.records)
    order: list[tuple[Sample, int]] = [(a, i) for i in range(n)]
    order += [(b, 0), (x, 0), (b, 2), (b, 1), (x, 1), *((b, i) for i in range(3, n))]
    order += [(x, 2), (a, 0)]  # a true re-send of the first call's first record: late
    order += [(c, 0), (x, 3), *((c, i) for i in range(1, n))]
    order += [(x, i) for i in range(4, m)]
    return order


class _Worker:
    """The agent's steps over one partition, one record per batch, with a Redis of close
    markers (`markers`) shared by every run, and the commit gate."""

    def __init__(self, markers: dict[RequestRef, str]) -> None:
        self.processor = RequestProcessor(PRICES, timeout=TIMEOUT, clock=FakeClock())
        self.gate = CommitGate()
        self.markers = markers
        self.out = Outputs()

    def step(self, s: Sample, seq: int, offset: int) -> None:
        p, out = self.processor, Outputs()
        message = RawMessage(
            TOPIC, 0, offset, position(TOPIC, offset).timestamp, s.key, s.records[seq]
        )
        examined = p.examine_batch([message], TOPIC)
        raws = p.admit_batch([message], examined, out)
        for ref in sorted(p.unknown(p.requests_of(raws))):
            if ref in self.markers:
                p.closed_earlier(ref, Closed.from_marker(self.markers[ref], applied=True))
        holds = p.apply_batch(out, [message], raws, {}, lambda t, n: (t, n))
        for done in out.completed:  # durable: the marker first, once
            self.markers.setdefault(done.ref, done.closed.marker())
        for tp, off, ref, span in holds:
            self.gate.hold(tp, off, ref, span)
        self.gate.finished(
            [d.ref for d in out.completed], {d.ref: d.closed.offset for d in out.completed}
        )
        self.gate.release()
        self.out.extend(out)

    def committed(self) -> int:
        return self.gate.committable().get((TOPIC, 0), 0)


def _bills(out: Outputs) -> dict[str, bytes]:
    bills: dict[str, bytes] = {}
    for done in out.completed:
        assert bills.setdefault(done.billing.event_id, done.billing_value) == done.billing_value
    return bills


def test_the_same_records_through_fresh_processors_give_the_same_outputs() -> None:
    traffic = _traffic()
    runs = []
    for _ in range(2):
        worker = _Worker({})
        for offset, (s, seq) in enumerate(traffic):
            worker.step(s, seq, offset)
        runs.append(worker.out)
    encoded = [[d.billing_value for d in out.completed] for out in runs]
    assert encoded[0] == encoded[1]
    assert len(encoded[0]) == 4  # the three calls and the other request
    assert [d.offset for d in runs[0].dead_letters] == [d.offset for d in runs[1].dead_letters]
    assert len(runs[0].dead_letters) == 1  # the re-send


@pytest.mark.parametrize("crash", range(1, 81))
def test_a_crash_anywhere_replays_to_the_same_bills_and_no_false_late(crash: int) -> None:
    """Run until record `crash`, then a fresh worker reads from the committed offset with
    the close markers the first wrote: every call is billed once, with the same bytes as
    without the crash, and the only dead letter is the re-send."""
    traffic = _traffic()
    assert crash < len(traffic)
    whole = _Worker({})
    for offset, (s, seq) in enumerate(traffic):
        whole.step(s, seq, offset)
    expected = _bills(whole.out)
    late = {d.offset for d in whole.out.dead_letters}

    markers: dict[RequestRef, str] = {}
    before = _Worker(markers)
    for offset, (s, seq) in enumerate(traffic[:crash]):
        before.step(s, seq, offset)
    start = before.committed()
    after = _Worker(markers)
    for offset in range(start, len(traffic)):
        s, seq = traffic[offset]
        after.step(s, seq, offset)
    got = _bills(before.out)
    for key, value in _bills(after.out).items():
        assert got.setdefault(key, value) == value  # a re-written bill is the same bytes
    assert got == expected
    assert {d.offset for d in after.out.dead_letters} <= late
    assert after.processor.counters.received == len(traffic) - start


def test_aborted_closes_are_counted_by_source_in_the_metrics() -> None:
    from streamtally.processors.metrics import WorkerMetrics

    s = sample("openai/named_tool_choice_stop.sse")  # reports no usage
    run = Run()
    run.send_all(s, [0, 1])
    run.feed(s.source, _cancelled_end(s, seq=2), 2, key=s.key)
    other = sample("openai/text_usage.sse")  # cancelled too, but its usage was reported
    run.send_all(other, list(range(len(other.records) - 1)), first=3)
    run.feed(other.source, _cancelled_end(other, seq=len(other.records) - 1), 99, key=other.key)
    sources = [d.billing.usage_source for d in run.out.completed]
    assert sources == [UsageSource.ABORTED, UsageSource.PROVIDER_REPORTED]
    metrics = WorkerMetrics()
    metrics.written(run.out)
    text = metrics.exposition().decode()
    assert 'streamtally_requests_aborted_total{source="openai"} 1.0' in text
