"""The Avro body of a `Chunk`, written directly: the one record the worker writes per raw event.

fastavro's generic writer resolves every nullable field's union and converts
the timestamp through its logical-type hooks, record by record: a fifth of
the worker's CPU under the pipeline benchmark went there.  The Chunk schema is
small and fixed, so its binary encoding is spelled out here, field by field
in schema order (Avro 1.11 binary encoding: longs as zig-zag varints, strings
as their UTF-8 length then bytes, a nullable field as its union branch index
then the value, an enum as its symbol index, an array as one block of its
items then 0).

It must write exactly the bytes fastavro writes: `tests/unit/test_avro.py`
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
from streamtally.wire.avro._errors import AvroEncodeError

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
#: Encodings of the longs 0..1023, the counts and indexes most fields hold.
_SMALL: Final = tuple(
    bytes((n << 1,)) if n < 64 else bytes((((n << 1) & 0x7F) | 0x80, (n << 1) >> 7))
    for n in range(1024)
)
_NULL: Final = b"\x00"
_SOME: Final = b"\x02"  # union branch 1 (the non-null one)
_EMPTY_STRING: Final = b"\x00"


def _symbols(names: Sequence[str]) -> dict[str, bytes]:
    return {name: _SMALL[i] for i, name in enumerate(names)}


_SOURCE: Final = _symbols(
    ["UNKNOWN", "OPENAI", "OPENAI_RESPONSES", "ANTHROPIC", "GEMINI", "DYNAMO", "VLLM", "ATOMR"]
)
_FINISH: Final = _symbols(
    ["UNKNOWN", "STOP", "LENGTH", "TOOL_CALLS", "CONTENT_FILTER", "ERROR", "CANCELLED"]
)


def _long(n: int) -> bytes:
    if 0 <= n < 1024:
        return _SMALL[n]
    if not _LONG_MIN <= n <= _LONG_MAX:
        raise AvroEncodeError(f"Chunk: {n} does not fit an Avro long")
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _string(text: str) -> bytes:
    if not text:
        return _EMPTY_STRING
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise AvroEncodeError(f"Chunk: {exc}") from exc
    return _long(len(data)) + data


def _optional_string(text: str | None) -> bytes:
    return _NULL if text is None else _SOME + _string(text)


def _micros(moment: datetime) -> int:
    delta = moment - (_EPOCH if moment.tzinfo is not None else _NAIVE_EPOCH)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> bytes:
    if not deltas:
        return _NULL  # an empty array: one block of 0 items
    parts = [_long(len(deltas))]
    for d in deltas:
        parts += (
            _long(d.index),
            _optional_string(d.id),
            _optional_string(d.name),
            _string(d.arguments_delta),
        )
    parts.append(_NULL)
    return b"".join(parts)


def _usage(usage: Usage | None) -> bytes:
    if usage is None:
        return _NULL
    return _SOME + b"".join(_long(n) for n in usage.counts())


def chunk_body(chunk: Chunk) -> bytes:
    """The Avro binary body of `chunk` under the current Chunk schema (no header)."""
    fields = chunk.__dict__  # a model's fields, read without its attribute hook
    finish: FinishReason | None = fields["finish_reason"]
    source: Source = fields["source"]
    return b"".join(
        (
            _string(fields["request_id"]),
            _long(fields["seq"]),
            _SOURCE[source.name],
            _optional_string(fields["model"]),
            _long(fields["choice"]),
            _string(fields["text_delta"]),
            _string(fields["reasoning_delta"]),
            _tool_call_deltas(fields["tool_call_deltas"]),
            _usage(fields["usage"]),
            _NULL if finish is None else _SOME + _FINISH[finish.name],
            _optional_string(fields["finish_reason_raw"]),
            _optional_string(fields["error"]),
            _long(_micros(fields["event_time"])),
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
