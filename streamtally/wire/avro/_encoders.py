"""Encoders: the models and records of the topics to single-object messages.

Each builds the record's Avro datum field by field and writes it with the
current schema (`_codec.write`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final

from pydantic import BaseModel

from streamtally.core.models import (
    USAGE_FIELDS,
    ChoiceTokens,
    Chunk,
    Source,
    Tokens,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from streamtally.errors import AvroEncodeError
from streamtally.wire.avro._chunk_writer import check_schema, chunk_body
from streamtally.wire.avro._codec import write
from streamtally.wire.avro._raw_writer import RawSseWriter, raw_sse_body
from streamtally.wire.avro._raw_writer import check_schema as check_raw_sse_schema
from streamtally.wire.avro._schemas import CURRENT, NAMESPACE
from streamtally.wire.records import (
    BillingCorrection,
    BillingEvent,
    DeadLetter,
    RawEngineOutput,
    RawSseEvent,
    scaled_cost,
)

__all__ = [
    "Model",
    "encode_billing_correction",
    "encode_billing_event",
    "encode_chunk",
    "encode_dead_letter",
    "encode_model",
    "encode_raw_engine_output",
    "encode_raw_sse_event",
    "encode_tokens",
    "raw_sse_writer",
]

#: The models that are Avro records of their own.
Model = Usage | ToolCallDelta | Chunk | ToolCall | ChoiceTokens | Tokens


# --------------------------------------------------------------------------- models


def _usage_out(u: Usage) -> dict[str, Any]:
    return dict(zip(USAGE_FIELDS, u.counts(), strict=True))


def _tool_call_delta_out(d: ToolCallDelta) -> dict[str, Any]:
    return {"index": d.index, "id": d.id, "name": d.name, "arguments_delta": d.arguments_delta}


def _tool_call_out(t: ToolCall) -> dict[str, Any]:
    return {"index": t.index, "id": t.id, "name": t.name, "arguments": t.arguments}


def _choice_out(c: ChoiceTokens) -> dict[str, Any]:
    return {
        "index": c.index,
        "text": c.text,
        "reasoning": c.reasoning,
        "tool_calls": [_tool_call_out(t) for t in c.tool_calls],
        "finish_reason": c.finish_reason.name,
        "finish_reason_raw": c.finish_reason_raw,
    }


def _chunk_out(c: Chunk) -> dict[str, Any]:
    return {
        "request_id": c.request_id,
        "seq": c.seq,
        "source": c.source.name,
        "model": c.model,
        "choice": c.choice,
        "text_delta": c.text_delta,
        "reasoning_delta": c.reasoning_delta,
        "tool_call_deltas": [_tool_call_delta_out(d) for d in c.tool_call_deltas],
        "usage": None if c.usage is None else _usage_out(c.usage),
        "finish_reason": None if c.finish_reason is None else c.finish_reason.name,
        "finish_reason_raw": c.finish_reason_raw,
        "error": c.error,
        "event_time": c.event_time,
    }


def _tokens_out(t: Tokens) -> dict[str, Any]:
    return {
        "request_id": t.request_id,
        "source": t.source.name,
        "model": t.model,
        "text": t.text,
        "reasoning": t.reasoning,
        "tool_calls": [_tool_call_out(c) for c in t.tool_calls],
        "usage": _usage_out(t.usage),
        "finish_reason": t.finish_reason.name,
        "finish_reason_raw": t.finish_reason_raw,
        "error": t.error,
        "chunks": t.chunks,
        "choices": [_choice_out(c) for c in t.choices],
        "truncated": t.truncated,
        "provider_request_id": t.provider_request_id,
    }


# model class -> (record name, to Avro datum)
_MODEL_ENCODERS: Final[Mapping[type[BaseModel], tuple[str, Callable[[Any], dict[str, Any]]]]] = {
    Usage: ("Usage", _usage_out),
    ToolCallDelta: ("ToolCallDelta", _tool_call_delta_out),
    ToolCall: ("ToolCall", _tool_call_out),
    ChoiceTokens: ("ChoiceTokens", _choice_out),
    Chunk: ("Chunk", _chunk_out),
    Tokens: ("Tokens", _tokens_out),
}


def encode_model(obj: Model) -> bytes:
    """Encode a model (`Usage`, `ToolCallDelta`, `ToolCall`, `ChoiceTokens`, `Chunk`, `Tokens`)."""
    name, out = _MODEL_ENCODERS[type(obj)]
    return write(CURRENT[name], out(obj))


_CHUNK: Final = CURRENT["Chunk"]
check_schema(_CHUNK.parsed)
_CHUNK_HEADER: Final = _CHUNK.header
_TOKENS: Final = CURRENT["Tokens"]


def encode_chunk(chunk: Chunk) -> bytes:
    """A `Chunk` as a single-object message (value of `streamtally.chunks`).

    Written by `_chunk_writer` (the same bytes as fastavro's writer, faster).
    """
    return _CHUNK_HEADER + chunk_body(chunk)


def encode_tokens(tokens: Tokens) -> bytes:
    """A `Tokens` as a single-object message (value of `streamtally.tokens`)."""
    return write(_TOKENS, _tokens_out(tokens))


# --------------------------------------------------------------------------- records


_RAW_SSE: Final = CURRENT["RawSseEvent"]
check_raw_sse_schema(_RAW_SSE.parsed)
_RAW_SSE_HEADER: Final = _RAW_SSE.header


def encode_raw_sse_event(event: RawSseEvent) -> bytes:
    """A `RawSseEvent` as a single-object message (value of `streamtally.raw.sse`).

    Written by `_raw_writer` (the same bytes as fastavro's writer, faster).
    """
    return _RAW_SSE_HEADER + raw_sse_body(event)


def raw_sse_writer(request_id: str, source: Source, tenant: str) -> RawSseWriter:
    """The single-object messages of one request's SSE events, each as
    `encode_raw_sse_event` writes the `RawSseEvent` of the same fields
    (`RawSseWriter.value`), without making the record: the tap's path."""
    return RawSseWriter(request_id, source, tenant, _RAW_SSE_HEADER)


def _raw_sse_out(event: RawSseEvent) -> dict[str, Any]:
    """`event` as fastavro's generic writer takes it (the reference the tests compare with)."""
    return {
        "request_id": event.request_id,
        "seq": event.seq,
        "source": event.source.name,
        "tenant": event.tenant,
        "received_at": event.received_at,
        "kind": event.kind.name,
        "event": event.event,
        "data": event.data,
        "sse_id": event.sse_id,
    }


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _payload_out(source: Source, payload: Mapping[str, Any]) -> dict[str, Any]:
    if source is Source.ATOMR and payload.get("tool_call_delta") is not None:
        try:
            text = _json_text(payload["tool_call_delta"])
        except (TypeError, ValueError) as exc:
            raise AvroEncodeError(f"TokenChunk.tool_call_delta is not JSON: {exc}") from exc
        return {**payload, "tool_call_delta": text}
    return dict(payload)


def encode_raw_engine_output(output: RawEngineOutput) -> bytes:
    """A `RawEngineOutput` as a single-object message (value of `streamtally.raw.engine`).

    The payload is written as the record its source implies; keys it has
    beyond the schema are dropped.  An atomr `tool_call_delta` (any JSON
    value) is stored as its JSON text.
    """
    payload = (
        None
        if output.payload is None
        else (
            f"{NAMESPACE}.{output.payload_type}",
            _payload_out(output.source, output.payload),
        )
    )
    return write(
        CURRENT["RawEngineOutput"],
        {
            "request_id": output.request_id,
            "seq": output.seq,
            "source": output.source.name,
            "tenant": output.tenant,
            "received_at": output.received_at,
            "kind": output.kind.name,
            "payload": payload,
            "model": output.model,
            "cancelled": output.cancelled,
        },
    )


def _billing_datum(event: BillingEvent) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "request_id": event.request_id,
        "tenant": event.tenant,
        "model": event.model,
        "source": event.source.name,
        "finish_reason": event.finish_reason.name,
        **event.usage_counts(),
        "cost": scaled_cost(event.cost),
        "priced": event.priced,
        "currency": event.currency,
        "price_table_version": event.price_table_version,
        "event_time": event.event_time,
        "raw_topic": event.raw_topic,
        "raw_partition": event.raw_partition,
        "first_offset": event.first_offset,
        "last_offset": event.last_offset,
        "raw_sha256": event.raw_sha256,
        "usage_source": event.usage_source.name,
        "provider_request_id": event.provider_request_id,
        "revision": event.revision,
        "supersedes": event.supersedes,
    }


def encode_billing_event(event: BillingEvent) -> bytes:
    """A `BillingEvent` as a single-object message (value of `streamtally.billing`)."""
    return write(CURRENT["BillingEvent"], _billing_datum(event))


def encode_billing_correction(correction: BillingCorrection) -> bytes:
    """A `BillingCorrection` (value of `streamtally.billing.corrections`)."""
    c = correction
    return write(
        CURRENT["BillingCorrection"],
        {
            "correction_id": c.correction_id,
            "audit_id": c.audit_id,
            "reason": c.reason,
            "field": c.field,
            "tenant": c.tenant,
            "request_id": c.request_id,
            "model": c.model,
            "day": c.day,
            "expected": c.expected,
            "found": c.found,
            "superseded_event_id": c.superseded_event_id,
            "billing_before": {str(p): o for p, o in sorted(c.billing_before.items())},
            "corrected": None if c.corrected is None else _billing_datum(c.corrected),
            **{name: getattr(c, name) for name in USAGE_FIELDS},
            "requests": c.requests,
            "cost": scaled_cost(c.cost),
            "currency": c.currency,
            "created_at": c.created_at,
        },
    )


def encode_dead_letter(letter: DeadLetter) -> bytes:
    """A `DeadLetter` as a single-object message (value of `streamtally.deadletter`)."""
    return write(
        CURRENT["DeadLetter"],
        {
            "topic": letter.topic,
            "partition": letter.partition,
            "offset": letter.offset,
            "key": letter.key,
            "value": letter.value,
            "reason": letter.reason,
            "error_type": letter.error_type,
            "source": letter.source,
            "request_id": letter.request_id,
            "dead_lettered_at": letter.dead_lettered_at,
        },
    )
