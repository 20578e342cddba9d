"""The Confluent wire format codec (`streamtally.wire.avro._confluent`): 00 + schema id + body.

Exact bytes of known records in both framings, round trips of every record in
both framings through the generic and the typed readers, and the refusals
(unknown id, bad magic, short header, wrong record) as `AvroDecodeError`s.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from streamtally.core.models import ChoiceTokens, Source, ToolCall, ToolCallDelta, Usage
from streamtally.errors import InputError
from streamtally.wire import avro
from streamtally.wire.avro._compat import _samples
from streamtally.wire.records import BillingCorrection, RawEngineOutput
from tests.unit.wire.test_avro import (
    BILLING,
    CHOICES,
    CHUNKS,
    DEAD_LETTERS,
    ENGINE_CASES,
    PINNED_CHUNK,
    PINNED_CHUNK_HEX,
    PROVEN,
    SSE_EVENTS,
    T0,
    TOKENS,
    TOOL_CALL_DELTAS,
    TOOL_CALLS,
    USAGES,
)

#: Schema ids as a registry would hand them out: one per record's current schema.
IDS: dict[int, avro.SchemaVersion] = {
    100 + i: avro.current(name) for i, name in enumerate(avro.RECORD_NAMES)
}
ID_OF = {version.name: schema_id for schema_id, version in IDS.items()}
DECODERS = avro.FramingDecoders(IDS)

# --------------------------------------------------------------------------- exact bytes

#: Usage(input 3, output 5, cached 1): five longs, zig-zag varints 06 0a 00 02 00.
USAGE = Usage(input_tokens=3, output_tokens=5, cached_tokens=1)
USAGE_BODY = "060a000200"
USAGE_SINGLE_OBJECT = "c301" + "99033e96c2b3c574" + USAGE_BODY  # marker, fingerprint (LE)
USAGE_CONFLUENT_ID_7 = "00" + "00000007" + USAGE_BODY  # magic, id 7 (big-endian)


def test_a_usage_in_each_framing_is_exactly_the_pinned_bytes() -> None:
    single = avro.encode_model(USAGE)
    assert single.hex() == USAGE_SINGLE_OBJECT
    assert avro.to_confluent(single, 7).hex() == USAGE_CONFLUENT_ID_7
    datum = avro.decode("Usage", single)
    assert avro.encode_confluent("Usage", datum, 7).hex() == USAGE_CONFLUENT_ID_7
    usage_ids = {7: avro.current("Usage")}
    for value in (single, bytes.fromhex(USAGE_CONFLUENT_ID_7)):
        assert avro.FramingDecoders(usage_ids).model(Usage, value) == USAGE


def test_the_pinned_chunk_in_confluent_framing() -> None:
    """The single-object bytes pinned in test_avro, with the 5-byte header instead."""
    confluent = avro.to_confluent(avro.encode_chunk(PINNED_CHUNK), 0x01020304)
    assert confluent == bytes.fromhex("0001020304" + PINNED_CHUNK_HEX[20:])
    assert avro.FramingDecoders({0x01020304: avro.current("Chunk")}).chunk(confluent) == (
        PINNED_CHUNK
    )


@pytest.mark.parametrize(
    ("schema_id", "header"),
    [(0, "0000000000"), (1, "0000000001"), (258, "0000000102"), (2**31 - 1, "007fffffff")],
)
def test_confluent_header(schema_id: int, header: str) -> None:
    assert avro.confluent_header(schema_id).hex() == header
    assert avro.schema_id_in(bytes.fromhex(header)) == schema_id


@pytest.mark.parametrize("schema_id", [-1, 2**31, 2**32])
def test_a_schema_id_beyond_a_java_int_is_refused(schema_id: int) -> None:
    with pytest.raises(avro.AvroEncodeError, match=f"schema id {schema_id} is not between"):
        avro.confluent_header(schema_id)
    with pytest.raises(avro.AvroEncodeError, match="schema id"):
        avro.encode_confluent("Usage", {}, schema_id)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", avro.RECORD_NAMES)
def test_every_record_round_trips_in_both_framings(name: str) -> None:
    """Samples through every union branch and enum symbol of each record."""
    for datum in _samples(avro.current(name).schema):
        single = avro.encode(name, datum)
        confluent = avro.encode_confluent(name, datum, ID_OF[name])
        assert confluent[:5] == avro.confluent_header(ID_OF[name])
        assert confluent[5:] == single[avro.HEADER_SIZE :]  # the same body
        expected = avro.decode(name, single)
        assert avro.decode_framed(name, single, IDS) == expected
        assert avro.decode_framed(name, confluent, IDS) == expected


def _both(value: bytes, name: str) -> list[bytes]:
    return [value, avro.to_confluent(value, ID_OF[name])]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_in_both_framings(chunk: Any) -> None:
    for value in _both(avro.encode_chunk(chunk), "Chunk"):
        assert DECODERS.chunk(value) == chunk


@pytest.mark.parametrize("tokens", TOKENS)
def test_tokens_in_both_framings(tokens: Any) -> None:
    for value in _both(avro.encode_tokens(tokens), "Tokens"):
        assert DECODERS.tokens(value) == tokens


@pytest.mark.parametrize(
    "model", [*USAGES, *TOOL_CALL_DELTAS, *TOOL_CALLS, *CHOICES], ids=lambda m: type(m).__name__
)
def test_models_in_both_framings(model: Usage | ToolCallDelta | ToolCall | ChoiceTokens) -> None:
    for value in _both(avro.encode_model(model), type(model).__name__):
        assert DECODERS.model(type(model), value) == model


@pytest.mark.parametrize("event", SSE_EVENTS)
def test_raw_sse_events_in_both_framings(event: Any) -> None:
    for value in _both(avro.encode_raw_sse_event(event), "RawSseEvent"):
        assert DECODERS.raw_sse_event(value) == event


@pytest.mark.parametrize(("source", "line"), ENGINE_CASES)
def test_raw_engine_outputs_in_both_framings(source: Source, line: dict[str, Any]) -> None:
    output = RawEngineOutput(
        request_id="r1",
        seq=0,
        source=source,
        tenant="acme",
        received_at=T0,
        payload=json.loads(json.dumps(line)),
    )
    single = avro.encode_raw_engine_output(output)
    expected = avro.decode_raw_engine_output(single)
    for value in _both(single, "RawEngineOutput"):
        assert DECODERS.raw_engine_output(value) == expected


@pytest.mark.parametrize("event", [BILLING, PROVEN], ids=["billing", "proven"])
def test_billing_events_in_both_framings(event: Any) -> None:
    for value in _both(avro.encode_billing_event(event), "BillingEvent"):
        assert DECODERS.billing_event(value) == event


def test_billing_corrections_in_both_framings() -> None:
    correction = BillingCorrection(
        correction_id="c" * 32,
        audit_id="a" * 32,
        reason="missing_billing",
        tenant="acme",
        request_id="r1",
        billing_before={0: 12, 3: 40},
        corrected=PROVEN,
        input_tokens=7,
        requests=1,
        cost=Decimal("0.000000000123"),
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
    for value in _both(avro.encode_billing_correction(correction), "BillingCorrection"):
        assert DECODERS.billing_correction(value) == correction


@pytest.mark.parametrize("letter", DEAD_LETTERS)
def test_dead_letters_in_both_framings(letter: Any) -> None:
    for value in _both(avro.encode_dead_letter(letter), "DeadLetter"):
        assert DECODERS.dead_letter(value) == letter


def test_an_older_writer_schema_under_its_own_id_is_resolved() -> None:
    """A registry id of a released version (BillingEvent v1: no `priced`, no provenance)."""
    v1 = avro.history("BillingEvent")[0]
    datum = avro.decode("BillingEvent", avro.encode_billing_event(BILLING))
    value = avro.encode_confluent("BillingEvent", datum, 41, version=1)
    event = avro.FramingDecoders({41: v1}).billing_event(value)
    assert event.priced is True  # the field's default
    assert event.usage_counts() == BILLING.usage_counts()
    assert event.raw_topic is None


# --------------------------------------------------------------------------- known versions


def test_known_version_maps_a_registry_schema_to_the_codec_version() -> None:
    for name in avro.RECORD_NAMES:
        for version in (*avro.history(name), avro.current(name)):
            text = json.dumps(version.schema)
            assert avro.known_version(text).fingerprint == version.fingerprint
            assert avro.known_version(version.schema).name == name
    # Docs and key order do not matter: the canonical form does.
    schema = json.loads(json.dumps(avro.current("Usage").schema))
    schema["doc"] = "as the registry stores it"
    assert avro.known_version(dict(reversed(schema.items()))) is avro.current("Usage")


def test_known_version_refuses_an_unknown_or_broken_schema() -> None:
    schema = json.loads(json.dumps(avro.current("Usage").schema))
    schema["fields"] = schema["fields"][:-1]
    with pytest.raises(avro.AvroDecodeError, match="does not know"):
        avro.known_version(schema)
    with pytest.raises(avro.AvroDecodeError, match="not an Avro schema"):
        avro.known_version("{not json")
    with pytest.raises(avro.AvroDecodeError, match="not an Avro schema"):
        avro.known_version({"type": "record", "name": "X", "fields": [{"name": "a"}]})


# --------------------------------------------------------------------------- refusals


def _confluent_billing(schema_id: int) -> bytes:
    return avro.to_confluent(avro.encode_billing_event(BILLING), schema_id)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (_confluent_billing(99), "BillingEvent: unknown schema id 99 (Confluent framing)"),
        (b"\x00\x00\x00", "3 bytes: too short for a Confluent-framed Avro value"),
        (b"\x01" + bytes(20), "bad marker 0100: neither Avro single-object encoding"),
        (b'{"event_id": 1}', "bad marker 7b22: neither"),
        (b"\xc3\x01" + bytes(8) + b"\x00", "unknown writer schema fingerprint 0000000000000000"),
        (b"", "0 bytes: too short"),
        (_confluent_billing(ID_OF["BillingEvent"])[:-3], "cannot decode the body"),
        (_confluent_billing(ID_OF["BillingEvent"]) + b"\x00", "1 trailing bytes"),
        (avro.to_confluent(avro.encode_model(USAGE), ID_OF["Usage"]), "got a Usage v1 one"),
    ],
    ids=[
        "unknown-id",
        "short-header",
        "bad-magic",
        "json",
        "unknown-fingerprint",
        "empty",
        "truncated",
        "trailing",
        "other-record",
    ],
)
def test_values_in_neither_framing_or_unknown_are_refused(value: bytes, message: str) -> None:
    with pytest.raises(avro.AvroDecodeError, match=re.escape(message)) as raised:
        DECODERS.billing_event(value)
    assert isinstance(raised.value, InputError)  # what the processors dead-letter
    with pytest.raises(avro.AvroDecodeError, match=re.escape(message)):
        avro.decode_framed("BillingEvent", value, IDS)


def test_an_unknown_id_is_refused_for_every_record() -> None:
    for name in avro.RECORD_NAMES:
        value = avro.confluent_header(ID_OF[name]) + b"\x00" * 4
        with pytest.raises(avro.AvroDecodeError, match=f"{name}: unknown schema id"):
            avro.decode_framed(name, value, {})


def test_the_plain_decoders_read_confluent_framing_by_the_process_table() -> None:
    """The typed decoders (the worker's) read both framings: a Confluent id through the
    process's table of ids (`_ids`), which knows nothing without a registry."""
    value = _confluent_billing(ID_OF["BillingEvent"])
    with pytest.raises(avro.AvroDecodeError, match=r"unknown schema id 101 .*no schema registry"):
        avro.decode_billing_event(value)
    avro.learn_id(ID_OF["BillingEvent"], avro.current("BillingEvent"))
    assert avro.decode_billing_event(value) == DECODERS.billing_event(value)


def test_to_confluent_takes_single_object_messages_only() -> None:
    with pytest.raises(avro.AvroDecodeError, match="bad marker"):
        avro.to_confluent(_confluent_billing(1), 2)
    with pytest.raises(avro.AvroDecodeError, match="unknown writer schema fingerprint"):
        avro.to_confluent(b"\xc3\x01" + bytes(8), 2)
