"""Raw events → chunks, for one request: the adapter registry and the `Normalizer`.

`Normalizer` wraps the adapter of a source with the request-level envelope of
every chunk (request id, sequence number, model, time).  When the caller does
not know the request id yet (`streamtally fold` without `--request-id`),
drafts wait until the provider's own id shows up.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import IO, Any

import orjson

from streamtally.core.adapters.anthropic import AnthropicAdapter
from streamtally.core.adapters.base import Adapter, AdapterOptions, Draft, load_json
from streamtally.core.adapters.engines import AtomrAdapter, DynamoAdapter, VllmAdapter
from streamtally.core.adapters.gemini import GeminiAdapter
from streamtally.core.adapters.openai import OpenAIChatAdapter
from streamtally.core.adapters.openai_responses import OpenAIResponsesAdapter
from streamtally.core.fold import MAX_TEXT_BYTES, Fold
from streamtally.core.models import (
    CHUNK_FIELDS,
    Chunk,
    Source,
    Tokens,
    new_model,
    set_dict,
    set_extra,
    set_fields_set,
    set_private,
    utc_now,
)
from streamtally.core.sse import NonSseLine, SseDecoder, SseEvent
from streamtally.errors import InvalidEvent, NotAStream

__all__ = [
    "ADAPTERS",
    "Normalizer",
    "discover_request_id",
    "fallback_request_id",
    "fold_stream",
    "make_adapter",
    "read_events",
]

ADAPTERS: dict[Source, type[Adapter]] = {
    Source.OPENAI: OpenAIChatAdapter,
    Source.OPENAI_RESPONSES: OpenAIResponsesAdapter,
    Source.ANTHROPIC: AnthropicAdapter,
    Source.GEMINI: GeminiAdapter,
    Source.DYNAMO: DynamoAdapter,
    Source.VLLM: VllmAdapter,
    Source.ATOMR: AtomrAdapter,
}

_READ_SIZE = 1 << 16


def make_adapter(source: Source, options: AdapterOptions | None = None) -> Adapter:
    return ADAPTERS[source](options)


class Normalizer:
    """One request's raw events in, its chunks out."""

    __slots__ = ("_adapter", "_model", "_pending", "_request_id", "_seq", "events", "source")

    def __init__(
        self,
        source: Source,
        request_id: str | None = None,
        options: AdapterOptions | None = None,
        model: str | None = None,
    ) -> None:
        """`model` names the model when the stream does not (engine outputs never do)."""
        self.source = source
        self._model = model
        self._adapter = make_adapter(source, options)
        self._request_id = request_id
        self._pending: list[tuple[Draft, datetime]] = []
        self._seq = 0
        #: Raw events applied so far.
        self.events = 0

    @property
    def request_id(self) -> str | None:
        return self._request_id or self._adapter.provider_request_id

    @property
    def provider_request_id(self) -> str | None:
        """The provider's own id of the request, once its stream named one (whatever id the
        request is keyed by)."""
        return self._adapter.provider_request_id

    @property
    def model(self) -> str | None:
        return self._adapter.model or self._model

    @property
    def usage_counted(self) -> bool:
        """Whether the last usage of the chunks returned so far was counted by the adapter
        (from the engine's token ids) rather than reported in the stream."""
        return self._adapter.counted

    def feed(self, event: SseEvent | Any, event_time: datetime | None = None) -> list[Chunk]:
        """Apply one raw event (an `SseEvent`, or a JSON object for engines)."""
        self.events += 1
        drafts = self._adapter.feed(event)
        if not drafts:
            return []
        request_id = self._request_id or self._adapter.provider_request_id
        if request_id is None or self._pending or event_time is None:
            return self._chunks(drafts, event_time)
        return self._ready(drafts, request_id, event_time)

    def end(self, event_time: datetime | None = None, fallback_request_id: str = "") -> list[Chunk]:
        """The stream is over; `fallback_request_id` names a request with no id at all."""
        chunks = self._chunks(self._adapter.end(), event_time)
        if self._pending:
            if self.request_id is None:
                self._request_id = fallback_request_id or "unknown"
            chunks = self._flush() + chunks
        return chunks

    def _chunks(self, drafts: list[Draft], event_time: datetime | None) -> list[Chunk]:
        if not drafts:
            return []
        when = event_time or utc_now()
        request_id = self._request_id or self._adapter.provider_request_id
        if request_id is None:
            self._pending.extend((draft, when) for draft in drafts)
            return []
        out = self._flush() if self._pending else []
        out.extend(self._ready(drafts, request_id, when))
        return out

    def _flush(self) -> list[Chunk]:
        """The chunks of the drafts that waited for the request id (known now)."""
        pending, self._pending = self._pending, []
        request_id = self.request_id
        assert request_id is not None
        out: list[Chunk] = []
        for draft, when in pending:
            out.extend(self._ready([draft], request_id, when))
        return out

    def _ready(self, drafts: list[Draft], request_id: str, when: datetime) -> list[Chunk]:
        """The chunks of `drafts`, next in the request.  Once per event: kept lean."""
        model = self._adapter.model or self._model
        source = self.source
        seq = self._seq
        out: list[Chunk] = []
        for draft in drafts:
            # `chunk_of`, inline: the fields in `Chunk`'s order, no validation.
            chunk: Chunk = new_model(Chunk)
            set_dict(
                chunk,
                {
                    "request_id": request_id,
                    "seq": seq,
                    "source": source,
                    "model": model,
                    "choice": draft.choice,
                    "text_delta": draft.text,
                    "reasoning_delta": draft.reasoning,
                    "tool_call_deltas": tuple(draft.tools) if draft.tools else (),
                    "usage": draft.usage,
                    "finish_reason": draft.finish,
                    "finish_reason_raw": draft.finish_raw,
                    "error": draft.error,
                    "event_time": when,
                },
            )
            set_fields_set(chunk, CHUNK_FIELDS)
            set_extra(chunk, None)
            set_private(chunk, None)
            out.append(chunk)
            seq += 1
        self._seq = seq
        return out


