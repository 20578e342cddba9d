"""Late records amend the bill (issue 24): a request closed at its timeout or over a gap
takes the records that come after its close, and is billed again as a new revision.

Each test drives `tests.unit.processors.test_requests.Run` (a pure `RequestProcessor`, the
counters invariant checked after every step) with our own transcripts.
"""

from __future__ import annotations

import zlib

import pytest

from streamtally.billing.events import event_id
from streamtally.billing.pricing import PriceTable
from streamtally.errors import InputError
from streamtally.processors._records import _Raw
from streamtally.processors.amendable import Amendable, KeptRecord
from streamtally.processors.requests import Closed, CloseReason, Completed, Refused
from streamtally.wire import avro
from streamtally.wire.records import RawSseEvent
from tests.unit.processors.test_requests import SEVERAL, TIMED_OUT, Run, Sample, position, sample


def _quiet_then_rest(s: Sample, prefix: int) -> tuple[Run, Completed, Completed]:
    """`prefix` records, quiet past the timeout, then the rest (usage and END)."""
    run = Run()
    run.send_all(s, list(range(prefix)))
    (first,) = run.expire().completed
    run.send_all(s, list(range(prefix, len(s.records))), first=prefix)
    first_again, amended = run.completed(s.request_id)
    assert first_again is first
    return run, first, amended


@pytest.mark.parametrize("file", SEVERAL)
def test_usage_after_the_timeout_amends_the_bill_to_the_whole_fold(file: str) -> None:
    s = sample(file)
    prefix = max(1, len(s.records) // 3)
    run, first, amended = _quiet_then_rest(s, prefix)
    assert (first.billing.revision, first.billing.supersedes) == (0, None)
    assert first.tokens.error == TIMED_OUT
    assert first.amendable is not None  # kept for its amendments
    # Revision 1: the request as one stream with every record, superseding revision 0.
    assert amended.tokens == s.expected()
    assert amended.billing.revision == 1
    assert amended.billing.supersedes == first.billing.event_id
    assert amended.billing.event_id == event_id(s.tenant, s.request_id, 1)
    assert tuple(amended.billing.usage_counts().values()) == s.expected().usage.counts()
    assert amended.supersedes == first.billing
    assert amended.closed == Closed(
        len(s.records) - 1, CloseReason.END, False, amended.closed.last_received, 1
    )
    assert amended.amendable is None  # closed at its END: nothing comes after it
    # Its provenance covers every record applied, the first ones too.
    assert (amended.billing.first_offset, amended.billing.last_offset) == (
        0,
        len(s.records) - 1,
    )
    # Each record counted once: the first revision's, then the amendment's.
    assert (first.records, amended.records) == (prefix, len(s.records) - prefix)
    counters = run.processor.counters
    assert (counters.dead_lettered, counters.requests_amended) == (0, 1)
    assert counters.applied == len(s.records)


def test_a_missing_record_that_comes_after_a_gap_close_amends_it() -> None:
    s = sample("openai/text_usage.sse")
    seqs = [i for i in range(len(s.records)) if i != 3]
    run = Run()
    run.send_all(s, seqs)
    (gap,) = run.expire().completed
    assert gap.closed.reason is CloseReason.GAP
    assert gap.tokens != s.expected()
    run.send(s, 3, len(seqs))  # the missing one, sent again at last
    first, amended = run.completed(s.request_id)
    assert first is gap
    assert amended.tokens == s.expected()
    assert (amended.billing.revision, amended.closed.reason) == (1, CloseReason.END)
    assert amended.records == 1


def test_a_second_quiet_spell_makes_a_second_amendment() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s, [0, 1])
    run.expire()
    run.send_all(s, [2, 3], first=2)
    run.expire()
    run.send_all(s, list(range(4, len(s.records))), first=4)
    bills = [done.billing for done in run.completed(s.request_id)]
    assert [b.revision for b in bills] == [0, 1, 2]
    assert [b.supersedes for b in bills] == [None, bills[0].event_id, bills[1].event_id]
    assert run.completed(s.request_id)[-1].tokens == s.expected()


def test_a_record_it_had_is_a_duplicate_and_amends_nothing() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s, [0, 1, 2])
    run.expire()
    out = run.send(s, 1, 3)  # seq 1 sent again after the close
    assert not run.processor.is_open(s.ref)
    (dead,) = out.dead_letters
    assert "a duplicate, nothing to amend" in dead.reason
    assert len(run.completed(s.request_id)) == 1


def test_after_its_end_a_record_is_late_as_before() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s)
    out = run.send(s, 1, len(s.records))
    (dead,) = out.dead_letters
    assert "already closed (at its end: nothing comes after it)" in dead.reason
    assert len(run.completed(s.request_id)) == 1


def test_a_request_whose_state_expired_is_not_amended_and_says_why() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s, [0, 1, 2])
    (first,) = run.expire().completed
    # A fresh worker: the store has the close, not its amendable state (past the TTL).
    later = Run()
    later.processor.closed_earlier(s.ref, Closed.from_marker(first.closed.marker(), applied=True))
    record = later.processor.examine_sse(s.key, s.records[3])
    assert not isinstance(record, Refused)
    raw = _Raw(record, position(s.topic, 3), s.key, s.records[3], s.ref)
    assert later.processor.amendable_to_fetch([raw]) == {s.ref}
    later.processor.amendable_fetched(s.ref, None)
    out = later.send(s, 3, 3)
    (dead,) = out.dead_letters
    assert "no longer amendable" in dead.reason
    assert "STREAMTALLY_STATE_TTL" in dead.reason


