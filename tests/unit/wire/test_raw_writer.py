"""The direct RawSseEvent writer writes exactly the bytes fastavro's generic writer writes.

`streamtally.wire.avro._raw_writer` spells the RawSseEvent schema's binary
encoding out by hand, since the tap encodes every event it tees on the
client's path; fastavro (through `_codec.write`) is the reference.  Compared
on edge values (varint boundaries, times on both sides of 1970, every SSE
source and kind, empty, long and astral-plane text, with and without an SSE
id), on random events, and on every event of the repo's SSE samples.
"""

from __future__ import annotations

import copy
import random
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Source
from streamtally.core.normalize import read_events
from streamtally.errors import AvroEncodeError
from streamtally.wire import avro
from streamtally.wire.avro._codec import write
from streamtally.wire.avro._encoders import _RAW_SSE, _raw_sse_out
from streamtally.wire.avro._raw_writer import check_schema
from streamtally.wire.records import KEEPALIVE_EVENT, EventKind, RawSseEvent

SAMPLES = Path(__file__).resolve().parents[3] / "samples"
SSE_SOURCES = tuple(source for source in Source if source.is_sse)
LONGS = (0, 1, 63, 64, 127, 128, 8191, 8192, 8193, 2**31, 2**48, 2**55, 2**63 - 1)
TEXTS = ("", "a", "message", "Grüße, 世界", "😀" * 3, "x" * 200, "\u0000nul", "é" * 5000)
MOMENTS = (
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(2026, 11, 27, 9, 0, 0, 1, tzinfo=timezone(timedelta(hours=5, minutes=45))),
)


def reference(event: RawSseEvent) -> bytes:
    """What fastavro writes for `event` (the generic codec)."""
    return write(_RAW_SSE, _raw_sse_out(event))


def raw(**fields: Any) -> RawSseEvent:
    base: dict[str, Any] = {
        "request_id": "chatcmpl-1",
        "seq": 0,
        "source": Source.OPENAI,
        "tenant": "acme",
        "received_at": datetime(2026, 11, 27, 20, 0, 0, 123456, tzinfo=UTC),
    }
    return RawSseEvent(**(base | fields))


def edge_events() -> list[RawSseEvent]:
    out = [raw()]
    out += [raw(seq=n) for n in LONGS]
    out += [raw(source=source) for source in SSE_SOURCES]
    out += [raw(kind=EventKind.END), raw(event=KEEPALIVE_EVENT)]
    out += [raw(request_id=t or "-", tenant=t, event=t, data=t, sse_id=t) for t in TEXTS]
    out += [raw(received_at=moment) for moment in MOMENTS]
    out += [
        RawSseEvent.end(
            request_id="r", seq=9, source=Source.ANTHROPIC, tenant="t",
            received_at=MOMENTS[0], cancelled=True,
        )
    ]  # fmt: skip
    return out


def random_events(count: int, seed: int) -> list[RawSseEvent]:
    rng = random.Random(seed)

    def text() -> str:
        alphabet = 'ab \n"\\é世😀\u200b\u0001:'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))

    return [
        raw(
            request_id=text() or "r",
            seq=rng.choice((rng.randrange(0, 200), rng.randrange(0, 2**40))),
            source=rng.choice(SSE_SOURCES),
            tenant=text(),
            received_at=datetime(2026, 1, 1, tzinfo=UTC)
            + timedelta(microseconds=rng.randrange(-(10**15), 10**15)),
            kind=rng.choice((EventKind.EVENT, EventKind.END)),
            event=rng.choice(("message", text())),
            data=text(),
            sse_id=rng.choice((None, text())),
        )
        for _ in range(count)
    ]


def sample_events() -> list[RawSseEvent]:
    out = []
    for path in sorted(SAMPLES.glob("*/*.sse")):
        source = Source.OPENAI_RESPONSES if path.parent.name == "openai-responses" else None
        source = source or Source[path.parent.name.upper()]
        with path.open("rb") as stream:
            for seq, event in enumerate(read_events(source, stream)):
                out.append(
                    raw(source=source, seq=seq, event=event.event, data=event.data, sse_id=event.id)
                )
    return out


@pytest.mark.parametrize("event", edge_events(), ids=repr)
def test_edge_values_are_written_as_fastavro_writes_them(event: RawSseEvent) -> None:
    assert avro.encode_raw_sse_event(event) == reference(event)