def read_events(
    source: Source,
    stream: IO[bytes],
    *,
    on_non_sse: Callable[[NonSseLine], None] | None = None,
) -> Iterator[SseEvent | Any]:
    """The raw events of one transcript: SSE events, or one JSON object per line.

    For an SSE source the events are exactly those the WHATWG algorithm
    dispatches (`streamtally.core.sse`).  Text that is not SSE is no event:
    at the end of the stream `on_non_sse` hears of each such line, in order.
    The one exception is a source's own documented rule for the non-SSE text
    after its last SSE line (`Adapter.take_trailing_body`; only Gemini has
    one, for its raw JSON error body): the event it makes comes last, and the
    lines it took are not reported as non-SSE.
    """
    if source.is_sse:
        # Each read's events come as one list, chained in C rather than yielded one by one.
        return itertools.chain.from_iterable(_sse_reads(source, stream, on_non_sse))
    return _json_lines(stream)


def _sse_reads(
    source: Source, stream: IO[bytes], on_non_sse: Callable[[NonSseLine], None] | None
) -> Iterator[list[SseEvent]]:
    """`read_events` of an SSE source: the events of each read, as a list."""
    decoder = SseDecoder()
    while data := stream.read(_READ_SIZE):
        yield decoder.feed(data)
    yield decoder.close()  # no event: an unfinished last event is discarded
    trailing = decoder.trailing_non_sse()
    taken = ADAPTERS[source].take_trailing_body(trailing)
    if taken is not None:
        yield [taken]
    if on_non_sse is not None:
        # `trailing` is the end of `non_sse`: what `taken` was made of.
        unused = decoder.non_sse[: len(decoder.non_sse) - len(trailing)]
        for non_sse in unused if taken is not None else decoder.non_sse:
            on_non_sse(non_sse)


def _json_lines(stream: IO[bytes]) -> Iterator[Any]:
    """`read_events` of an engine source: one JSON value per line, blank lines skipped."""
    for number, line in enumerate(stream, start=1):
        try:  # JSON with its line end: the same value as the stripped line, in one parse
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            text = line.strip()
            if not text:
                continue
            try:
                value = load_json(text)
            except ValueError as exc:
                raise InvalidEvent(f"line {number} is not JSON: {exc}") from exc
        yield value


def fold_stream(
    source: Source,
    events: Iterable[SseEvent | Any],
    request_id: str | None = None,
    *,
    options: AdapterOptions | None = None,
    fallback_request_id: str = "",
    on_invalid: Callable[[int, InvalidEvent], None] | None = None,
    model: str | None = None,
    max_text_bytes: int = MAX_TEXT_BYTES,
) -> Tokens:
    """Normalise and fold one whole request: what `streamtally fold` prints.

    An event that is not valid for `source` is skipped, as the processors
    dead-letter it and go on (`on_invalid` hears of it), so the command and
    the pipeline give the same Tokens.  Input with no valid event at all is
    not a stream of `source`: `NotAStream`.
    """
    normalizer = Normalizer(source, request_id, options, model)
    acc: Fold | None = None  # made at the first chunk: every chunk names the request alike
    first_error: str | None = None
    now = utc_now()
    for number, event in enumerate(events, start=1):
        try:
            chunks = normalizer.feed(event, now)
        except InvalidEvent as exc:
            if first_error is None:
                first_error = f"event {number}: {exc}"
            if on_invalid is not None:
                on_invalid(number, exc)
            continue
        if chunks:
            if acc is None:
                acc = Fold(chunks[0].request_id, source, max_text_bytes=max_text_bytes)
                add = acc.add
            for chunk in chunks:
                add(chunk)
    chunks = normalizer.end(now, fallback_request_id=fallback_request_id)
    if chunks and acc is None:
        acc = Fold(chunks[0].request_id, source, max_text_bytes=max_text_bytes)
    if acc is None:
        what = "SSE events" if source.is_sse else "lines"
        detail = f" ({first_error})" if first_error else ""
        raise NotAStream(
            f"no {source.value} content in {normalizer.events} {what}{detail}: "
            f"is this a {source.value} stream? (see `streamtally fold --help` for the sources)"
        )
    for chunk in chunks:
        acc.add(chunk)
    acc.provider_request_id = normalizer.provider_request_id
    if acc.model is None:  # no chunk named it: the model the events named (as the worker)
        acc.model = normalizer.model
    return acc.result()


def fallback_request_id(data: bytes) -> str:
    """The id of a request whose stream names none: derived from its bytes, so stable."""
    return "sha256-" + hashlib.sha256(data).hexdigest()[:24]


def discover_request_id(
    source: Source, events: Iterable[SseEvent | Any], options: AdapterOptions | None = None
) -> str | None:
    """The provider's own id for the request, as `streamtally fold` reports it."""
    adapter = make_adapter(source, options)
    for event in events:
        try:
            adapter.feed(event)
        except InvalidEvent:
            continue  # the worker will dead-letter it; the id may still come later
        if adapter.provider_request_id is not None:
            return adapter.provider_request_id
    return None
