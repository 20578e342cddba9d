"""Poison records touch only themselves: dead-lettered with the reason, batch-mates applied.

Each case here took the worker down before (an `AvroEncodeError` or a
`ValueError` raised in the middle of a batch): a lone surrogate in an event's
text, a token count beyond a 64-bit long, a total that passes one, a cost the
billing record cannot carry.  `streamtally fold` skips the same events, since
the rule lives in the shared core.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from streamtally.billing.pricing import PriceTable
from streamtally.core.adapters.usage import RawUsage
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source, Tokens, Usage
from streamtally.core.normalize import fold_stream, read_events
from streamtally.errors import InvalidEvent
from streamtally.processors.requests import Outputs, Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key
from streamtally.wire import avro

TOPIC = Topics.in_namespace().raw_sse.name
T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)


def _event(content: str | None = None, *, finish: str | None = None, usage: str = "") -> bytes:
    delta = "{}" if content is None else '{"content":"' + content + '"}'
    finish_json = "null" if finish is None else f'"{finish}"'
    tail = f',"usage":{usage}' if usage else ""
    return (
        b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","model":"gpt-4o",'
        b'"choices":[{"index":0,"delta":'
        + delta.encode()
        + b',"finish_reason":'
        + finish_json.encode()
        + b"}]"
        + tail.encode()
        + b"}\n\n"
    )


GOOD = (
    _event("Hello")
    + _event(" world")
    + _event(finish="stop", usage='{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}')
    + b"data: [DONE]\n\n"
)
LONE_SURROGATE = _event("ok") + _event("bad \\ud800 here") + _event(finish="stop")
HUGE_COUNT = _event("ok") + _event(
    finish="stop", usage='{"prompt_tokens":9223372036854775808,"completion_tokens":1}'
)


def _clock() -> Callable[[], datetime]:
    n = {"i": 0}

    def now() -> datetime:
        n["i"] += 1
        return T0 + n["i"] * timedelta(milliseconds=10)

    return now


def _records(data: bytes, request_id: str, tenant: str = "acme") -> list[bytes]:
    _, records = raw_records(
        Source.OPENAI, data, tenant=tenant, request_id=request_id, clock=_clock()
    )
    return records


def _run(processor: RequestProcessor, *requests: tuple[str, list[bytes]]) -> Outputs:
    """The requests' records interleaved into ONE batch, as the worker hands it over."""
    out = Outputs()
    offset = 0
    queues = [(rid, list(recs)) for rid, recs in requests]
    while any(recs for _, recs in queues):
        for rid, recs in queues:
            if recs:
                value = recs.pop(0)
                position = Position(TOPIC, 0, offset, 1_790_000_000.0 + offset)
                processor.handle_sse(encode_key(rid), value, position, out)
                offset += 1
    return out


def _expected(data: bytes, request_id: str) -> Tokens:
    events = list(read_events(Source.OPENAI, io.BytesIO(data)))
    return fold_stream(Source.OPENAI, events, request_id=request_id, on_invalid=lambda i, e: None)


def _all_values_decode(out: Outputs) -> None:
    assert len(out.chunk_values) == len(out.chunks) == len(out.chunk_refs)
    for chunk, value, ref in zip(out.chunks, out.chunk_values, out.chunk_refs, strict=True):
        assert avro.decode_chunk(value) == chunk
        assert ref.request_id == chunk.request_id
    for done in out.completed:
        assert avro.decode_tokens(done.tokens_value) == done.tokens
        assert avro.decode_billing_event(done.billing_value) == done.billing


