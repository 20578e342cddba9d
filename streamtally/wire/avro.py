"""Avro on the wire: the schemas of every topic value, and their single-object framing.

This is the only module that imports fastavro.

Every schema in `schemas/*.avsc` (one named type per file, namespace
`io.streamtally.v1`) is read once at import.  A record's file may name types
of other files; each record is then expanded into one self-contained schema
(a named type is defined where it first occurs and referred to by full name
after), which is what its Parsing Canonical Form and fingerprint are taken of
and what `schemas/history/<Name>/<n>.avsc` stores for each released version.

A message is Avro *single-object encoding*::

    C3 01 | CRC-64-AVRO fingerprint of the writer schema (8 bytes, little-endian) | Avro binary body

`decode` looks the fingerprint up among the known versions of the record
(current and `schemas/history/`) and resolves that writer schema to the
current one.  Anything that is not such a message raises `AvroDecodeError`
(an `InputError`: the processors dead-letter the record with its message).
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import fastavro
from fastavro.read import SchemaResolutionError
from fastavro.schema import fingerprint as _fastavro_fingerprint
from fastavro.schema import parse_schema, to_parsing_canonical_form
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
from streamtally.errors import InputError, StreamtallyError
from streamtally.wire.records import (
    ENGINE_PAYLOAD_TYPES,
    BillingEvent,
    DeadLetter,
    EventKind,
    RawEngineOutput,
    RawSseEvent,
    scaled_cost,
)

__all__ = [
    "HEADER_SIZE",
    "MARKER",
    "NAMESPACE",
    "RECORD_NAMES",
    "SCHEMA_DIR",
    "AvroDecodeError",
    "AvroEncodeError",
    "AvroError",
    "AvroSchemaError",
    "SchemaVersion",
    "canonical_form",
    "compatibility_errors",
    "current",
    "decode",
    "decode_billing_event",
    "decode_chunk",
    "decode_dead_letter",
    "decode_model",
    "decode_raw_engine_output",
    "decode_raw_sse_event",
    "decode_tokens",
    "encode",
    "encode_billing_event",
    "encode_chunk",
    "encode_dead_letter",
    "encode_model",
    "encode_raw_engine_output",
    "encode_raw_sse_event",
    "encode_tokens",
    "fingerprint",
    "history",
    "schema_fingerprint",
    "writer_of",
]

NAMESPACE: Final = "io.streamtally.v1"
#: The two marker bytes that open every single-object encoded message.
MARKER: Final = b"\xc3\x01"
#: Marker plus the 8-byte fingerprint.
HEADER_SIZE: Final = 10

SchemaJSON = dict[str, Any]


def _schema_dir() -> Path:
    """`$STREAMTALLY_SCHEMA_DIR`, else `streamtally/_schemas` (wheel), else repo `schemas/`."""
    env = os.environ.get("STREAMTALLY_SCHEMA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "_schemas"


SCHEMA_DIR: Final = _schema_dir()


# --------------------------------------------------------------------------- errors


class AvroError(InputError):
    """Base of the Avro codec errors."""


class AvroDecodeError(AvroError):
    """Bytes that are not a decodable single-object message of the expected record."""


class AvroEncodeError(AvroError):
    """A record that does not fit its schema."""


class AvroSchemaError(StreamtallyError):
    """The schema files themselves are wrong (raised at import or by the tooling)."""


# --------------------------------------------------------------------------- schema files

_PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
)
_NAMED: Final = frozenset({"record", "error", "enum", "fixed"})


def _fullname(name: str, namespace: str | None) -> str:
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


def _namespace_of(fullname: str) -> str | None:
    return fullname.rpartition(".")[0] or None


def _register(node: Any, namespace: str | None, defs: dict[str, SchemaJSON], origin: str) -> None:
    """Record every named type defined in `node` (a file's schema) into `defs`."""
    if isinstance(node, list):
        for branch in node:
            _register(branch, namespace, defs, origin)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind in _NAMED:
        full = _fullname(node["name"], node.get("namespace", namespace))
        if full in defs:
            raise AvroSchemaError(f"{origin}: {full} is defined twice")
        defs[full] = {**node, "name": full.rpartition(".")[2], "namespace": _namespace_of(full)}
        inner = _namespace_of(full)
        for fld in node.get("fields", ()):
            _register(fld["type"], inner, defs, origin)
    elif kind == "array":
        _register(node["items"], namespace, defs, origin)
    elif kind == "map":
        _register(node["values"], namespace, defs, origin)
    elif isinstance(kind, (dict, list)):
        _register(kind, namespace, defs, origin)


def _expand(
    node: Any, namespace: str | None, defs: Mapping[str, SchemaJSON], seen: set[str]
) -> Any:
    """A self-contained copy of `node`: each named type defined at its first occurrence."""
    if isinstance(node, str):
        if node in _PRIMITIVES:
            return node
        full = _fullname(node, namespace)
        if full in seen:
            return full
        if full not in defs:
            raise AvroSchemaError(f"unknown type {node!r} (as {full})")
        return _expand(defs[full], _namespace_of(full), defs, seen)
    if isinstance(node, list):
        return [_expand(branch, namespace, defs, seen) for branch in node]
    if not isinstance(node, dict):
        raise AvroSchemaError(f"not a schema: {node!r}")
    kind = node.get("type")
    if kind in _NAMED:
        full = _fullname(node["name"], node.get("namespace", namespace))
        if full in seen:
            return full
        seen.add(full)
        out = {**node, "name": full.rpartition(".")[2], "namespace": _namespace_of(full)}
        if "fields" in node:
            inner = _namespace_of(full)
            out["fields"] = [
                {**fld, "type": _expand(fld["type"], inner, defs, seen)} for fld in node["fields"]
            ]
        return out
    if kind == "array":
        return {**node, "items": _expand(node["items"], namespace, defs, seen)}
    if kind == "map":
        return {**node, "values": _expand(node["values"], namespace, defs, seen)}
    if isinstance(kind, (dict, list)):
        return _expand(kind, namespace, defs, seen)
    if kind in _PRIMITIVES:
        return dict(node)
    raise AvroSchemaError(f"not a schema: {node!r}")


def _parse(schema: SchemaJSON) -> Any:
    """fastavro's parsed form of one self-contained schema."""
    return parse_schema(schema, named_schemas={})


def canonical_form(schema: SchemaJSON) -> str:
    """The Parsing Canonical Form of a self-contained schema (Avro spec)."""
    pcf: str = to_parsing_canonical_form(schema)
    return pcf


def schema_fingerprint(schema: SchemaJSON) -> bytes:
    """The 8-byte little-endian CRC-64-AVRO fingerprint of a schema's Parsing Canonical Form.

    These are the bytes that follow `MARKER` in a single-object message.
    """
    return bytes.fromhex(_fastavro_fingerprint(canonical_form(schema), "CRC-64-AVRO"))


@dataclass(frozen=True, slots=True, eq=False)
class SchemaVersion:
    """One version of a record schema.  `version` is None for an unreleased current schema.

    `schema` is the self-contained JSON schema (treat it as read-only), `parsed`
    fastavro's form of it, `header` the 10 bytes every message written with it
    starts with.
    """

    name: str
    version: int | None
    schema: SchemaJSON
    canonical_form: str
    fingerprint: bytes
    parsed: Any
    header: bytes

    @classmethod
    def build(cls, name: str, version: int | None, schema: SchemaJSON) -> SchemaVersion:
        if schema.get("type") != "record" or schema.get("name") != name:
            raise AvroSchemaError(f"{name} v{version}: not the record {name}")
        try:
            parsed = _parse(schema)
            pcf = canonical_form(schema)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # fastavro's parse errors
            raise AvroSchemaError(f"{name} v{version}: {exc}") from exc
        fp = bytes.fromhex(_fastavro_fingerprint(pcf, "CRC-64-AVRO"))
        return cls(name, version, schema, pcf, fp, parsed, MARKER + fp)

    @property
    def label(self) -> str:
        return (
            f"{self.name} v{self.version}"
            if self.version is not None
            else f"{self.name} (unreleased)"
        )


def _load_current(directory: Path) -> dict[str, SchemaVersion]:
    """Every record of `directory/*.avsc`, expanded into a self-contained schema."""
    defs: dict[str, SchemaJSON] = {}
    tops: dict[str, str] = {}  # short name -> full name, for record files
    for path in sorted(directory.glob("*.avsc")):
        try:
            node = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise AvroSchemaError(f"{path}: {exc}") from exc
        if not isinstance(node, dict) or node.get("name") != path.stem:
            raise AvroSchemaError(f"{path}: must define the named type {path.stem!r}")
        if node.get("namespace") != NAMESPACE:
            raise AvroSchemaError(f"{path}: namespace must be {NAMESPACE!r}")
        _register(node, NAMESPACE, defs, str(path))
        if node.get("type") == "record":
            tops[path.stem] = _fullname(path.stem, NAMESPACE)
    if not tops:
        raise AvroSchemaError(f"no schema found in {directory}")
    return {
        name: SchemaVersion.build(name, None, _expand(defs[full], NAMESPACE, defs, set()))
        for name, full in tops.items()
    }


def _load_history(directory: Path, names: Sequence[str]) -> dict[str, tuple[SchemaVersion, ...]]:
    out: dict[str, tuple[SchemaVersion, ...]] = {}
    for name in names:
        versions: list[SchemaVersion] = []
        folder = directory / "history" / name
        for path in sorted(folder.glob("*.avsc"), key=lambda p: (len(p.stem), p.stem)):
            if not path.stem.isdigit():
                raise AvroSchemaError(f"{path}: history files are named <n>.avsc")
            try:
                schema = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise AvroSchemaError(f"{path}: {exc}") from exc
            versions.append(SchemaVersion.build(name, int(path.stem), schema))
        out[name] = tuple(versions)
    return out


_CURRENT_UNRELEASED: Final = _load_current(SCHEMA_DIR)
_HISTORY: Final = _load_history(SCHEMA_DIR, sorted(_CURRENT_UNRELEASED))


def _release_current() -> dict[str, SchemaVersion]:
    """The current schemas, numbered with the history version they equal (if released)."""
    out: dict[str, SchemaVersion] = {}
    for name, cur in _CURRENT_UNRELEASED.items():
        released = [v for v in _HISTORY[name] if v.fingerprint == cur.fingerprint]
        version = released[-1].version if released else None
        out[name] = SchemaVersion(
            name, version, cur.schema, cur.canonical_form, cur.fingerprint, cur.parsed, cur.header
        )
    return out


_CURRENT: Final = _release_current()


def _index() -> dict[bytes, SchemaVersion]:
    index: dict[bytes, SchemaVersion] = {}
    for versions in _HISTORY.values():
        for version in versions:
            other = index.get(version.fingerprint)
            if other is not None and other.name != version.name:
                raise AvroSchemaError(f"{version.label} and {other.label} share a fingerprint")
            index[version.fingerprint] = version
    for cur in _CURRENT.values():
        index[cur.fingerprint] = cur  # the current parsed schema: no resolution needed
    return index


_BY_FINGERPRINT: Final = _index()

#: Every record schema that `encode` and `decode` accept, by short name.
RECORD_NAMES: Final = tuple(sorted(_CURRENT))


def current(name: str) -> SchemaVersion:
    """The current schema of a record (`Chunk`, `Tokens`, ...)."""
    try:
        return _CURRENT[name]
    except KeyError:
        raise KeyError(f"no Avro record named {name!r}; known: {', '.join(RECORD_NAMES)}") from None


def history(name: str) -> tuple[SchemaVersion, ...]:
    """Released versions of a record, oldest first (`schemas/history/<name>/<n>.avsc`)."""
    current(name)
    return _HISTORY[name]


def fingerprint(name: str) -> bytes:
    """The 8 fingerprint bytes of the current schema of a record."""
    return current(name).fingerprint


def writer_of(data: bytes) -> SchemaVersion:
    """The writer schema of a single-object message, from its header alone."""
    if len(data) < HEADER_SIZE:
        raise AvroDecodeError(
            f"{len(data)} bytes: too short for an Avro single-object message "
            f"(a {HEADER_SIZE}-byte header comes first)"
        )
    if data[:2] != MARKER:
        raise AvroDecodeError(
            f"bad marker {bytes(data[:2]).hex()}: not Avro single-object encoding (c301)"
        )
    fp = bytes(data[2:HEADER_SIZE])
    version = _BY_FINGERPRINT.get(fp)
    if version is None:
        raise AvroDecodeError(f"unknown writer schema fingerprint {fp.hex()}")
    return version


# --------------------------------------------------------------------------- generic codec

_ENCODE_ERRORS: Final = (TypeError, ValueError, KeyError, AttributeError, OverflowError)
_DECODE_ERRORS: Final = (
    EOFError,
    ValueError,  # UnicodeDecodeError included
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    SchemaResolutionError,
)


def _write(version: SchemaVersion, record: Mapping[str, Any]) -> bytes:
    out = io.BytesIO()
    out.write(version.header)
    try:
        fastavro.schemaless_writer(out, version.parsed, record)
    except _ENCODE_ERRORS as exc:
        raise AvroEncodeError(f"{version.name}: {exc}") from exc
    return out.getvalue()


def _read(name: str, data: bytes, *, record_names: bool = False) -> dict[str, Any]:
    reader = current(name)
    try:
        writer = writer_of(data)
    except AvroDecodeError as exc:
        raise AvroDecodeError(f"{name}: {exc}") from None
    if writer.name != name:
        raise AvroDecodeError(f"expected a {name} message, got a {writer.label} one")
    body = io.BytesIO(data)
    body.seek(HEADER_SIZE)
    try:
        record = fastavro.schemaless_reader(
            body,
            writer.parsed,
            None if writer is reader else reader.parsed,
            return_record_name=record_names,
            return_record_name_override=record_names,
        )
    except _DECODE_ERRORS as exc:
        raise AvroDecodeError(
            f"{name}: cannot decode the body written with {writer.label} "
            f"({type(exc).__name__}: {exc or 'truncated'})"
        ) from exc
    rest = len(data) - body.tell()
    if rest:
        raise AvroDecodeError(f"{name}: {rest} trailing bytes after the record")
    if not isinstance(record, dict):
        raise AvroDecodeError(f"{name}: decoded a {type(record).__name__}, not a record")
    return record


def _engine_variant(record: Mapping[str, Any]) -> dict[str, Any]:
    """Name the branch of `RawEngineOutput.payload` after `source` (the union has three records)."""
    payload = record.get("payload")
    if not isinstance(payload, dict):  # None, or already in (name, dict) notation
        return dict(record)
    try:
        branch = ENGINE_PAYLOAD_TYPES[Source[record["source"]]]
    except KeyError:
        raise AvroEncodeError(
            f"RawEngineOutput: source {record.get('source')!r} is not DYNAMO, VLLM or ATOMR"
        ) from None
    return {**record, "payload": (f"{NAMESPACE}.{branch}", payload)}


_PREPARE: Final[Mapping[str, Callable[[Mapping[str, Any]], Mapping[str, Any]]]] = {
    "RawEngineOutput": _engine_variant,
}


def encode(name: str, record: Mapping[str, Any], *, version: int | None = None) -> bytes:
    """Encode an Avro datum (a dict in fastavro's form) of record `name` as a single-object message.

    Enum values are symbol strings, timestamps aware datetimes, decimals
    `Decimal`s.  Keys the schema does not have are ignored; a missing key
    takes the field's default.  `RawEngineOutput.payload` may be a plain dict:
    its union branch is chosen by `source`.  `version` writes with that
    released version of the schema instead of the current one.
    """
    writer = current(name)
    if version is not None and version != writer.version:
        released = [v for v in history(name) if v.version == version]
        if not released:
            raise KeyError(f"{name} has no released version {version}")
        writer = released[0]
    prepare = _PREPARE.get(name)
    return _write(writer, prepare(record) if prepare else record)


def decode(name: str, data: bytes) -> dict[str, Any]:
    """Decode a single-object message of record `name` into a plain dict (fastavro's form).

    Raises `AvroDecodeError` for a bad marker, an unknown fingerprint, a
    message of another record, or a truncated or malformed body.
    """
    return _read(name, data)


# --------------------------------------------------------------------------- enums

_SOURCES: Final = {s.name: s for s in Source}
_FINISH_REASONS: Final = {f.name: f for f in FinishReason}
_KINDS: Final = {k.name: k for k in EventKind}


def _symbol(table: Mapping[str, Any], symbol: str, what: str) -> Any:
    try:
        return table[symbol]
    except KeyError:
        raise AvroDecodeError(f"{what} {symbol!r} is unknown to this version") from None


def _source(symbol: str) -> Source:
    return cast(Source, _symbol(_SOURCES, symbol, "source"))


def _finish(symbol: str | None) -> FinishReason | None:
    return (
        None
        if symbol is None
        else cast(FinishReason, _symbol(_FINISH_REASONS, symbol, "finish reason"))
    )


def _kind(symbol: str) -> EventKind:
    return cast(EventKind, _symbol(_KINDS, symbol, "event kind"))


# --------------------------------------------------------------------------- models


def _usage_out(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "cached_tokens": u.cached_tokens,
        "cache_write_tokens": u.cache_write_tokens,
    }


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
    }


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


