"""Incremental Server-Sent Events decoder: WHATWG HTML, "interpreting an event stream".

Bytes go in as they arrive; events come out.  The decoder follows the
standard's algorithm exactly, with no leniency of its own:

* The bytes are UTF-8, decoded incrementally (a character split across reads
  waits for its end); invalid bytes become U+FFFD as the UTF-8 decode
  algorithm says.  One U+FEFF (BOM) is stripped at the very start of the
  stream, and only there: anywhere else it is ordinary text.
* Lines end at CRLF, LF or CR, and at nothing else (never U+2028, U+0085, ...).
  A CR ending one read and an LF starting the next are one line end.
* A blank line dispatches the event being built.  A line starting with `:` is
  a comment.  Otherwise the field name is the text before the first `:` (the
  whole line when there is none) and the value the text after it, less one
  leading space.  `data` appends its value to the data buffer (several join
  with LF), `event` sets the event type (empty: "message"), `id` sets the last
  event id unless the value holds a NUL, `retry` sets the reconnection time
  when the value is ASCII digits only.  Every other field is ignored.
* An event whose data buffer is empty is not dispatched (its event type is
  reset all the same).  The last event id is not reset by a dispatch: it
  carries over to every later event until an `id` field changes it, an `id`
  of an event that was never dispatched included.  `SseEvent.id` is None
  while the stream has had no `id` field at all.
* At the end of the stream, an event not followed by its blank line is
  discarded, never dispatched: `close()` returns no event.  What it would
  have been stays readable as `discarded`, for diagnostics only.

The side channel.  A line that is not blank, not a comment and whose field
name is none of `data`, `event`, `id`, `retry` is, per the standard, ignored.
For us such a line is *text that is not SSE* (a proxy's error page, a raw JSON
body, a stray log line): it never becomes an event and is recorded instead, in
stream order, in `non_sse` (`NonSseLine`: its line number, its text and the
reason).  A last line with no line end is recorded too when it is not SSE.
A known field with a value the standard ignores (an `id` holding a NUL, a
`retry` that is not digits) is SSE, not reported.  `trailing_non_sse()` is the
non-SSE text after the last line that was SSE: the place where Gemini appends
its raw JSON error body.  The decoder never interprets that text; a source
that needs it takes it explicitly (see `Adapter.take_trailing_body` and
`streamtally.core.normalize.read_events`).

The decoder runs in time linear in its input: each read is scanned once, and
a line spread over many reads is joined once, when it ends.  `scanned` and
`joined` count that work (characters), so tests can check it without a clock.

The decoder runs once per read of every tapped stream, so it is one of the
compiled modules (`streamtally._native.MODULES`); the types it gives are in
`streamtally.core.sse_event` (Python classes either way) and re-exported here.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from typing import Any, Final

from streamtally.core.sse_event import NOT_A_FIELD, NonSseLine, SseEvent

__all__ = ["NOT_A_FIELD", "NonSseLine", "SseDecoder", "SseEvent", "iter_events"]

_BOM = "\ufeff"
#: The line ends of `str.splitlines` beyond CRLF, CR and LF: no SSE line ends.
_ASCII_OTHER_LINE_ENDS = ("\v", "\f", "\x1c", "\x1d", "\x1e")
_OTHER_LINE_ENDS = (*_ASCII_OTHER_LINE_ENDS, "\x85", "\u2028", "\u2029")
#: Python refuses to convert longer digit strings to int (`sys.get_int_max_str_digits`).
_MAX_RETRY_DIGITS = 4000

# `SseEvent(data, event, id)` for the decoder's hot path: a bare instance, then its three
# slots set directly (the frozen dataclass's `__init__` goes through `object.__setattr__`).
_new: Final[Any] = object.__new__
_set_data: Final[Any] = SseEvent.__dict__["data"].__set__
_set_event: Final[Any] = SseEvent.__dict__["event"].__set__
_set_id: Final[Any] = SseEvent.__dict__["id"].__set__


class SseDecoder:
    """Feed bytes with `feed`, then call `close` once at end of input."""

    __slots__ = (
        "_at_start",
        "_closed",
        "_data",
        "_decoder",
        "_event",
        "_last_id",
        "_parts",
        "_skip_lf",
        "discarded",
        "joined",
        "last_sse_line",
        "lines",
        "non_sse",
        "retry",
        "scanned",
    )

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        #: The current line so far, one piece per read: joined once, when the line ends.
        self._parts: list[str] = []
        self._skip_lf = False
        self._at_start = True
        self._closed = False
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None
        #: The side channel: every line that is not SSE, in stream order.
        self.non_sse: list[NonSseLine] = []
        #: After `close`: the unfinished event the stream ended in (never dispatched).
        self.discarded: SseEvent | None = None
        #: The last reconnection time (ms) a `retry` field set.
        self.retry: int | None = None
        #: Lines seen so far.
        self.lines = 0
        #: Number of the last line that was SSE (a comment or a known field); 0: none.
        self.last_sse_line = 0
        #: Characters handed to the line splitter (each decoded character once).
        self.scanned = 0
        #: Characters copied to join lines that spanned several reads.
        self.joined = 0

    def feed(self, data: bytes) -> list[SseEvent]:
        """The events dispatched by this read."""
        if self._closed:
            raise ValueError("SseDecoder.feed() after close()")
        text = self._decoder.decode(data)
        if not text:
            return []
        if self._at_start:
            self._at_start = False
            if text[0] == _BOM:
                text = text[1:]
        if self._skip_lf:
            self._skip_lf = False
            if text[:1] == "\n":
                text = text[1:]
        if not text:
            return []
        self.scanned += len(text)
        if "\r" in text:
            # A CR ending this read may be the first half of a CRLF: skip an LF opening the next.
            self._skip_lf = text[-1] == "\r"
        lines = _split_lines(text)
        tail = lines.pop()  # the start of a line whose end has not come yet
        out: list[SseEvent] = []
        if lines:
            self._lines(lines, out)
        if tail:
            self._parts.append(tail)
        return out

    def _lines(self, lines: list[str], out: list[SseEvent]) -> None:
        """`_line` for each of `lines` (whole lines), with the common lines done inline."""
        if self._parts:  # the first line started in an earlier read
            self._parts.append(lines[0])
            lines[0] = "".join(self._parts)
            self.joined += len(lines[0])
            self._parts = []
        number = self.lines
        last_sse = self.last_sse_line
        data = self._data
        for line in lines:
            number += 1
            if not line:
                if data:
                    event = _new(SseEvent)
                    _set_data(event, data[0] if len(data) == 1 else "\n".join(data))
                    _set_event(event, self._event or "message")
                    _set_id(event, self._last_id)
                    out.append(event)
                    data.clear()
                self._event = ""
            elif line.startswith("data: "):
                data.append(line[6:])
                last_sse = number
            elif line[:5] == "data:":
                data.append(line[5:])
                last_sse = number
            elif line[:6] == "event:":
                self._event = line[7:] if line[6:7] == " " else line[6:]
                last_sse = number
            else:
                self.lines = number - 1
                self.last_sse_line = last_sse
                self._line(line, out)
                last_sse = self.last_sse_line
        self.lines = number
        self.last_sse_line = last_sse

    def close(self) -> list[SseEvent]:
        """End of input.  Returns no event: an event without its blank line is discarded."""
        if self._closed:
            return []
        self._closed = True
        rest = self._decoder.decode(b"", final=True)  # a truncated character: U+FFFD
        if rest:
            if self._at_start:
                self._at_start = False
                rest = rest.removeprefix(_BOM)
            self._parts.append(rest)
        last = "".join(self._parts)
        self._parts = []
        if last:
            self.joined += len(last)
            self._line(last, [], ended=False)
        if self._data:
            data = "\n".join(self._data)
            self.discarded = SseEvent(data, self._event or "message", self._last_id)
        self._data = []
        self._event = ""
        return []

    def trailing_non_sse(self) -> list[NonSseLine]:
        """The non-SSE lines after the last line that was SSE (blank lines aside)."""
        return [line for line in self.non_sse if line.number > self.last_sse_line]

    def _line(self, line: str, out: list[SseEvent], *, ended: bool = True) -> None:
        self.lines += 1
        if not line:
            if self._data:
                data = "\n".join(self._data)
                out.append(SseEvent(data, self._event or "message", self._last_id))
                self._data = []
            self._event = ""
            return
        if line[:5] == "data:":  # most lines: the general case below, made quicker
            self._data.append(line[6:] if line[5:6] == " " else line[5:])
            self.last_sse_line = self.lines
            return
        if line[0] == ":":
            self.last_sse_line = self.lines
            return
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry":
            digits = value.isascii() and value.isdigit()
            if ended and digits and len(value.lstrip("0")) <= _MAX_RETRY_DIGITS:
                self.retry = int(value.lstrip("0") or "0")
        else:
            shown = name if len(name) <= 40 else name[:40] + "..."
            reason = f"{NOT_A_FIELD}: field name {shown!r}"
            if not ended:
                reason += " (last line, no line end)"
            self.non_sse.append(NonSseLine(self.lines, line, reason))
            return
        self.last_sse_line = self.lines


def _split_lines(text: str) -> list[str]:
    """`text` cut at its line ends (CRLF, CR, LF): the last piece is what follows the last."""
    if "\r" not in text:
        return text.split("\n")
    lines = text.split("\r\n")
    if len(lines) > 1:  # the usual text with CRs: every line ends with CRLF
        rest = "".join(lines)
        if "\r" not in rest and "\n" not in rest:
            return lines
    if _only_sse_line_ends(text):  # then `splitlines` ends lines where SSE does
        lines = text.splitlines()
        if text[-1] in "\r\n":
            lines.append("")
        return lines
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # CRLFs first


def _only_sse_line_ends(text: str) -> bool:
    """Whether every line end `str.splitlines` sees in `text` is CRLF, CR or LF."""
    ends = _ASCII_OTHER_LINE_ENDS if text.isascii() else _OTHER_LINE_ENDS
    return not any(end in text for end in ends)


def iter_events(reads: Iterable[bytes]) -> Iterator[SseEvent]:
    """Decode a whole stream given as an iterable of byte reads (the side channel is dropped)."""
    decoder = SseDecoder()
    for data in reads:
        yield from decoder.feed(data)
    yield from decoder.close()
