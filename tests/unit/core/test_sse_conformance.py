"""Conformance vectors for the SSE decoder: WHATWG HTML, "interpreting an event stream".

The vectors are our own inputs and expected outputs, grouped the way the
public conformance suites group theirs (web-platform-tests `eventsource/format-*`,
the eventsource-parser test suite): BOM, comments, each field, field parsing,
unknown fields, leading space, newlines, NUL, UTF-8, the end of the stream.
Each expected output was worked out from the standard's algorithm, not from
our decoder.

Every vector is fed whole, one byte at a time, and (when it is short) cut in
two at every byte boundary: the events, the side channel, the discarded
event and the reconnection time must come out the same every way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

import pytest

from streamtally.core.sse import NOT_A_FIELD, SseDecoder, SseEvent

#: Vectors up to this many bytes are also cut at every byte boundary.
SHORT = 400


@dataclass(frozen=True)
class Vector:
    name: str
    stream: bytes
    events: list[SseEvent]
    #: Line numbers (1-based) that go to the side channel as not SSE.
    non_sse: list[int] = field(default_factory=list)
    #: The unfinished event the stream ends in, discarded.
    discarded: SseEvent | None = None
    retry: int | None = None


def E(data: str, event: str = "message", id: str | None = None) -> SseEvent:
    return SseEvent(data, event, id)


BOM = b"\xef\xbb\xbf"

VECTORS = [
    # --- BOM (format-bom, format-bom-2) --------------------------------------------------
    Vector(
        "bom-leading-stripped-later-ones-are-text",
        BOM + b"data:one\n\n" + BOM + b"data:two\n\ndata:three\n\n",
        [E("one"), E("three")],
        non_sse=[3],  # "\ufeffdata:two": field name "\ufeffdata"
    ),
    Vector(
        "bom-double-at-start-only-the-first-stripped",
        BOM + BOM + b"data:one\n\ndata:two\n\n",
        [E("two")],
        non_sse=[1],
    ),
    Vector("bom-alone", BOM, []),
    Vector("bom-then-blank-line", BOM + b"\n" + b"data:x\n\n", [E("x")]),
    Vector("bom-inside-data-is-kept", b"data: \xef\xbb\xbfx\n\n", [E("\ufeffx")]),
    Vector("bom-after-leading-comment", b":c\n" + BOM + b"data:x\n\n", [], non_sse=[2]),
    # --- comments (format-comments) ---------------------------------------------------------
    Vector(
        "comments-between-data-lines-any-line-end",
        b"data:a\r:\r\n:\n:" + b"z" * 300 + b"\rdata:b\n:data: not data\r:" + b"y" * 50 + b"\n"
        b"data:c\n\n",
        [E("a\nb\nc")],
    ),
    Vector("comment-only-stream", b":one\n\n:two\r\n\r\n", []),
    Vector("comment-colon-alone", b":\ndata:x\n:\n\n", [E("x")]),
    Vector("comment-does-not-end-an-event", b"data:a\n: not blank\ndata:b\n\n", [E("a\nb")]),
    # --- data (format-field-data, eventsource-parser "oddly shaped data field") -------------
    Vector(
        "data-empty-value-and-no-colon",
        b"data:\n\ndata\ndata\n\ndata:x\n\n",
        [E(""), E("\n"), E("x")],
    ),
    Vector("data-lines-join-with-lf", b"data: a\ndata: b\ndata:\ndata: c\n\n", [E("a\nb\n\nc")]),
    Vector("data-value-keeps-later-colons", b"data: a: b:c\n\n", [E("a: b:c")]),
    Vector("data-trailing-spaces-kept", b"data: x  \n\n", [E("x  ")]),
    # --- event (format-field-event, format-field-event-empty) -------------------------------
    Vector(
        "event-type-applies-once-then-resets",
        b"event: tick\ndata: 1\n\ndata: 2\n\n",
        [E("1", "tick"), E("2")],
    ),
    Vector("event-empty-value-is-message", b"event: \ndata: d\n\n", [E("d")]),
    Vector("event-no-colon-is-message", b"event\ndata: d\n\n", [E("d")]),
    Vector("event-two-spaces-keeps-one", b"event:  t\ndata: d\n\n", [E("d", " t")]),
    Vector("event-last-field-wins", b"event: a\nevent: b\ndata: d\n\n", [E("d", "b")]),
    Vector(
        "event-without-data-resets-its-type",
        b"event: ping\n\ndata: d\n\n",
        [E("d")],
    ),
    Vector("event-after-data-in-the-same-block", b"data: d\nevent: late\n\n", [E("d", "late")]),
    # --- id (format-field-id, -id-2, -id-null; eventsource-parser onId) ---------------------
    Vector(
        "id-persists-across-events",
        b"id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\n",
        [E("a", id="1"), E("b", id="1"), E("c", id="2")],
    ),
    Vector("id-never-set-is-none", b"data: a\n\n", [E("a")]),
    Vector(
        "id-empty-value-resets-to-empty-string",
        b"id: 1\ndata: a\n\nid\ndata: b\n\nid:\ndata: c\n\n",
        [E("a", id="1"), E("b", id=""), E("c", id="")],
    ),
    Vector(
        "id-from-a-block-without-data-carries-over",
        b"id: 7\n\ndata: a\n\n",
        [E("a", id="7")],
    ),
    Vector(
        "id-non-ascii",
        "id: …\ndata: a\n\n".encode(),
        [E("a", id="…")],
    ),
    Vector(
        "id-with-nul-is-ignored-anywhere-in-the-value",
        b"id: 1\ndata: a\n\nid: \x00\x00\ndata: b\n\nid: x\x00\ndata: c\n\n"
        b"id: \x00x\ndata: d\n\nid: x\x00x\ndata: e\n\n",
        [E("a", id="1"), E("b", id="1"), E("c", id="1"), E("d", id="1"), E("e", id="1")],
    ),
    Vector("id-leading-space-once", b"id:  5\ndata: a\n\n", [E("a", id=" 5")]),
    # --- retry (format-field-retry, -retry-bogus, -retry-empty) -----------------------------
    Vector("retry-digits", b"retry: 1500\ndata: a\n\n", [E("a")], retry=1500),
    Vector("retry-zero", b"retry:0\n\n", [], retry=0),
    Vector(
        "retry-bogus-values-are-ignored",
        b"retry: 100\nretry: 2000x\nretry:  300\nretry: -1\nretry:\nretry\nretry: 1.5\n\n",
        [],
        retry=100,
    ),
    Vector(
        "retry-unicode-digits-are-not-ascii-digits",
        "retry: 42\nretry: \u0663\u0664\nretry: \uff15\n\n".encode(),
        [],
        retry=42,
    ),
    Vector("retry-is-not-data", b"retry: 10\ndata: a\nretry: 20\n\n", [E("a")], retry=20),
    Vector(  # beyond what Python converts to int (and any sane delay): ignored
        "retry-too-long-to-convert-is-ignored",
        b"retry: 5\nretry: " + b"9" * 5000 + b"\nretry: " + b"0" * 5000 + b"7\n\n",
        [],
        retry=7,
    ),
    # --- field parsing (format-field-parsing, format-field-unknown) -------------------------
    Vector(
        "field-names-are-exact-and-case-sensitive",
        b"data:\x00\ndata:  x\rDATA:1\ndata\x00:2\ndata:y\r\x00data:3\n"
        b"d-ata:4\rdata-5\ndata:z\rdata:\r\n data:6\nEvent:7\ndata:w\n\n",
        [E("\x00\n x\ny\nz\n\nw")],
        non_sse=[3, 4, 6, 7, 8, 11, 12],
    ),
    Vector(
        "unknown-fields-and-plain-text-are-ignored",
        b"data:first\n  data\ndata\nnot-a-field:value\nsome words here\n:note\ndata:last\n\n",
        [E("first\n\nlast")],
        non_sse=[2, 4, 5],
    ),
    Vector("field-name-with-trailing-space", b"data :x\ndata:y\n\n", [E("y")], non_sse=[1]),
    Vector(
        "whitespace-only-line-is-not-blank",
        b"data: a\n \n\t\ndata: b\n\n",
        [E("a\nb")],
        non_sse=[2, 3],
    ),
    Vector(
        "raw-json-lines-are-not-sse",
        b'data: {"a":1}\n\n{\n  "error": {"code": 1}\n}\n',
        [E('{"a":1}')],
        non_sse=[3, 4, 5],
    ),
    Vector(
        "raw-json-object-on-one-line",
        b'{"error":{"message":"boom"}}\ndata: a\n\n',
        [E("a")],
        non_sse=[1],
    ),
    # --- leading space (format-leading-space) ------------------------------------------------
    Vector(
        "only-one-space-is-dropped-and-only-a-space",
        b"data:\ttab\n\ndata:  two\n\ndata:x\n\ndata: \n\n",
        [E("\ttab"), E(" two"), E("x"), E("")],
    ),
    # --- newlines (format-newlines; eventsource-parser cr/lf/crlf) --------------------------
    Vector(
        "crlf-lf-and-lone-cr-mixed",
        b"data:one\r\ndata\ndata:two\r\n\r",
        [E("one\n\ntwo")],
    ),
    Vector("cr-only-stream", b"data: a\rdata: b\r\rdata: c\r\r", [E("a\nb"), E("c")]),
    Vector("lf-then-cr-is-two-line-ends", b"data: a\n\rdata: b\n\n", [E("a"), E("b")]),
    Vector("cr-cr-lf-is-a-line-end-then-a-blank-line", b"data: one\r\r\n", [E("one")]),
    Vector("crlf-blank-lines", b"data: a\r\n\r\n\r\n\r\ndata: b\r\n\r\n", [E("a"), E("b")]),
    Vector(
        "unicode-separators-are-not-line-ends",
        "data: a\u2028b\u2029c\u0085d\x0be\x0cf\x1cg\n\n".encode(),
        [E("a\u2028b\u2029c\u0085d\x0be\x0cf\x1cg")],
    ),
    # --- NUL (format-null-character) ----------------------------------------------------------
    Vector("nul-in-data-is-kept", b"data: \x00\n\ndata: a\x00b\n\n", [E("\x00"), E("a\x00b")]),
    Vector("nul-in-event-type-is-kept", b"event: a\x00b\ndata: x\n\n", [E("x", "a\x00b")]),
    # --- UTF-8 (format-utf-8; WHATWG UTF-8 decode, U+FFFD for maximal subparts) -------------
    Vector("utf8-multibyte", "data: ok… € 😀 我\n\n".encode(), [E("ok… € 😀 我")]),
    Vector(
        "utf8-invalid-bytes-become-replacement-characters",
        b"data: a\xffb\n\n"  # a byte that never starts a character
        b"data: \xc3(\n\n"  # lead byte then a non-continuation
        b"data: \xe2\x82\n\n"  # truncated 3-byte character before a line end
        b"data: \xf0\x9f\x98x\n\n"  # truncated 4-byte character
        b"data: \xc0\xaf\n\n"  # overlong encoding
        b"data: \xed\xa0\x80\n\n"  # an encoded surrogate
        b"data: \xf4\x90\x80\x80\n\n"  # beyond U+10FFFF
        b"data: \x80\x80\n\n",  # lone continuation bytes
        [
            E("a\ufffdb"),
            E("\ufffd("),
            E("\ufffd"),
            E("\ufffdx"),
            E("\ufffd\ufffd"),
            E("\ufffd\ufffd\ufffd"),
            E("\ufffd\ufffd\ufffd\ufffd"),
            E("\ufffd\ufffd"),
        ],
    ),
    Vector(
        "utf8-truncated-character-at-end-of-stream",
        b"data: a\n\nxyz\xe2\x82",
        [E("a")],
        non_sse=[3],
    ),
    # --- end of stream (format-data-before-final-empty-line) ---------------------------------
    Vector(
        "event-without-final-blank-line-is-discarded",
        b"retry:250\ndata:first\n\nid:abc\ndata:second",
        [E("first")],
        discarded=E("second", id="abc"),
        retry=250,
    ),
    Vector(
        "complete-json-without-final-blank-line-is-discarded-too",
        b'data: {"a": 1}\n\ndata: {"b": 2}\n',
        [E('{"a": 1}')],
        discarded=E('{"b": 2}'),
    ),
    Vector(
        "done-sentinel-without-final-blank-line-is-discarded",
        b"data: x\n\ndata: [DONE]\r\n",
        [E("x")],
        discarded=E("[DONE]"),
    ),
    Vector(
        "event-type-of-discarded-event",
        b"event: message_stop\ndata: {}\r",
        [],
        discarded=E("{}", "message_stop"),
    ),
    Vector("fields-without-data-at-end-discard-nothing", b"data: a\n\nevent: x\nid: 3", [E("a")]),
    Vector(
        "unterminated-last-line-that-is-not-sse-is-reported",
        b"data: a\n\n}",
        [E("a")],
        non_sse=[3],
    ),
    Vector("empty-stream", b"", []),
    Vector("blank-lines-only", b"\n\r\n\r\r\n\n", []),
]


def run(reads: Iterable[bytes]) -> tuple[list[SseEvent], list[int], SseEvent | None, int | None]:
    decoder = SseDecoder()
    events: list[SseEvent] = []
    for data in reads:
        events.extend(decoder.feed(data))
    events.extend(decoder.close())
    assert all(line.reason.startswith(NOT_A_FIELD) for line in decoder.non_sse)
    return events, [line.number for line in decoder.non_sse], decoder.discarded, decoder.retry


def expected(vector: Vector) -> tuple[list[SseEvent], list[int], SseEvent | None, int | None]:
    return vector.events, vector.non_sse, vector.discarded, vector.retry


def test_vector_names_are_unique() -> None:
    assert len({v.name for v in VECTORS}) == len(VECTORS)


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector_fed_whole(vector: Vector) -> None:
    assert run([vector.stream]) == expected(vector)


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector_fed_one_byte_at_a_time(vector: Vector) -> None:
    stream = vector.stream
    assert run(stream[i : i + 1] for i in range(len(stream))) == expected(vector)


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if len(v.stream) <= SHORT], ids=lambda v: v.name
)
def test_vector_cut_in_two_at_every_byte_boundary(vector: Vector) -> None:
    stream = vector.stream
    want = expected(vector)
    for cut in range(len(stream) + 1):
        assert run([stream[:cut], stream[cut:]]) == want, cut


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if len(v.stream) <= 40], ids=lambda v: v.name
)
def test_vector_cut_in_three_at_every_pair_of_boundaries(vector: Vector) -> None:
    stream = vector.stream
    want = expected(vector)
    for a in range(len(stream) + 1):
        for b in range(a, len(stream) + 1):
            cuts = [0, a, b, len(stream)]
            assert run(stream[x:y] for x, y in pairwise(cuts)) == want, (a, b)


def test_side_channel_keeps_each_line_whole_with_its_reason() -> None:
    decoder = SseDecoder()
    decoder.feed(b"data: a\n\nfoo: bar\r\n" + b"x" * 100 + b"\n")
    decoder.close()
    first, second = decoder.non_sse
    assert (first.number, first.text) == (3, "foo: bar")
    assert first.reason == f"{NOT_A_FIELD}: field name 'foo'"
    assert (second.number, second.text) == (4, "x" * 100)
    assert second.reason == f"{NOT_A_FIELD}: field name '{'x' * 40}...'"