Model = Usage | ToolCallDelta | Chunk | ToolCall | ChoiceTokens | Tokens
M = TypeVar("M", bound=Model)
_ModelT = TypeVar("_ModelT", bound=BaseModel)

# model class -> (record name, to Avro datum, Avro datum -> model fields)
_MODEL_CODECS: Final[
    Mapping[
        type[BaseModel],
        tuple[str, Callable[[Any], dict[str, Any]], Callable[[dict[str, Any]], dict[str, Any]]],
    ]
] = {
    Usage: ("Usage", _usage_out, _same),
    ToolCallDelta: ("ToolCallDelta", _tool_call_delta_out, _same),
    ToolCall: ("ToolCall", _tool_call_out, _same),
    ChoiceTokens: ("ChoiceTokens", _choice_out, _choice_in),
    Chunk: ("Chunk", _chunk_out, _chunk_in),
    Tokens: ("Tokens", _tokens_out, _tokens_in),
}


def _validate(cls: type[_ModelT], fields: dict[str, Any]) -> _ModelT:
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise AvroDecodeError(f"decoded record is not a valid {cls.__name__}: {exc}") from exc


def encode_model(obj: Model) -> bytes:
    """Encode a model (`Usage`, `ToolCallDelta`, `ToolCall`, `ChoiceTokens`, `Chunk`, `Tokens`)."""
    name, out, _ = _MODEL_CODECS[type(obj)]
    return _write(_CURRENT[name], out(obj))