def test_random_events_are_written_as_fastavro_writes_them() -> None:
    events = random_events(500, seed=27)
    assert [avro.encode_raw_sse_event(e) for e in events] == [reference(e) for e in events]


def test_every_sample_event_is_written_as_fastavro_writes_it() -> None:
    events = sample_events()
    assert len(events) > 300  # every SSE sample of the repo, not an empty glob
    assert {e.source for e in events} == set(SSE_SOURCES)
    assert [avro.encode_raw_sse_event(e) for e in events] == [reference(e) for e in events]


def test_what_it_writes_reads_back() -> None:
    for event in (*edge_events(), *random_events(50, seed=3)):
        assert avro.decode_raw_sse_event(avro.encode_raw_sse_event(event)) == event


def test_text_that_is_not_utf8_is_an_encode_error() -> None:
    with pytest.raises(AvroEncodeError, match=r"RawSseEvent: .*surrogate"):
        avro.encode_raw_sse_event(raw(data="half \ud800 a pair"))


def test_a_sequence_number_past_an_avro_long_is_an_encode_error_of_this_record() -> None:
    with pytest.raises(AvroEncodeError, match=r"^RawSseEvent: 9223372036854775808 does not fit"):
        avro.encode_raw_sse_event(raw(seq=2**63))


def test_the_schema_it_writes_is_checked() -> None:
    check_schema(_RAW_SSE.parsed)  # the current schema: accepted
    renamed = copy.deepcopy(_RAW_SSE.parsed)
    renamed["fields"][7]["name"] = "payload"
    with pytest.raises(RuntimeError, match=r"RawSseEvent\.avsc changed"):
        check_schema(renamed)
    reordered = copy.deepcopy(_RAW_SSE.parsed)
    reordered["fields"][2], reordered["fields"][3] = (
        reordered["fields"][3],
        reordered["fields"][2],
    )
    with pytest.raises(RuntimeError, match=r"RawSseEvent\.avsc changed"):
        check_schema(reordered)
    kinds = copy.deepcopy(_RAW_SSE.parsed)
    kinds["fields"][5]["type"]["symbols"] = ["UNKNOWN", "END", "EVENT"]
    with pytest.raises(RuntimeError, match="EventKind symbols changed"):
        check_schema(kinds)


def by_writer(event: RawSseEvent) -> bytes:
    """`event` through the tap's per-request writer (`avro.raw_sse_writer`)."""
    writer = avro.raw_sse_writer(event.request_id, event.source, event.tenant)
    return writer.value(
        event.seq, avro.micros_of(event.received_at), event.event, event.data, event.sse_id
    )


def test_the_per_request_writer_writes_what_fastavro_writes() -> None:
    """Every EVENT record of the edge values, random events and the samples: the same
    bytes as `encode_raw_sse_event` and as fastavro, without making the record."""
    events = [
        e
        for e in (*edge_events(), *random_events(500, seed=28), *sample_events())
        if e.kind is EventKind.EVENT
    ]
    assert len(events) > 800
    assert [by_writer(e) for e in events] == [reference(e) for e in events]


def test_one_writer_serves_every_event_of_its_request() -> None:
    writer = avro.raw_sse_writer("chatcmpl-9", Source.ANTHROPIC, "acme")
    for seq, event in enumerate(
        raw(
            request_id="chatcmpl-9",
            source=Source.ANTHROPIC,
            seq=n,
            data="x" * (n % 300),
            sse_id=None,
        )
        for n in (0, 1, 63, 64, 200, 2**40)
    ):
        micros = avro.micros_of(event.received_at)
        assert writer.value(event.seq, micros, "message", event.data, None) == reference(event), seq


def test_the_per_request_writer_refuses_what_the_record_refuses() -> None:
    with pytest.raises(ValueError, match="request_id must not be empty"):
        avro.raw_sse_writer("", Source.OPENAI, "acme")
    with pytest.raises(ValueError, match="not an SSE source"):
        avro.raw_sse_writer("r", Source.VLLM, "acme")
    writer = avro.raw_sse_writer("r", Source.OPENAI, "acme")
    with pytest.raises(ValueError, match="seq must be >= 0"):
        writer.value(-1, 0, "message", "", None)
    with pytest.raises(AvroEncodeError, match=r"RawSseEvent: .*surrogate"):
        writer.value(0, 0, "message", "half \ud800 a pair", None)
    with pytest.raises(ValueError, match="timezone-aware"):
        avro.micros_of(datetime(2026, 1, 1))  # noqa: DTZ001 - the naive time it refuses
