"""The normalised data model: one `Chunk` per raw event, one `Tokens` per request.

Every adapter turns its provider's raw events into `Chunk`s; `fold` turns a
request's chunks into `Tokens`.  Usage on a chunk is always the provider's
running total for the request as known after that event (never an increment),
already converted to the five-field meaning of `Usage`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeInt


class Source(StrEnum):
    """The wire format a raw event comes in."""

    OPENAI = "openai"
    OPENAI_RESPONSES = "openai-responses"
    ANTHROPIC = "anthropic"
    GEMINI = "gemini"
    DYNAMO = "dynamo"
    VLLM = "vllm"
    ATOMR = "atomr"

    @property
    def is_sse(self) -> bool:
        return self in _SSE_SOURCES


_SSE_SOURCES = frozenset({Source.OPENAI, Source.OPENAI_RESPONSES, Source.ANTHROPIC, Source.GEMINI})


class FinishReason(StrEnum):
    """Normalised finish reasons, in no particular order (see `PRECEDENCE`)."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"
    ERROR = "error"
    CANCELLED = "cancelled"


#: Higher wins when several finish signals apply to one choice.
PRECEDENCE: dict[FinishReason, int] = {
    FinishReason.STOP: 0,
    FinishReason.TOOL_CALLS: 1,
    FinishReason.CONTENT_FILTER: 2,
    FinishReason.LENGTH: 3,
    FinishReason.CANCELLED: 4,
    FinishReason.ERROR: 4,
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Usage(_Frozen):
    """Five token counts with one meaning across every provider.

    `cached_tokens` and `cache_write_tokens` are parts of `input_tokens`;
    `reasoning_tokens` is part of `output_tokens`.
    """

    input_tokens: NonNegativeInt = 0
    output_tokens: NonNegativeInt = 0
    reasoning_tokens: NonNegativeInt = 0
    cached_tokens: NonNegativeInt = 0
    cache_write_tokens: NonNegativeInt = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(**{f: getattr(self, f) + getattr(other, f) for f in USAGE_FIELDS})

    def counts(self) -> tuple[int, int, int, int, int]:
        """The five counts in `USAGE_FIELDS` order."""
        return (
            self.input_tokens,
            self.output_tokens,
            self.reasoning_tokens,
            self.cached_tokens,
            self.cache_write_tokens,
        )


#: The five usage fields, in their one order (Avro, Redis rows, JSON, tables).
USAGE_FIELDS: Final = tuple(Usage.model_fields)
ZERO_USAGE = Usage()


class ToolCallDelta(_Frozen):
    """A piece of one tool call: `index` keys the call within its choice."""

    index: NonNegativeInt
    id: str | None = None
    name: str | None = None
    arguments_delta: str = ""


class Chunk(_Frozen):
    """What one raw event carried, normalised.  `seq` is its position in the request."""

    request_id: str
    seq: NonNegativeInt
    source: Source
    model: str | None = None
    choice: NonNegativeInt = 0
    text_delta: str = ""
    reasoning_delta: str = ""
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()
    usage: Usage | None = None
    finish_reason: FinishReason | None = None
    finish_reason_raw: str | None = None
    error: str | None = None
    event_time: AwareDatetime


_USAGE_FIELDS = frozenset(Usage.model_fields)
#: `__pydantic_fields_set__` of a trusted chunk: every field was given.
CHUNK_FIELDS = frozenset(Chunk.model_fields)

# A model built without validation, from values the caller has already checked: a bare
# instance, then the four slots of every pydantic model set directly (what
# `model_construct` sets, minus its Python-level work).  `trusted_chunk`, `chunk_of` and
# `trusted_usage` are the ways to use them; the normaliser inlines `chunk_of`.
new_model = object.__new__
set_dict = BaseModel.__dict__["__dict__"].__set__
set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def trusted_chunk(**fields: Any) -> Chunk:
    """A `Chunk` from values the caller has already checked, without re-validation.

    The normaliser's hot path builds every field from checked values, and
    validating them again costs more than all the rest of a chunk's work.
    Every field must be given.  Chunks from anywhere else (a topic, a file)
    go through normal validation.
    """
    return chunk_of(fields)


def chunk_of(fields: dict[str, Any]) -> Chunk:
    """`trusted_chunk` taking its fields as a dict, which becomes the chunk's own.

    Every field must be there, in the order `Chunk` declares them (the order
    a validated chunk has, seen by `repr`), and the dict used for nothing else.
    """
    chunk: Chunk = new_model(Chunk)
    set_dict(chunk, fields)
    set_fields_set(chunk, CHUNK_FIELDS)
    set_extra(chunk, None)
    set_private(chunk, None)
    return chunk


def trusted_usage(
    input_tokens: int = 0,
    output_tokens: int = 0,
    reasoning_tokens: int = 0,
    cached_tokens: int = 0,
    cache_write_tokens: int = 0,
) -> Usage:
    """A `Usage` from counts the caller has already checked (non-negative ints)."""
    usage: Usage = new_model(Usage)
    set_dict(
        usage,
        {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "reasoning_tokens": reasoning_tokens,
            "cached_tokens": cached_tokens,
            "cache_write_tokens": cache_write_tokens,
        },
    )
    set_fields_set(usage, _USAGE_FIELDS)
    set_extra(usage, None)
    set_private(usage, None)
    return usage


class ToolCall(_Frozen):
    index: NonNegativeInt
    id: str | None
    name: str | None
    arguments: str


class ChoiceTokens(_Frozen):
    """One choice of a request with several (`n > 1`)."""

    index: NonNegativeInt
    text: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    finish_reason_raw: str | None


class Tokens(_Frozen):
    """The final record of one request.  Top-level fields describe choice 0."""

    request_id: str
    source: Source
    model: str | None
    text: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    finish_reason: FinishReason
    finish_reason_raw: str | None
    error: str | None
    chunks: NonNegativeInt
    #: Every choice, choice 0 included; empty when the request had one choice.
    choices: tuple[ChoiceTokens, ...] = Field(default=())
    #: True when the text kept (text, reasoning, tool arguments) hit the request's limit:
    #: it is a prefix; the usage still counts in full.
    truncated: bool = False
    #: The provider's own id of the call, as its stream named it (`chatcmpl-…`, `msg_…`,
    #: `resp_…`, Gemini `responseId`, an engine's `request_id`): `request_id` itself when
    #: the request is keyed by it; None when the stream named none.
    provider_request_id: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """The public JSON shape printed by `streamtally fold` and `tokens get`.

        `provider_request_id` appears only when it differs from `request_id` (a request
        keyed by an id of its own: a proxy's call id, a new call that reused a closed
        request's id): absent, the request id is the provider's own, or the stream named
        none.  So the spec's shape is unchanged for requests keyed by the provider's id.
        """
        out = self.model_dump(mode="json")
        if not self.choices:
            del out["choices"]
        if not self.truncated:
            del out["truncated"]
        if self.provider_request_id in (None, self.request_id):
            del out["provider_request_id"]
        return out


def utc_now() -> datetime:
    return datetime.now(UTC)
