"""The raw records the decoders make without their dataclass constructor are the same records.

`raw_sse_event_of` and `raw_engine_output_of` build a record they can check
themselves as a bare instance, its slots set directly (the hot path: one per
raw message); anything else goes through `RawSseEvent(...)` /
`RawEngineOutput(...)`.  Held here: on every raw record of the repo's samples
the two ways give equal records, field for field and of the same type; every
datum the constructor refuses is refused by the decoder with the constructor's
reason; and what the fast checks pass by (a time in another zone, odd types)
still reaches the constructor.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Source
from streamtally.errors import AvroDecodeError
from streamtally.producers.raw import raw_records
from streamtally.wire.avro._codec import read
from streamtally.wire.avro._decoders import raw_engine_output_of, raw_sse_event_of
from streamtally.wire.records import EventKind, RawEngineOutput, RawSseEvent

SAMPLES = Path(__file__).resolve().parents[3] / "samples"
#: A time without a zone: what the records refuse (made from an aware one).
NAIVE = datetime(2026, 1, 1, tzinfo=UTC).replace(tzinfo=None)


def _sample_datums() -> list[tuple[str, dict[str, Any]]]:
    """(record name, datum) of every raw record the samples make, events and END."""
    out = []
    for line in (SAMPLES / "manifest.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        source = Source(row["source"])
        _, records = raw_records(source, (SAMPLES / row["file"]).read_bytes(), tenant=row["tenant"])
        name = "RawSseEvent" if source.is_sse else "RawEngineOutput"
        out += [
            (name, read(name, record, record_names=name == "RawEngineOutput")) for record in records
        ]
    return out


def _by_constructor(name: str, datum: dict[str, Any]) -> RawSseEvent | RawEngineOutput:
    """The record as the dataclass makes it from the same datum (the reference)."""
    fields = dict(datum)
    fields["source"] = Source[fields["source"]]
    fields["kind"] = EventKind[fields["kind"]]
    if name == "RawSseEvent":
        return RawSseEvent(**fields)
    if fields["payload"] is not None:
        fields["payload"] = fields["payload"][1]
    return RawEngineOutput(**fields)


def _decoded(name: str, datum: dict[str, Any]) -> RawSseEvent | RawEngineOutput:
    of = raw_sse_event_of if name == "RawSseEvent" else raw_engine_output_of
    return of(dict(datum))


def _same(a: object, b: object) -> None:
    assert type(a) is type(b)
    assert dataclasses.is_dataclass(a)
    assert dataclasses.is_dataclass(b)
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        assert va == vb, f.name
        assert type(va) is type(vb), f.name
    assert a == b
    assert repr(a) == repr(b)


DATUMS = _sample_datums()


def test_every_sample_record_is_the_record_its_constructor_makes() -> None:
    names = {name for name, _ in DATUMS}
    assert names == {"RawSseEvent", "RawEngineOutput"}
    ends = sum(1 for _, d in DATUMS if d["kind"] == "END")
    assert ends >= 8  # every transcript's END marker is among them
    for name, datum in DATUMS:
        if name == "RawEngineOutput" and datum["source"] == "ATOMR" and datum["payload"]:
            continue  # atomr's tool-call text is parsed by the decoder: compared below
        _same(_decoded(name, datum), _by_constructor(name, datum))


def test_an_atomr_record_keeps_its_parsed_tool_call_delta() -> None:
    atomr = [d for n, d in DATUMS if n == "RawEngineOutput" and d["source"] == "ATOMR"]
    assert atomr
    for datum in atomr:
        record = _decoded("RawEngineOutput", datum)
        assert isinstance(record, RawEngineOutput)
        assert record.source is Source.ATOMR


def _first(name: str, kind: str) -> dict[str, Any]:
    return next(d for n, d in DATUMS if n == name and d["kind"] == kind)


def _changed(name: str, kind: str, **changes: Any) -> dict[str, Any]:
    return {**_first(name, kind), **changes}


@pytest.mark.parametrize(
    ("name", "kind", "changes", "reason"),
    [
        ("RawSseEvent", "EVENT", {"request_id": ""}, "request_id must not be empty"),
        ("RawSseEvent", "EVENT", {"seq": -1}, "seq must be >= 0"),
        ("RawSseEvent", "EVENT", {"received_at": NAIVE}, "timezone-aware"),
        ("RawSseEvent", "EVENT", {"source": "DYNAMO"}, "is not an SSE source"),
        ("RawEngineOutput", "EVENT", {"request_id": ""}, "request_id must not be empty"),
        ("RawEngineOutput", "EVENT", {"seq": -5}, "seq must be >= 0"),
        ("RawEngineOutput", "EVENT", {"received_at": NAIVE}, "timezone-aware"),
        ("RawEngineOutput", "EVENT", {"cancelled": True}, "only an END marker can be cancelled"),
        ("RawEngineOutput", "END", {"cancelled": 1}, "only an END marker can be cancelled"),
    ],
)
def test_what_the_constructor_refuses_is_refused_with_its_reason(
    name: str, kind: str, changes: dict[str, Any], reason: str
) -> None:
    datum = _changed(name, kind, **changes)
    with pytest.raises(ValueError, match=reason):
        _by_constructor(name, datum)
    with pytest.raises(AvroDecodeError, match=reason):
        _decoded(name, datum)


def test_an_engine_end_with_a_payload_is_refused() -> None:
    event = _first("RawEngineOutput", "EVENT")
    datum = _changed("RawEngineOutput", "END", payload=event["payload"])
    with pytest.raises(AvroDecodeError, match="an END marker carries no payload"):
        _decoded("RawEngineOutput", datum)


def test_an_engine_output_of_an_sse_source_is_refused() -> None:
    datum = _changed("RawEngineOutput", "END", source="OPENAI")
    with pytest.raises(AvroDecodeError, match="is not an engine source"):
        _decoded("RawEngineOutput", datum)


@pytest.mark.parametrize("name", ["RawSseEvent", "RawEngineOutput"])
def test_what_the_fast_checks_pass_by_still_reaches_the_constructor(name: str) -> None:
    # Valid, but not the codec's own: a time in another zone, an int subclass.
    zone = timezone(timedelta(hours=5, minutes=45))
    at = datetime(2026, 11, 28, 10, 0, tzinfo=zone)
    for changes in ({"received_at": at}, {"seq": True}):
        datum = _changed(name, "EVENT", **changes)
        record = _decoded(name, datum)
        _same(record, _by_constructor(name, datum))
    assert _decoded(name, _changed(name, "EVENT", received_at=at)).received_at.tzinfo is zone
    utc = _decoded(name, _first(name, "EVENT")).received_at
    assert utc.tzinfo is UTC


def test_a_fast_record_is_as_frozen_as_a_constructed_one() -> None:
    record = _decoded("RawSseEvent", _first("RawSseEvent", "EVENT"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.seq = 3  # type: ignore[misc]
    assert hash(record) == hash(_by_constructor("RawSseEvent", _first("RawSseEvent", "EVENT")))
