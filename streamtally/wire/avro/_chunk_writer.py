"""The Avro body of a `Chunk`, written directly: the one record the worker writes per raw event.

fastavro's generic writer resolves every nullable field's union and converts
the timestamp through its logical-type hooks, record by record: a fifth of
the worker's CPU under the pipeline benchmark went there.  The Chunk schema is
small and fixed, so its binary encoding is spelled out here, field by field
in schema order (Avro 1.11 binary encoding: longs as zig-zag varints, strings
as their UTF-8 length then bytes, a nullable field as its union branch index
then the value, an enum as its symbol index, an array as one block of its
items then 0).

It must write exactly the bytes fastavro writes: `tests/unit/wire/test_avro.py`
compares both on many chunks, and `check_schema` refuses, at import, a Chunk
schema other than the one spelled out here (a schema change must change this
module too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from streamtally.core.models import (
    USAGE_FIELDS,
    Chunk,
    FinishReason,
    Source,
    ToolCallDelta,
    Usage,
)
from streamtally.errors import AvroEncodeError

__all__ = ["check_schema", "chunk_body"]

#: The fields of the Chunk schema this module writes, with their Avro types.
CHUNK_FIELDS: Final = (
    ("request_id", "string"),
    ("seq", "long"),
    ("source", "io.streamtally.v1.Source"),
    ("model", ["null", "string"]),
    ("choice", "long"),
    ("text_delta", "string"),
    ("reasoning_delta", "string"),
    ("tool_call_deltas", "array<io.streamtally.v1.ToolCallDelta>"),
    ("usage", ["null", "io.streamtally.v1.Usage"]),
    ("finish_reason", ["null", "io.streamtally.v1.FinishReason"]),
    ("finish_reason_raw", ["null", "string"]),
    ("error", ["null", "string"]),
    ("event_time", "timestamp-micros"),
)
#: The fields of its nested records, in the order written.
NESTED_FIELDS: Final = {
    "tool_call_deltas": (
        ("index", "long"),
        ("id", ["null", "string"]),
        ("name", ["null", "string"]),
        ("arguments_delta", "string"),
    ),
    "usage": tuple((name, "long") for name in USAGE_FIELDS),
}
_LONG_MIN: Final = -(1 << 63)
_LONG_MAX: Final = (1 << 63) - 1
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH: Final = datetime(1970, 1, 1)  # noqa: DTZ001 - fastavro's reading of a naive time
#: Encodings of the longs 0..8191 (one or two bytes), the counts and indexes most fields hold.
_SMALL_LIMIT: Final = 8192
_SMALL: Final = tuple(
    bytes((n << 1,)) if n < 64 else bytes((((n << 1) & 0x7F) | 0x80, (n << 1) >> 7))
    for n in range(_SMALL_LIMIT)
)
#: The zig-zag values written in exactly eight bytes (seven bits each).
_EIGHT_BYTES: Final = 1 << 49
_NINE_BYTES: Final = 1 << 56
_NULL: Final = b"\x00"
_SOME: Final = b"\x02"  # union branch 1 (the non-null one)
_EMPTY_STRING: Final = b"\x00"
#: The record named in this module's errors.
_CHUNK: Final = "Chunk"


def _symbols(names: Sequence[str]) -> dict[str, bytes]:
    return {name: _SMALL[i] for i, name in enumerate(names)}


_SOURCE: Final = _symbols(
    ["UNKNOWN", "OPENAI", "OPENAI_RESPONSES", "ANTHROPIC", "GEMINI", "DYNAMO", "VLLM", "ATOMR"]
)
_FINISH: Final = _symbols(
    ["UNKNOWN", "STOP", "LENGTH", "TOOL_CALLS", "CONTENT_FILTER", "ERROR", "CANCELLED"]
)
#: The same, keyed by the members themselves (an enum's `.name` is a slow property).
_SOURCE_OF: Final = {member: _SOURCE[member.name] for member in Source}
_FINISH_OF: Final = {None: _NULL} | {
    member: _SOME + _FINISH[member.name] for member in FinishReason
}


def _long(n: int, record: str) -> bytes:
    """`n` as an Avro long (a zig-zag varint), for a field of `record` (the name an
    `AvroEncodeError` gives when `n` does not fit 64 bits)."""
    if 0 <= n < _SMALL_LIMIT:
        return _SMALL[n]
    if not _LONG_MIN <= n <= _LONG_MAX:
        raise AvroEncodeError(f"{record}: {n} does not fit an Avro long")
    z = (n << 1) ^ (n >> 63)
    if _EIGHT_BYTES <= z < _NINE_BYTES:  # a time in micros, Dec. 1978 to 3111
        return bytes(
            (
                (z & 0x7F) | 0x80,
                (z >> 7 & 0x7F) | 0x80,
                (z >> 14 & 0x7F) | 0x80,
                (z >> 21 & 0x7F) | 0x80,
                (z >> 28 & 0x7F) | 0x80,
                (z >> 35 & 0x7F) | 0x80,
                (z >> 42 & 0x7F) | 0x80,
                z >> 49,
            )
        )
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _string(text: str, record: str) -> bytes:
    """`text` as an Avro string (its UTF-8 length, then its bytes), for a field of `record`
    (the name an `AvroEncodeError` gives when `text` is not UTF-8: a lone surrogate).
    `_raw_writer` writes its strings with it too, and its longs with `_long`."""
    if not text:
        return _EMPTY_STRING
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise AvroEncodeError(f"{record}: {exc}") from exc
    n = len(data)
    return (_SMALL[n] if n < _SMALL_LIMIT else _long(n, record)) + data


def _optional_string(text: str | None) -> bytes:
    return _NULL if text is None else _SOME + _string(text, _CHUNK)


def _micros(moment: datetime) -> int:
    delta = moment - (_EPOCH if moment.tzinfo is not None else _NAIVE_EPOCH)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> bytes:
    if not deltas:
        return _NULL  # an empty array: one block of 0 items
    parts = [_long(len(deltas), _CHUNK)]
    for d in deltas:
        parts += (
            _long(d.index, _CHUNK),
            _optional_string(d.id),
            _optional_string(d.name),
            _string(d.arguments_delta, _CHUNK),
        )
    parts.append(_NULL)
    return b"".join(parts)


def _usage(usage: Usage) -> bytes:
    return _SOME + b"".join(
        [_SMALL[n] if 0 <= n < _SMALL_LIMIT else _long(n, _CHUNK) for n in usage.counts()]
    )


def chunk_body(chunk: Chunk) -> bytes:
    """The Avro binary body of `chunk` under the current Chunk schema (no header).

    The helpers' common cases are spelled out inline (a call costs more than
    the work): a long below `_SMALL_LIMIT`, an empty string, a null.
    """
    fields = chunk.__dict__  # a model's fields, read without its attribute hook
    seq: int = fields["seq"]
    model: str | None = fields["model"]
    choice: int = fields["choice"]
    text: str = fields["text_delta"]
    reasoning: str = fields["reasoning_delta"]
    deltas: Sequence[ToolCallDelta] = fields["tool_call_deltas"]
    usage: Usage | None = fields["usage"]
    raw_finish: str | None = fields["finish_reason_raw"]
    error: str | None = fields["error"]
    return b"".join(
        (
            _string(fields["request_id"], _CHUNK),
            _SMALL[seq] if 0 <= seq < _SMALL_LIMIT else _long(seq, _CHUNK),
            _SOURCE_OF[fields["source"]],
            _NULL if model is None else _SOME + _string(model, _CHUNK),
            _SMALL[choice] if 0 <= choice < _SMALL_LIMIT else _long(choice, _CHUNK),
            _string(text, _CHUNK) if text else _EMPTY_STRING,
            _string(reasoning, _CHUNK) if reasoning else _EMPTY_STRING,
            _tool_call_deltas(deltas) if deltas else _NULL,
            _NULL if usage is None else _usage(usage),
            _FINISH_OF[fields["finish_reason"]],
            _NULL if raw_finish is None else _SOME + _string(raw_finish, _CHUNK),
            _NULL if error is None else _SOME + _string(error, _CHUNK),
            _long(_micros(fields["event_time"]), _CHUNK),
        )
    )


def _type_name(avro_type: Any) -> Any:
    """A field's type as `CHUNK_FIELDS` spells it, from fastavro's parsed schema."""
    if isinstance(avro_type, list):
        return [_type_name(branch) for branch in avro_type]
    if isinstance(avro_type, Mapping):
        if avro_type.get("logicalType") == "timestamp-micros":
            return "timestamp-micros"
        if avro_type["type"] == "array":
            return f"array<{_type_name(avro_type['items'])}>"
        if avro_type["type"] in ("record", "enum"):
            return avro_type["name"]
        return avro_type["type"]
    return avro_type


def check_schema(parsed: Mapping[str, Any]) -> None:
    """Refuse a Chunk schema (fastavro's parsed form) other than the one written here."""
    found = tuple((f["name"], _type_name(f["type"])) for f in parsed["fields"])
    if found != CHUNK_FIELDS:
        raise RuntimeError(
            "schemas/Chunk.avsc changed: update streamtally/wire/avro/_chunk_writer.py "
            f"(it writes {CHUNK_FIELDS}, the schema has {found})"
        )
    for name, wanted in NESTED_FIELDS.items():
        field = next(f for f in parsed["fields"] if f["name"] == name)
        (record,) = [r for r in _branches(field["type"]) if r.get("type") in ("record", "array")]
        record = record["items"] if record["type"] == "array" else record
        nested = tuple((f["name"], _type_name(f["type"])) for f in record["fields"])
        if nested != wanted:
            raise RuntimeError(
                f"the {name} record of schemas/Chunk.avsc changed: update "
                "streamtally/wire/avro/_chunk_writer.py"
            )
    symbols = {
        f["name"]: tuple(tuple(b["symbols"]) for b in _branches(f["type"]) if "symbols" in b)
        for f in parsed["fields"]
    }
    if symbols["source"] != (tuple(_SOURCE),) or symbols["finish_reason"] != (tuple(_FINISH),):
        raise RuntimeError(
            "the Source or FinishReason symbols changed: update "
            "streamtally/wire/avro/_chunk_writer.py"
        )


def _branches(avro_type: Any) -> list[Mapping[str, Any]]:
    types = avro_type if isinstance(avro_type, list) else [avro_type]
    return [t for t in types if isinstance(t, Mapping)]