def decode_model(cls: type[M], data: bytes) -> M:
    """Decode a message of the record named like `cls` into an instance of `cls`."""
    name, _, fields_in = _MODEL_CODECS[cls]
    return _validate(cls, fields_in(_read(name, data)))


_CHUNK: Final = _CURRENT["Chunk"]
_TOKENS: Final = _CURRENT["Tokens"]


def encode_chunk(chunk: Chunk) -> bytes:
    """A `Chunk` as a single-object message (value of `streamtally.chunks`)."""
    return _write(_CHUNK, _chunk_out(chunk))


def decode_chunk(data: bytes) -> Chunk:
    return _validate(Chunk, _chunk_in(_read("Chunk", data)))


def encode_tokens(tokens: Tokens) -> bytes:
    """A `Tokens` as a single-object message (value of `streamtally.tokens`)."""
    return _write(_TOKENS, _tokens_out(tokens))


def decode_tokens(data: bytes) -> Tokens:
    return _validate(Tokens, _tokens_in(_read("Tokens", data)))


# --------------------------------------------------------------------------- records


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AvroDecodeError(message)


def _record(cls: Callable[..., Any], fields: dict[str, Any]) -> Any:
    try:
        return cls(**fields)
    except (ValueError, TypeError) as exc:
        raise AvroDecodeError(
            f"decoded record is not a valid {getattr(cls, '__name__', cls)}: {exc}"
        ) from exc


