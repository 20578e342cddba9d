"""What of a proxied response goes to the tap: which calls, and in which events.

The proxy (`streamtally.cli.proxy`) forwards everything; this module decides
what it tees.  A call is recognised by its path (`source_of`), and teed when
its response is 2xx and in an encoding the tap can read (`plan`).  A
streaming response (``text/event-stream``) is fed to the tap as it passes:
its SSE events are the raw events, as `streamtally produce` would send them.
A non-streaming response is the whole JSON object the stream would have
built (a `chat.completion`, a Response, a Message, a
`GenerateContentResponse`); each adapter folds that object as one event, so
the body becomes one raw record (`body_events`), kept verbatim for audit.
Gemini's `streamGenerateContent` without ``alt=sse`` answers with a JSON
array of chunks: one raw record each.  A Responses API body still queued or
in progress (``background: true``) carries no result yet (the client fetches
it later, by another call): it is not teed.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from typing import Final

from streamtally.core.models import Source
from streamtally.core.sse import SseEvent
from streamtally.producers import TapRequest

__all__ = ["MAX_BODY_BYTES", "Tee", "TeePlan", "body_events", "plan", "source_of"]

log = logging.getLogger("streamtally.cli.proxy")

#: Bytes of a non-streaming body the tap keeps (a raw record's limit).
MAX_BODY_BYTES: Final = 4 << 20
#: Content encodings the tee can decode (the client still gets the bytes as sent).
_ENCODINGS: Final = frozenset({"identity", "gzip", "deflate"})
#: Responses API statuses of a Response that has no result yet.
_NOT_DONE: Final = frozenset({"queued", "in_progress"})


def source_of(path: str) -> Source | None:
    """The wire format of an API call, from its path; None: not tapped."""
    if path.endswith(":streamGenerateContent") or path.endswith(":generateContent"):
        return Source.GEMINI
    if path.endswith("/chat/completions"):
        return Source.OPENAI
    if path.endswith("/responses"):
        return Source.OPENAI_RESPONSES
    if path.endswith("/messages"):
        return Source.ANTHROPIC
    return None


@dataclass(frozen=True, slots=True)
class TeePlan:
    """How one response is teed: its source, SSE or a whole body, its content encoding."""

    source: Source
    streaming: bool
    encoding: str


def plan(path: str, status: int, content_type: str, encoding: str) -> TeePlan | None:
    """The tee of a response to a call on `path`, or None when it is forwarded only."""
    source = source_of(path)
    if source is None or not 200 <= status < 300:
        return None
    encoding = encoding.strip().lower() or "identity"
    if encoding not in _ENCODINGS:
        log.warning("%s: a %s body is not tapped", path, encoding)
        return None
    streaming = content_type.strip().lower().startswith("text/event-stream")
    return TeePlan(source, streaming, encoding)


def body_events(source: Source, text: str) -> list[SseEvent]:
    """The raw events of a non-streaming body: the body itself, as one event.

    A Gemini JSON array (``streamGenerateContent`` without ``alt=sse``) is one
    event per element.  A Responses API body still queued or in progress has
    none (nothing to bill yet).  Anything else, JSON or not, is passed on
    whole: the worker dead-letters what its adapter cannot read, with the reason.
    """
    head = text.lstrip()[:1]
    if head not in ("[", "{") or source not in (Source.GEMINI, Source.OPENAI_RESPONSES):
        return [SseEvent(text)]
    try:
        value = json.loads(text)
    except ValueError:
        return [SseEvent(text)]
    if source is Source.GEMINI and isinstance(value, list):
        return [SseEvent(json.dumps(part, ensure_ascii=False)) for part in value]
    if (
        source is Source.OPENAI_RESPONSES
        and isinstance(value, dict)
        and value.get("object") == "response"
        and value.get("status") in _NOT_DONE
    ):
        log.info("response %s is %s: nothing to tap yet", value.get("id"), value.get("status"))
        return []
    return [SseEvent(text)]


class Tee:
    """One teed response: decoded, then fed as SSE, or kept whole until it is complete."""

    def __init__(self, request: TapRequest, tee: TeePlan) -> None:
        self.request = request
        self.streaming = tee.streaming
        self._inflate = (
            zlib.decompressobj(wbits=47 if tee.encoding == "gzip" else zlib.MAX_WBITS)
            if tee.encoding != "identity"
            else None
        )
        self._body = bytearray()
        self._too_big = False

    async def feed(self, chunk: bytes) -> None:
        if self._inflate is not None:
            chunk = self._inflate.decompress(chunk)
        if self.streaming:
            await self.request.feed(chunk)
        elif not self._too_big:
            self._body += chunk
            if len(self._body) > MAX_BODY_BYTES:
                self._too_big = True
                self._body = bytearray()
                log.warning("a body over %d bytes is not tapped", MAX_BODY_BYTES)

    async def close(self) -> None:
        """The response is complete: a non-streaming body's events go to the tap now."""
        if self.streaming or self._too_big or not self._body:
            return
        text = self._body.decode("utf-8", errors="replace")
        for event in body_events(self.request.source, text):
            await self.request.event(event)
