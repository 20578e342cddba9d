"""Decoders: single-object messages to the models and records of the topics.

Each reads the datum with `_codec.read` (resolving an older or newer writer
schema to the current one) and builds the typed value from it (`chunk_of`,
`billing_event_of`, ...: `_confluent.FramingDecoders` builds them from a datum
of either framing), refusing with `AvroDecodeError` what it cannot represent
(an `UNKNOWN` enum symbol, a payload of the wrong branch, a field the model's
validation rejects).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, TypeVar

from pydantic import BaseModel, ValidationError

from streamtally.core.models import (
    ChoiceTokens,
    Chunk,
    FinishReason,
    Source,
    Tokens,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from streamtally.errors import AvroDecodeError
from streamtally.wire.avro._codec import read
from streamtally.wire.avro._schemas import NAMESPACE
from streamtally.wire.records import (
    ENGINE_PAYLOAD_TYPES,
    BillingCorrection,
    BillingEvent,
    DeadLetter,
    EventKind,
    RawEngineOutput,
    RawSseEvent,
    UsageSource,
)

if TYPE_CHECKING:
    from streamtally.wire.avro._encoders import Model

__all__ = [
    "billing_correction_of",
    "billing_event_of",
    "chunk_of",
    "dead_letter_of",
    "decode_billing_correction",
    "decode_billing_event",
    "decode_chunk",
    "decode_dead_letter",
    "decode_model",
    "decode_raw_engine_output",
    "decode_raw_sse_event",
    "decode_tokens",
    "model_of",
    "model_record",
    "raw_engine_output_of",
    "raw_sse_event_of",
    "tokens_of",
]

M = TypeVar("M", bound="Model")
_ModelT = TypeVar("_ModelT", bound=BaseModel)
_E = TypeVar("_E")
_R = TypeVar("_R")

# --------------------------------------------------------------------------- enums

_SOURCES: Final = {s.name: s for s in Source}
_FINISH_REASONS: Final = {f.name: f for f in FinishReason}
_KINDS: Final = {k.name: k for k in EventKind}


def _symbol(table: Mapping[str, _E], symbol: str, what: str) -> _E:
    try:
        return table[symbol]
    except KeyError:
        raise AvroDecodeError(f"{what} {symbol!r} is unknown to this version") from None


def _source(symbol: str) -> Source:
    return _symbol(_SOURCES, symbol, "source")


def _finish(symbol: str | None) -> FinishReason | None:
    return None if symbol is None else _symbol(_FINISH_REASONS, symbol, "finish reason")


def _kind(symbol: str) -> EventKind:
    return _symbol(_KINDS, symbol, "event kind")


# --------------------------------------------------------------------------- models


def _choice_in(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "finish_reason": _finish(r["finish_reason"])}


def _chunk_in(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "source": _source(r["source"]), "finish_reason": _finish(r["finish_reason"])}


def _tokens_in(r: dict[str, Any]) -> dict[str, Any]:
    return {
        **r,
        "source": _source(r["source"]),
        "finish_reason": _finish(r["finish_reason"]),
        "choices": [_choice_in(c) for c in r["choices"]],
    }


def _same(r: dict[str, Any]) -> dict[str, Any]:
    return r


# model class -> (record name, Avro datum -> model fields)
_MODEL_DECODERS: Final[
    Mapping[type[BaseModel], tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]]
] = {
    Usage: ("Usage", _same),
    ToolCallDelta: ("ToolCallDelta", _same),
    ToolCall: ("ToolCall", _same),
    ChoiceTokens: ("ChoiceTokens", _choice_in),
    Chunk: ("Chunk", _chunk_in),
    Tokens: ("Tokens", _tokens_in),
}


def _validate(cls: type[_ModelT], fields: dict[str, Any]) -> _ModelT:
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise AvroDecodeError(f"decoded record is not a valid {cls.__name__}: {exc}") from exc


def model_record(cls: type[BaseModel]) -> str:
    """The Avro record a model class is written as."""
    return _MODEL_DECODERS[cls][0]


def model_of(cls: type[M], r: dict[str, Any]) -> M:
    """An instance of `cls` from the datum of its record."""
    return _validate(cls, _MODEL_DECODERS[cls][1](r))


def chunk_of(r: dict[str, Any]) -> Chunk:
    return _validate(Chunk, _chunk_in(r))


def tokens_of(r: dict[str, Any]) -> Tokens:
    return _validate(Tokens, _tokens_in(r))


def decode_model(cls: type[M], data: bytes) -> M:
    """Decode a message of the record named like `cls` into an instance of `cls`."""
    name, fields_in = _MODEL_DECODERS[cls]
    return _validate(cls, fields_in(read(name, data)))


def decode_chunk(data: bytes) -> Chunk:
    return chunk_of(read("Chunk", data))


def decode_tokens(data: bytes) -> Tokens:
    return tokens_of(read("Tokens", data))


# --------------------------------------------------------------------------- records


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AvroDecodeError(message)


def _record(cls: Callable[..., _R], fields: dict[str, Any]) -> _R:
    try:
        return cls(**fields)
    except (ValueError, TypeError) as exc:
        raise AvroDecodeError(
            f"decoded record is not a valid {getattr(cls, '__name__', cls)}: {exc}"
        ) from exc


# One raw record per message is the hot path: a record the dataclass would accept is made
# without its generated `__init__` (keyword arguments, one interpreted `object.__setattr__`
# per field of a frozen class, an interpreted `__post_init__`): a bare instance, its
# slots set from here.  Only what passes checks at least as strict as `__post_init__`'s
# is made so (its time in the codec's own UTC; a valid source, id and seq, of the right
# types); anything else goes through the constructor, which refuses it with its reason.
# `tests/unit/wire/test_raw_record_fast_path.py` holds both ways to the same records.
_new: Final = object.__new__
_set: Final = object.__setattr__
#: The fields of each record, in its order: a bare instance gets every one from the datum.
_RAW_SSE_FIELDS: Final = tuple(f.name for f in dataclasses.fields(RawSseEvent))
_RAW_ENGINE_FIELDS: Final = tuple(f.name for f in dataclasses.fields(RawEngineOutput))
_SSE_SOURCES: Final = frozenset(s for s in Source if s.is_sse)
_ENGINE_SOURCES: Final = frozenset(ENGINE_PAYLOAD_TYPES)


def _plain(request_id: object, seq: object, received_at: object) -> bool:
    """Whether `_check_common` would pass these, and they are the codec's own types."""
    return (
        type(request_id) is str
        and request_id != ""
        and type(seq) is int
        and seq >= 0
        and type(received_at) is datetime
        and received_at.tzinfo is UTC
    )