def encode_raw_sse_event(event: RawSseEvent) -> bytes:
    """A `RawSseEvent` as a single-object message (value of `streamtally.raw.sse`)."""
    return _write(
        _CURRENT["RawSseEvent"],
        {
            "request_id": event.request_id,
            "seq": event.seq,
            "source": event.source.name,
            "tenant": event.tenant,
            "received_at": event.received_at,
            "kind": event.kind.name,
            "event": event.event,
            "data": event.data,
            "sse_id": event.sse_id,
        },
    )


def decode_raw_sse_event(data: bytes) -> RawSseEvent:
    r = _read("RawSseEvent", data)
    return cast(
        RawSseEvent,
        _record(RawSseEvent, {**r, "source": _source(r["source"]), "kind": _kind(r["kind"])}),
    )


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


def _payload_in(source: Source, payload: dict[str, Any]) -> dict[str, Any]:
    text = payload.get("tool_call_delta") if source is Source.ATOMR else None
    if text is None:
        return payload
    try:
        return {**payload, "tool_call_delta": json.loads(text)}
    except ValueError as exc:
        raise AvroDecodeError(f"TokenChunk.tool_call_delta is not JSON text: {exc}") from exc


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
    return _write(
        _CURRENT["RawEngineOutput"],
        {
            "request_id": output.request_id,
            "seq": output.seq,
            "source": output.source.name,
            "tenant": output.tenant,
            "received_at": output.received_at,
            "kind": output.kind.name,
            "payload": payload,
            "model": output.model,
        },
    )


