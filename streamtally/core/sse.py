"""Incremental Server-Sent Events decoder (WHATWG HTML, "parsing an event stream").

Bytes go in as they arrive; events come out.  Lines end at CRLF, CR or LF —
nothing else — and the bytes are split into lines *before* UTF-8 decoding, so
a multi-byte character or a CR/LF pair straddling two reads is handled.

Two deliberate, documented leniencies:

* At end of input, a last event without its blank line is still dispatched
  when its data is complete JSON (several real servers omit the final blank
  line).
* Lines that are neither comments nor known fields (`data`, `event`, `id`,
  `retry`) are collected and surfaced as one `SseEvent` of type `STRAY`.  The
  spec ignores them, but Gemini appends its mid-stream error as raw JSON after
  the events, and that error must not be lost.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["STRAY", "SseDecoder", "SseEvent", "iter_events"]

#: Event type given to text found outside any SSE field.
STRAY = "__stray__"

_LINE_END = re.compile(r"\r\n|\r|\n")
_BOM = "\ufeff"


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One dispatched event: its type (default "message"), data and last event id."""

    data: str
    event: str = "message"
    id: str | None = None


class SseDecoder:
    """Feed bytes with `feed`, then call `close` once at end of input."""

    __slots__ = (
        "_at_start",
        "_data",
        "_decoder",
        "_event",
        "_last_id",
        "_skip_lf",
        "_stray",
        "_tail",
    )

    def __init__(self) -> None:
        # Incremental: a multi-byte character split across reads waits for its end.
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._tail = ""
        self._skip_lf = False
        self._at_start = True
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None
        self._stray: list[str] = []

    def feed(self, data: bytes) -> list[SseEvent]:
        text = self._decoder.decode(data)
        if not text:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
        if self._at_start and text:
            self._at_start = False
            if text[0] == _BOM:
                text = text[1:]
        if self._tail:
            text = self._tail + text
        if not text:
            return []
        # Only CR and LF end lines (never U+2028, U+0085, …): no str.splitlines().
        lines = text.split("\n") if "\r" not in text else _LINE_END.split(text)
        self._tail = lines.pop()
        # A CR ending the input so far may be the first half of a CRLF.
        self._skip_lf = not self._tail and text[-1] == "\r"
        out: list[SseEvent] = []
        data_lines = self._data
        for line in lines:
            if not line:
                if data_lines or self._stray:
                    self._dispatch(out)
                    data_lines = self._data
                else:
                    self._event = ""
            elif line[0] == ":":
                continue
            elif line[:5] == "data:":
                data_lines.append(line[6:] if line[5:6] == " " else line[5:])
            else:
                self._field(line)
        return out

    def close(self) -> list[SseEvent]:
        """End of input: flush the unterminated last line and a complete last event."""
        out: list[SseEvent] = []
        tail = self._tail + self._decoder.decode(b"", final=True)
        self._tail = ""
        if tail and tail[0] != ":":
            if tail[:5] == "data:":
                self._data.append(tail[6:] if tail[5:6] == " " else tail[5:])
            else:
                self._field(tail)
        if self._data:
            data = "\n".join(self._data)
            if _is_complete_json(data):
                out.append(SseEvent(data, self._event or "message", self._last_id))
            else:
                self._stray.extend(self._data)
        self._data = []
        self._event = ""
        self._flush_stray(out)
        return out

    def _field(self, line: str) -> None:
        field, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\0" not in value:
                self._last_id = value
        elif field != "retry":
            self._stray.append(line)

    def _dispatch(self, out: list[SseEvent]) -> None:
        if self._data:
            out.append(SseEvent("\n".join(self._data), self._event or "message", self._last_id))
            self._data = []
        self._event = ""
        self._flush_stray(out)

    def _flush_stray(self, out: list[SseEvent]) -> None:
        if self._stray:
            out.append(SseEvent("\n".join(self._stray), STRAY, self._last_id))
            self._stray = []


def _is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def iter_events(reads: Iterable[bytes]) -> Iterator[SseEvent]:
    """Decode a whole stream given as an iterable of byte reads."""
    decoder = SseDecoder()
    for data in reads:
        yield from decoder.feed(data)
    yield from decoder.close()