@pytest.mark.parametrize(
    ("poison", "reason"),
    [(LONE_SURROGATE, "lone surrogate"), (HUGE_COUNT, "beyond a 64-bit count")],
    ids=["lone-surrogate", "count-beyond-int64"],
)
def test_a_poison_event_is_dead_lettered_and_its_batch_mates_applied(
    poison: bytes, reason: str
) -> None:
    processor = RequestProcessor(PriceTable.default())
    out = _run(
        processor,
        ("good-1", _records(GOOD, "good-1")),
        ("poison-1", _records(poison, "poison-1")),
        ("good-2", _records(GOOD, "good-2", tenant="other")),
        # the same request id of another tenant is another request, and a good one
        ("poison-1", _records(GOOD, "poison-1", tenant="other")),
    )
    done = {c.ref: c for c in out.completed}
    good = [RequestRef("acme", "good-1"), RequestRef("other", "good-2")]
    poisoned, namesake = RequestRef("acme", "poison-1"), RequestRef("other", "poison-1")
    assert set(done) == {*good, poisoned, namesake}
    for ref in (*good, namesake):
        assert done[ref].tokens == _expected(GOOD, ref.request_id), ref
    # the poison request closes with what it had; its bad event is dead-lettered, alone
    assert [d.request_id for d in out.dead_letters] == ["poison-1"]
    assert reason in out.dead_letters[0].reason
    assert done[poisoned].tokens == _expected(poison, "poison-1")
    _all_values_decode(out)
    c = processor.counters
    assert c.received == c.applied + c.duplicates + c.dead_lettered + c.replayed


def test_fold_skips_the_same_events_the_processors_dead_letter() -> None:
    skipped: list[str] = []
    events = list(read_events(Source.OPENAI, io.BytesIO(LONE_SURROGATE + HUGE_COUNT)))
    fold_stream(
        Source.OPENAI,
        events,
        request_id="x",
        on_invalid=lambda i, exc: skipped.append(str(exc)),
    )
    assert len(skipped) == 2
    assert "lone surrogate" in skipped[0]
    assert "beyond a 64-bit count" in skipped[1]


def test_a_usage_total_beyond_a_long_is_refused_and_changes_nothing() -> None:
    def anthropic_like(raw: Mapping[str, int]) -> Usage:
        return Usage(input_tokens=raw.get("input", 0) + raw.get("cache_read", 0))

    usage = RawUsage(anthropic_like)
    assert usage.report({"input": 10}).input_tokens == 10
    with pytest.raises(InvalidEvent, match="beyond a 64-bit count"):
        usage.report({"input": 2**62, "cache_read": 2**62})
    assert usage.raw() == {"input": 10}  # the running total stays what it was
    assert usage.report({"input": 11}).input_tokens == 11


def test_a_cost_the_billing_record_cannot_carry_is_billed_unpriced() -> None:
    table = PriceTable.from_dict(
        {
            "version": "huge",
            "currency": "USD",
            "unit": 1,
            "models": {"gpt-4o": {"input": "9" * 30, "cached_input": "0", "output": "9" * 30}},
        }
    )
    processor = RequestProcessor(table)
    out = _run(
        processor,
        ("costly", _records(GOOD, "costly")),
        ("next", _records(GOOD, "next")),
    )
    assert [c.ref for c in out.completed] == [
        RequestRef("acme", "costly"),
        RequestRef("acme", "next"),
    ]
    for done in out.completed:
        assert done.billing.cost == Decimal(0)
        assert done.billing.input_tokens == 5  # usage is billed in full, only unpriced
    assert processor.counters.unpriced == 2
    _all_values_decode(out)


def test_an_output_that_cannot_be_encoded_dead_letters_its_record_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defence in depth: whatever the core let through, the encoder's refusal is per record."""
    real = avro.encode_chunk

    def refuse_world(chunk: object) -> bytes:
        if getattr(chunk, "text_delta", "") == " world":
            raise avro.AvroEncodeError("this chunk cannot be encoded")
        return real(chunk)  # type: ignore[arg-type]

    monkeypatch.setattr(avro, "encode_chunk", refuse_world)
    processor = RequestProcessor(PriceTable.default())
    out = _run(processor, ("a", _records(GOOD, "a")), ("b", _records(GOOD, "b")))
    assert sorted(d.request_id or "" for d in out.dead_letters) == ["a", "b"]
    assert all("cannot be encoded" in d.reason for d in out.dead_letters)
    assert [c.tokens.text for c in out.completed] == ["Hello", "Hello"]
    assert " world" not in [c.text_delta for c in out.chunks]
