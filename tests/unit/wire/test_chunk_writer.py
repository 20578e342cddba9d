"""The direct Chunk writer writes exactly the bytes fastavro's generic writer writes.

`streamtally.wire.avro._chunk_writer` spells the Chunk schema's binary
encoding out by hand for speed; fastavro (through `_codec.write`) is the
reference.  Compared on edge values (varint boundaries, negative times,
every enum symbol, empty and astral-plane text, absent and present optional
fields), on many random chunks, and on every chunk of the repo's samples.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import (
    Chunk,
    FinishReason,
    Source,
    ToolCallDelta,
    Usage,
    trusted_chunk,
)
from streamtally.core.normalize import Normalizer, read_events
from streamtally.errors import AvroEncodeError, InvalidEvent
from streamtally.wire import avro
from streamtally.wire.avro._chunk_writer import check_schema
from streamtally.wire.avro._codec import write
from streamtally.wire.avro._encoders import _CHUNK, _chunk_out

SAMPLES = Path(__file__).resolve().parents[3] / "samples"
LONG_EDGES = (
    *(0, 1, 63, 64, 127, 128, 1023, 1024, 8191, 8192, 8193, 2**31),
    *(2**48 - 1, 2**48, 2**53 + 1, 2**55 - 1, 2**55, 2**63 - 1),  # the eight-byte varints
)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Times whose micros are the edges of the eight-byte varints, on both sides of 1970.
EIGHT_BYTE_MICROS = (
    *(2**48 - 1, 2**48, 2**55 - 1, 2**55),
    *(-(2**48) + 1, -(2**48), -(2**55), -(2**55) - 1),
)
TEXTS = ("", "a", "Grüße, 世界", "😀" * 3, "x" * 200, "\u0000nul", "line\nbreak", "é" * 64)


def reference(chunk: Chunk) -> bytes:
    """What fastavro writes for `chunk` (the generic codec)."""
    return write(_CHUNK, _chunk_out(chunk))


def chunk(**fields: Any) -> Chunk:
    base: dict[str, Any] = {
        "request_id": "r-1",
        "seq": 0,
        "source": Source.OPENAI,
        "event_time": datetime(2026, 11, 24, 12, 0, 0, 123456, tzinfo=UTC),
    }
    return Chunk(**(base | fields))


def edge_chunks() -> list[Chunk]:
    out = [chunk()]
    out += [chunk(seq=n, choice=n) for n in LONG_EDGES]
    out += [chunk(source=source) for source in Source]
    out += [chunk(finish_reason=reason, finish_reason_raw=reason.value) for reason in FinishReason]
    out += [chunk(text_delta=t, reasoning_delta=t[::-1], model=t, error=t) for t in TEXTS]
    out += [chunk(request_id=t or "-") for t in TEXTS]
    out += [chunk(usage=Usage(input_tokens=n, output_tokens=n // 2)) for n in LONG_EDGES]
    out.append(chunk(usage=Usage()))
    out.append(
        chunk(
            tool_call_deltas=(
                ToolCallDelta(index=0, id="call_1", name="get_weather", arguments_delta='{"ci'),
                ToolCallDelta(index=1),
                ToolCallDelta(index=1023, id="", name="", arguments_delta="ü" * 70),
            )
        )
    )
    for moment in (
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),  # a negative time
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(2026, 11, 24, 9, 0, 0, 1, tzinfo=timezone(timedelta(hours=-7, minutes=-30))),
        *(EPOCH + timedelta(microseconds=us) for us in EIGHT_BYTE_MICROS),
    ):
        out.append(chunk(event_time=moment))
    return out


def random_chunks(count: int, seed: int) -> list[Chunk]:
    rng = random.Random(seed)

    def number() -> int:
        return rng.choice(
            (rng.randrange(0, 200), rng.randrange(0, 2**20), rng.randrange(0, 2**63),
             rng.randrange(2**47, 2**57))
        )  # fmt: skip

    def text() -> str:
        alphabet = 'ab \n"\\é世😀\u200b\u0001'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))

    def maybe(value: Any) -> Any:
        return value if rng.random() < 0.5 else None

    out = []
    for _ in range(count):
        deltas = tuple(
            ToolCallDelta(index=number(), id=maybe(text()), name=maybe(text()),
                          arguments_delta=text())
            for _ in range(rng.choice((0, 0, 1, 2, 5)))
        )  # fmt: skip
        usage = maybe(Usage(**{f: number() for f in Usage.model_fields}))
        finish = maybe(rng.choice(list(FinishReason)))
        out.append(
            chunk(
                request_id=text() or "r",
                seq=number(),
                source=rng.choice(list(Source)),
                model=maybe(text()),
                choice=number(),
                text_delta=text(),
                reasoning_delta=text(),
                tool_call_deltas=deltas,
                usage=usage,
                finish_reason=finish,
                finish_reason_raw=maybe(text()),
                error=maybe(text()),
                event_time=datetime(2026, 1, 1, tzinfo=UTC)
                + timedelta(microseconds=rng.randrange(-(10**15), 10**15)),
            )
        )
    return out


def sample_chunks() -> list[Chunk]:
    out: list[Chunk] = []
    for line in (SAMPLES / "manifest.jsonl").read_text().splitlines():
        row = json.loads(line)
        source = Source(row["source"])
        normalizer = Normalizer(source, row.get("request_id"), model=row.get("model"))
        when = datetime(2026, 11, 24, tzinfo=UTC)
        with (SAMPLES / row["file"]).open("rb") as stream:
            for event in read_events(source, stream):
                with contextlib.suppress(InvalidEvent):  # invalid on purpose: no chunks
                    out += normalizer.feed(event, when)
        out += normalizer.end(when)
    return out


@pytest.mark.parametrize("c", edge_chunks(), ids=lambda c: f"{c.seq}-{c.source.name}")
def test_edge_values_are_written_as_fastavro_writes_them(c: Chunk) -> None:
    assert avro.encode_chunk(c) == reference(c)


def test_random_chunks_are_written_as_fastavro_writes_them() -> None:
    chunks = random_chunks(3000, seed=20261124)
    differ = [c for c in chunks if avro.encode_chunk(c) != reference(c)]
    assert differ == []


def test_every_sample_chunk_is_written_as_fastavro_writes_it_and_reads_back() -> None:
    chunks = sample_chunks()
    assert len(chunks) > 500  # the samples hold thousands of events
    for c in chunks:
        data = avro.encode_chunk(c)
        assert data == reference(c)
        assert avro.decode_chunk(data) == c


def test_trusted_chunks_built_by_the_normaliser_are_written_alike() -> None:
    c = trusted_chunk(
        request_id="r", seq=70, source=Source.GEMINI, model=None, choice=0, text_delta="hi",
        reasoning_delta="", tool_call_deltas=(), usage=None, finish_reason=None,
        finish_reason_raw=None, error=None, event_time=datetime(2026, 1, 1, tzinfo=UTC),
    )  # fmt: skip
    assert avro.encode_chunk(c) == reference(c)


def test_what_avro_cannot_carry_is_an_encode_error_as_with_fastavro() -> None:
    for bad in (
        chunk(text_delta="lone \ud800 surrogate"),
        chunk(seq=2**63),
        chunk(usage=Usage(input_tokens=2**64)),
    ):
        with pytest.raises(AvroEncodeError):
            reference(bad)
        with pytest.raises(AvroEncodeError):
            avro.encode_chunk(bad)
    with pytest.raises(AvroEncodeError, match=r"Chunk: .*surrogate"):
        avro.encode_chunk(chunk(error="lone \ud800 surrogate"))
    with pytest.raises(AvroEncodeError, match=r"^Chunk: 9223372036854775808 does not fit"):
        avro.encode_chunk(chunk(seq=2**63))


def test_another_chunk_schema_is_refused_at_import() -> None:
    changed = copy.deepcopy(_CHUNK.parsed)
    changed["fields"].insert(3, {"name": "extra", "type": "long"})
    with pytest.raises(RuntimeError, match=r"Chunk\.avsc changed"):
        check_schema(changed)
    renamed = copy.deepcopy(_CHUNK.parsed)
    renamed["fields"][2]["type"]["symbols"] = ["UNKNOWN", "OPENAI"]
    with pytest.raises(RuntimeError, match="symbols changed"):
        check_schema(renamed)
    reordered = copy.deepcopy(_CHUNK.parsed)
    usage = next(f for f in reordered["fields"] if f["name"] == "usage")
    usage["type"][1]["fields"].reverse()
    with pytest.raises(RuntimeError, match="usage record"):
        check_schema(reordered)
