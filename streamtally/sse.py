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

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["STRAY", "SseDecoder", "SseEvent", "iter_events"]

#: Event type given to text found outside any SSE field.
STRAY = "__stray__"

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = "\ufeff"


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One dispatched event: its type (default "message"), data and last event id."""

    data: str
    event: str = "message"
    id: str | None = None


class SseDecoder:
    """Feed bytes with `feed`, then call `close` once at end of input."""

    __slots__ = ("_at_start", "_buf", "_data", "_event", "_last_id", "_skip_lf", "_stray")

    def __init__(self) -> None:
        self._buf = b""
        self._skip_lf = False
        self._at_start = True
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None
        self._stray: list[str] = []

    def feed(self, data: bytes) -> list[SseEvent]:
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buf = self._buf + data if self._buf else data
        parts = _LINE_END.split(buf)
        self._buf = parts.pop()
        # A CR ending the buffer may be the first half of a CRLF.
        self._skip_lf = not self._buf and buf[-1:] == b"\r"
        out: list[SseEvent] = []
        for raw in parts:
            self._line(raw.decode("utf-8", "replace"), out)
        return out

    def close(self) -> list[SseEvent]:
        """End of input: flush the unterminated last line and a complete last event."""
        out: list[SseEvent] = []
        if self._buf:
            self._line(self._buf.decode("utf-8", "replace"), out)
            self._buf = b""
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

    def _line(self, line: str, out: list[SseEvent]) -> None:
        if self._at_start:
            self._at_start = False
            if line.startswith(_BOM):
                line = line[1:]
        if not line:
            self._dispatch(out)
            return
        if line[0] == ":":
            return
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
