"""Readers compiled from a schema read exactly what fastavro reads, and refuse what is broken.

`streamtally.wire.avro._compiled` turns the raw records' schemas into straight-line
Python for speed; fastavro's `schemaless_reader` is the reference.  Compared on every
record of the repo's samples, on random datums of every current schema it can compile
(edge values: varint boundaries, 64-bit extremes, astral-plane text, empty and
multi-block arrays), and on damaged bodies: every truncation raises, and a body with
flipped bytes reads either as fastavro reads it or raises.
"""

from __future__ import annotations

import io
import json
import random
import struct
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fastavro
import pytest

from streamtally.core.models import Source
from streamtally.producers import raw_records
from streamtally.wire import avro
from streamtally.wire.avro import _raw_readers
from streamtally.wire.avro._codec import COMPILED, DECODE_ERRORS, _compiled
from streamtally.wire.avro._compiled import (
    GENERATED,
    GENERATED_FILE,
    Unsupported,
    compile_reader,
    generated_source,
)
from streamtally.wire.avro._framing import HEADER_SIZE
from streamtally.wire.avro._schemas import current, parse

SAMPLES = Path(__file__).resolve().parents[3] / "samples"
LONGS = (0, 1, -1, 63, -64, 64, -65, 8191, 8192, 2**31, -(2**31) - 1, 2**53 + 1)
LONGS += (2**63 - 1, -(2**63))
TEXTS = ("", "a", "Grüße, 世界", "😀" * 3, "x" * 300, "\u0000nul", "line\nbreak")
#: Every schema the worker may compile, with the record-name form it reads it in.
RAW = (("RawSseEvent", False), ("RawEngineOutput", True))


def fastavro_read(parsed: Any, body: bytes, record_names: bool) -> tuple[Any, int]:
    fo = io.BytesIO(body)
    datum = fastavro.schemaless_reader(
        fo,
        parsed,
        None,
        return_record_name=record_names,
        return_record_name_override=record_names,
    )
    return datum, fo.tell()


def reader_of(name: str, record_names: bool) -> Callable[[bytes, int], tuple[Any, int]]:
    reader = _compiled(current(name), record_names)
    assert reader is not None  # else the worker reads it with fastavro, and this tests nothing
    return reader


# --------------------------------------------------------------------------- random datums


class Datums:
    """Random valid datums of a parsed schema, in the form fastavro writes."""

    def __init__(self, parsed: Any, rng: random.Random) -> None:
        self.named = parsed["__named_schemas"]
        self.rng = rng

    def of(self, schema: Any) -> Any:
        rng = self.rng
        if isinstance(schema, str):
            schema = self.named.get(schema, schema)
        if isinstance(schema, list):
            branch = rng.choice(schema)
            resolved = self.named.get(branch, branch) if isinstance(branch, str) else branch
            value = self.of(branch)
            if isinstance(resolved, dict) and resolved.get("type") == "record":
                return (resolved["name"], value)  # the branch named: no guessing on writing
            return value
        if isinstance(schema, str):
            return self.primitive(schema)
        kind = schema["type"]
        if schema.get("logicalType") == "timestamp-micros":
            return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(
                microseconds=rng.choice((0, 1, -1, 1_790_000_000_123_456, -(10**12)))
            )
        if kind == "record":
            return {f["name"]: self.of(f["type"]) for f in schema["fields"]}
        if kind == "enum":
            return rng.choice(schema["symbols"])
        if kind == "array":
            return [self.of(schema["items"]) for _ in range(rng.choice((0, 1, 3, 70)))]
        if kind == "map":
            return {rng.choice(TEXTS) + str(k): self.of(schema["values"]) for k in range(3)}
        if kind == "fixed":
            return rng.randbytes(schema["size"])
        return self.primitive(kind)

    def primitive(self, kind: str) -> Any:
        rng = self.rng
        if kind == "null":
            return None
        if kind == "long":
            return rng.choice((*LONGS, rng.randrange(-(2**63), 2**63)))
        if kind == "int":
            return rng.choice((0, 1, -1, 2**31 - 1, -(2**31), rng.randrange(-(2**31), 2**31)))
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "string":
            return rng.choice(TEXTS)
        if kind == "bytes":
            return rng.randbytes(rng.choice((0, 1, 200)))
        if kind == "double":
            return rng.choice((0.0, -1.5, 1e300, float("inf"), rng.random()))
        if kind == "float":
            return rng.choice((0.0, -1.5, 0.25))
        raise AssertionError(f"no datum for {kind}")


