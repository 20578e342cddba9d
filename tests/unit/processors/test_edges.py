"""What is refused at the edge, before it can touch a request: keyless records, tombstones,
and an end marker that would close a request with no events.

Before: a keyless record was applied but committed before its request closed
(the commit gate keys on the Kafka key), so a restart lost it; a tombstone
was dropped without being counted (in != applied + dead-lettered); a lone END
made a phantom 0-cost request, billed and counted in a usage row.
"""

from __future__ import annotations

from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.processors.requests import Counters, Limits, Outputs, Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key

TOPIC = Topics.in_namespace().raw_sse.name
STREAM = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,'
    b'"completion_tokens":1}}\n\n'
)


def _records(request_id: str, tenant: str = "acme") -> list[bytes]:
    return raw_records(Source.OPENAI, STREAM, tenant=tenant, request_id=request_id)[1]


def _at(offset: int) -> Position:
    return Position(TOPIC, 0, offset, 1_790_000_000.0 + offset)


def _reconciles(c: Counters) -> bool:
    return c.received == c.applied + c.duplicates + c.dead_lettered + c.replayed


def test_a_keyless_record_is_dead_lettered_and_opens_nothing() -> None:
    processor = RequestProcessor(PriceTable.default())
    out = processor.handle_sse(None, _records("r-1")[0], _at(0))
    (letter,) = out.dead_letters
    assert letter.reason == "record has no key: a raw record is keyed by its request id"
    assert letter.key is None
    assert not processor.is_open(RequestRef("acme", "r-1"))
    assert processor.open_requests == 0
    assert _reconciles(processor.counters)


def test_a_tombstone_is_dead_lettered_and_counted() -> None:
    processor = RequestProcessor(PriceTable.default())
    out = processor.handle_sse(b"r-1", None, _at(0))
    (letter,) = out.dead_letters
    assert "tombstone" in letter.reason
    assert letter.value == b""
    assert processor.counters.dead_lettered == 1
    assert _reconciles(processor.counters)


def test_a_lone_end_bills_nothing_and_the_real_request_still_counts() -> None:
    processor = RequestProcessor(PriceTable.default())
    lone = raw_records(Source.OPENAI, b"", tenant="mallory", request_id="victim-1")[1]
    assert len(lone) == 1  # the end marker alone, seq 0
    attacker_end = lone[0]
    out = processor.handle_sse(encode_key("victim-1"), attacker_end, _at(0))
    assert out.completed == []  # no Tokens, no billing event, no usage row
    (letter,) = out.dead_letters
    assert "has no events" in letter.reason
    # the victim's own request, arriving after, is billed to the victim in full
    done = Outputs()
    for i, value in enumerate(_records("victim-1", tenant="acme"), start=1):
        processor.handle_sse(encode_key("victim-1"), value, _at(i), done)
    (completed,) = done.completed
    assert completed.billing.tenant == "acme"
    assert completed.billing.input_tokens == 3
    assert _reconciles(processor.counters)


# --------------------------------------------------------------------------- limits


def _open(processor: RequestProcessor, request_id: str, tenant: str, offset: int) -> Outputs:
    first = _records(request_id, tenant=tenant)[0]
    return processor.handle_sse(encode_key(request_id), first, _at(offset))


def test_open_requests_past_the_limits_are_refused_with_the_reason() -> None:
    processor = RequestProcessor(
        PriceTable.default(), limits=Limits(open_requests=3, open_per_tenant=2)
    )
    assert _open(processor, "a-1", "acme", 0).dead_letters == []
    assert _open(processor, "a-2", "acme", 1).dead_letters == []
    (letter,) = _open(processor, "a-3", "acme", 2).dead_letters  # acme has 2 open
    assert "STREAMTALLY_MAX_OPEN_PER_TENANT=2" in letter.reason
    assert _open(processor, "g-1", "globex", 3).dead_letters == []  # another tenant may
    (letter,) = _open(processor, "g-2", "globex", 4).dead_letters  # the worker holds 3
    assert "STREAMTALLY_MAX_OPEN_REQUESTS=3" in letter.reason
    # a closed request frees its slot
    end = _records("a-1", tenant="acme")[-1]
    assert processor.handle_sse(b"a-1", end, _at(5)).completed
    assert _open(processor, "a-4", "acme", 6).dead_letters == []
    assert _reconciles(processor.counters)


def test_a_request_past_its_record_limit_closes_there_with_what_it_had() -> None:
    long_stream = STREAM.replace(b'"finish_reason":"stop"', b'"finish_reason":null') * 5
    records = raw_records(Source.OPENAI, long_stream, tenant="acme", request_id="r")[1]
    processor = RequestProcessor(PriceTable.default(), limits=Limits(records_per_request=3))
    out = Outputs()
    for offset, value in enumerate(records):
        processor.handle_sse(b"r", value, _at(offset), out)
    # closed at the record past the limit, with what it had; what follows is late
    first, *late = out.dead_letters
    assert "STREAMTALLY_MAX_RECORDS_PER_REQUEST=3" in first.reason
    assert [d.offset for d in late] == [4, 5]
    assert all("already closed" in d.reason for d in late)
    (done,) = out.completed
    assert done.tokens.text == "HiHiHi"
    assert done.tokens.error == "request closed at its record limit (3 records)"
    assert done.closed.offset == 3
    assert _reconciles(processor.counters)