def test_the_state_from_the_store_amends_byte_for_byte_as_the_state_in_memory() -> None:
    s = sample("anthropic/thinking_then_text.sse")
    prefix = len(s.records) // 2
    here, first, _ = _quiet_then_rest(s, prefix)
    assert first.amendable is not None
    # Another worker (after a restart): the close and the amendable state from the store.
    other = Run()
    other.processor.closed_earlier(s.ref, Closed.from_marker(first.closed.marker(), applied=True))
    other.processor.amendable_fetched(s.ref, Amendable.decode(first.amendable))
    other.send_all(s, list(range(prefix, len(s.records))), first=prefix)
    (amended,) = other.completed(s.request_id)
    assert other.encoded()["billing"] == here.encoded()["billing"][1:]
    assert other.encoded()["tokens"] == here.encoded()["tokens"][1:]
    assert amended.closed == here.completed(s.request_id)[1].closed


def test_an_amendment_decided_and_not_written_is_made_again_the_same() -> None:
    """A crash between the amendment's close decision and its write: the replay re-reads
    the first revision's records (replays) and the late ones, and closes revision 1 at
    the decided offset, with the same outputs."""
    s = sample("openai/text_usage.sse")
    prefix = 3
    original, first, amended = _quiet_then_rest(s, prefix)
    assert first.amendable is not None
    replay = Run()
    pending = Closed.from_marker(amended.closed.marker(), applied=False)
    assert pending.revision == 1
    replay.processor.closed_earlier(s.ref, pending)
    replay.processor.amendable_fetched(s.ref, Amendable.decode(first.amendable))
    replay.send_all(s)  # from the committed offset: the first revision's records too
    (again,) = replay.completed(s.request_id)
    assert replay.encoded()["billing"] == original.encoded()["billing"][1:]
    assert again.closed == amended.closed
    assert replay.processor.counters.replayed == prefix


def test_the_amendable_state_round_trips_and_refuses_garbage() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s, [0, 1, 2])
    (first,) = run.expire().completed
    assert first.amendable is not None
    kept = Amendable.decode(first.amendable)
    assert kept.revision == 0
    assert kept.closed_offset == 2
    assert kept.bill == first.billing
    assert kept.records == tuple(KeptRecord(i, i, s.records[i]) for i in range(3))
    assert Amendable.decode(kept.encode()) == kept
    with pytest.raises(InputError, match="does not decompress"):
        Amendable.decode(b"not zlib")
    with pytest.raises(InputError, match="unknown format"):
        Amendable.decode(zlib.compress(b"something else"))
    with pytest.raises(InputError, match="truncated"):
        Amendable.decode(zlib.compress(zlib.decompress(first.amendable)[:-5]))


def test_a_keepalive_after_the_timeout_amends_nothing() -> None:
    s = sample("openai/text_usage.sse")
    run = Run()
    run.send_all(s, [0, 1, 2])
    (first,) = run.expire().completed
    assert first.closed.reason is CloseReason.TIMEOUT
    alive = RawSseEvent.keepalive(
        request_id=s.request_id,
        seq=3,
        source=s.source,
        tenant=s.tenant,
        received_at=s.received_at(3),
    )
    out = run.feed(s.source, avro.encode_raw_sse_event(alive), 3, key=s.key)
    (dead,) = out.dead_letters
    assert "no billable information, nothing to amend" in dead.reason
    assert not run.processor.is_open(s.ref)
    # The rest of the stream still amends it.
    run.send_all(s, list(range(3, len(s.records))), first=4)
    assert [d.billing.revision for d in run.completed(s.request_id)] == [0, 1]
    assert run.completed(s.request_id)[1].tokens == s.expected()


def test_the_states_kept_in_memory_are_bounded_and_the_oldest_is_asked_of_the_store() -> None:
    a, b = sample("openai/text_usage.sse", request_id="a"), sample("openai/text_usage.sse")
    run = Run()
    run.processor.amendable_memory_bytes = 1  # room for the latest state only
    run.send_all(a, [0, 1, 2])
    run.send_all(b, [0, 1, 2], first=3)
    (first_a, _) = run.expire().completed
    record = run.processor.examine_sse(a.key, a.records[3])
    assert not isinstance(record, Refused)
    late = _Raw(record, position(a.topic, 6), a.key, a.records[3], a.ref)
    assert run.processor.amendable_to_fetch([late]) == {a.ref}  # evicted: the store is asked
    assert first_a.amendable is not None
    run.processor.amendable_fetched(a.ref, Amendable.decode(first_a.amendable))
    run.send_all(a, list(range(3, len(a.records))), first=6)
    assert run.completed("a")[-1].tokens == a.expected()


def test_the_audit_keeps_every_state_it_makes() -> None:
    from streamtally.audit._run import replay_processor
    from streamtally.settings import Settings

    processor = replay_processor(Settings(), PriceTable.default())
    assert processor.amendable_memory_bytes > 1 << 60


def test_a_request_timed_out_after_its_first_event_alone_is_billed_under_its_model() -> None:
    """OpenAI's first event (the role chunk) names the model and has no content: a request
    closed at its timeout with it alone is billed under that model, priced, not under
    ``unknown``; so its amendment stays in that model's usage row (moving it from an
    ``unknown`` row left one with 0 requests)."""
    s = sample("openai/long_text_bench.sse")
    run, first, amended = _quiet_then_rest(s, 1)
    model = s.expected().model
    assert model is not None
    assert (first.tokens.model, first.billing.model, first.billing.priced) == (model, model, True)
    assert first.tokens.error == TIMED_OUT
    assert amended.supersedes == first.billing
    assert amended.billing.model == amended.supersedes.model == model
    assert run.processor.counters.unpriced == 0