def _bare(cls: type[_R], names: tuple[str, ...], r: dict[str, Any]) -> _R:
    """An instance of `cls` with each field of `names` set to the datum's value, unchecked."""
    record: _R = _new(cls)
    for name in names:
        _set(record, name, r[name])
    return record


def decode_raw_sse_event(data: bytes) -> RawSseEvent:
    return raw_sse_event_of(read("RawSseEvent", data))


def raw_sse_event_of(r: dict[str, Any]) -> RawSseEvent:
    # The enums in place, in the datum itself: it is ours (one raw event, the hot path).
    source = r["source"] = _source(r["source"])
    r["kind"] = _kind(r["kind"])
    if not (source in _SSE_SOURCES and _plain(r["request_id"], r["seq"], r["received_at"])):
        return _record(RawSseEvent, r)  # refused there, with the reason
    return _bare(RawSseEvent, _RAW_SSE_FIELDS, r)


def _payload_in(source: Source, payload: dict[str, Any]) -> dict[str, Any]:
    text = payload.get("tool_call_delta") if source is Source.ATOMR else None
    if text is None:
        return payload
    try:
        return {**payload, "tool_call_delta": json.loads(text)}
    except ValueError as exc:
        raise AvroDecodeError(f"TokenChunk.tool_call_delta is not JSON text: {exc}") from exc