def decode_raw_engine_output(data: bytes) -> RawEngineOutput:
    """Decode a raw engine output; its payload is the dict the engine's JSON line parses to."""
    r = _read("RawEngineOutput", data, record_names=True)
    source = _source(r["source"])
    raw = r["payload"]
    payload: dict[str, Any] | None = None
    if raw is not None:
        _require(isinstance(raw, tuple) and len(raw) == 2, "RawEngineOutput: unnamed payload")
        branch, body = raw
        expected = ENGINE_PAYLOAD_TYPES.get(source)
        _require(
            branch == f"{NAMESPACE}.{expected}",
            f"RawEngineOutput: a {source.value} output carries a {branch.rpartition('.')[2]}",
        )
        payload = _payload_in(source, body)
    fields = {**r, "source": source, "kind": _kind(r["kind"]), "payload": payload}
    return cast(RawEngineOutput, _record(RawEngineOutput, fields))


def encode_billing_event(event: BillingEvent) -> bytes:
    """A `BillingEvent` as a single-object message (value of `streamtally.billing`)."""
    return _write(
        _CURRENT["BillingEvent"],
        {
            "event_id": event.event_id,
            "request_id": event.request_id,
            "tenant": event.tenant,
            "model": event.model,
            "source": event.source.name,
            "finish_reason": event.finish_reason.name,
            "input_tokens": event.input_tokens,
            "output_tokens": event.output_tokens,
            "reasoning_tokens": event.reasoning_tokens,
            "cached_tokens": event.cached_tokens,
            "cache_write_tokens": event.cache_write_tokens,
            "cost": scaled_cost(event.cost),
            "currency": event.currency,
            "price_table_version": event.price_table_version,
            "event_time": event.event_time,
        },
    )


