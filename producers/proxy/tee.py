"""What of a proxied call goes to the tap: which calls, in which events, under which id.

The proxy (`streamtally.producers.proxy.server`) forwards everything; this module decides
what it tees: `metered` (from the request's method and path) and `call_of`
(with its body too: a metered `Call`, or None), `upstream_headers` (what the
proxy asks of the upstream), and `Teeing.tee` (from the response's status
and headers: a `Tee`, or None), whose `TeeStats` count what it could not read.

Metered calls (`call_of`), by method and path:

| call | source | response |
|---|---|---|
| ``POST …/chat/completions`` | openai | SSE or a `chat.completion` |
| ``POST …/completions`` (legacy) | openai | SSE or a `text_completion` |
| ``POST …/embeddings`` | openai | an embeddings list |
| ``POST …/responses`` | openai-responses | SSE or a Response |
| ``GET …/responses/{id}`` (retrieve, stream resume) | openai-responses | a Response, or SSE |
| ``POST …/responses/{id}/cancel`` | openai-responses | a Response |
| ``POST …/messages`` | anthropic | SSE or a Message |
| ``POST …:generateContent``, ``…:streamGenerateContent`` | gemini | a body, an array, or SSE |
| ``POST …:embedContent``, ``…:batchEmbedContents`` | gemini | an embeddings body |

Anything else is forwarded unmetered (or refused: ``--unmetered reject``).
A response is teed when it is 2xx.  A streaming one (``text/event-stream``)
is fed to the tap as it passes: its SSE events are the raw events, as
`streamtally produce` would send them.  A non-streaming one is the whole
JSON object the stream would have built; each adapter folds that object as
one event, so the body becomes one raw record (`body_events`), kept verbatim
for audit.  Gemini's `streamGenerateContent` without ``alt=sse`` answers with
a JSON array of chunks: one raw record each.

Encodings (`streamtally.producers.proxy.encodings`): the proxy asks the upstream only for
codings the tee decodes, and the tee decodes gzip, deflate, br and zstd, in
any stack, from pieces cut anywhere; the client gets the bytes as sent.  A
response in another coding (an upstream that ignores Accept-Encoding), or
whose bytes do not decode, is forwarded, logged as an error naming its path
and counted (`TeeStats.undecodable`): never silently untapped.

The Responses API's background mode: billed once per response.  A call
created with ``background: true`` answers at once (``queued``); its result
comes by later calls: polls (``GET /responses/{id}``), a stream (``stream:
true`` on the create, or ``GET /responses/{id}?stream=true``) that may be
resumed (``&starting_after=N``), a cancel.  Every tee of such a response is
keyed by the response id (``resp_…``, the tap's request id) and numbered by
the provider, so that two calls that carry the same thing send the same
records, which the worker keeps once (a re-sent sequence number is a
duplicate; a record of a closed request is not billed again):

- a streamed event is numbered by its ``sequence_number``: the overlap of a
  resumed stream is exact duplicates.  The END marker follows the stream's
  last event once a terminal event (``response.completed``, ``.failed``,
  ``.incomplete``, ``.cancelled`` or ``error``) was teed; a stream that
  stops before one (the client or the connection went away) ends without
  END, since the response goes on upstream: its resumption brings the rest,
  or the worker's timeout closes it with what it had.
- a non-streaming body (the create's answer, a poll, a cancel) is teed only
  when its status is terminal, as record 0, then END (record 1): repeated
  polls of a finished response are the same two records.  A body still
  ``queued`` or ``in_progress`` is not teed (nothing to bill yet).  A
  retrieved Response is teed only when it says ``"background": true``: a
  foreground response was billed by its create call.
- a proxy remembers the background responses it teed to their end (the last
  100,000) and does not tee them again (`TeeStats.repeats`), which spares
  the worker the late records of a later poll.

Limits: a response both streamed and polled whose stream stopped before its
terminal event, while that stream's request is still open, gets the poll's
records as duplicates of the stream's first two (dropped): the terminal body
is then lost, and the request closes by timeout without usage (`missing`).
Resuming the stream, as the SDKs do, bills it.

Non-streaming bodies: while one arrives it is spooled (`SPOOL_MEMORY_BYTES`
in memory, then a temporary file) and read back once at its end; it is one
raw event, one record, or part records when it is over 512 KiB
(`streamtally.producers.tap`).  A body over the proxy's ``--max-body-bytes``
(`DEFAULT_MAX_BODY_BYTES`, 64 MiB) is not teed whole, never dropped either:
its usage, id and model are found in its first and last 64 KiB and teed as
a small body of the same source that folds to them
(`streamtally.producers.proxy.oversize`), with a warning (an error naming the request
when no usage is found); `Tee.oversize` says so, and the proxy counts it.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from streamtally.core.identity import new_call_id
from streamtally.core.models import Source
from streamtally.core.sse import SseDecoder, SseEvent
from streamtally.producers import Tap, TapRequest
from streamtally.producers.proxy.encodings import (
    DecodeError,
    Decoder,
    UndecodableEncoding,
    accept_encoding_upstream,
    codings_of,
    decoder_for,
)
from streamtally.producers.proxy.oversize import EDGE_BYTES, extract

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "SPOOL_MEMORY_BYTES",
    "Call",
    "Tee",
    "TeePlan",
    "TeeStats",
    "Teeing",
    "body_events",
    "call_of",
    "metered",
    "plan",
    "route_of",
    "source_of",
    "upstream_headers",
]

log = logging.getLogger("streamtally.producers.proxy")

#: Bytes of a non-streaming body teed whole unless told otherwise (``--max-body-bytes``);
#: past it, only its usage is (see `Tee`).
DEFAULT_MAX_BODY_BYTES: Final = 64 << 20
#: Bytes of a body held in memory before its spool moves to a temporary file.
SPOOL_MEMORY_BYTES: Final = 1 << 20
#: Responses API statuses of a Response that has no result yet.
_NOT_DONE: Final = frozenset({"queued", "in_progress"})
#: Responses API statuses of a Response that is over.
_TERMINAL_STATUS: Final = frozenset({"completed", "failed", "incomplete", "cancelled"})
#: Responses API stream events after which a response has nothing more to bill.
_TERMINAL_EVENTS: Final = frozenset(
    {"response.completed", "response.failed", "response.incomplete", "response.cancelled", "error"}
)
#: Events a background stream holds until it names its response.
_ID_WAIT_EVENTS: Final = 16
#: Background responses a proxy remembers as teed to their end.
_FINISHED_KEPT: Final = 100_000
#: Distinct paths counted per counter (then "other"): a metric's labels stay bounded.
_ROUTES_KEPT: Final = 100

_RETRIEVE: Final = re.compile(r"/responses/([^/]+)\Z")
_CANCEL: Final = re.compile(r"/responses/([^/]+)/cancel\Z")
#: A path segment that is a generated id (``resp_0a1b…``, ``file-…``, a uuid, a number).
_ID_SEGMENT: Final = re.compile(
    r"\A(?:[A-Za-z]{1,12}[-_][A-Za-z0-9_-]{12,}|[0-9A-Fa-f-]{16,}|[0-9]+)\Z"
)


@dataclass(frozen=True, slots=True)
class Call:
    """A metered API call, as its request says: the response's source and how it is keyed."""

    source: Source
    #: What it is (`call_of`'s table): "chat", "completions", "embeddings", "responses",
    #: "responses.retrieve", "responses.cancel", "messages", "generateContent",
    #: "streamGenerateContent", "embedContent", "batchEmbedContents".
    endpoint: str
    path: str
    #: A Responses API background response: keyed by its id, numbered by the provider.
    background: bool = False
    #: The response id the path names (retrieve, cancel).
    response_id: str | None = None


