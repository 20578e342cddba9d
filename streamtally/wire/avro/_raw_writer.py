"""The Avro body of a `RawSseEvent`, written directly: the one record the tap writes per event.

The tap encodes every server-sent event it tees before the event's bytes go on
to the client, so this encoding is on the client's path.  fastavro's generic
writer took about 12 µs per event there (a third of the proxy's time per
event); the schema is small and fixed, so its binary encoding is spelled out
here field by field in schema order, with the primitives of `_chunk_writer`
(the same Avro 1.11 binary encoding; its string and long writers name this
record in their errors).

It must write exactly the bytes fastavro writes: `tests/unit/wire/test_raw_writer.py`
compares both on edge values and on every event of the repo's samples, and
`check_schema` refuses, at import, a RawSseEvent schema other than the one
spelled out here (a schema change must change this module too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from streamtally.core.models import Source
from streamtally.wire.avro._chunk_writer import (
    _NULL,
    _SMALL,
    _SMALL_LIMIT,
    _SOME,
    _SOURCE,
    _branches,
    _long,
    _micros,
    _string,
    _type_name,
)
from streamtally.wire.records import EventKind, RawSseEvent

__all__ = ["RAW_SSE_FIELDS", "check_schema", "raw_sse_body"]

#: The fields of the RawSseEvent schema this module writes, with their Avro types.
RAW_SSE_FIELDS: Final = (
    ("request_id", "string"),
    ("seq", "long"),
    ("source", "io.streamtally.v1.Source"),
    ("tenant", "string"),
    ("received_at", "timestamp-micros"),
    ("kind", "io.streamtally.v1.EventKind"),
    ("event", "string"),
    ("data", "string"),
    ("sse_id", ["null", "string"]),
)
_KIND_SYMBOLS: Final = ("UNKNOWN", "EVENT", "END")
_SOURCE_OF: Final = {member: _SOURCE[member.name] for member in Source}
_KIND_OF: Final = {member: _SMALL[_KIND_SYMBOLS.index(member.name)] for member in EventKind}
#: The record named in this module's errors.
_RAW_SSE: Final = "RawSseEvent"
#: The event name nearly every record carries, encoded once.
_MESSAGE: Final = b"\x0emessage"


def raw_sse_body(event: RawSseEvent) -> bytes:
    """The Avro binary body of `event` under the current RawSseEvent schema (no header).

    The record's own checks (`RawSseEvent.__post_init__`: a request id, a
    sequence number from 0, an aware time, an SSE source) hold already.
    """
    seq = event.seq
    name = event.event
    sse_id = event.sse_id
    return b"".join(
        (
            _string(event.request_id, _RAW_SSE),
            _SMALL[seq] if seq < _SMALL_LIMIT else _long(seq, _RAW_SSE),
            _SOURCE_OF[event.source],
            _string(event.tenant, _RAW_SSE),
            _long(_micros(event.received_at), _RAW_SSE),
            _KIND_OF[event.kind],
            _MESSAGE if name == "message" else _string(name, _RAW_SSE),
            _string(event.data, _RAW_SSE),
            _NULL if sse_id is None else _SOME + _string(sse_id, _RAW_SSE),
        )
    )


def check_schema(parsed: Mapping[str, Any]) -> None:
    """Refuse a RawSseEvent schema (fastavro's parsed form) other than the one written here."""
    found = tuple((f["name"], _type_name(f["type"])) for f in parsed["fields"])
    if found != RAW_SSE_FIELDS:
        raise RuntimeError(
            "schemas/RawSseEvent.avsc changed: update streamtally/wire/avro/_raw_writer.py "
            f"(it writes {RAW_SSE_FIELDS}, the schema has {found})"
        )
    symbols = {
        f["name"]: tuple(tuple(b["symbols"]) for b in _branches(f["type"]) if "symbols" in b)
        for f in parsed["fields"]
    }
    if symbols["source"] != (tuple(_SOURCE),) or symbols["kind"] != (_KIND_SYMBOLS,):
        raise RuntimeError(
            "the Source or EventKind symbols changed: update streamtally/wire/avro/_raw_writer.py"
        )
