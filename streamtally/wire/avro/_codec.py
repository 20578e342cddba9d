"""The generic codec: an Avro datum (a dict in fastavro's form) to and from a message.

`write` writes a single-object message (`streamtally.wire.framing` turns it into
the Confluent framing where that is chosen); `read` reads a value in either
framing, dispatching on its first byte (``C3`` single-object, ``00`` Confluent:
`_ids`), then the same body readers (the compiled ones on the hot path).  The
typed encoders and decoders are built on them.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Mapping
from typing import Any, Final

import fastavro
from fastavro.read import SchemaResolutionError

from streamtally.core.models import Source
from streamtally.errors import AvroDecodeError, AvroEncodeError
from streamtally.wire.avro import _raw_readers
from streamtally.wire.avro._compiled import Reader, Unsupported, compile_reader
from streamtally.wire.avro._framing import HEADER_SIZE
from streamtally.wire.avro._ids import CONFLUENT_HEADER_SIZE, confluent_writer
from streamtally.wire.avro._schemas import NAMESPACE, SchemaVersion, current, history, writer_of
from streamtally.wire.records import ENGINE_PAYLOAD_TYPES

__all__ = ["DECODE_ERRORS", "ENCODE_ERRORS", "decode", "encode", "read", "read_body", "write"]

#: What fastavro raises for a datum that does not fit the writer schema.
ENCODE_ERRORS: Final = (TypeError, ValueError, KeyError, AttributeError, OverflowError)
#: What fastavro raises for a body it cannot read (or resolve to the reader schema).
DECODE_ERRORS: Final = (
    EOFError,
    ValueError,  # UnicodeDecodeError included
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    SchemaResolutionError,
)


def write(version: SchemaVersion, record: Mapping[str, Any]) -> bytes:
    """`record` written with the schema `version`, after its header."""
    out = io.BytesIO()
    out.write(version.header)
    try:
        fastavro.schemaless_writer(out, version.parsed, record)
    except ENCODE_ERRORS as exc:
        raise AvroEncodeError(f"{version.name}: {exc}") from exc
    return out.getvalue()


#: The records read once per raw event: read by a reader compiled from the schema
#: (`_compiled`) when written with the current one.
COMPILED: Final = frozenset({"RawSseEvent", "RawEngineOutput"})
#: Their readers as the worker reads them, generated into `_raw_readers` (compiled by
#: mypyc with the hot path): by (name, record names).
_GENERATED: Final[Mapping[tuple[str, bool], Reader]] = {
    ("RawSseEvent", False): _raw_readers.read_raw_sse_event,
    ("RawEngineOutput", True): _raw_readers.read_raw_engine_output,
}


@functools.cache
def _compiled(version: SchemaVersion, record_names: bool) -> Reader | None:
    generated = _GENERATED.get((version.name, record_names))
    if generated is not None and version is current(version.name):
        return generated
    try:
        return compile_reader(version.parsed, record_names=record_names)
    except Unsupported:  # a schema feature it does not read: fastavro reads it
        return None


#: The single-object headers of the `COMPILED` records written with their current schema,
#: found once: (header, name, record names) → (reader, the writer's label).  A raw message
#: of the hot path is then read from its header alone.
_HOT: Final[dict[tuple[bytes, str, bool], tuple[Reader, str]]] = {}


def read(name: str, data: bytes, *, record_names: bool = False) -> dict[str, Any]:
    """The datum of a value of record `name` in either framing, resolved from its writer
    schema to the current: the first byte tells them apart (``00`` Confluent, its schema
    id looked up in the process's table, `_ids`; else single-object)."""
    hot = _HOT.get((data[:HEADER_SIZE], name, record_names))
    if hot is not None:
        return _run(name, hot[0], hot[1], data, HEADER_SIZE)
    if data and data[0] == 0:
        writer = confluent_writer(name, data)
        return read_body(name, writer, data, CONFLUENT_HEADER_SIZE, record_names)
    try:
        writer = writer_of(data)
    except AvroDecodeError as exc:
        raise AvroDecodeError(f"{name}: {exc}") from None
    if writer is current(name) and name in COMPILED:
        fast = _compiled(writer, record_names)
        if fast is not None:
            _HOT[writer.header, name, record_names] = (fast, writer.label)
    return read_body(name, writer, data, HEADER_SIZE, record_names)


def _run(name: str, fast: Reader, label: str, data: bytes, start: int) -> dict[str, Any]:
    """The datum `fast` (a compiled reader) reads in `data` from `start` to the end."""
    try:
        record, end = fast(data, start)
    except DECODE_ERRORS as exc:
        raise _undecodable(name, label, exc) from exc
    return _whole(name, record, end, data)


def _undecodable(name: str, label: str, exc: BaseException) -> AvroDecodeError:
    """Why a body written with the schema `label` could not be read (`exc`: the reader's)."""
    return AvroDecodeError(
        f"{name}: cannot decode the body written with {label} "
        f"({type(exc).__name__}: {exc or 'truncated'})"
    )


def _whole(name: str, record: object, end: int, data: bytes) -> dict[str, Any]:
    rest = len(data) - end
    if rest:
        raise AvroDecodeError(f"{name}: {rest} trailing bytes after the record")
    if not isinstance(record, dict):
        raise AvroDecodeError(f"{name}: decoded a {type(record).__name__}, not a record")
    return record


def read_body(
    name: str, writer: SchemaVersion, data: bytes, start: int, record_names: bool
) -> dict[str, Any]:
    """The datum of record `name` written with `writer` in `data` from `start` to the end.

    `read` calls it after the single-object header; `_confluent` after the Confluent one.
    """
    reader = current(name)
    if writer.name != name:
        raise AvroDecodeError(f"expected a {name} message, got a {writer.label} one")
    fast = _compiled(writer, record_names) if writer is reader and name in COMPILED else None
    if fast is not None:
        return _run(name, fast, writer.label, data, start)
    try:
        body = io.BytesIO(data)
        body.seek(start)
        record = fastavro.schemaless_reader(
            body,
            writer.parsed,
            None if writer is reader else reader.parsed,
            return_record_name=record_names,
            return_record_name_override=record_names,
        )
        end = body.tell()
    except DECODE_ERRORS as exc:
        raise _undecodable(name, writer.label, exc) from exc
    return _whole(name, record, end, data)


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
    return write(writer, prepare(record) if prepare else record)


def decode(name: str, data: bytes) -> dict[str, Any]:
    """Decode a value of record `name` (either framing) into a plain dict (fastavro's form).

    Raises `AvroDecodeError` for a value in neither framing, an unknown fingerprint or
    schema id, a message of another record, or a truncated or malformed body.
    """
    return read(name, data)