def _gemini_method(path: str) -> str | None:
    _, sep, method = path.rpartition(":")
    if sep and method in (
        "generateContent",
        "streamGenerateContent",
        "embedContent",
        "batchEmbedContents",
    ):
        return method
    return None


def call_of(method: str, path: str, body: bytes | None = None) -> Call | None:
    """The metered call a request makes (module docstring), or None: not metered.

    `body` is the request's body, read for the Responses API's ``background``
    flag only.
    """
    method = method.upper()
    if method == "GET":
        match = _RETRIEVE.search(path)
        if match is not None and match.group(1) != "input_items":
            return Call(
                Source.OPENAI_RESPONSES,
                "responses.retrieve",
                path,
                background=True,
                response_id=match.group(1),
            )
        return None
    if method != "POST":
        return None
    gemini = _gemini_method(path)
    if gemini is not None:
        return Call(Source.GEMINI, gemini, path)
    if path.endswith("/chat/completions"):
        return Call(Source.OPENAI, "chat", path)
    if path.endswith("/completions"):
        return Call(Source.OPENAI, "completions", path)
    if path.endswith("/embeddings"):
        return Call(Source.OPENAI, "embeddings", path)
    if path.endswith("/responses"):
        return Call(Source.OPENAI_RESPONSES, "responses", path, background=_background(body))
    match = _CANCEL.search(path)
    if match is not None:
        return Call(
            Source.OPENAI_RESPONSES,
            "responses.cancel",
            path,
            background=True,
            response_id=match.group(1),
        )
    if path.endswith("/messages"):
        return Call(Source.ANTHROPIC, "messages", path)
    return None


