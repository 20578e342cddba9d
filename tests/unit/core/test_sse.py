"""The incremental SSE decoder against the WHATWG event-stream rules (contract "SSE decoding").

The conformance vectors are in `test_sse_conformance.py`; this file has the
decoder's own API: reads, the end of input, the side channel, linear time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from itertools import pairwise

import pytest

from streamtally.core import sse_event
from streamtally.core.sse import NOT_A_FIELD, SseDecoder, SseEvent, iter_events


def decode(reads: Iterable[bytes]) -> list[SseEvent]:
    """Feed every read to one decoder, then close it."""
    decoder = SseDecoder()
    out: list[SseEvent] = []
    for data in reads:
        out.extend(decoder.feed(data))
    out.extend(decoder.close())
    return out


def decode_split(data: bytes, cuts: Sequence[int]) -> list[SseEvent]:
    """Decode `data` fed in pieces cut at the given offsets."""
    bounds = [0, *cuts, len(data)]
    return decode(data[a:b] for a, b in pairwise(bounds))


def datas(events: Iterable[SseEvent]) -> list[str]:
    return [e.data for e in events]


# --- line endings -------------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r", b"\r\n"], ids=["LF", "CR", "CRLF"])
def test_each_line_ending_ends_lines_and_events(eol: bytes) -> None:
    body = eol.join([b"event: e1", b"data: a", b"data: b", b"", b"data: c", b"", b""])
    assert decode([body]) == [SseEvent("a\nb", "e1"), SseEvent("c")]


def test_mixed_line_endings_in_one_stream() -> None:
    body = b"data: a\r\n\r\ndata: b\r\rdata: c\n\ndata: d\r\n\n"
    assert datas(decode([body])) == ["a", "b", "c", "d"]


def test_crlf_split_across_two_feeds_is_one_line_end() -> None:
    decoder = SseDecoder()
    # If the CR and the LF were taken as two line ends, the LF would be a blank
    # line and dispatch "a" alone.
    first = decoder.feed(b"data: a\r")
    second = decoder.feed(b"\ndata: b\r\n\r\n")
    assert first == []
    assert second == [SseEvent("a\nb")]
    assert decoder.close() == []


def test_cr_at_end_of_feed_followed_by_a_non_lf_is_still_a_line_end() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\rdata: b\n\n") == [SseEvent("a"), SseEvent("b")]


def test_lone_lf_after_crlf_boundary_is_a_blank_line() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\n") == [SseEvent("a")]


def test_every_chunk_boundary_two_feeds() -> None:
    body = b"data:ok\r\n\r\n"
    for cut in range(len(body) + 1):
        assert decode_split(body, [cut]) == [SseEvent("ok")], cut


def test_every_chunk_boundary_three_feeds() -> None:
    body = b"data:ok\r\n\r\n"
    for a in range(len(body) + 1):
        for b in range(a, len(body) + 1):
            assert decode_split(body, [a, b]) == [SseEvent("ok")], (a, b)


RICH = (
    b"\xef\xbb\xbf: keep-alive\r\n"
    b"event: first\r\n"
    b"id: 7\r\n"
    b'data: {"t":"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"}\r\n'
    b"\r\n"
    b"data: x\r"
    b":HTTP_STATUS/200\r"
    b"data:  y\r"
    b"\r"
    b"data\n"
    b"\n"
    b"data: last\n\n"
)
RICH_EVENTS = [
    SseEvent('{"t":"café € 😀"}', "first", "7"),
    SseEvent("x\n y", "message", "7"),
    SseEvent("", "message", "7"),
    SseEvent("last", "message", "7"),
]


def test_rich_stream_in_one_feed() -> None:
    assert decode([RICH]) == RICH_EVENTS


def test_rich_stream_split_at_every_byte_boundary() -> None:
    for cut in range(len(RICH) + 1):
        assert decode_split(RICH, [cut]) == RICH_EVENTS, cut


def test_rich_stream_fed_one_byte_at_a_time() -> None:
    assert decode(RICH[i : i + 1] for i in range(len(RICH))) == RICH_EVENTS


# --- UTF-8 --------------------------------------------------------------------------------


def test_multi_byte_character_split_across_feeds() -> None:
    snowman = "☃".encode()  # 3 bytes
    face = "😀".encode()  # 4 bytes
    body = b"data: " + snowman + face + b"\n\n"
    start = len(b"data: ")
    for cut in range(start + 1, start + len(snowman) + len(face)):
        assert decode_split(body, [cut]) == [SseEvent("☃😀")], cut


def test_multi_byte_character_over_many_feeds() -> None:
    face = "😀".encode()
    reads = [b"data: ", face[:1], face[1:2], face[2:3], face[3:], b"\n", b"\n"]
    assert decode(reads) == [SseEvent("😀")]


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\u0085", "\x1c", "\x0b", "\x0c"])
def test_unicode_line_separators_are_not_line_breaks(char: str) -> None:
    payload = json.dumps({"content": f"a{char}b"}, ensure_ascii=False)
    body = f"data: {payload}\n\n".encode()
    events = decode([body])
    assert events == [SseEvent(payload)]
    assert json.loads(events[0].data)["content"] == f"a{char}b"


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert decode([b"data: a\xffb\n\n"]) == [SseEvent("a\ufffdb")]


# --- comments and fields ------------------------------------------------------------------


def test_comments_are_ignored_at_start_and_mid_stream() -> None:
    body = (
        b": keep-alive\n"
        b": OPENROUTER PROCESSING\n"
        b"data: a\n"
        b": keep-alive\n"
        b"data: b\n"
        b"\n"
        b":HTTP_STATUS/200\n"
        b"data:c\n"
        b"\n"
    )
    assert decode([body]) == [SseEvent("a\nb"), SseEvent("c")]


def test_comment_only_stream_yields_nothing() -> None:
    assert decode([b": keep-alive\n\n: keep-alive\n\n"]) == []


@pytest.mark.parametrize(
    ("line", "value"),
    [
        (b"data:x", "x"),
        (b"data: x", "x"),
        (b"data:  x", " x"),
        (b"data:x ", "x "),
        (b"data: ", ""),
        (b"data:", ""),
        (b"data", ""),
        (b"data: a: b", "a: b"),
    ],
)
def test_exactly_one_space_after_the_colon_is_dropped(line: bytes, value: str) -> None:
    assert decode([line + b"\n\n"]) == [SseEvent(value)]


def test_multi_line_data_joined_with_lf_openai_python_example() -> None:
    body = b'data: {\ndata: "foo":\ndata: \ndata:\ndata: true}\n\n'
    assert decode([body]) == [SseEvent('{\n"foo":\n\n\ntrue}')]


def test_event_field_sets_type_and_is_reset_after_dispatch() -> None:
    body = b"event: message_start\ndata: 1\n\ndata: 2\n\nevent:x\ndata: 3\n\n"
    assert [(e.event, e.data) for e in decode([body])] == [
        ("message_start", "1"),
        ("message", "2"),
        ("x", "3"),
    ]


def test_empty_event_field_means_message() -> None:
    assert decode([b"event:\ndata: a\n\n"]) == [SseEvent("a", "message")]


def test_id_persists_across_events() -> None:
    body = b"id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\n"
    assert [(e.data, e.id) for e in decode([body])] == [("a", "1"), ("b", "1"), ("c", "2")]


def test_id_without_any_id_line_is_none() -> None:
    assert decode([b"data: a\n\n"]) == [SseEvent("a", "message", None)]


def test_id_containing_nul_is_ignored() -> None:
    body = b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n"
    assert [(e.data, e.id) for e in decode([body])] == [("a", "1"), ("b", "1")]


def test_retry_field_is_not_data_and_only_digits_set_it() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"retry: 1000\ndata: a\n\nretry: soon\ndata: b\n\n") == [
        SseEvent("a"),
        SseEvent("b"),
    ]
    assert decoder.retry == 1000


def test_event_without_data_is_not_dispatched() -> None:
    body = b"event: ping\n\nid: 9\n\nevent: x\nid: 10\n\n"
    assert decode([body]) == []


def test_event_without_data_does_not_leak_its_type_into_the_next() -> None:
    body = b"event: ping\n\ndata: a\n\n"
    assert decode([body]) == [SseEvent("a", "message")]


def test_id_set_by_an_event_without_data_still_persists() -> None:
    assert decode([b"id: 5\n\ndata: a\n\n"]) == [SseEvent("a", "message", "5")]


def test_blank_lines_alone_dispatch_nothing() -> None:
    assert decode([b"\n\n\r\n\r\r"]) == []


# --- BOM ------------------------------------------------------------------------------------


def test_leading_bom_is_stripped() -> None:
    assert decode([b"\xef\xbb\xbfdata: a\n\n"]) == [SseEvent("a")]


def test_leading_bom_split_across_feeds_is_stripped() -> None:
    assert decode([b"\xef", b"\xbb", b"\xbfdata: a\n\n"]) == [SseEvent("a")]


def test_leading_bom_alone_in_the_first_read_is_stripped() -> None:
    assert decode([b"\xef\xbb\xbf", b"data: a\n\n"]) == [SseEvent("a")]


def test_only_one_leading_bom_is_stripped_and_only_at_the_start() -> None:
    body = b"data: a\n\n\xef\xbb\xbfdata: b\n\n"
    assert datas(decode([body])) == ["a"]


# --- end of input -------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [b"", b"\n", b"\r\n", b"\r"])
def test_last_event_without_blank_line_is_discarded_even_when_complete_json(tail: bytes) -> None:
    decoder = SseDecoder()
    body = b'data: {"a": 1}\n\ndata: {"b": [1, 2]}' + tail
    assert decoder.feed(body) == [SseEvent('{"a": 1}')]
    assert decoder.close() == []
    assert decoder.discarded == SseEvent('{"b": [1, 2]}')


def test_last_multi_line_event_without_blank_line_is_discarded() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"event: e\nid: 4\ndata: {\ndata: }\n") == []
    assert decoder.close() == []
    assert decoder.discarded == SseEvent("{\n}", "e", "4")


@pytest.mark.parametrize("tail", [b"data: unfinished", b'data: {"a": ', b"data: [DONE"])
def test_last_event_without_blank_line_is_never_dispatched(tail: bytes) -> None:
    events = decode([b"data: a\n\n" + tail + b"\n"])
    assert datas(events) == ["a"]


def test_nothing_is_discarded_after_a_complete_stream() -> None:
    decoder = SseDecoder()
    decoder.feed(b"data: a\n\nevent: x\nid: 1\n")
    decoder.close()
    assert decoder.discarded is None


def test_close_without_pending_input_returns_nothing() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\n\n") == [SseEvent("a")]
    assert decoder.close() == []
    assert decoder.close() == []


def test_feed_after_close_is_an_error() -> None:
    decoder = SseDecoder()
    decoder.close()
    with pytest.raises(ValueError, match="after close"):
        decoder.feed(b"data: a\n\n")


def test_empty_feed_returns_nothing() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"") == []
    assert decoder.feed(b"data: a\n\n") == [SseEvent("a")]


# --- the side channel: text that is not SSE -------------------------------------------------

GEMINI_ERROR_TAIL = (
    b"{\n"
    b'  "error": {\n'
    b'    "code": 503,\n'
    b'    "message": "The model is overloaded. Please try again later.",\n'
    b'    "status": "UNAVAILABLE"\n'
    b"  }\n"
    b"}\n"
)
TAIL_LINES = GEMINI_ERROR_TAIL.decode().splitlines()


def side_channel(decoder: SseDecoder) -> list[tuple[int, str]]:
    return [(line.number, line.text) for line in decoder.non_sse]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
def test_raw_json_tail_is_no_event_and_goes_to_the_side_channel(eol: bytes) -> None:
    decoder = SseDecoder()
    body = b'data: {"candidates": []}\r\n\r\n' + GEMINI_ERROR_TAIL.replace(b"\n", eol)
    assert decoder.feed(body) == [SseEvent('{"candidates": []}')]
    assert decoder.close() == []
    assert side_channel(decoder) == list(enumerate(TAIL_LINES, start=3))
    assert decoder.trailing_non_sse() == decoder.non_sse
    assert all(line.reason.startswith(NOT_A_FIELD) for line in decoder.non_sse)
    assert decoder.discarded is None


def test_raw_json_tail_without_final_newline_keeps_its_last_line() -> None:
    decoder = SseDecoder()
    decoder.feed(b'data: {"candidates": []}\n\n' + GEMINI_ERROR_TAIL.rstrip(b"\n"))
    decoder.close()
    texts = [line.text for line in decoder.trailing_non_sse()]
    assert json.loads("\n".join(texts))["error"]["code"] == 503
    assert decoder.non_sse[-1].reason.endswith("(last line, no line end)")


def test_raw_json_tail_split_at_every_boundary_gives_the_same_side_channel() -> None:
    body = b'data: {"candidates": []}\r\n\r\n' + GEMINI_ERROR_TAIL
    for cut in range(len(body) + 1):
        decoder = SseDecoder()
        events = decoder.feed(body[:cut]) + decoder.feed(body[cut:]) + decoder.close()
        assert events == [SseEvent('{"candidates": []}')], cut
        assert side_channel(decoder) == list(enumerate(TAIL_LINES, start=3)), cut


def test_non_sse_text_does_not_become_data_nor_end_an_event() -> None:
    decoder = SseDecoder()
    events = decoder.feed(b'{"error": {"code": 1}}\ndata: a\n<html>\ndata: b\n\n')
    assert events == [SseEvent("a\nb")]
    assert side_channel(decoder) == [(1, '{"error": {"code": 1}}'), (3, "<html>")]


def test_trailing_non_sse_is_what_follows_the_last_sse_line() -> None:
    decoder = SseDecoder()
    decoder.feed(b"junk 1\ndata: a\n\njunk 2\n: comment\n\njunk 3\n\njunk 4\n")
    decoder.close()
    assert side_channel(decoder) == [(1, "junk 1"), (4, "junk 2"), (7, "junk 3"), (9, "junk 4")]
    assert decoder.last_sse_line == 5
    assert [line.text for line in decoder.trailing_non_sse()] == ["junk 3", "junk 4"]


def test_ignored_values_of_known_fields_are_sse_not_side_channel() -> None:
    decoder = SseDecoder()
    decoder.feed(b"id: a\x00b\nretry: soon\nretry\nevent\n\n")
    decoder.close()
    assert decoder.non_sse == []
    assert decoder.last_sse_line == 4


def test_iter_events_drops_the_side_channel_and_the_unfinished_event() -> None:
    body = b"data: a\n\n" + GEMINI_ERROR_TAIL + b'data: {"b": 1}'
    assert list(iter_events([body])) == [SseEvent("a")]


# --- linear time (work counted in characters, never timed) -----------------------------------

PIECE = 1 << 16


def feed_in_pieces(body: bytes, piece: int = PIECE) -> SseDecoder:
    decoder = SseDecoder()
    for start in range(0, len(body), piece):
        decoder.feed(body[start : start + piece])
    decoder.close()
    return decoder


def work(decoder: SseDecoder) -> int:
    return decoder.scanned + decoder.joined


@pytest.mark.parametrize(
    "prefix", [b"data: ", b"not-a-field: ", b""], ids=["data", "non-sse", "bare"]
)
def test_one_long_line_in_many_reads_is_scanned_once_and_joined_once(prefix: bytes) -> None:
    size = 4 << 20  # 4 MiB in 64 KiB reads: 64 reads
    line = prefix + b"x" * size
    decoder = feed_in_pieces(line + b"\n\n")
    # Every character is looked at once by the line splitter, and the line's
    # pieces are joined once, when it ends: no rescan of what came before.
    assert decoder.scanned == len(line) + 2
    assert decoder.joined == len(line)


def test_work_doubles_when_the_line_doubles() -> None:
    def line_work(size: int) -> int:
        return work(feed_in_pieces(b"data: " + b"x" * size + b"\n\n"))

    small, large = line_work(2 << 20), line_work(4 << 20)
    # Linear: twice the input, twice the work (up to the few fixed characters).
    assert abs(large - 2 * small) <= 16


def test_a_long_line_fed_a_byte_at_a_time_is_still_linear() -> None:
    size = 20_000
    decoder = feed_in_pieces(b"data: " + b"y" * size + b"\n\n", piece=1)
    assert work(decoder) <= 2 * (size + 8)


def test_many_short_lines_join_only_those_cut_by_a_read() -> None:
    body = b"".join(b"data: %d\n\n" % i for i in range(20_000))
    decoder = feed_in_pieces(body)
    assert decoder.scanned == len(body)
    # Only the lines cut by a read boundary are joined.
    assert decoder.joined <= (len(body) // PIECE + 1) * 16


# --- iter_events ------------------------------------------------------------------------------


def test_iter_events_matches_feed_and_close() -> None:
    reads = [RICH[:10], RICH[10:47], RICH[47:]]
    assert list(iter_events(reads)) == RICH_EVENTS


def test_iter_events_is_lazy_per_read() -> None:
    produced: list[int] = []

    def reads() -> Iterable[bytes]:
        for n, piece in enumerate([b"data: a\n\n", b"data: b\n\n"]):
            produced.append(n)
            yield piece

    it = iter_events(reads())
    assert next(it) == SseEvent("a")
    assert produced == [0]
    assert list(it) == [SseEvent("b")]


def test_iter_events_does_not_flush_a_complete_json_tail() -> None:
    assert list(iter_events([b'data: {"a":1}'])) == []


def test_the_events_are_the_python_classes_frozen_and_hashable_whether_compiled_or_not() -> None:
    """The decoder may run compiled (`streamtally._native`); what it gives stays the one
    Python `SseEvent` of `streamtally.core.sse_event`, made by its fast path, as frozen,
    equal and hashable as one made by the constructor."""
    decoder = SseDecoder()
    (event,) = decoder.feed(b"event: delta\nid: 7\ndata: a\ndata: b\n\nnot a field\n")
    assert type(event) is sse_event.SseEvent is SseEvent
    assert event == SseEvent("a\nb", "delta", "7")
    assert hash(event) == hash(SseEvent("a\nb", "delta", "7"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.data = "changed"  # type: ignore[misc]
    assert [type(line) for line in decoder.non_sse] == [sse_event.NonSseLine]
    assert str(sse_event.__file__).endswith(".py")
