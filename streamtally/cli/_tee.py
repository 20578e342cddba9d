"""What of a proxied response goes to the tap: which calls, and in which events.

The proxy (`streamtally.cli.proxy`) forwards everything; this module decides
what it tees.  A call is recognised by its path (`source_of`), and teed when
its response is 2xx and in an encoding the tap can read (`plan`).  A
streaming response (``text/event-stream``) is fed to the tap as it passes:
its SSE events are the raw events, as `streamtally produce` would send them.
A non-streaming response is the whole JSON object the stream would have
built (a `chat.completion`, a Response, a Message, a
`GenerateContentResponse`); each adapter folds that object as one event, so
the body becomes one raw event (`body_events`), kept verbatim for audit: one
record, or part records when it is over 512 KiB (`streamtally.producers.tap`).
While it arrives the body is spooled (`SPOOL_MEMORY_BYTES` in memory, then a
temporary file), and read back once at its end.  A body over the proxy's
``--max-body-bytes`` (`DEFAULT_MAX_BODY_BYTES`, 64 MiB) is not teed whole,
never dropped either: its usage, id and model are found in its first and last
64 KiB and teed as a small body of the same source that folds to them
(`streamtally.cli._oversize`), with a warning (an error naming the request
when no usage is found); `Tee.oversize` says so, and the proxy counts it.
Gemini's `streamGenerateContent` without ``alt=sse`` answers with a JSON
array of chunks: one raw record each.  A Responses API body still queued or
in progress (``background: true``) carries no result yet (the client fetches
it later, by another call): it is not teed.
"""

from __future__ import annotations

import json
import logging
import tempfile
import zlib
from dataclasses import dataclass, field
from typing import Final

from streamtally.cli._oversize import EDGE_BYTES, extract
from streamtally.core.models import Source
from streamtally.core.sse import SseEvent
from streamtally.producers import TapRequest

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "SPOOL_MEMORY_BYTES",
    "Tee",
    "TeePlan",
    "body_events",
    "plan",
    "source_of",
]

log = logging.getLogger("streamtally.cli.proxy")

#: Bytes of a non-streaming body teed whole unless told otherwise (``--max-body-bytes``);
#: past it, only its usage is (see `Tee`).
DEFAULT_MAX_BODY_BYTES: Final = 64 << 20
#: Bytes of a body held in memory before its spool moves to a temporary file.
SPOOL_MEMORY_BYTES: Final = 1 << 20
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
    """How one response is teed: its source, SSE or a whole body, its content encoding,
    and the largest body teed whole."""

    source: Source
    streaming: bool
    encoding: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: The call's path (named in the log lines of an oversized body).
    path: str = field(default="", compare=False)


def plan(
    path: str,
    status: int,
    content_type: str,
    encoding: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> TeePlan | None:
    """The tee of a response to a call on `path`, or None when it is forwarded only."""
    source = source_of(path)
    if source is None or not 200 <= status < 300:
        return None
    encoding = encoding.strip().lower() or "identity"
    if encoding not in _ENCODINGS:
        log.warning("%s: a %s body is not tapped", path, encoding)
        return None
    streaming = content_type.strip().lower().startswith("text/event-stream")
    return TeePlan(source, streaming, encoding, max_body_bytes, path)


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
    """One teed response: decoded, then fed as SSE, or spooled whole until it is complete.

    A non-streaming body goes to a temporary file (in memory up to `SPOOL_MEMORY_BYTES`)
    while it arrives, and is teed whole at its end, up to `max_body_bytes`.  Past it the
    spool is dropped, its first and last `EDGE_BYTES` kept, and a synthetic body with
    the usage found in them is teed (`streamtally.cli._oversize`); `oversize` says so.
    """

    def __init__(
        self, request: TapRequest, tee: TeePlan, *, max_body_bytes: int | None = None
    ) -> None:
        self.request = request
        self.streaming = tee.streaming
        self.path = tee.path
        self.max_body_bytes = tee.max_body_bytes if max_body_bytes is None else max_body_bytes
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        self._inflate = (
            zlib.decompressobj(wbits=47 if tee.encoding == "gzip" else zlib.MAX_WBITS)
            if tee.encoding != "identity"
            else None
        )
        self._spool: tempfile.SpooledTemporaryFile[bytes] | None = None
        #: Bytes of the (decoded) body so far.
        self.size = 0
        #: The body passed `max_body_bytes`: only its head and tail are kept.
        self.oversize = False
        self._head = b""
        self._tail = bytearray()

    async def feed(self, chunk: bytes) -> None:
        if self._inflate is not None:
            chunk = self._inflate.decompress(chunk)
        if self.streaming:
            await self.request.feed(chunk)
            return
        before = self.size
        self.size += len(chunk)
        if self.oversize:
            self._tail += chunk
            del self._tail[: max(0, len(self._tail) - EDGE_BYTES)]
            return
        if self._spool is None:
            # Kept open across `feed` calls; closed at `close` or once over the limit.
            self._spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115
        if self.size <= self.max_body_bytes:
            self._spool.write(chunk)
            return
        # Past the limit: keep the head and the tail, drop the spool.
        spool, self._spool = self._spool, None
        spool.seek(0)
        self._head = spool.read(EDGE_BYTES)
        spool.seek(max(0, before - EDGE_BYTES))
        self._tail = bytearray(spool.read()) + chunk
        del self._tail[: max(0, len(self._tail) - EDGE_BYTES)]
        if len(self._head) < EDGE_BYTES:  # a limit below the head's size
            self._head = bytes(self._head + chunk)[:EDGE_BYTES]
        spool.close()
        self.oversize = True

    async def close(self) -> None:
        """The response is complete: a non-streaming body's events go to the tap now."""
        if self.streaming:
            return
        if self.oversize:
            await self._tee_extracted()
            return
        spool, self._spool = self._spool, None
        if spool is None:
            return
        with spool:
            spool.seek(0)
            text = spool.read().decode("utf-8", errors="replace")
        for event in body_events(self.request.source, text):
            await self.request.event(event)

    async def _tee_extracted(self) -> None:
        source = self.request.source
        found = extract(
            source,
            self._head.decode("utf-8", errors="replace"),
            bytes(self._tail).decode("utf-8", errors="replace"),
        )
        if found.usage:
            log.warning(
                "%s: a %s body of %d bytes is over --max-body-bytes %d: teed as its usage, "
                "id %s and model %s (its content is not kept)",
                self.path,
                source.value,
                self.size,
                self.max_body_bytes,
                found.request_id,
                found.model,
            )
        else:
            log.error(
                "%s: a %s body of %d bytes is over --max-body-bytes %d and its usage was not "
                "found in its last %d bytes: request %s (model %s, tenant %s) teed without usage",
                self.path,
                source.value,
                self.size,
                self.max_body_bytes,
                EDGE_BYTES,
                found.request_id,
                found.model,
                self.request.tenant,
            )
        await self.request.event(SseEvent(json.dumps(found.body, ensure_ascii=False)))