def decode_billing_event(data: bytes) -> BillingEvent:
    r = _read("BillingEvent", data)
    finish = _finish(r["finish_reason"])
    _require(finish is not None, "BillingEvent: no finish reason")
    fields = {**r, "source": _source(r["source"]), "finish_reason": finish}
    return cast(BillingEvent, _record(BillingEvent, fields))


def encode_dead_letter(letter: DeadLetter) -> bytes:
    """A `DeadLetter` as a single-object message (value of `streamtally.deadletter`)."""
    return _write(
        _CURRENT["DeadLetter"],
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


def decode_dead_letter(data: bytes) -> DeadLetter:
    return cast(DeadLetter, _record(DeadLetter, _read("DeadLetter", data)))


# --------------------------------------------------------------------------- compatibility

_EPOCH: Final = datetime(2024, 1, 1, tzinfo=UTC)
_STRINGS: Final = ("", "a", "é✓ 𝄞", "x" * 40)


def _leaf_types(schema: Any) -> dict[tuple[str, ...], tuple[Any, ...]]:
    """(record, field, path in the field's type) -> (type, logicalType, precision, scale).

    One entry per primitive leaf of each record's fields: what the fingerprint
    leaves out (logical types) but reading depends on.
    """
    out: dict[tuple[str, ...], tuple[Any, ...]] = {}

    def walk(node: Any, where: tuple[str, ...], namespace: str | None) -> None:
        if isinstance(node, list):
            for branch in node:
                label = branch if isinstance(branch, str) else str(branch.get("type"))
                walk(branch, (*where, f"|{label}"), namespace)
        elif isinstance(node, str):
            if node in _PRIMITIVES:
                out[where] = (node, None, None, None)
        elif isinstance(node, dict):
            kind = node.get("type")
            if kind in ("record", "error"):
                full = _fullname(node["name"], node.get("namespace", namespace))
                inner = _namespace_of(full)
                for fld in node["fields"]:
                    walk(fld["type"], (full, fld["name"]), inner)
            elif kind == "array":
                walk(node["items"], (*where, "[]"), namespace)
            elif kind == "map":
                walk(node["values"], (*where, "{}"), namespace)
            elif isinstance(kind, (dict, list)):
                walk(kind, where, namespace)
            elif kind in _PRIMITIVES:
                logical = node.get("logicalType")
                out[where] = (kind, logical, node.get("precision"), node.get("scale"))

    walk(schema, (), None)
    return out


def _sample(node: Any, i: int, names: dict[str, Any], namespace: str | None) -> Any:
    """A datum of `node`; varying `i` goes through every union branch and enum symbol."""
    if isinstance(node, str):
        if node in _PRIMITIVES:
            return _primitive(node, i)
        return _sample(names[_fullname(node, namespace)], i, names, namespace)
    if isinstance(node, list):
        branch = node[i % len(node)]
        value = _sample(branch, i, names, namespace)
        target = names.get(_fullname(branch, namespace)) if isinstance(branch, str) else branch
        if isinstance(target, dict) and target.get("type") in ("record", "error"):
            full = _fullname(target["name"], target.get("namespace", namespace))
            return (full, value)
        return value
    kind = node["type"]
    if kind in _NAMED:
        inner = _namespace_of(_fullname(node["name"], node.get("namespace", namespace)))
        if kind == "enum":
            symbols = node["symbols"]
            return symbols[i % len(symbols)]
        if kind == "fixed":
            return bytes([i % 256]) * int(node["size"])
        return {
            fld["name"]: _sample(fld["type"], i + k, names, inner)
            for k, fld in enumerate(node["fields"])
        }
    if kind == "array":
        return [_sample(node["items"], i + j, names, namespace) for j in range(i % 3)]
    if kind == "map":
        return {f"k{j}": _sample(node["values"], i + j, names, namespace) for j in range(i % 3)}
    logical = node.get("logicalType")
    if logical in ("timestamp-micros", "local-timestamp-micros"):
        return _EPOCH + timedelta(microseconds=i)
    if logical in ("timestamp-millis", "local-timestamp-millis"):
        return _EPOCH + timedelta(milliseconds=i)
    if logical == "decimal":
        return Decimal(i * 7).scaleb(-int(node.get("scale", 0)))
    if isinstance(kind, (dict, list)):
        return _sample(kind, i, names, namespace)
    return _primitive(kind, i)


def _primitive(kind: str, i: int) -> Any:
    if kind == "null":
        return None
    if kind == "boolean":
        return i % 2 == 1
    if kind in ("int", "long"):
        return i * 7
    if kind in ("float", "double"):
        return i + 0.5
    if kind == "bytes":
        return bytes([i % 256]) * (i % 3)
    if kind == "string":
        return _STRINGS[i % len(_STRINGS)]
    raise AvroSchemaError(f"unknown primitive {kind!r}")


def _widest(node: Any) -> int:
    """The largest union or enum in a schema (how many samples reach every branch)."""
    if isinstance(node, list):
        return max([len(node), *(_widest(b) for b in node)])
    if not isinstance(node, dict):
        return 1
    kind = node.get("type")
    if kind == "enum":
        return len(node["symbols"])
    if kind in ("record", "error"):
        return max([1, *(_widest(f["type"]) for f in node["fields"])])
    if kind == "array":
        return _widest(node["items"])
    if kind == "map":
        return _widest(node["values"])
    if isinstance(kind, (dict, list)):
        return _widest(kind)
    return 1


def _samples(schema: SchemaJSON) -> Iterator[Any]:
    names: dict[str, SchemaJSON] = {}
    _register(schema, None, names, "schema")
    for i in range(2 * _widest(schema) + 3):
        yield _sample(schema, i, names, None)


def compatibility_errors(writer: SchemaJSON, reader: SchemaJSON) -> list[str]:
    """Why data written with `writer` would not decode correctly with `reader` (empty: it does).

    Records generated from `writer` (going through every union branch and
    enum symbol) are written with it and read back through fastavro's schema
    resolution into `reader`; and a logical type (timestamp unit, decimal
    precision and scale) must not change under a field both schemas have, as
    the fingerprint ignores it.  Full compatibility is both directions.
    """
    errors: list[str] = []
    try:
        w, r = _parse(writer), _parse(reader)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return [f"schema does not parse: {exc}"]
    for n, datum in enumerate(_samples(writer)):
        out = io.BytesIO()
        try:
            fastavro.schemaless_writer(out, w, datum)
        except _ENCODE_ERRORS as exc:
            errors.append(f"sample {n}: cannot write with the writer schema: {exc}")
            continue
        out.seek(0)
        try:
            fastavro.schemaless_reader(out, w, r)
        except _DECODE_ERRORS as exc:
            message = f"{type(exc).__name__}: {exc}"
            if message not in errors:
                errors.append(message)
    old, new = _leaf_types(writer), _leaf_types(reader)
    for where in sorted(old.keys() & new.keys()):
        if old[where][1:] != new[where][1:]:
            errors.append(
                f"{'.'.join(where)}: logical type {old[where][1:]} became {new[where][1:]}"
            )
    return errors


# --------------------------------------------------------------------------- tooling


def release(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Write `history/<Name>/<n+1>.avsc` for each record whose current schema is unreleased."""
    written: list[Path] = []
    for name in RECORD_NAMES:
        cur = _CURRENT[name]
        if cur.version is not None:
            continue
        versions = _HISTORY[name]
        number = (versions[-1].version or 0) + 1 if versions else 1
        path = directory / "history" / name / f"{number}.avsc"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(cur.schema, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m streamtally.wire.avro fingerprints|release`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["fingerprints"]:
        for name in RECORD_NAMES:
            cur = _CURRENT[name]
            version = "unreleased" if cur.version is None else f"v{cur.version}"
            print(f"{name:16} {version:10} {cur.fingerprint.hex()}")
        return 0
    if args == ["release"]:
        for path in release():
            print(f"wrote {path}")
        return 0
    print("usage: python -m streamtally.wire.avro fingerprints|release", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
