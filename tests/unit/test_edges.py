"""What is refused at the edge, before it can touch a request: keyless records, tombstones,
and an end marker that would close a request with no events.

Before: a keyless record was applied but committed before its request closed
(the commit gate keys on the Kafka key), so a restart lost it; a tombstone
was dropped without being counted (in != applied + dead-lettered); a lone END
made a phantom 0-cost request, billed and counted in a usage row.
"""

from __future__ import annotations

from streamtally.core.models import Source
from streamtally.core.pricing import PriceTable
from streamtally.processors.requests import Counters, Outputs, Position, RequestProcessor
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
    assert not processor.is_open("r-1")
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