def written(parsed: Any, datum: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed, datum)
    return out.getvalue()


def random_bodies(name: str, count: int, seed: int) -> list[bytes]:
    parsed = current(name).parsed
    datums = Datums(parsed, random.Random(seed))
    return [written(parsed, datums.of(parsed)) for _ in range(count)]


# --------------------------------------------------------------------------- tests


def test_the_worker_reads_its_raw_records_with_compiled_readers() -> None:
    assert {name for name, _ in RAW} == COMPILED
    for name, record_names in RAW:
        reader_of(name, record_names)


def test_the_generated_readers_are_those_of_the_current_schemas_and_in_use() -> None:
    # A schema change without `python -m streamtally.wire.avro._compiled` fails here.
    assert GENERATED_FILE.read_text(encoding="utf-8") == generated_source()
    assert {(name, names) for name, names, _ in GENERATED} == set(RAW)
    for name, record_names, function in GENERATED:
        assert reader_of(name, record_names) is getattr(_raw_readers, function)


@pytest.mark.parametrize(("name", "record_names"), RAW)
def test_random_datums_read_as_fastavro_reads_them(name: str, record_names: bool) -> None:
    parsed = current(name).parsed
    reader = reader_of(name, record_names)
    for body in random_bodies(name, 400, seed=len(name)):
        assert reader(body, 0) == fastavro_read(parsed, body, record_names)


def test_every_sample_record_reads_as_fastavro_reads_it() -> None:
    rows = [json.loads(line) for line in (SAMPLES / "manifest.jsonl").read_text().splitlines()]
    seen = set()
    for row in rows:
        source = Source(row["source"])
        _, records = raw_records(
            source, (SAMPLES / row["file"]).read_bytes(), tenant=row["tenant"], request_id="r-1"
        )
        name, record_names = RAW[0] if source.is_sse else RAW[1]
        parsed = current(name).parsed
        reader = reader_of(name, record_names)
        for value in records:
            body = value[HEADER_SIZE:]
            assert reader(body, 0) == fastavro_read(parsed, body, record_names)
        seen.add(source)
    assert seen == set(Source)


@pytest.mark.parametrize(("name", "record_names"), RAW)
def test_every_truncation_raises(name: str, record_names: bool) -> None:
    reader = reader_of(name, record_names)
    for body in random_bodies(name, 30, seed=7):
        for end in range(len(body)):
            with pytest.raises(DECODE_ERRORS):
                reader(body[:end], 0)


@pytest.mark.parametrize(("name", "record_names"), RAW)
def test_a_damaged_body_reads_as_fastavro_reads_it_or_raises(name: str, record_names: bool) -> None:
    parsed = current(name).parsed
    reader = reader_of(name, record_names)
    rng = random.Random(11)
    read = raised = 0
    for body in random_bodies(name, 60, seed=3):
        for _ in range(40):
            damaged = bytearray(body)
            for _ in range(rng.choice((1, 2))):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            try:
                ours = reader(bytes(damaged), 0)
            except DECODE_ERRORS:
                raised += 1
                continue
            read += 1
            # compared as text: a damaged double may read as NaN, which equals nothing
            assert repr(ours) == repr(fastavro_read(parsed, bytes(damaged), record_names))
    assert read > 100  # both outcomes were exercised
    assert raised > 100


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _string(text: str) -> bytes:
    data = text.encode()
    return _varint(len(data)) + data


ARRAY = parse(
    {
        "type": "record",
        "name": "A",
        "fields": [
            {"name": "xs", "type": {"type": "array", "items": "long"}},
            {"name": "m", "type": {"type": "map", "values": "string"}},
        ],
    }
)


