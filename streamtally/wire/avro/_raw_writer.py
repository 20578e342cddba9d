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
from datetime import datetime
from typing import Any, Final

from streamtally.core.models import Source
from streamtally.core.sse_event import SseEvent
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

__all__ = ["RAW_SSE_FIELDS", "RawSseWriter", "check_schema", "micros_of", "raw_sse_body"]

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
_EVENT: Final = _KIND_OF[EventKind.EVENT]


def raw_sse_body(event: RawSseEvent) -> bytes:
    """The Avro binary body of `event` under the current RawSseEvent schema (no header).

    The record's own checks (`RawSseEvent.__post_init__`: a request id, a
    sequence number from 0, an aware time, an SSE source) hold already.
    """
    return _record(
        _string(event.request_id, _RAW_SSE),
        seq=event.seq,
        middle=_SOURCE_OF[event.source] + _string(event.tenant, _RAW_SSE),
        micros=_micros(event.received_at),
        kind=_KIND_OF[event.kind],
        name=event.event,
        data=event.data,
        sse_id=event.sse_id,
    )


def _record(
    head: bytes,
    *,
    seq: int,
    middle: bytes,
    micros: int,
    kind: bytes,
    name: str,
    data: str,
    sse_id: str | None,
) -> bytes:
    """The fields in schema order: `head` (what precedes the request id, and it written),
    `seq`, `middle` (the source and the tenant, written), the receive time, `kind`
    (written), the event's name, its data and its SSE id."""
    return b"".join(
        (
            head,
            _SMALL[seq] if seq < _SMALL_LIMIT else _long(seq, _RAW_SSE),
            middle,
            _long(micros, _RAW_SSE),
            kind,
            _MESSAGE if name == "message" else _string(name, _RAW_SSE),
            _string(data, _RAW_SSE),
            _NULL if sse_id is None else _SOME + _string(sse_id, _RAW_SSE),
        )
    )


class RawSseWriter:
    """One request's events (kind EVENT), each after `header`: the request's id, source and
    tenant written once, so that each event writes only its own fields.

    The tap writes one per event, on the client's path; building a `RawSseEvent` for each
    (its constructor and its checks) cost more than writing it.  The checks that concern
    the request are made here, once, as the record's constructor makes them; each event's
    `seq` is checked as there.  `value(...)` is, byte for byte, `header` and then
    `raw_sse_body` of the `RawSseEvent` with the same fields
    (`tests/unit/wire/test_raw_writer.py`).
    """

    def __init__(self, request_id: str, source: Source, tenant: str, header: bytes = b"") -> None:
        if not request_id:
            raise ValueError("request_id must not be empty")
        if not source.is_sse:
            raise ValueError(f"source {source.value!r} is not an SSE source")
        self.request_id = request_id
        self._head = header + _string(request_id, _RAW_SSE)
        self._middle = _SOURCE_OF[source] + _string(tenant, _RAW_SSE)

    def value(
        self, seq: int, received_micros: int, name: str, data: str, sse_id: str | None
    ) -> bytes:
        """`header` and the body of the event numbered `seq`, received at
        `received_micros` (microseconds since the epoch, UTC: `micros_of`)."""
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        return _record(
            self._head,
            seq=seq,
            middle=self._middle,
            micros=received_micros,
            kind=_EVENT,
            name=name,
            data=data,
            sse_id=sse_id,
        )

    def values(self, first_seq: int, received_micros: int, events: list[SseEvent]) -> list[bytes]:
        """`value` of each of `events` (one upstream chunk's), numbered from `first_seq`."""
        return [
            self.value(first_seq + n, received_micros, event.event, event.data, event.id)
            for n, event in enumerate(events)
        ]


def micros_of(moment: datetime) -> int:
    """An aware `moment` as microseconds since the epoch (Avro's timestamp-micros)."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"received_at must be a timezone-aware datetime, got {moment!r}")
    return _micros(moment)


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