def _background(body: bytes | None) -> bool:
    """Whether a Responses API create asks for background mode (``"background": true``)."""
    if not body or b'"background"' not in body:
        return False
    try:
        value = json.loads(body)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("background") is True


def metered(method: str, path: str) -> bool:
    """Whether the proxy meters calls of this method to this path."""
    return call_of(method, path) is not None


def source_of(path: str) -> Source | None:
    """The wire format of a POST to `path`; None: not metered (see `call_of`)."""
    call = call_of("POST", path)
    return None if call is None else call.source


def route_of(path: str) -> str:
    """`path` with its generated ids as ``{id}``: a counter's label (bounded, no secrets)."""
    segments = [
        "{id}" if _ID_SEGMENT.match(segment) else segment for segment in path[:256].split("/")
    ]
    return "/".join(segments)


def upstream_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A metered call's headers to send upstream: Accept-Encoding restricted to what the tee
    decodes (`streamtally.producers.proxy.encodings.accept_encoding_upstream`)."""
    offers = [value for name, value in headers if name.lower() == "accept-encoding"]
    offer = ", ".join(offers) if offers else None
    rest = [(name, value) for name, value in headers if name.lower() != "accept-encoding"]
    return [*rest, ("Accept-Encoding", accept_encoding_upstream(offer))]


@dataclass(frozen=True, slots=True)
class TeePlan:
    """How one response is teed: its source, SSE or a whole body, its content encoding,
    and the largest body teed whole."""

    source: Source
    streaming: bool
    #: The response's Content-Encoding, lower-cased ("identity" when none).
    encoding: str
    #: The call it answers (None: a plain call of `source`).
    call: Call | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def plan(
    call: Call,
    status: int,
    content_type: str,
    encoding: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> TeePlan | None:
    """The tee of a response to `call`, or None when it is forwarded only (not 2xx).

    Raises `UndecodableEncoding` when the tee cannot read its Content-Encoding.
    """
    if not 200 <= status < 300:
        return None
    decoder_for(encoding)  # raises UndecodableEncoding
    codings = codings_of(encoding)
    streaming = content_type.strip().lower().startswith("text/event-stream")
    return TeePlan(call.source, streaming, ", ".join(codings) or "identity", call, max_body_bytes)


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


@dataclass(slots=True)
class TeeStats:
    """What the tee side of a proxy counted since it started."""

    #: Responses of metered calls not tapped (whole or in part) because their encoding
    #: could not be decoded, by path.
    undecodable: Counter[str] = field(default_factory=Counter)
    #: Background responses already teed to their end by this proxy, not teed again.
    repeats: int = 0
    #: Non-streaming bodies over ``--max-body-bytes``: teed as their usage only.
    oversize: int = 0


def _count(counter: Counter[str], path: str) -> None:
    route = route_of(path)
    if route not in counter and len(counter) >= _ROUTES_KEPT:
        route = "other"
    counter[route] += 1


class Teeing:
    """A proxy's tee side: which calls are metered, which responses teed, and the counts."""

    def __init__(self, tap: Tap, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.tap = tap
        #: The largest non-streaming body teed whole (``--max-body-bytes``).
        self.max_body_bytes = max_body_bytes
        self.stats = TeeStats()
        self._finished: OrderedDict[tuple[str, str], None] = OrderedDict()

    def tee(self, call: Call, tenant: str, status: int, headers: Any) -> Tee | None:
        """The tee of the response to `call` (its status and headers), or None.

        `headers` is the response's header multidict (``getall`` reads every
        Content-Encoding header; a plain mapping works too).
        """
        getall = getattr(headers, "getall", None)
        encodings = getall("Content-Encoding", []) if getall is not None else []
        if getall is None and headers.get("Content-Encoding"):
            encodings = [headers["Content-Encoding"]]
        try:
            tee = plan(
                call,
                status,
                headers.get("Content-Type", ""),
                ", ".join(encodings),
                max_body_bytes=self.max_body_bytes,
            )
        except UndecodableEncoding as exc:
            self.undecodable(call, str(exc))
            return None
        return None if tee is None else Tee(self.tap, tenant, tee, owner=self)

    def undecodable(self, call: Call, reason: str) -> None:
        log.error("%s: a response of a metered call is not tapped: %s", call.path, reason)
        _count(self.stats.undecodable, call.path)

    def finished(self, tenant: str, response_id: str) -> bool:
        return (tenant, response_id) in self._finished

    def finish(self, tenant: str, response_id: str) -> None:
        self._finished[tenant, response_id] = None
        if len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)


