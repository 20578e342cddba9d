"""One request keeps at most `max_text_bytes` of text: a prefix, marked, with its usage in full.

Before, nothing capped what one request buffered: endless deltas grew a
worker to gigabytes, and a Tokens over 8 MiB could never be written to its
topic (retried forever).
"""

from __future__ import annotations

from datetime import UTC, datetime

from streamtally.billing.pricing import PriceTable
from streamtally.core.fold import Fold
from streamtally.core.identity import RequestRef
from streamtally.core.models import Chunk, Source, ToolCallDelta, Usage
from streamtally.processors.limits import Limits
from streamtally.processors.requests import Outputs, Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics
from streamtally.wire import avro

WHEN = datetime(2026, 11, 24, tzinfo=UTC)


def _chunk(seq: int, **fields: object) -> Chunk:
    return Chunk(request_id="r", seq=seq, source=Source.OPENAI, event_time=WHEN, **fields)


def test_text_past_the_limit_is_cut_to_a_marked_prefix_and_usage_stays_whole() -> None:
    acc = Fold("r", Source.OPENAI, max_text_bytes=10)
    acc.add(_chunk(0, reasoning_delta="think"))  # 5 bytes
    acc.add(_chunk(1, text_delta="héllo"))  # 6 bytes, 5 of room left
    acc.add(_chunk(2, text_delta=" more"))
    acc.add(_chunk(3, usage=Usage(input_tokens=7, output_tokens=900)))
    tokens = acc.result()
    assert tokens.reasoning == "think"
    assert tokens.text == "héll"  # 1 + 2 + 1 + 1 bytes
    assert len((tokens.reasoning + tokens.text).encode()) <= 10
    assert tokens.truncated
    assert tokens.usage == Usage(input_tokens=7, output_tokens=900)
    assert tokens.to_json_dict()["truncated"] is True
    assert avro.decode_tokens(avro.encode_tokens(tokens)) == tokens


def test_a_prefix_never_splits_a_character() -> None:
    acc = Fold("r", Source.OPENAI, max_text_bytes=5)
    acc.add(_chunk(0, text_delta="ab𝄞c"))  # 𝄞 is 4 bytes: "ab" + it would be 6
    assert acc.result().text == "ab"


def test_tool_arguments_count_too() -> None:
    acc = Fold("r", Source.OPENAI, max_text_bytes=4)
    acc.add(
        _chunk(0, tool_call_deltas=(ToolCallDelta(index=0, name="f", arguments_delta='{"a":1}'),))
    )
    tokens = acc.result()
    assert tokens.tool_calls[0].arguments == '{"a"'
    assert tokens.truncated


def test_under_the_limit_nothing_changes_and_the_json_has_no_new_key() -> None:
    acc = Fold("r", Source.OPENAI, max_text_bytes=100)
    acc.add(_chunk(0, text_delta="short"))
    tokens = acc.result()
    assert not tokens.truncated
    assert "truncated" not in tokens.to_json_dict()


def test_endless_deltas_to_one_request_keep_its_memory_bounded() -> None:
    delta = (
        b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":'
        b'[{"index":0,"delta":{"content":"' + b"x" * 1000 + b'"},"finish_reason":null}]}\n\n'
    )
    _, records = raw_records(Source.OPENAI, delta * 2000, tenant="acme", request_id="r")
    processor = RequestProcessor(PriceTable.default(), limits=Limits(text_bytes=64 << 10))
    topic = Topics.in_namespace().raw_sse.name
    out = Outputs()
    for offset, value in enumerate(records):  # 2 MB of text, then the end marker
        processor.handle_sse(b"r", value, Position(topic, 0, offset, 1.79e9 + offset), out)
        if offset == 1500:
            state = processor.table.open[RequestRef("acme", "r")]
            kept = sum(len(t) for c in state.fold._choices.values() for t in c.text)
            assert kept <= 64 << 10  # the open request holds the prefix only
    (done,) = out.completed
    assert done.tokens.truncated
    assert len(done.tokens.text) == 64 << 10
    assert done.tokens.chunks == 2000  # every chunk still counted and sent


def test_the_fold_and_the_worker_default_to_the_same_limit() -> None:
    from streamtally.core.fold import MAX_TEXT_BYTES
    from streamtally.settings import Settings

    assert Limits().text_bytes == Settings().max_text_bytes == MAX_TEXT_BYTES
