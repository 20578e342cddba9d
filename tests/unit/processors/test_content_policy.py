"""The content policy (STREAMTALLY_CONTENT): exact markers, records rewritten, billing untouched.

`streamtally.core.content` replaces every non-empty content string by
``st-redacted:v1:<bytes>:<HMAC-SHA256 hex>`` (redacted) or
``st-removed:v1:<bytes>`` (none); ``full`` returns its input itself.  The
processor applies it to what it writes (Tokens, chunks, dead letters) and
bills from the fold, so billing is the same under every policy.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime
from pathlib import Path

import pytest

from streamtally.billing.pricing import PriceTable
from streamtally.core.content import FULL, Content, ContentPolicy, marked_size
from streamtally.core.models import (
    ChoiceTokens,
    Chunk,
    FinishReason,
    Source,
    Tokens,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from streamtally.errors import InputError
from streamtally.processors.content import content_policy
from streamtally.processors.requests import Outputs, Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire import avro

KEY = bytes(range(32))
REDACTED = ContentPolicy(Content.REDACTED, KEY)
NONE = ContentPolicy(Content.NONE)
T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
SAMPLES = Path(__file__).resolve().parents[3] / "samples"
TOPIC = Topics.in_namespace().raw_sse.name


def _hmac(text: str) -> str:
    return hmac.new(KEY, text.encode(), hashlib.sha256).hexdigest()


# -- one value ---------------------------------------------------------------------------


def test_redacted_text_is_its_utf8_length_and_hmac_under_the_key() -> None:
    assert REDACTED.text("héllo") == f"st-redacted:v1:6:{_hmac('héllo')}"
    # pinned: the documented form, HMAC-SHA256 of the UTF-8 bytes under bytes 0..31
    assert REDACTED.text("héllo") == (
        "st-redacted:v1:6:255e6588f0efdf787b9813244fb77523ea49a0effd5b814054d445fcf2c84875"
    )
    other_key = ContentPolicy(Content.REDACTED, bytes(range(1, 33)))
    assert other_key.text("héllo") != REDACTED.text("héllo")


def test_removed_text_is_its_utf8_length_only() -> None:
    assert NONE.text("héllo") == "st-removed:v1:6"
    assert NONE.text("a" * 1000) == "st-removed:v1:1000"


def test_empty_stays_empty_and_full_returns_the_value_itself() -> None:
    assert REDACTED.text("") == ""
    assert NONE.data(b"") == b""
    text = "kept as it is"
    assert FULL.text(text) is text
    data = b"\xc3\x01raw"
    assert FULL.data(data) is data


def test_bytes_are_marked_as_ascii_bytes() -> None:
    raw = b"\xc3\x01\x00binary"
    digest = hmac.new(KEY, raw, hashlib.sha256).hexdigest()
    assert REDACTED.data(raw) == f"st-redacted:v1:{len(raw)}:{digest}".encode()
    assert NONE.data(raw) == b"st-removed:v1:9"


def test_a_lone_surrogate_raises_as_encoding_it_would() -> None:
    with pytest.raises(UnicodeEncodeError):
        NONE.text("bad \ud800")


def test_marked_size_reads_a_marker_back_and_nothing_else() -> None:
    assert marked_size(REDACTED.text("héllo")) == 6
    assert marked_size(NONE.data(b"x" * 4096)) == 4096
    assert marked_size("st-removed:v1:12 and more") is None
    assert marked_size("st-redacted:v1:6:abc") is None
    assert marked_size(b"\xc3\x01st-removed:v1:3") is None
    assert marked_size("plain text") is None


def test_redacted_needs_a_key_of_32_bytes() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        ContentPolicy(Content.REDACTED, b"short")
    assert repr(REDACTED) == "ContentPolicy(content=<Content.REDACTED: 'redacted'>)"


def test_quoted_values_of_a_reason_are_replaced_and_the_prose_kept() -> None:
    reason = "choice index is not a non-negative integer: 'zebra quartz 7741'"
    assert NONE.reason(reason) == "choice index is not a non-negative integer: 'st-removed:v1:17'"
    quoted = "it's done"
    assert REDACTED.reason(f"unknown finish_reason: {quoted!r}") == (
        f"unknown finish_reason: 'st-redacted:v1:9:{_hmac(quoted)}'"
    )
    # an apostrophe inside a word is not a quote; a bytes literal is one
    assert NONE.reason("key b'k-1' is not the record's request id 'abc'") == (
        "key 'st-removed:v1:3' is not the record's request id 'st-removed:v1:3'"
    )
    assert NONE.reason("line 3 is not JSON: unexpected character") == (
        "line 3 is not JSON: unexpected character"
    )
    assert FULL.reason(reason) is reason


# -- records -----------------------------------------------------------------------------


def _tokens() -> Tokens:
    call = ToolCall(index=0, id="call_1", name="lookup", arguments='{"q":"secret"}')
    choice = ChoiceTokens(
        index=1,
        text="second answer",
        reasoning="",
        tool_calls=(),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
    )
    return Tokens(
        request_id="r-1",
        source=Source.OPENAI,
        model="gpt-4o",
        text="first answer",
        reasoning="because",
        tool_calls=(call,),
        usage=Usage(input_tokens=10, output_tokens=4),
        finish_reason=FinishReason.TOOL_CALLS,
        finish_reason_raw="tool_calls",
        error="upstream said: overloaded",
        chunks=5,
        choices=(choice,),
    )


def test_tokens_keep_everything_but_their_content() -> None:
    tokens = _tokens()
    removed = NONE.tokens(tokens)
    assert removed.model_dump() == {
        **tokens.model_dump(),
        "text": "st-removed:v1:12",
        "reasoning": "st-removed:v1:7",
        "tool_calls": (
            {"index": 0, "id": "call_1", "name": "lookup", "arguments": "st-removed:v1:14"},
        ),
        "choices": (
            {
                "index": 1,
                "text": "st-removed:v1:13",
                "reasoning": "",
                "tool_calls": (),
                "finish_reason": FinishReason.STOP,
                "finish_reason_raw": "stop",
            },
        ),
    }
    redacted = REDACTED.tokens(tokens)
    assert redacted.text == f"st-redacted:v1:12:{_hmac('first answer')}"
    arguments = '{"q":"secret"}'
    assert redacted.tool_calls[0].arguments == f"st-redacted:v1:14:{_hmac(arguments)}"
    assert redacted.choices[0].text == f"st-redacted:v1:13:{_hmac('second answer')}"
    assert redacted.usage == tokens.usage
    assert redacted.error == tokens.error
    assert FULL.tokens(tokens) is tokens
    # still a valid Tokens record of its topic
    assert avro.decode_tokens(avro.encode_tokens(redacted)) == redacted


def test_a_chunk_loses_its_deltas_only_and_a_contentless_one_is_not_copied() -> None:
    chunk = Chunk(
        request_id="r-1",
        seq=3,
        source=Source.OPENAI,
        model="gpt-4o",
        text_delta="Hi",
        reasoning_delta="hmm",
        tool_call_deltas=(ToolCallDelta(index=0, id="c1", name="f", arguments_delta='{"a"'),),
        usage=Usage(output_tokens=2),
        event_time=T0,
    )
    assert NONE.chunk(chunk).model_dump() == {
        **chunk.model_dump(),
        "text_delta": "st-removed:v1:2",
        "reasoning_delta": "st-removed:v1:3",
        "tool_call_deltas": (
            {"index": 0, "id": "c1", "name": "f", "arguments_delta": "st-removed:v1:4"},
        ),
    }
    usage_only = Chunk(
        request_id="r-1", seq=4, source=Source.OPENAI, usage=Usage(output_tokens=2), event_time=T0
    )
    assert NONE.chunk(usage_only) is usage_only
    assert FULL.chunk(chunk) is chunk


# -- the processor -----------------------------------------------------------------------


def _run(policy: ContentPolicy, *, chunks_topic: bool = True) -> Outputs:
    """A sample with text and tool calls, then a late copy of its first record (dead letter)."""
    processor = RequestProcessor(PriceTable.default())
    processor.content = policy
    processor.chunks_topic = chunks_topic
    data = (SAMPLES / "openai" / "parallel_tool_calls_cached.sse").read_bytes()
    _, records = raw_records(Source.OPENAI, data, tenant="acme", request_id="r-1", clock=lambda: T0)
    out = Outputs()
    for offset, value in enumerate([*records, records[0]]):
        processor.handle_sse(b"r-1", value, Position(TOPIC, 0, offset, 1_790_000_000.0), out)
    return out


def test_billing_is_identical_under_every_policy_and_only_the_stored_text_differs() -> None:
    full, removed, redacted = _run(FULL), _run(NONE), _run(REDACTED)
    (done_full,), (done_none,), (done_red,) = full.completed, removed.completed, redacted.completed
    assert done_none.billing == done_full.billing == done_red.billing
    assert done_none.billing_value == done_full.billing_value == done_red.billing_value
    assert done_none.tokens == NONE.tokens(done_full.tokens)
    assert done_red.tokens == REDACTED.tokens(done_full.tokens)
    assert avro.decode_tokens(done_none.tokens_value) == done_none.tokens
    assert done_full.tokens.tool_calls  # the sample has tool arguments to remove
    assert [avro.decode_chunk(v) for v in removed.chunk_values] == [
        NONE.chunk(c) for c in full.chunks
    ]
    (late_full,), (late_none,) = full.dead_letters, removed.dead_letters
    assert late_none.reason == late_full.reason  # the processor's own words, kept
    assert late_none.value == f"st-removed:v1:{len(late_full.value)}".encode()
    assert late_none.key == late_full.key == b"r-1"


def test_with_the_chunks_topic_off_no_chunk_is_written_and_the_rest_is_the_same() -> None:
    on, off = _run(NONE), _run(NONE, chunks_topic=False)
    assert on.chunks
    assert (off.chunks, off.chunk_values, off.chunk_refs) == ([], [], [])
    assert [d.tokens_value for d in off.completed] == [d.tokens_value for d in on.completed]
    assert [d.billing_value for d in off.completed] == [d.billing_value for d in on.completed]


def test_a_reason_quoting_the_event_is_scrubbed_in_the_dead_letter() -> None:
    bad = (
        b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o",'
        b'"choices":[{"index":"zebra quartz","delta":{"content":"x"}}]}\n\n'
    )
    _, records = raw_records(Source.OPENAI, bad, tenant="acme", request_id="r-2", clock=lambda: T0)
    letters = []
    for policy in (FULL, NONE):
        processor = RequestProcessor(PriceTable.default())
        processor.content = policy
        out = processor.handle_sse(b"r-2", records[0], Position(TOPIC, 0, 0, 1_790_000_000.0))
        letters.append(out.dead_letters[0])
    assert "zebra quartz" in letters[0].reason
    assert letters[1].reason == NONE.reason(letters[0].reason)
    assert "zebra quartz" not in letters[1].reason
    assert "st-removed:v1:12" in letters[1].reason
    assert letters[1].error_type == letters[0].error_type


# -- settings and the key file -----------------------------------------------------------


def test_settings_read_the_policy_the_key_and_the_chunks_switch(tmp_path: Path) -> None:
    default = Settings.load({})
    assert (default.content, default.content_key_path, default.chunks_topic) == ("full", None, True)
    key = tmp_path / "content.key"
    settings = Settings.load(
        {
            "STREAMTALLY_CONTENT": "redacted",
            "STREAMTALLY_CONTENT_KEY": str(key),
            "STREAMTALLY_CHUNKS": "off",
        }
    )
    assert (settings.content, settings.content_key_path, settings.chunks_topic) == (
        "redacted",
        key,
        False,
    )
    assert Settings.load({"STREAMTALLY_CHUNKS": "on"}).chunks_topic


def test_a_bad_policy_or_redacted_without_a_key_is_one_clear_error() -> None:
    with pytest.raises(InputError, match="STREAMTALLY_CONTENT='secret'"):
        Settings.load({"STREAMTALLY_CONTENT": "secret"})
    with pytest.raises(InputError, match="redacted needs STREAMTALLY_CONTENT_KEY"):
        Settings.load({"STREAMTALLY_CONTENT": "redacted"})
    with pytest.raises(InputError, match="STREAMTALLY_CHUNKS"):
        Settings.load({"STREAMTALLY_CHUNKS": "sometimes"})


def test_the_key_file_holds_hex_or_base64_and_is_never_quoted(tmp_path: Path) -> None:
    path = tmp_path / "content.key"
    path.write_text(KEY.hex() + "\n")
    settings = Settings(content="redacted", content_key_path=path)
    assert content_policy(settings) == REDACTED
    path.write_text(base64.b64encode(KEY).decode())
    assert content_policy(settings) == REDACTED
    assert content_policy(Settings(content="none", content_key_path=path)) == NONE
    assert content_policy(Settings()) == FULL
    short = "ab" * 16 + "cd" * 8
    path.write_text(short)
    with pytest.raises(InputError) as refused:
        content_policy(settings)
    assert "fewer than 32" in str(refused.value)
    assert short not in str(refused.value)
    with pytest.raises(InputError, match="cannot read the content key file"):
        content_policy(Settings(content="redacted", content_key_path=tmp_path / "missing"))


def test_a_chunk_is_capped_to_a_prefix_of_whole_characters() -> None:
    from streamtally.core.content import capped_chunk
    from streamtally.core.models import ToolCallDelta

    at = datetime(2026, 3, 1, tzinfo=UTC)
    chunk = Chunk(
        request_id="r",
        seq=0,
        source=Source.OPENAI,
        text_delta="€" * 5,  # 15 bytes
        reasoning_delta="ab",
        tool_call_deltas=(ToolCallDelta(index=0, arguments_delta="xyz"),),
        event_time=at,
    )
    assert capped_chunk(chunk, 100) is chunk
    assert capped_chunk(chunk, 20) is chunk  # 15 + 2 + 3 bytes: fits exactly
    cut = capped_chunk(chunk, 19)
    assert (cut.text_delta, cut.reasoning_delta) == ("€" * 5, "ab")
    assert cut.tool_call_deltas[0].arguments_delta == "xy"
    cut = capped_chunk(chunk, 8)
    assert (cut.text_delta, cut.reasoning_delta, cut.tool_call_deltas[0].arguments_delta) == (
        "€€",
        "ab",
        "",
    )
    assert cut.model_dump(exclude={"text_delta", "reasoning_delta", "tool_call_deltas"}) == (
        chunk.model_dump(exclude={"text_delta", "reasoning_delta", "tool_call_deltas"})
    )
