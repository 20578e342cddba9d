"""JSON edge cases: what the event parser accepts or refuses, pinned as observable behaviour.

Every event goes through one parse: orjson first, and only for what orjson
refuses, Python's `json` (which also accepts `NaN`/`Infinity` literals and
other encodings of engine lines), with a lone surrogate refused either way.
A faster parser must keep every answer here: the value an event folds to, or
the `InvalidEvent` (the dead-letter reason) it raises.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest

from streamtally.core.adapters.base import event_object, load_json
from streamtally.core.models import Source, Tokens
from streamtally.core.normalize import Normalizer, fold_stream, read_events
from streamtally.core.sse import SseEvent
from streamtally.errors import InvalidEvent


def chat_chunk(delta: str = '{"content":"hi"}', *, usage: str = "", extra: str = "") -> str:
    """The data of one OpenAI chat chunk, written by hand (so any JSON text can go in it)."""
    tail = f',"usage":{usage}' if usage else ""
    return (
        '{"id":"c1","model":"m","choices":[{"index":0,"delta":'
        + delta
        + ',"finish_reason":"stop"}]'
        + tail
        + extra
        + "}"
    )


def fold_chat(data: str) -> Tokens:
    return fold_stream(Source.OPENAI, [SseEvent(data)], "r")


def feed_chat(data: str) -> None:
    Normalizer(Source.OPENAI, "r").feed(SseEvent(data))


# --- values the JSON layer gives -------------------------------------------------------------


def test_a_duplicate_key_keeps_its_last_value() -> None:
    assert event_object('{"a": 1, "a": 2}', "x") == {"a": 2}
    tokens = fold_chat(chat_chunk('{"content":"first","content":"last"}'))
    assert tokens.text == "last"


def test_a_duplicate_key_in_usage_keeps_its_last_count() -> None:
    usage = '{"prompt_tokens":1,"prompt_tokens":7,"completion_tokens":2}'
    assert fold_chat(chat_chunk(usage=usage)).usage.input_tokens == 7


def test_integers_up_to_64_bits_stay_exact_integers() -> None:
    assert event_object('{"a": 18446744073709551615, "b": -9223372036854775808}', "x") == {
        "a": 2**64 - 1,
        "b": -(2**63),
    }
    value = event_object('{"a": 9223372036854775807}', "x")
    assert value is not None
    assert type(value["a"]) is int


def test_an_integer_beyond_64_bits_is_a_float() -> None:
    value = event_object('{"a": 123456789012345678901234567890}', "x")
    assert value == {"a": 1.2345678901234568e29}
    assert type(value["a"]) is float


def test_a_count_beyond_a_long_is_refused() -> None:
    usage = '{"prompt_tokens":9223372036854775808,"completion_tokens":1}'
    with pytest.raises(InvalidEvent, match="beyond a 64-bit count: 9223372036854775808"):
        feed_chat(chat_chunk(usage=usage))


def test_a_count_beyond_64_bits_is_no_integer() -> None:
    usage = '{"prompt_tokens":123456789012345678901234567890}'
    with pytest.raises(InvalidEvent, match=r"not a non-negative integer: 1\.234567890123\d*e\+29"):
        feed_chat(chat_chunk(usage=usage))


@pytest.mark.parametrize(
    ("literal", "check"),
    [
        ("NaN", math.isnan),
        ("Infinity", lambda v: v == math.inf),
        ("-Infinity", lambda v: v == -math.inf),
        ("1e999", lambda v: v == math.inf),
    ],
)
def test_nan_and_infinity_literals_are_numbers(literal: str, check: Any) -> None:
    value = event_object('{"a": ' + literal + "}", "x")
    assert value is not None
    assert check(value["a"])


def test_nan_in_a_field_nobody_reads_leaves_the_event_valid() -> None:
    tokens = fold_chat(chat_chunk(extra=',"x_score":NaN'))
    assert tokens.text == "hi"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_as_a_count_is_refused(literal: str) -> None:
    with pytest.raises(InvalidEvent, match="usage field prompt is not a non-negative integer"):
        feed_chat(chat_chunk(usage='{"prompt_tokens":' + literal + "}"))


def test_numbers_keep_their_json_type() -> None:
    assert event_object('{"a": -0, "b": 1.0, "c": 1E2, "d": 2.5e-3}', "x") == {
        "a": 0,
        "b": 1.0,
        "c": 100.0,
        "d": 0.0025,
    }
    value = event_object('{"a": 1.0}', "x")
    assert value is not None
    assert type(value["a"]) is float


def test_a_float_count_is_refused() -> None:
    with pytest.raises(InvalidEvent, match=r"not a non-negative integer: 5\.0"):
        feed_chat(chat_chunk(usage='{"prompt_tokens":5.0}'))


# --- strings ---------------------------------------------------------------------------------


def test_a_surrogate_pair_escape_is_one_character() -> None:
    assert fold_chat(chat_chunk('{"content":"\\ud83d\\ude00"}')).text == "\U0001f600"


@pytest.mark.parametrize(
    "delta",
    [
        '{"content":"bad \\ud800 here"}',
        '{"content":"\\udc00"}',
        '{"content":"\\ude00\\ud83d"}',
        '{"\\ud800":"key"}',
    ],
    ids=["high", "low", "reversed-pair", "in-a-key"],
)
def test_a_lone_surrogate_escape_makes_the_event_invalid(delta: str) -> None:
    with pytest.raises(InvalidEvent, match="lone surrogate"):
        feed_chat(chat_chunk(delta))


def test_a_lone_surrogate_in_a_field_nobody_reads_still_makes_the_event_invalid() -> None:
    with pytest.raises(InvalidEvent, match="lone surrogate"):
        feed_chat(chat_chunk(extra=',"ignored":["\\udbff"]'))


def test_a_nul_escape_is_text() -> None:
    assert fold_chat(chat_chunk('{"content":"a\\u0000b"}')).text == "a\0b"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ('{"a": "x\ty"}', "Invalid control character"),
        ('{"a": 1} trailing', "Extra data"),
        ('\ufeff{"a": 1}', "Unexpected UTF-8 BOM"),
        ("{'a': 1}", "Expecting property name"),
        ('{"a": 1,}', "Expecting property name|Illegal trailing comma"),  # by Python version
        ('{"a": 01}', "Expecting ','"),
    ],
    ids=["raw-tab", "trailing", "bom", "single-quotes", "trailing-comma", "leading-zero"],
)
def test_text_that_is_not_json_is_refused_with_the_json_reason(data: str, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=f"event data is not valid JSON \\(({reason})"):
        event_object(data, "x")


def test_whitespace_around_the_object_is_json() -> None:
    assert event_object('{"a": 1} \t\r\n', "x") == {"a": 1}


def test_invalid_utf8_in_an_sse_stream_is_replacement_characters() -> None:
    body = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"a\xffb\xc3"}}]}\n\n'
    events = list(read_events(Source.OPENAI, io.BytesIO(body)))
    assert events[0].data.count("\ufffd") == 2
    assert fold_stream(Source.OPENAI, events, "r").text == "a\ufffdb\ufffd"


# --- nesting ---------------------------------------------------------------------------------


def test_moderate_nesting_is_json() -> None:
    nested = "[" * 100 + "]" * 100
    assert fold_chat(chat_chunk(extra=f',"deep":{nested}')).text == "hi"


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_deep_nesting_is_refused_not_a_crash(depth: int) -> None:
    nested = "[" * depth + "]" * depth
    with pytest.raises(InvalidEvent, match="nested too deeply"):
        feed_chat(chat_chunk(extra=f',"deep":{nested}'))


def test_unclosed_deep_nesting_is_refused() -> None:
    with pytest.raises(InvalidEvent, match="not valid JSON"):
        feed_chat('{"a":' * 100_000)


# --- engine lines (bytes, one JSON value per line) ---------------------------------------------


def engine_lines(body: bytes) -> list[Any]:
    return list(read_events(Source.ATOMR, io.BytesIO(body)))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"text_delta": "a\xff"}\n', "'utf-8' codec can't decode byte 0xff"),
        (b'{"text_delta": "\xc0\xaf"}\n', "'utf-8' codec can't decode byte 0xc0"),
        (b'{"text_delta": "\xed\xa0\x80"}\n', "lone surrogate"),
        (b'{"text_delta": "\\ud800"}\n', "lone surrogate"),
        (b'{"a": 1}\r{"b": 2}\n', "Extra data"),
        (b'{"a": 1}\n{"a": \n', "Expecting value"),
    ],
    ids=["invalid-byte", "overlong", "encoded-surrogate", "surrogate-escape", "cr", "truncated"],
)
def test_an_engine_line_that_is_not_json_names_its_line_and_reason(
    body: bytes, reason: str
) -> None:
    with pytest.raises(InvalidEvent, match=r"line \d+ is not JSON: .*" + reason):
        engine_lines(body)


def test_engine_lines_parse_as_json_values() -> None:
    body = (
        b'{"a": 1, "a": 2}\n'
        b"\n   \n"  # blank lines are skipped
        b'\x0b{"nan": NaN}\x0c\r\n'  # ASCII whitespace around a line is stripped
        b"\xef\xbb\xbf[1, 2]\n"  # a UTF-8 BOM opens a line
        b'{"big": 123456789012345678901234567890, "u64": 18446744073709551615}\n'
    )
    values = engine_lines(body)
    assert values[0] == {"a": 2}
    assert math.isnan(values[1]["nan"])
    assert values[2] == [1, 2]
    assert values[3] == {"big": 1.2345678901234568e29, "u64": 2**64 - 1}


def test_an_engine_line_in_utf16_without_a_bom_is_json() -> None:
    # Python's json detects the encoding of bytes: a UTF-16 line with no BOM parses.
    assert engine_lines('{"a": 1}'.encode("utf-16-le") + b"\n") == [{"a": 1}]


def test_an_engine_line_that_is_not_an_object_is_refused_by_the_adapter() -> None:
    with pytest.raises(InvalidEvent, match="must be a JSON object, got list"):
        fold_stream(Source.ATOMR, engine_lines(b"[1, 2]\n"), "r", on_invalid=_raise)


def _raise(number: int, exc: InvalidEvent) -> None:
    del number
    raise exc


# --- load_json directly ----------------------------------------------------------------------


@pytest.mark.parametrize("text", ['{"a": [1, {"b": null}]}', '"s"', "1", "[]", "true"])
def test_load_json_matches_the_standard_library_on_plain_json(text: str) -> None:
    assert load_json(text) == json.loads(text)
    assert load_json(text.encode()) == json.loads(text)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('"\\ud800"', "lone surrogate"),
        ("[" * 5_000 + "]" * 5_000, "nested too deeply"),
        ("{", "Expecting property name"),
        (b"\xff", "can't decode"),
    ],
)
def test_load_json_raises_value_error(text: str | bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        load_json(text)