#: The union branch of `RawEngineOutput.payload` each engine source writes, by full name.
_PAYLOAD_BRANCHES: Final = {s: f"{NAMESPACE}.{t}" for s, t in ENGINE_PAYLOAD_TYPES.items()}


def decode_raw_engine_output(data: bytes) -> RawEngineOutput:
    """Decode a raw engine output; its payload is the dict the engine's JSON line parses to."""
    return raw_engine_output_of(read("RawEngineOutput", data, record_names=True))


def raw_engine_output_of(r: dict[str, Any]) -> RawEngineOutput:
    """The datum read with record names (the payload's branch named)."""
    source = _source(r["source"])
    raw = r["payload"]
    payload: dict[str, Any] | None = None
    if raw is not None:
        _require(isinstance(raw, tuple) and len(raw) == 2, "RawEngineOutput: unnamed payload")
        branch, body = raw
        if branch != _PAYLOAD_BRANCHES.get(source):
            raise AvroDecodeError(
                f"RawEngineOutput: a {source.value} output carries a {branch.rpartition('.')[2]}"
            )
        payload = _payload_in(source, body)
    kind = _kind(r["kind"])
    r["source"], r["kind"], r["payload"] = source, kind, payload
    cancelled = r["cancelled"]
    if not (
        source in _ENGINE_SOURCES
        and _plain(r["request_id"], r["seq"], r["received_at"])
        and (payload is None or kind is not EventKind.END)
        and (cancelled is False or (cancelled is True and kind is EventKind.END))
    ):
        return _record(RawEngineOutput, r)  # refused there, with the reason
    return _bare(RawEngineOutput, _RAW_ENGINE_FIELDS, r)


def billing_event_of(r: dict[str, Any]) -> BillingEvent:
    finish = _finish(r["finish_reason"])
    _require(finish is not None, "BillingEvent: no finish reason")
    fields = {
        **r,
        "source": _source(r["source"]),
        "finish_reason": finish,
        "usage_source": UsageSource[r["usage_source"]],
    }
    return _record(BillingEvent, fields)


def decode_billing_event(data: bytes) -> BillingEvent:
    """A billing event written with any released version of its schema.

    One written before `priced` existed (version 1) reads as priced, the field's default.
    One written before the provenance fields existed (versions 1 and 2) reads with their
    defaults: `raw_topic`, `raw_partition`, the offsets and `raw_sha256` None and
    `usage_source` UNKNOWN, which say that the event carries no provenance.  One written
    before `provider_request_id` existed (versions 1 to 3) reads it as None, and one
    written before revisions (versions 1 to 4) as revision 0, superseding none.
    """
    return billing_event_of(read("BillingEvent", data))


def decode_billing_correction(data: bytes) -> BillingCorrection:
    """A correction (`streamtally.billing.corrections`) written with any version of its schema."""
    return billing_correction_of(read("BillingCorrection", data))


def billing_correction_of(r: dict[str, Any]) -> BillingCorrection:
    before: dict[int, int] = {}
    for partition, offset in r["billing_before"].items():
        _require(partition.isdigit(), f"BillingCorrection: bad partition {partition!r}")
        before[int(partition)] = offset
    corrected = None if r["corrected"] is None else billing_event_of(r["corrected"])
    fields = {**r, "billing_before": before, "corrected": corrected}
    return _record(BillingCorrection, fields)


def decode_dead_letter(data: bytes) -> DeadLetter:
    return dead_letter_of(read("DeadLetter", data))


def dead_letter_of(r: dict[str, Any]) -> DeadLetter:
    return _record(DeadLetter, r)