def test_blocks_with_a_negative_count_and_several_blocks_are_read() -> None:
    """Other writers (Java's) may split an array in blocks and give a block's byte size."""
    first = _varint(300) + _varint(-2)
    body = (
        _varint(-2)
        + _varint(len(first))
        + first
        + _varint(1)
        + _varint(7)
        + _varint(0)
        + _varint(1)
        + _string("k")
        + _string("v")
        + _varint(0)
    )
    expected = {"xs": [300, -2, 7], "m": {"k": "v"}}
    assert compile_reader(ARRAY)(body, 0) == (expected, len(body))
    assert fastavro_read(ARRAY, body, False) == (expected, len(body))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_varint(1) + b"\xff" * 10 + b"\x01" + _varint(0), id="varint past 10 bytes"),
        pytest.param(_varint(1) + b"\xff" * 9 + b"\x7f" + _varint(0), id="varint past 64 bits"),
        pytest.param(_varint(0) + _varint(1) + _varint(-1) + _varint(0), id="negative length"),
    ],
)
def test_what_fastavro_would_misread_is_refused(body: bytes) -> None:
    with pytest.raises(DECODE_ERRORS):
        compile_reader(ARRAY)(body, 0)


def test_enum_and_union_indexes_out_of_range_are_refused() -> None:
    parsed = current("RawSseEvent").parsed
    body = written(parsed, sse_datum())
    reader = reader_of("RawSseEvent", False)
    start = len(_string("r-1")) + 1  # request_id, then seq (one byte)
    for index in (_varint(8), _varint(-1)):  # Source has 8 symbols
        damaged = body[:start] + index + body[start + 1 :]
        with pytest.raises(IndexError):
            reader(damaged, 0)
    sse_id = body.rfind(b"\x00")  # the last byte: sse_id's union branch (null)
    assert sse_id == len(body) - 1
    for branch in (_varint(2), _varint(-1)):
        with pytest.raises(IndexError):
            reader(body[:sse_id] + branch, 0)


def sse_datum() -> dict[str, Any]:
    return {
        "request_id": "r-1",
        "seq": 1,
        "source": "OPENAI",
        "tenant": "acme",
        "received_at": datetime(2026, 11, 24, tzinfo=UTC),
        "kind": "EVENT",
        "event": "message",
        "data": "{}",
        "sse_id": None,
    }


def test_doubles_floats_and_bytes_read_as_fastavro_reads_them() -> None:
    parsed = parse(
        {
            "type": "record",
            "name": "D",
            "fields": [
                {"name": "d", "type": "double"},
                {"name": "f", "type": "float"},
                {"name": "b", "type": "bytes"},
                {"name": "x", "type": {"type": "fixed", "name": "X", "size": 3}},
                {"name": "t", "type": "boolean"},
            ],
        }
    )
    datums = Datums(parsed, random.Random(5))
    reader = compile_reader(parsed)
    for _ in range(50):
        datum = datums.of(parsed)
        body = written(parsed, datum)
        assert reader(body, 0) == fastavro_read(parsed, body, False)
    short = struct.pack("<d", 1.5)[:5]
    with pytest.raises(EOFError):
        reader(short, 0)


def test_a_logical_type_it_does_not_read_is_left_to_fastavro() -> None:
    parsed = parse(
        {
            "type": "record",
            "name": "L",
            "fields": [{"name": "d", "type": {"type": "int", "logicalType": "date"}}],
        }
    )
    with pytest.raises(Unsupported):
        compile_reader(parsed)


def test_decoding_through_the_codec_uses_the_compiled_reader_and_frames_errors() -> None:
    _, records = raw_records(
        Source.OPENAI,
        (SAMPLES / "openai/text_usage.sse").read_bytes(),
        tenant="acme",
        request_id="r-1",
    )
    event = avro.decode_raw_sse_event(records[0])
    assert (event.request_id, event.tenant) == ("r-1", "acme")
    with pytest.raises(avro.AvroDecodeError, match="cannot decode"):
        avro.decode_raw_sse_event(records[0][:-3])
    with pytest.raises(avro.AvroDecodeError, match="trailing"):
        avro.decode_raw_sse_event(records[0] + b"\x00")
