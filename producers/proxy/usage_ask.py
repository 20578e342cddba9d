"""Usage always requested: the proxy asks an OpenAI-compatible stream for its usage chunk.

An OpenAI-compatible server streams a chat or text completion without any
token counts unless the request says ``"stream_options": {"include_usage":
true}``; the official SDKs do not say it by default, so such a call would be
billed 0 tokens (``usage_source: missing``).  The proxy therefore asks for
the usage itself (`ask_for_usage`: the request body with ``include_usage``
set) and gives the client back the stream it would have had without the
proxy (`UsageStripper`):

- the usage-only chunk (``"choices": []`` and a ``usage`` object, sent just
  before ``data: [DONE]``) is teed but not forwarded;
- the ``"usage": null`` member that the server adds to every other chunk
  once usage is asked for is cut out of the chunk's bytes, and only when the
  chunk without it parses to exactly the same object less that member
  (otherwise the chunk is forwarded as it came and counted as
  `UsageStripper.unchanged`).

Everything else passes byte for byte, SSE framing included (the stripper
works on whole SSE blocks and re-emits their own bytes).  A call whose
client asked for usage itself is left entirely alone.  Which calls are
asked: `asks_for_usage` (a POST to ``…/chat/completions`` or
``…/completions`` whose JSON body streams); `streamtally proxy
--no-usage-request` turns it off.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

__all__ = ["UsageStripper", "ask_for_usage", "asks_for_usage"]

#: Paths of the OpenAI-compatible calls that stream usage only when asked.
_ASKED_PATHS: Final = ("/chat/completions", "/completions")
#: The member a server adds to every chunk once usage is asked for, as servers write it.
_NULL_USAGE: Final = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,')
_LINE_END: Final = re.compile(rb"\r\n|\r|\n")


def asks_for_usage(method: str, path: str) -> bool:
    """Whether a call on `path` is one whose streamed usage must be asked for."""
    return method.upper() == "POST" and path.endswith(_ASKED_PATHS)


def ask_for_usage(body: bytes) -> bytes | None:
    """The request body with ``stream_options.include_usage`` true, when the call streams
    without it; None when the body is left as it is (not JSON, not streaming, or the client
    asked for usage already).

    The rest of the body is kept: members and their order, other ``stream_options``.
    """
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("stream") is not True:
        return None
    options = value.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return None  # the server refuses it anyway: its answer goes to the client as it is
    if options.get("include_usage") is True:
        return None
    value["stream_options"] = {**options, "include_usage": True}
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class UsageStripper:
    """The client's side of a stream whose usage the proxy asked for (module docstring).

    `feed` takes the upstream's bytes as they come and returns what goes to the
    client now; `close` returns what is left at the end (an unfinished block, as
    it came).
    """

    def __init__(self) -> None:
        self._pending = bytearray()
        #: Where the line being read starts in `_pending` (every line end before it is
        #: handled already: a piece is scanned once, not again with each later piece).
        self._line_start = 0
        #: Usage-only chunks held back from the client.
        self.dropped = 0
        #: Chunks with ``"usage": null`` that could not be cut exactly (forwarded as they came).
        self.unchanged = 0

    def feed(self, data: bytes) -> bytes:
        pending = self._pending
        line_start = self._line_start
        # The scan goes on where the last one stopped: its last byte again, a "\r" that
        # may be the first half of a "\r\n".
        resume = max(line_start, len(pending) - 1)
        pending += data
        out = bytearray()
        start = 0  # where the block being read starts
        for match in _LINE_END.finditer(pending, resume):
            if match.group() == b"\r" and match.end() == len(pending):
                break  # "\r" at the end of what came: maybe the first half of "\r\n"
            empty = match.start() == line_start
            line_start = match.end()
            if empty:  # a blank line: the block is complete
                out += self._block(bytes(pending[start:line_start]))
                start = line_start
        del pending[:start]
        self._line_start = line_start - start
        return bytes(out)

    def close(self) -> bytes:
        rest, self._pending = bytes(self._pending), bytearray()
        self._line_start = 0
        return rest

    def _block(self, block: bytes) -> bytes:
        """One SSE block, its blank line included: dropped, cut, or as it came."""
        lines = _LINE_END.split(block)
        data = [line[5:] for line in lines if line.startswith(b"data:")]
        if len(data) != 1:
            return block
        payload = data[0][1:] if data[0].startswith(b" ") else data[0]
        if not payload.startswith(b"{"):
            return block
        try:
            value: Any = json.loads(payload)
        except ValueError:
            return block
        if not isinstance(value, dict) or "usage" not in value:
            return block
        usage = value["usage"]
        if isinstance(usage, dict) and value.get("choices") == []:
            self.dropped += 1
            return b""
        if usage is not None:
            return block
        cut = _cut_null_usage(payload, value)
        if cut is None:
            self.unchanged += 1
            return block
        return block.replace(payload, cut, 1)


def _cut_null_usage(payload: bytes, value: dict[str, Any]) -> bytes | None:
    """`payload` without its ``"usage": null`` member, or None when that cannot be done
    exactly (the member found more than once, or the result not the same object less it)."""
    matches = list(_NULL_USAGE.finditer(payload))
    if len(matches) != 1:
        return None
    match = matches[0]
    cut = payload[: match.start()] + payload[match.end() :]
    try:
        again = json.loads(cut)
    except ValueError:
        return None
    expected = {k: v for k, v in value.items() if k != "usage"}
    return cut if again == expected else None
