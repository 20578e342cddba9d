"""The decoder's quick paths against a plain reading of the standard, on generated streams.

`SseDecoder` cuts lines with `str.split` or `str.splitlines` (only when the
text holds no character `splitlines` would also end a line at) and reads
`data`, `event` and blank lines inline.  `reference` below is the standard's
algorithm written plainly (one regex split of the whole stream, one line at a
time); every generated stream, fed whole or cut into random reads, must
decode to the same events, side channel, counters and discarded event.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import pytest

from streamtally.core.sse import NOT_A_FIELD, NonSseLine, SseDecoder, SseEvent


@dataclass
class Decoded:
    events: list[SseEvent]
    non_sse: list[NonSseLine]
    retry: int | None
    discarded: SseEvent | None
    lines: int
    last_sse_line: int


def reference(body: bytes) -> Decoded:
    text = body.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    pieces = re.split(r"\r\n|\r|\n", text)
    unended = pieces.pop()
    out = Decoded([], [], None, None, 0, 0)
    data: list[str] = []
    event = ""
    last_id: str | None = None

    def line(text: str, ended: bool) -> None:
        nonlocal data, event, last_id
        out.lines += 1
        if not text:
            if data:
                out.events.append(SseEvent("\n".join(data), event or "message", last_id))
            data, event = [], ""
            return
        name, colon, value = text.partition(":")
        if not name and colon:  # a comment
            out.last_sse_line = out.lines
            return
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            if "\0" not in value:
                last_id = value
        elif name == "retry":
            if ended and value.isascii() and value.isdigit() and len(value.lstrip("0")) <= 4000:
                out.retry = int(value)
        else:
            shown = name if len(name) <= 40 else name[:40] + "..."
            reason = f"{NOT_A_FIELD}: field name {shown!r}"
            if not ended:
                reason += " (last line, no line end)"
            out.non_sse.append(NonSseLine(out.lines, text, reason))
            return
        out.last_sse_line = out.lines

    for piece in pieces:
        line(piece, True)
    if unended:
        line(unended, False)
    if data:
        out.discarded = SseEvent("\n".join(data), event or "message", last_id)
    return out


def decode(body: bytes, cuts: list[int]) -> Decoded:
    decoder = SseDecoder()
    events: list[SseEvent] = []
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        events.extend(decoder.feed(body[start:end]))
    assert decoder.close() == []
    return Decoded(
        events,
        decoder.non_sse,
        decoder.retry,
        decoder.discarded,
        decoder.lines,
        decoder.last_sse_line,
    )


#: Characters `str.splitlines` ends lines at that SSE does not (and some that neither does).
ODD = ["\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\ufeff", "\0", "é", "😀"]
ENDS = [b"\n", b"\r\n", b"\r"]


def random_line(rng: random.Random) -> bytes:
    word = "".join(rng.choice(["a", " ", ":", *ODD]) for _ in range(rng.randrange(6)))
    kind = rng.randrange(12)
    if kind < 5:
        text = rng.choice(["data:", "data: ", "data"]) + word
    elif kind == 5:
        text = rng.choice(["event:", "event: "]) + word
    elif kind == 6:
        text = "id: " + word
    elif kind == 7:
        text = "retry: " + rng.choice(["15", "007", "x1", word])
    elif kind == 8:
        text = ":" + word
    elif kind == 9:
        text = rng.choice(["", "", "", "{", "junk"]) + word
    else:
        text = ""
    raw = text.encode()
    if rng.random() < 0.05:
        raw += rng.choice([b"\xff", b"\xc3", b"\xe2\x80"])  # invalid or cut UTF-8
    return raw


def random_stream(rng: random.Random) -> bytes:
    ends = ENDS if rng.random() < 0.5 else [rng.choice(ENDS)]
    body = b"".join(random_line(rng) + rng.choice(ends) for _ in range(rng.randrange(1, 30)))
    if rng.random() < 0.3:
        body = body[: rng.randrange(len(body) + 1)]  # an unended last line or event
    if rng.random() < 0.1:
        body = b"\xef\xbb\xbf" + body
    return body


@pytest.mark.parametrize("seed", range(40))
def test_generated_streams_decode_as_the_standard_says(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        body = random_stream(rng)
        expected = reference(body)
        assert decode(body, []) == expected, body
        for _ in range(3):
            cuts = sorted(rng.sample(range(len(body) + 1), min(len(body) + 1, rng.randrange(1, 6))))
            assert decode(body, cuts) == expected, (body, cuts)


@pytest.mark.parametrize("odd", ODD[:8])
@pytest.mark.parametrize("eol", ["\r\n", "\r"])
def test_a_splitlines_line_end_in_a_crlf_stream_is_text(odd: str, eol: str) -> None:
    body = f"data: a{odd}b{eol}{eol}event: e{odd}{eol}data: c{eol}{eol}".encode()
    got = decode(body, [])
    assert got.events == [SseEvent(f"a{odd}b"), SseEvent("c", f"e{odd}")]
    assert got.lines == 5


def test_a_crlf_stream_keeps_its_line_numbers() -> None:
    body = b"data: a\r\n\r\nnot sse\r\n: comment\r\ndata: b\r\n\r\ntail"
    got = decode(body, [])
    assert got.events == [SseEvent("a"), SseEvent("b")]
    assert [(line.number, line.text) for line in got.non_sse] == [(3, "not sse"), (7, "tail")]
    assert got.last_sse_line == 5
    assert got.lines == 7


def test_a_data_line_cut_between_reads_in_a_crlf_stream_is_joined_once() -> None:
    body = b"data: " + b"x" * 100 + b"\r\n\r\n"
    decoder = SseDecoder()
    events = decoder.feed(body[:50]) + decoder.feed(body[50:103]) + decoder.feed(body[103:])
    assert events == [SseEvent("x" * 100)]
    assert decoder.scanned == len(body)
    assert decoder.joined == len("data: ") + 100