class Tee:
    """One teed response: decoded, then fed as SSE, or spooled whole until it is complete.

    A non-streaming body goes to a temporary file (in memory up to `SPOOL_MEMORY_BYTES`)
    while it arrives, and is teed whole at its end, up to `max_body_bytes`.  Past it the
    spool is dropped, its first and last `EDGE_BYTES` kept, and a synthetic body with
    the usage found in them is teed (`streamtally.producers.proxy.oversize`); `oversize` says so.
    """

    def __init__(
        self,
        tap: Tap,
        tenant: str,
        tee: TeePlan,
        *,
        owner: Teeing | None = None,
    ) -> None:
        self.tap = tap
        self.tenant = tenant
        self.plan = tee
        self.streaming = tee.streaming
        self.call = tee.call or Call(tee.source, tee.source.value, "")
        self.background = self.call.background
        self._owner = owner
        self._decoder: Decoder | None = decoder_for(tee.encoding)
        self._failed = False
        self.max_body_bytes = tee.max_body_bytes
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        self._spool: tempfile.SpooledTemporaryFile[bytes] | None = None
        #: Bytes of the (decoded) non-streaming body so far.
        self.size = 0
        #: The body passed `max_body_bytes`: only its head and tail are kept.
        self.oversize = False
        self._head = b""
        self._tail = bytearray()
        #: The tap's request: at once for a plain call; once the response id is known for
        #: a background one (None until then, and when nothing of it is teed).
        self.request: TapRequest | None = (
            None
            if self.background
            else tap.request(tee.source, tenant=tenant, request_id=new_call_id())
        )
        # A background stream: its SSE, the events held until the id, the next number.
        self._sse = SseDecoder() if self.background and self.streaming else None
        self._held: list[tuple[SseEvent, int | None]] = []
        self._response_id = self.call.response_id
        self._next = 0
        self._numbered = True
        self._terminal = False
        self._repeat = False

    async def feed(self, chunk: bytes) -> None:
        """The next piece of the response body, as the upstream sent it."""
        if self._failed:
            return
        if self._decoder is not None:
            try:
                chunk = self._decoder.decompress(chunk)
            except DecodeError as exc:
                self._fail(str(exc))
                return
        await self._take(chunk)

    async def _take(self, data: bytes) -> None:
        if not data:
            return
        if self._sse is not None:
            for event in self._sse.feed(data):
                await self._stream_event(event)
        elif self.streaming:
            assert self.request is not None
            await self.request.feed(data)
        else:
            self._spool_body(data)

    def _spool_body(self, chunk: bytes) -> None:
        """A piece of a non-streaming body: to the spool, or past the limit its head and
        tail only (the class docstring)."""
        before = self.size
        self.size += len(chunk)
        if self.oversize:
            self._tail += chunk
            del self._tail[: max(0, len(self._tail) - EDGE_BYTES)]
            return
        if self._spool is None:
            # Kept open across `feed` calls; closed at `close`, once over the limit, or
            # when the tee fails.
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

    def _body_text(self) -> str | None:
        """The whole non-streaming body, read back from its spool (closed); None: none."""
        spool, self._spool = self._spool, None
        if spool is None:
            return None
        with spool:
            spool.seek(0)
            return spool.read().decode("utf-8", errors="replace")

    def _fail(self, reason: str) -> None:
        self._failed = True
        spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()
        if self._owner is not None:
            self._owner.undecodable(self.call, reason)
        else:
            log.error("%s: a response is not tapped: %s", self.call.path, reason)

    async def close(self) -> None:
        """The response is complete: a non-streaming body's events go to the tap now."""
        if self._decoder is not None and not self._failed:
            try:
                rest = self._decoder.flush()
            except DecodeError as exc:
                self._fail(str(exc))
            else:
                await self._take(rest)
        if self._failed:
            return
        if self._sse is not None:
            for event in self._sse.close():
                await self._stream_event(event)
            return
        if self.streaming:
            return
        if self.oversize:
            await self._tee_extracted()
            return
        text = self._body_text()
        if not text:
            return
        if self.background:
            await self._background_body(text)
            return
        assert self.request is not None
        for event in body_events(self.plan.source, text):
            await self.request.event(event)

    async def _tee_extracted(self) -> None:
        """A body over `max_body_bytes`: its usage, id and model, as a small body."""
        source = self.plan.source
        if self._owner is not None:
            self._owner.stats.oversize += 1
        found = extract(
            source,
            self._head.decode("utf-8", errors="replace"),
            bytes(self._tail).decode("utf-8", errors="replace"),
        )
        if found.usage:
            log.warning(
                "%s: a %s body of %d bytes is over --max-body-bytes %d: teed as its usage, "
                "id %s and model %s (its content is not kept)",
                self.call.path,
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
                self.call.path,
                source.value,
                self.size,
                self.max_body_bytes,
                EDGE_BYTES,
                found.request_id,
                found.model,
                self.tenant,
            )
        body = json.dumps(found.body, ensure_ascii=False)
        if self.background:
            await self._background_body(body)
            return
        assert self.request is not None
        await self.request.event(SseEvent(body))

    def end(self, *, cancelled: bool = False) -> None:
        """The call is over (`cancelled`: its client went away): the END marker, if any.

        A plain call's request ends (cancelled or not).  A background response
        ends only once its terminal event or body was teed: otherwise it goes on
        upstream, and its request is left open (module docstring).
        """
        if not self.background:
            assert self.request is not None
            self.request.end(cancelled=cancelled)
            return
        if self.request is None and self._held:
            self._open_unnamed()
            self._flush_held_now()
        if self.request is None:
            return
        if self._terminal or not self._numbered:
            self.request.end(cancelled=cancelled and not self._terminal)
            if self._terminal and self._response_id is not None and self._owner is not None:
                self._owner.finish(self.tenant, self._response_id)
        else:
            self.request.suspend()

    # -- background responses ---------------------------------------------------------

    def _seen(self, response_id: str) -> bool:
        if self._owner is not None and self._owner.finished(self.tenant, response_id):
            self._owner.stats.repeats += 1
            log.info("response %s was teed to its end already: not teed again", response_id)
            return True
        return False

    async def _background_body(self, text: str) -> None:
        """A Response (the create's answer, a poll, a cancel): teed when it is terminal."""
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict) or value.get("object") != "response":
            log.warning("%s: the body is not a Response: not tapped", self.call.path)
            return
        response_id = value.get("id")
        status = value.get("status")
        if not isinstance(response_id, str) or not response_id:
            log.warning("%s: a Response without an id: not tapped", self.call.path)
            return
        if status not in _TERMINAL_STATUS:
            log.info("response %s is %s: nothing to tap yet", response_id, status)
            return
        if self.call.endpoint == "responses.retrieve" and value.get("background") is not True:
            log.info("response %s is no background response: billed by its create", response_id)
            return
        if self._seen(response_id):
            return
        self._response_id = response_id
        self.request = self.tap.request(
            self.plan.source, tenant=self.tenant, request_id=response_id
        )
        # Stamped with the provider's own time, so that every poll of it makes the same
        # record: a copy, which the worker never takes for a new call of the same id.
        when = _provider_time(value, "completed_at", "created_at")
        await self.request.event(SseEvent(text), seq=0, received_at=when)
        self._terminal = True

    async def _stream_event(self, event: SseEvent) -> None:
        """One event of a background stream: numbered by its `sequence_number`."""
        if self._repeat:
            return
        obj = _object(event.data)
        seq = obj.get("sequence_number")
        number = seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None
        if obj.get("type") in _TERMINAL_EVENTS:
            self._terminal = True
        if self.request is None:
            if self._response_id is None:
                response = obj.get("response")
                if isinstance(response, dict) and isinstance(response.get("id"), str):
                    self._response_id = response["id"] or None
            self._held.append((event, number))
            if self._response_id is not None:
                if self._seen(self._response_id):
                    self._repeat = True
                    self._held = []
                    return
                self.request = self.tap.request(
                    self.plan.source, tenant=self.tenant, request_id=self._response_id
                )
            elif len(self._held) >= _ID_WAIT_EVENTS:
                log.error(
                    "%s: no response id in the first %d events of a background stream: "
                    "teed as a call of its own",
                    self.call.path,
                    len(self._held),
                )
                self._open_unnamed()
            else:
                return
            held, self._held = self._held, []
            for item, item_number in held:
                await self._send(item, item_number)
            return
        await self._send(event, number)

    async def _send(self, event: SseEvent, number: int | None) -> None:
        assert self.request is not None
        if not self._numbered:
            await self.request.event(event)
            return
        seq = self._next if number is None else number
        self._next = max(self._next, seq + 1)
        when = None
        if seq == 0:  # the first record: stamped with the response's creation (see above)
            response = _object(event.data).get("response")
            if isinstance(response, dict):
                when = _provider_time(response, "created_at")
        await self.request.event(event, seq=seq, received_at=when)

    def _open_unnamed(self) -> None:
        """A background stream that never named its response: a call of its own, numbered
        by the tap (the provider id it finds, or its fallback)."""
        self._numbered = False
        self.request = self.tap.request(
            self.plan.source, tenant=self.tenant, request_id=new_call_id()
        )

    def _flush_held_now(self) -> None:
        """At the end, held events of a stream that named no response (nothing waits)."""
        assert self.request is not None
        held, self._held = self._held, []
        for event, _ in held:
            self.request._event_now(event)


def _provider_time(value: dict[str, Any], *keys: str) -> datetime | None:
    """The first of `keys` that holds a plausible Unix time (seconds), as an aware UTC
    datetime; None when none does (the tap's clock is used then)."""
    for key in keys:
        seconds = value.get(key)
        if (
            isinstance(seconds, int | float)
            and not isinstance(seconds, bool)
            and 0 < seconds < 32_503_680_000  # before the year 3000
        ):
            return datetime.fromtimestamp(seconds, tz=UTC)
    return None


def _object(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
