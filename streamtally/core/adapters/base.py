"""What every adapter is: per-request state that turns raw events into drafts.

An adapter sees one request's raw events in order (`feed`), then the end of
the stream (`end`).  It returns `Draft`s: the content of a chunk without the
request-level envelope (request id, sequence number, time), which the
`Normalizer` adds.  Adapters keep only the state their wire format forces on
them (a block's type, a running token count, a cumulative text to diff).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from streamtally.core.models import FinishReason, Source, ToolCallDelta, Usage
from streamtally.core.sse import NonSseLine, SseEvent
from streamtally.errors import InvalidEvent

__all__ = [
    "Adapter",
    "AdapterOptions",
    "Draft",
    "ToolKeys",
    "as_int",
    "as_str",
    "event_object",
    "load_json",
]


@dataclass(slots=True)
class Draft:
    """The normalised content of one raw event (for one choice)."""

    choice: int = 0
    text: str = ""
    reasoning: str = ""
    #: A list when there are tool-call deltas (none: the shared empty tuple, never mutated).
    tools: Sequence[ToolCallDelta] = ()
    usage: Usage | None = None
    finish: FinishReason | None = None
    finish_raw: str | None = None
    error: str | None = None

    def carries_anything(self) -> bool:
        return bool(
            self.text
            or self.reasoning
            or self.tools
            or self.usage is not None
            or self.finish is not None
            or self.error is not None
        )


@dataclass(frozen=True, slots=True)
class AdapterOptions:
    """Per-stream settings that the wire format itself does not carry."""

    #: vLLM `RequestOutputKind` when a line does not say: "DELTA" or "CUMULATIVE".
    vllm_output_kind: str = "DELTA"


class Adapter(ABC):
    """Turns one request's raw events of one source into drafts."""

    source: ClassVar[Source]
    #: Whether the last usage this adapter returned was counted by the adapter itself from
    #: the token ids the engine emitted, not reported in the stream (vLLM always; Dynamo
    #: while it reports no `completion_usage`): `BillingEvent.usage_source`.
    counted: bool = False

    def __init__(self, options: AdapterOptions | None = None) -> None:
        self.options = options or AdapterOptions()
        #: The provider's own id for the request, once seen.
        self.provider_request_id: str | None = None
        #: The model, once known.
        self.model: str | None = None

    @abstractmethod
    def feed(self, event: Any) -> list[Draft]:
        """Apply one raw event; raise `InvalidEvent` if it is not of this source."""

    def end(self) -> list[Draft]:
        """The stream is over: drafts for anything still pending."""
        return []

    @classmethod
    def take_trailing_body(cls, lines: Sequence[NonSseLine]) -> SseEvent | None:
        """One more event made of the text that is not SSE at the end of a stream, or None.

        `lines` are the decoder's non-SSE lines after the stream's last SSE
        line (`SseDecoder.trailing_non_sse`).  Text that is not SSE never
        becomes an event: it stays on the decoder's side channel.  A source
        whose provider is documented to put something there overrides this,
        and takes all of `lines` or none (only `gemini` does).
        """
        del lines
        return None

    def _see_id(self, value: object) -> None:
        if self.provider_request_id is None and isinstance(value, str) and value:
            self.provider_request_id = value

    def _see_model(self, value: object) -> None:
        if self.model is None and isinstance(value, str) and value:
            self.model = value


class ToolKeys:
    """Resolves each OpenAI-shaped tool-call entry of one choice to its index.

    The key is the entry's `index`; without one, a known non-empty `id`; without
    either, the latest call (a continuation).  A new id without an index starts
    the next call.
    """

    __slots__ = ("by_id", "latest", "next")

    def __init__(self) -> None:
        self.by_id: dict[str, int] = {}
        self.latest: int | None = None
        self.next = 0

    def index_of(self, entry: Mapping[str, Any]) -> int:
        call_id = as_str(entry.get("id"))
        index = entry.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            if call_id in self.by_id:
                index = self.by_id[call_id]
            elif call_id or self.latest is None:
                index = self.next
            else:
                index = self.latest
        if call_id:
            self.by_id.setdefault(call_id, index)
        self.latest = index
        self.next = max(self.next, index + 1)
        return index


#: Data that carries no JSON on purpose: blank, or a comment wrapped in `data:`.
_KEEP_ALIVE = re.compile(r"[ \t\r\n]*(?::|\Z)")


#: The largest token count a record can carry (an Avro long, a Redis counter).
MAX_COUNT = 2**63 - 1


def load_json(text: str | bytes) -> Any:
    """`text` parsed as JSON; `ValueError` when it is not JSON (or nests too deeply).

    Strings must be Unicode text: a lone surrogate escape (``"\\ud800"``), which
    no UTF-8 record, topic or terminal can carry, makes the JSON invalid.
    """
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:  # what orjson refuses but JSON allows (integers beyond 64 bits, lone surrogates)
        value = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    _check_text(value)
    return value


def _check_text(value: Any) -> None:
    """ValueError when a string in `value` holds a lone surrogate (iterative: no recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone surrogate (not Unicode text)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def event_object(data: str, what: str) -> dict[str, Any] | None:
    """The JSON object that the data of an SSE event carries; None for a keep-alive.

    Every event of an SSE source carries one JSON object, `what` (named in
    the error).  Keep-alives carry none and are not errors: data that is
    empty or only whitespace (`data:` alone), or whose first character past
    the whitespace is `:` (a gateway's comment wrapped in `data:`, as in
    `data: : keep-alive`): neither can be the start of a JSON object, so a
    truncated one never passes as a keep-alive.  A format's own sentinel
    (OpenAI's `[DONE]`) is checked by its adapter before this.  Any other
    data that is not one JSON object (truncated or invalid JSON, or JSON of
    another type) raises `InvalidEvent`, which the processors dead-letter
    and `streamtally fold` reports as a skipped event.
    """
    if data[:1] == "{":  # the common case first: one call to orjson
        try:
            parsed: dict[str, Any] = orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
        else:
            return parsed
    elif _KEEP_ALIVE.match(data):
        return None
    try:
        value = load_json(data)
    except ValueError as exc:
        raise InvalidEvent(
            f"event data is not valid JSON ({exc}), so not a {what}: {_excerpt(data)}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidEvent(
            f"event data is JSON but not an object ({type(value).__name__}), "
            f"so not a {what}: {_excerpt(data)}"
        )
    return value


def _excerpt(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def as_str(value: object) -> str:
    """A string field, or "" when absent/null/not a string."""
    return value if isinstance(value, str) else ""


def as_int(value: object, what: str) -> int | None:
    """A token count: None when absent/null, else a non-negative int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidEvent(f"{what} is not a non-negative integer: {value!r}")
    if value > MAX_COUNT:
        raise InvalidEvent(f"{what} is beyond a 64-bit count: {value}")
    return value
