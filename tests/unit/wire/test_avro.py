"""The Avro codec: schemas, single-object framing, typed helpers, schema evolution."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import random
import re
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import pytest

from streamtally.billing.events import event_id
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
from streamtally.errors import InputError
from streamtally.wire import avro
from streamtally.wire.records import (
    KEEPALIVE_EVENT,
    BillingEvent,
    DeadLetter,
    EventKind,
    RawEngineOutput,
    RawSseEvent,
    UsageSource,
)

ROOT = Path(__file__).resolve().parents[3]
T0 = datetime(2025, 3, 4, 5, 6, 7, 891011, tzinfo=UTC)
UNICODE = "héllo wörld ✓ 日本語 🎉 \u0000 \u2028 𝄞"

# --------------------------------------------------------------------------- reference CRC-64-AVRO
# Written from the Avro specification ("Schema Fingerprints"), independent of streamtally.wire.avro.

_EMPTY64 = 0xC15D213AA4D7A795
_MASK64 = (1 << 64) - 1


def _fp_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_EMPTY64 & -(fp & 1))
        table.append(fp & _MASK64)
    return table


_FP_TABLE = _fp_table()


def crc64_avro(data: bytes) -> int:
    fp = _EMPTY64
    for byte in data:
        fp = (fp >> 8) ^ _FP_TABLE[(fp ^ byte) & 0xFF]
    return fp


def signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# From apache/avro share/test/data/schema-tests.txt: input, canonical form, signed fingerprint.
SPEC_VECTORS = [
    ('"null"', '"null"', 7195948357588979594),
    ('{"type":"int"}', '"int"', 8247732601305521295),
    ('"string"', '"string"', -8142146995180207161),
    (
        '{"fields":[], "type":"record", "name":"foo", "namespace":"x.y"}',
        '{"name":"x.y.foo","type":"record","fields":[]}',
        5916914534497305771,
    ),
    (
        '{"fields":[{"type":"boolean", "aliases":[], "name":"f1", "default":true},'
        '{"order":"descending","name":"f2","doc":"Hello","type":"int"}],'
        '"type":"record", "name":"foo"}',
        '{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"},'
        '{"name":"f2","type":"int"}]}',
        -4860222112080293046,
    ),
    (
        '{"namespace":"x.y.z", "type":"enum", "name":"foo", "doc":"foo bar",'
        ' "symbols":["A1", "A2"]}',
        '{"name":"x.y.z.foo","type":"enum","symbols":["A1","A2"]}',
        -4448647247586288245,
    ),
    (
        '{ "items":{"type":"null"}, "type":"array"}',
        '{"type":"array","items":"null"}',
        -589620603366471059,
    ),
]


@pytest.mark.parametrize(("schema", "canonical", "fingerprint"), SPEC_VECTORS)
def test_canonical_form_and_fingerprint_match_the_avro_spec_vectors(
    schema: str, canonical: str, fingerprint: int
) -> None:
    assert signed64(crc64_avro(canonical.encode())) == fingerprint
    parsed = json.loads(schema)
    assert avro.canonical_form(parsed) == canonical
    assert avro.schema_fingerprint(parsed) == (fingerprint & _MASK64).to_bytes(8, "little")


@pytest.mark.parametrize("name", avro.RECORD_NAMES)
def test_every_fingerprint_is_the_crc64_of_the_canonical_form(name: str) -> None:
    version = avro.current(name)
    expected = crc64_avro(version.canonical_form.encode()).to_bytes(8, "little")
    assert version.fingerprint == expected == avro.fingerprint(name)
    assert version.header == b"\xc3\x01" + expected
    assert avro.canonical_form(version.schema) == version.canonical_form
    # the canonical form is Avro's: no docs, defaults or logical types, full names only
    assert '"doc"' not in version.canonical_form
    assert '"default"' not in version.canonical_form
    assert "logicalType" not in version.canonical_form
    assert version.canonical_form.startswith(f'{{"name":"io.streamtally.v1.{name}","type":"record"')


# --------------------------------------------------------------------------- exact bytes

PINNED_CHUNK = Chunk(
    request_id="r1",
    seq=1,
    source=Source.OPENAI,
    text_delta="hé",
    tool_call_deltas=(ToolCallDelta(index=0, id="c", arguments_delta="{}"),),
    usage=Usage(input_tokens=3, output_tokens=5),
    finish_reason=FinishReason.STOP,
    finish_reason_raw="stop",
    event_time=datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC),
)

PINNED_CHUNK_HEX = (
    "c301"  # single-object marker
    "09a4a70ba9e0b481"  # CRC-64-AVRO of Chunk v1's canonical form, little-endian
    "047231"  # request_id: length 2 (zigzag 4), "r1"
    "02"  # seq: 1
    "02"  # source: enum index 1 = OPENAI (0 is UNKNOWN)
    "00"  # model: union branch 0 = null
    "00"  # choice: 0
    "0668c3a9"  # text_delta: 3 UTF-8 bytes, "hé"
    "00"  # reasoning_delta: ""
    "02"  # tool_call_deltas: a block of 1 item
    "00"  # .index 0
    "020263"  # .id: branch 1 (string), "c"
    "00"  # .name: null
    "047b7d"  # .arguments_delta: "{}"
    "00"  # end of the array
    "02"  # usage: branch 1 (Usage)
    "060a000000"  # 3, 5, 0, 0, 0
    "0202"  # finish_reason: branch 1, enum index 1 = STOP
    "020873746f70"  # finish_reason_raw: branch 1, "stop"
    "00"  # error: null
    "80897a"  # event_time: 1_000_000 µs, zigzag 2_000_000 as a varint
)


def test_a_small_chunk_encodes_to_exactly_the_pinned_bytes() -> None:
    data = avro.encode_chunk(PINNED_CHUNK)
    assert data.hex() == PINNED_CHUNK_HEX
    assert avro.decode_chunk(bytes.fromhex(PINNED_CHUNK_HEX)) == PINNED_CHUNK
    pcf = avro.current("Chunk").canonical_form.encode()
    assert data[2:10] == crc64_avro(pcf).to_bytes(8, "little")


# --------------------------------------------------------------------------- models

USAGES = [
    Usage(),
    Usage(
        input_tokens=2**40,
        output_tokens=7,
        reasoning_tokens=3,
        cached_tokens=1,
        cache_write_tokens=2**63 - 1,
    ),
]

TOOL_CALL_DELTAS = [
    ToolCallDelta(index=0),
    ToolCallDelta(index=3, id="call_1", name="get_weather", arguments_delta='{"city":"Zürich"'),
    ToolCallDelta(index=1, id="", name="", arguments_delta=""),
]

TOOL_CALLS = [
    ToolCall(index=0, id=None, name=None, arguments=""),
    ToolCall(index=2, id="call_✓", name="f", arguments='{"a": [1, 2, "🎉"]}'),
]

CHOICES = [
    ChoiceTokens(
        index=0,
        text="",
        reasoning="",
        tool_calls=(),
        finish_reason=FinishReason.STOP,
        finish_reason_raw=None,
    ),
    ChoiceTokens(
        index=1,
        text=UNICODE,
        reasoning="think",
        tool_calls=tuple(TOOL_CALLS),
        finish_reason=FinishReason.TOOL_CALLS,
        finish_reason_raw="tool_calls",
    ),
]

CHUNKS = [
    Chunk(request_id="r", seq=0, source=Source.ANTHROPIC, event_time=T0),
    Chunk(
        request_id="chatcmpl-✓",
        seq=2**40,
        source=Source.OPENAI_RESPONSES,
        model="gpt-4.1",
        choice=2,
        text_delta=UNICODE,
        reasoning_delta="hmm…",
        tool_call_deltas=tuple(TOOL_CALL_DELTAS),
        usage=USAGES[1],
        finish_reason=FinishReason.LENGTH,
        finish_reason_raw="max_output_tokens",
        error="",
        event_time=datetime(2025, 3, 4, 7, 6, 7, 891011, tzinfo=timezone(timedelta(hours=2))),
    ),
    Chunk(
        request_id="x",
        seq=5,
        source=Source.GEMINI,
        usage=Usage(),
        finish_reason=FinishReason.ERROR,
        error="503 overloaded",
        event_time=datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ),
    *[
        Chunk(request_id="s", seq=i, source=source, finish_reason=finish, event_time=T0)
        for i, (source, finish) in enumerate(
            zip(list(Source), [*FinishReason, FinishReason.STOP], strict=True)
        )
    ],
]

TOKENS = [
    Tokens(
        request_id="msg_1",
        source=Source.ANTHROPIC,
        model=None,
        text="",
        reasoning="",
        tool_calls=(),
        usage=Usage(),
        finish_reason=FinishReason.ERROR,
        finish_reason_raw=None,
        error="stream ended without a finish",
        chunks=0,
    ),
    Tokens(
        request_id="chatcmpl-n3",
        source=Source.OPENAI,
        model="gpt-4o",
        text=UNICODE,
        reasoning="r",
        tool_calls=(TOOL_CALLS[1],),
        usage=USAGES[1],
        finish_reason=FinishReason.TOOL_CALLS,
        finish_reason_raw="stop",
        error=None,
        chunks=12,
        choices=(
            ChoiceTokens(
                index=0,
                text=UNICODE,
                reasoning="r",
                tool_calls=(TOOL_CALLS[1],),
                finish_reason=FinishReason.TOOL_CALLS,
                finish_reason_raw="stop",
            ),
            *CHOICES[1:],
            ChoiceTokens(
                index=2,
                text="third",
                reasoning="",
                tool_calls=(),
                finish_reason=FinishReason.CANCELLED,
                finish_reason_raw="abort",
            ),
        ),
    ),
]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunk_round_trip(chunk: Chunk) -> None:
    data = avro.encode_chunk(chunk)
    back = avro.decode_chunk(data)
    assert back == chunk
    assert back.event_time.tzinfo is UTC
    assert avro.decode_model(Chunk, avro.encode_model(chunk)) == chunk
    assert avro.writer_of(data).name == "Chunk"


@pytest.mark.parametrize("tokens", TOKENS)
def test_tokens_round_trip(tokens: Tokens) -> None:
    back = avro.decode_tokens(avro.encode_tokens(tokens))
    assert back == tokens
    assert back.to_json_dict() == tokens.to_json_dict()


@pytest.mark.parametrize(
    "model", [*USAGES, *TOOL_CALL_DELTAS, *TOOL_CALLS, *CHOICES], ids=lambda m: type(m).__name__
)
def test_model_round_trip(model: Usage | ToolCallDelta | ToolCall | ChoiceTokens) -> None:
    data = avro.encode_model(model)
    assert avro.writer_of(data).name == type(model).__name__
    assert avro.decode_model(type(model), data) == model


def test_generic_decode_gives_the_avro_form() -> None:
    record = avro.decode("Chunk", avro.encode_chunk(CHUNKS[1]))
    assert record["source"] == "OPENAI_RESPONSES"
    assert record["finish_reason"] == "LENGTH"
    assert record["usage"]["cache_write_tokens"] == 2**63 - 1
    assert avro.decode("Chunk", avro.encode("Chunk", record)) == record


# --------------------------------------------------------------------------- raw SSE events

SSE_EVENTS = [
    RawSseEvent(
        request_id="req-1",
        seq=0,
        source=Source.ANTHROPIC,
        tenant="acme",
        received_at=T0,
        event="content_block_delta",
        data='{"type":"content_block_delta","delta":{"text":"' + UNICODE + '"}}',
        sse_id="42",
    ),
    RawSseEvent(
        request_id="req-1", seq=1, source=Source.OPENAI, tenant="", received_at=T0, data=""
    ),
    RawSseEvent.end(request_id="req-1", seq=2, source=Source.GEMINI, tenant="acme", received_at=T0),
]


@pytest.mark.parametrize("event", SSE_EVENTS)
def test_raw_sse_event_round_trip(event: RawSseEvent) -> None:
    assert avro.decode_raw_sse_event(avro.encode_raw_sse_event(event)) == event


def test_raw_sse_event_defaults() -> None:
    end = SSE_EVENTS[2]
    assert end.kind is EventKind.END
    assert (end.event, end.data, end.sse_id) == ("message", "", None)
    record = avro.decode("RawSseEvent", avro.encode_raw_sse_event(end))
    assert record["kind"] == "END"
    with pytest.raises(ValueError, match="not an SSE source"):
        RawSseEvent(request_id="r", seq=0, source=Source.VLLM, tenant="t", received_at=T0)
    with pytest.raises(ValueError, match="timezone-aware"):
        RawSseEvent(
            request_id="r",
            seq=0,
            source=Source.OPENAI,
            tenant="t",
            received_at=datetime(2025, 1, 1),  # noqa: DTZ001
        )


# --------------------------------------------------------------------------- raw engine outputs

# Every field of the schema present, as an engine's JSON line would have it.
DYNAMO_LINES: list[dict[str, Any]] = [
    # tokens with a detokenised null, log probs, full usage, finish {"error": msg}
    {
        "token_ids": [1, 2, 128000],
        "tokens": ["he", None, "✓"],
        "text": "he✓",
        "finish_reason": {"error": "KV cache lost: ✗"},
        "stop_reason": None,
        "index": 1,
        "cum_log_probs": -1.25,
        "log_probs": [-0.5, -0.25, -0.5],
        "completion_usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "total_tokens": 13,
            "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": 4},
            "completion_tokens_details": {
                "accepted_prediction_tokens": 0,
                "audio_tokens": None,
                "reasoning_tokens": 2,
                "rejected_prediction_tokens": None,
            },
        },
    },
    # Display form of Error(msg), stop_reason as a token id
    {
        "token_ids": [],
        "tokens": None,
        "text": None,
        "finish_reason": "error: boom",
        "stop_reason": 128001,
        "index": None,
        "cum_log_probs": None,
        "log_probs": None,
        "completion_usage": None,
    },
    # matched stop string
    {
        "token_ids": [5],
        "tokens": [],
        "text": "",
        "finish_reason": "stop",
        "stop_reason": "</answer>",
        "index": 0,
        "cum_log_probs": 0.0,
        "log_probs": [],
        "completion_usage": {
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "total_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    },
    *[
        {
            "token_ids": [],
            "tokens": None,
            "text": None,
            "finish_reason": reason,
            "stop_reason": None,
            "index": None,
            "cum_log_probs": None,
            "log_probs": None,
            "completion_usage": None,
        }
        for reason in ("eos", "length", "cancelled", "abort", "content_filter", "error", None)
    ],
]

VLLM_LINES: list[dict[str, Any]] = [
    {
        "request_id": "cmpl-1",
        "prompt_token_ids": [1, 2, 3],
        "outputs": [
            {
                "index": 0,
                "text": "Hel",
                "token_ids": [9, 10],
                "cumulative_logprob": -0.75,
                "finish_reason": None,
                "stop_reason": None,
            },
            {
                "index": 1,
                "text": "",
                "token_ids": [11],
                "cumulative_logprob": None,
                "finish_reason": "stop",
                "stop_reason": 2,
            },
        ],
        "finished": False,
        "num_cached_tokens": 2,
        "output_kind": "DELTA",
    },
    {
        "request_id": "cmpl-1",
        "prompt_token_ids": None,
        "outputs": [
            {
                "index": 0,
                "text": UNICODE,
                "token_ids": [],
                "cumulative_logprob": None,
                "finish_reason": "length",
                "stop_reason": "STOP",
            }
        ],
        "finished": True,
        "num_cached_tokens": None,
        "output_kind": "CUMULATIVE",
    },
    # vLLM's STREAM_FINISHED sentinel: no outputs, finished
    {
        "request_id": "cmpl-2",
        "prompt_token_ids": [],
        "outputs": [],
        "finished": True,
        "num_cached_tokens": 0,
        "output_kind": None,
    },
]

ATOMR_LINES: list[dict[str, Any]] = [
    {
        "request_id": "a-1",
        "text_delta": UNICODE,
        "tool_call_delta": {"id": "t1", "function": {"name": "f", "arguments": '{"x":'}},
        "usage": {"input_tokens": 5, "output_tokens": 1, "reasoning_tokens": 0, "cached_tokens": 3},
        "finish_reason": None,
    },
    {
        "request_id": "a-1",
        "text_delta": "",
        "tool_call_delta": "a bare JSON string",
        "usage": None,
        "finish_reason": "stop",
    },
    {
        "request_id": "a-1",
        "text_delta": "",
        "tool_call_delta": [1, None, True, 2.5, {"ü": []}],
        "usage": None,
        "finish_reason": None,
    },
    {
        "request_id": "a-1",
        "text_delta": "x",
        "tool_call_delta": None,
        "usage": None,
        "finish_reason": None,
    },
]

ENGINE_CASES = [
    *[(Source.DYNAMO, line) for line in DYNAMO_LINES],
    *[(Source.VLLM, line) for line in VLLM_LINES],
    *[(Source.ATOMR, line) for line in ATOMR_LINES],
]


@pytest.mark.parametrize(("source", "line"), ENGINE_CASES)
def test_raw_engine_output_payload_is_what_the_json_line_parses_to(
    source: Source, line: dict[str, Any]
) -> None:
    text = json.dumps(line)
    output = RawEngineOutput(
        request_id="req-9",
        seq=4,
        source=source,
        tenant="acme",
        received_at=T0,
        payload=json.loads(text),
    )
    back = avro.decode_raw_engine_output(avro.encode_raw_engine_output(output))
    assert back == output
    assert back.payload == json.loads(text)


@pytest.mark.parametrize("source", [Source.DYNAMO, Source.VLLM, Source.ATOMR])
def test_raw_engine_output_end_marker(source: Source) -> None:
    end = RawEngineOutput.end(
        request_id="req-9", seq=7, source=source, tenant="acme", received_at=T0
    )
    assert end.kind is EventKind.END
    assert end.payload is None
    assert avro.decode_raw_engine_output(avro.encode_raw_engine_output(end)) == end
    assert avro.decode("RawEngineOutput", avro.encode_raw_engine_output(end))["payload"] is None


@pytest.mark.parametrize("source", [Source.OPENAI, Source.VLLM, Source.DYNAMO, Source.ATOMR])
def test_a_keepalive_round_trips_in_the_current_schemas(source: Source) -> None:
    fields: dict[str, Any] = {
        "request_id": "req-k",
        "seq": 4,
        "source": source,
        "tenant": "acme",
        "received_at": T0,
    }
    if source.is_sse:
        sse = RawSseEvent.keepalive(**fields)
        assert (sse.kind, sse.event, sse.data, sse.is_keepalive) == (
            EventKind.EVENT,
            KEEPALIVE_EVENT,
            "",
            True,
        )
        assert avro.decode_raw_sse_event(avro.encode_raw_sse_event(sse)) == sse
        assert not RawSseEvent(**fields, data="{}").is_keepalive
        assert not RawSseEvent.end(**fields).is_keepalive
        return
    engine = RawEngineOutput.keepalive(**fields, model="m")
    assert (engine.kind, engine.payload, engine.is_keepalive) == (EventKind.EVENT, None, True)
    # written with the released schema (the payload is a union with null): no new version
    assert avro.decode_raw_engine_output(avro.encode_raw_engine_output(engine)) == engine
    assert not RawEngineOutput.end(**fields).is_keepalive


def test_a_cancelled_engine_end_round_trips_and_older_versions_read_not_cancelled() -> None:
    end = RawEngineOutput.end(
        request_id="req-9", seq=3, source=Source.VLLM, tenant="acme", received_at=T0
    )
    cancelled = RawEngineOutput.end(
        request_id="req-9", seq=3, source=Source.VLLM, tenant="acme", received_at=T0, cancelled=True
    )
    assert (end.cancelled, cancelled.cancelled) == (False, True)
    assert avro.decode_raw_engine_output(avro.encode_raw_engine_output(cancelled)) == cancelled
    # an END written before the field existed (version 2) is a plain END
    datum = avro.decode("RawEngineOutput", avro.encode_raw_engine_output(cancelled))
    del datum["cancelled"]
    old = avro.encode("RawEngineOutput", datum, version=2)
    assert old[2:10] == avro.history("RawEngineOutput")[1].fingerprint
    assert avro.decode_raw_engine_output(old) == end
    # only an END marker can say it was cancelled
    with pytest.raises(ValueError, match="only an END marker can be cancelled"):
        RawEngineOutput(
            request_id="r",
            seq=0,
            source=Source.VLLM,
            tenant="t",
            received_at=T0,
            payload={"request_id": "r", "outputs": []},
            cancelled=True,
        )


def test_engine_fields_not_in_the_schema_are_dropped_and_absent_ones_default() -> None:
    line = {
        "token_ids": [1],
        "output_type": "text",  # not kept
        "top_logprobs": [[{"rank": 1, "token_id": 1, "logprob": -0.1}]],  # not kept
        "finish_reason": {"error": "x"},
        "completion_usage": {"prompt_tokens": 3, "completion_tokens": 1},  # no total_tokens
    }
    output = RawEngineOutput(
        request_id="r", seq=0, source=Source.DYNAMO, tenant="t", received_at=T0, payload=line
    )
    back = avro.decode_raw_engine_output(avro.encode_raw_engine_output(output))
    assert back.payload == {
        "token_ids": [1],
        "tokens": None,
        "text": None,
        "finish_reason": {"error": "x"},
        "stop_reason": None,
        "index": None,
        "cum_log_probs": None,
        "log_probs": None,
        "completion_usage": {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "total_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }


@pytest.mark.parametrize(
    ("source", "line"),
    [
        (Source.DYNAMO, DYNAMO_LINES[0]),
        (Source.VLLM, VLLM_LINES[0]),
        (Source.ATOMR, ATOMR_LINES[3]),
    ],
)
def test_generic_engine_codec_picks_the_payload_branch_by_source(
    source: Source, line: dict[str, Any]
) -> None:
    record = {
        "request_id": "r",
        "seq": 0,
        "source": source.name,
        "tenant": "t",
        "received_at": T0,
        "kind": "EVENT",
        "payload": line,
        "model": "llama-3.1-70b",
        "cancelled": False,
    }
    data = avro.encode("RawEngineOutput", record)
    assert avro.decode("RawEngineOutput", data) == record
    typed = avro.decode_raw_engine_output(data)
    assert typed.payload == line
    assert (
        typed.payload_type
        == {
            Source.DYNAMO: "LLMEngineOutput",
            Source.VLLM: "RequestOutput",
            Source.ATOMR: "TokenChunk",
        }[source]
    )


@pytest.mark.parametrize("name", ["LLMEngineOutput", "RequestOutput", "TokenChunk"])
def test_engine_payload_records_on_their_own(name: str) -> None:
    line = {
        "LLMEngineOutput": DYNAMO_LINES[0],
        "RequestOutput": VLLM_LINES[0],
        "TokenChunk": {**ATOMR_LINES[0], "tool_call_delta": '{"id":"t1"}'},
    }[name]
    assert avro.decode(name, avro.encode(name, line)) == line


def test_engine_payload_must_match_its_source() -> None:
    with pytest.raises(ValueError, match="not an engine source"):
        RawEngineOutput(
            request_id="r", seq=0, source=Source.OPENAI, tenant="t", received_at=T0, payload={}
        )
    with pytest.raises(ValueError, match="carries no payload"):
        RawEngineOutput(
            request_id="r",
            seq=0,
            source=Source.VLLM,
            tenant="t",
            received_at=T0,
            kind=EventKind.END,
            payload=VLLM_LINES[0],
        )
    # an EVENT without a payload is a keep-alive (`KEEPALIVE_EVENT`), not an output
    assert RawEngineOutput(
        request_id="r", seq=0, source=Source.VLLM, tenant="t", received_at=T0
    ).is_keepalive
    # a vLLM payload in a dynamo record does not fit LLMEngineOutput
    wrong = RawEngineOutput(
        request_id="r", seq=0, source=Source.DYNAMO, tenant="t", received_at=T0, payload={}
    )
    assert avro.decode_raw_engine_output(avro.encode_raw_engine_output(wrong)).payload == {
        **DYNAMO_LINES[-1],
    }
    # a record whose payload branch disagrees with its source is refused on decoding
    mismatched = avro.encode(
        "RawEngineOutput",
        {
            "request_id": "r",
            "seq": 0,
            "source": "DYNAMO",
            "tenant": "t",
            "received_at": T0,
            "kind": "EVENT",
            "payload": ("io.streamtally.v1.TokenChunk", ATOMR_LINES[3]),
        },
    )
    with pytest.raises(avro.AvroDecodeError, match="a dynamo output carries a TokenChunk"):
        avro.decode_raw_engine_output(mismatched)


def test_atomr_tool_call_delta_is_stored_as_json_text() -> None:
    output = RawEngineOutput(
        request_id="r",
        seq=0,
        source=Source.ATOMR,
        tenant="t",
        received_at=T0,
        payload=ATOMR_LINES[0],
    )
    record = avro.decode("RawEngineOutput", avro.encode_raw_engine_output(output))
    assert record["payload"]["tool_call_delta"] == (
        '{"id":"t1","function":{"name":"f","arguments":"{\\"x\\":"}}'
    )
    bad = {**ATOMR_LINES[0], "tool_call_delta": float("nan")}
    with pytest.raises(avro.AvroEncodeError, match="not JSON"):
        avro.encode_raw_engine_output(
            RawEngineOutput(
                request_id="r", seq=0, source=Source.ATOMR, tenant="t", received_at=T0, payload=bad
            )
        )


# --------------------------------------------------------------------------- billing

BILLING = BillingEvent(
    event_id="bill:acme:req-1:2025-03",
    request_id="req-1",
    tenant="acme",
    model="claude-sonnet-4",
    source=Source.ANTHROPIC,
    finish_reason=FinishReason.STOP,
    input_tokens=1200,
    output_tokens=345,
    reasoning_tokens=100,
    cached_tokens=1000,
    cache_write_tokens=150,
    cost=Decimal("0.000001234567"),
    currency="USD",
    price_table_version="2025-03-01",
    event_time=T0,
)


@pytest.mark.parametrize(
    "cost",
    [
        "0.000001234567",
        "0",
        "-0.000000000001",
        "1.5",
        "1E+5",
        "12345678901234567890123456.123456789012",  # 38 digits
        "-12345678901234567890123456.123456789012",
        "0.1000000000000000",  # trailing zeros beyond the scale are exact
    ],
)
def test_billing_cost_is_exact(cost: str) -> None:
    event = BillingEvent(**{**_fields(BILLING), "cost": Decimal(cost)})
    back = avro.decode_billing_event(avro.encode_billing_event(event))
    assert back == event
    assert back.cost == Decimal(cost)
    assert back.cost.as_tuple().exponent == -12
    assert str(back.cost.normalize()) == str(Decimal(cost).normalize())


def test_billing_round_trip_and_usage() -> None:
    back = avro.decode_billing_event(avro.encode_billing_event(BILLING))
    assert back == BILLING
    assert str(back.cost) == "0.000001234567"
    assert back.usage == Usage(
        input_tokens=1200,
        output_tokens=345,
        reasoning_tokens=100,
        cached_tokens=1000,
        cache_write_tokens=150,
    )
    minimal = BillingEvent(
        event_id="e",
        request_id="r",
        tenant="t",
        model=None,
        source=Source.VLLM,
        finish_reason=FinishReason.CANCELLED,
        cost=Decimal(0),
        price_table_version="v0",
        event_time=T0,
    )
    assert avro.decode_billing_event(avro.encode_billing_event(minimal)) == minimal


@pytest.mark.parametrize(
    ("cost", "error"),
    [
        (0.1, TypeError),
        (1, TypeError),
        (Decimal("1E-13"), ValueError),
        (Decimal("0.0000000000001"), ValueError),
        (Decimal("NaN"), ValueError),
        (Decimal("Infinity"), ValueError),
        (Decimal("123456789012345678901234567"), ValueError),  # 27 + 12 digits > 38
    ],
)
def test_billing_cost_refuses_floats_and_inexact_values(
    cost: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        BillingEvent(**{**_fields(BILLING), "cost": cost})


def test_billing_refuses_negative_counts() -> None:
    with pytest.raises(ValueError, match="output_tokens"):
        BillingEvent(**{**_fields(BILLING), "output_tokens": -1})


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def test_billing_priced_round_trips() -> None:
    assert BILLING.priced is True
    unpriced = BillingEvent(**{**_fields(BILLING), "cost": Decimal(0), "priced": False})
    back = avro.decode_billing_event(avro.encode_billing_event(unpriced))
    assert back == unpriced
    assert back.priced is False
    assert avro.decode("BillingEvent", avro.encode_billing_event(unpriced))["priced"] is False


def test_a_billing_event_of_version_1_decodes_as_priced() -> None:
    """Events written before `priced` existed read with its default, true."""
    record = avro.decode("BillingEvent", avro.encode_billing_event(BILLING))
    old = avro.encode("BillingEvent", record, version=1)
    assert avro.writer_of(old).version == 1
    assert old[2:10] == avro.history("BillingEvent")[0].fingerprint
    assert old[2:10].hex() == "373b7e6c075c7a5a"  # the v1 fingerprint, as on the topic
    back = avro.decode_billing_event(old)
    assert back.priced is True
    assert back == BILLING
    free = BillingEvent(**{**_fields(BILLING), "cost": Decimal(0)})
    old_free = avro.encode(
        "BillingEvent", avro.decode("BillingEvent", avro.encode_billing_event(free)), version=1
    )
    assert avro.decode_billing_event(old_free).priced is True  # a v1 event cannot say otherwise


def test_billing_event_version_2_only_adds_priced_with_default_true() -> None:
    v1, v2 = (v.schema for v in avro.history("BillingEvent")[:2])
    assert [v.version for v in avro.history("BillingEvent")][:2] == [1, 2]
    names_v1 = [f["name"] for f in v1["fields"]]
    names_v2 = [f["name"] for f in v2["fields"]]
    assert [n for n in names_v2 if n != "priced"] == names_v1
    assert names_v2.index("priced") == names_v2.index("cost") + 1
    priced = _field(v2, "priced")
    assert (priced["type"], priced["default"]) == ("boolean", True)
    assert avro.compatibility_errors(v1, v2) == []
    assert avro.compatibility_errors(v2, v1) == []


#: The provenance fields BillingEvent v3 adds after `event_time`: (name, type, default).
_PROVENANCE_V3 = [
    ("raw_topic", ["null", "string"], None),
    ("raw_partition", ["null", "int"], None),
    ("first_offset", ["null", "long"], None),
    ("last_offset", ["null", "long"], None),
    ("raw_sha256", ["null", "string"], None),
]


def test_billing_event_version_3_only_appends_provenance_with_defaults() -> None:
    v2, v3 = (v.schema for v in avro.history("BillingEvent")[1:3])
    assert [v.version for v in avro.history("BillingEvent")][:3] == [1, 2, 3]
    assert avro.history("BillingEvent")[2].fingerprint.hex() == "af3f0820356351b9"
    names_v2 = [f["name"] for f in v2["fields"]]
    names_v3 = [f["name"] for f in v3["fields"]]
    added = [name for name, _, _ in _PROVENANCE_V3] + ["usage_source"]
    assert names_v3 == names_v2 + added
    for name, kind, default in _PROVENANCE_V3:
        field = _field(v3, name)
        assert (field["type"], field["default"]) == (kind, default), name
    usage_source = _field(v3, "usage_source")
    assert usage_source["default"] == "UNKNOWN"
    assert usage_source["type"]["symbols"] == [
        "UNKNOWN",
        "PROVIDER_REPORTED",
        "ENGINE_COUNTED",
        "MISSING",
    ]
    assert usage_source["type"]["default"] == "UNKNOWN"  # a symbol added later reads UNKNOWN
    assert [s.name for s in UsageSource][:4] == usage_source["type"]["symbols"]
    for old in (v.schema for v in avro.history("BillingEvent")[:2]):
        assert avro.compatibility_errors(old, v3) == []  # backward: old events read
        assert avro.compatibility_errors(v3, old) == []  # forward: old readers read v3


PROVEN = BillingEvent(
    **{
        **_fields(BILLING),
        "raw_topic": "streamtally.raw.sse",
        "raw_partition": 5,
        "first_offset": 1200,
        "last_offset": 1213,
        "raw_sha256": hashlib.sha256(b"x").hexdigest(),
        "usage_source": UsageSource.ENGINE_COUNTED,
    }
)


def test_billing_provenance_round_trips() -> None:
    data = avro.encode_billing_event(PROVEN)
    assert avro.writer_of(data).version == 5
    assert avro.decode_billing_event(data) == PROVEN
    record = avro.decode("BillingEvent", data)
    assert (record["raw_partition"], record["usage_source"]) == (5, "ENGINE_COUNTED")
    for source in UsageSource:
        event = BillingEvent(**{**_fields(PROVEN), "usage_source": source})
        assert avro.decode_billing_event(avro.encode_billing_event(event)) == event


@pytest.mark.parametrize("version", [1, 2])
def test_a_billing_event_of_before_version_3_decodes_without_provenance(version: int) -> None:
    """Events written before v3 read with the defaults: no provenance, usage_source unknown."""
    record = avro.decode("BillingEvent", avro.encode_billing_event(PROVEN))
    old = avro.encode("BillingEvent", record, version=version)
    assert avro.writer_of(old).version == version
    back = avro.decode_billing_event(old)
    assert back == BILLING  # every field but the provenance survives
    assert (back.raw_topic, back.raw_partition, back.first_offset, back.last_offset) == (
        None,
        None,
        None,
        None,
    )
    assert back.raw_sha256 is None
    assert back.usage_source is UsageSource.UNKNOWN
    assert not back.has_provenance


def test_a_version_2_reader_reads_a_version_3_event() -> None:
    """Forward: a consumer built before v3 reads a v3 event, provenance ignored."""
    data = avro.encode_billing_event(PROVEN)
    v2 = avro.history("BillingEvent")[1]
    out = fastavro.schemaless_reader(
        io.BytesIO(data[10:]), avro.current("BillingEvent").parsed, v2.parsed
    )
    assert "raw_sha256" not in out
    assert out["output_tokens"] == PROVEN.output_tokens
    assert out["priced"] is True


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"raw_sha256": "AB" * 32}, "raw_sha256"),
        ({"raw_sha256": "ab" * 31}, "raw_sha256"),
        ({"first_offset": 5, "last_offset": 4}, "after last_offset"),
        ({"first_offset": None}, "both set"),
        ({"raw_partition": -1}, "raw_partition"),
        ({"usage_source": "missing"}, "usage_source"),
    ],
)
def test_billing_provenance_is_checked(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BillingEvent(**{**_fields(PROVEN), **changes})


# ------------------------------------------------ BillingEvent v4 and Tokens v3 (one call)


def test_billing_event_version_4_adds_provider_request_id_and_the_aborted_source() -> None:
    """v4 appends `provider_request_id` (null by default) and the UsageSource symbol
    ABORTED, in one version; old readers resolve ABORTED to the enum's default."""
    history = avro.history("BillingEvent")
    assert [v.version for v in history][:4] == [1, 2, 3, 4]
    assert history[3].fingerprint.hex() == "35e143f773117ac3"
    v3, v4 = history[2].schema, history[3].schema
    names_v3 = [f["name"] for f in v3["fields"]]
    assert [f["name"] for f in v4["fields"]] == [*names_v3, "provider_request_id"]
    added = _field(v4, "provider_request_id")
    assert (added["type"], added["default"]) == (["null", "string"], None)
    symbols = _field(v4, "usage_source")["type"]["symbols"]
    assert symbols == [*_field(v3, "usage_source")["type"]["symbols"], "ABORTED"]
    assert [s.name for s in UsageSource] == symbols
    assert UsageSource.ABORTED.value == "aborted"
    for old in (v.schema for v in history[:3]):
        assert avro.compatibility_errors(old, v4) == []  # backward: old events read
        assert avro.compatibility_errors(v4, old) == []  # forward: old readers read v4


ABORTED = BillingEvent(
    **{
        **_fields(PROVEN),
        "usage_source": UsageSource.ABORTED,
        "provider_request_id": "chatcmpl-42",
        "request_id": "call-0190a1b2c3d4e5f60718293a4b5c6d7e",
    }
)


def test_provider_request_id_round_trips_on_billing_events_and_corrections() -> None:
    data = avro.encode_billing_event(ABORTED)
    assert avro.decode_billing_event(data) == ABORTED
    record = avro.decode("BillingEvent", data)
    assert (record["provider_request_id"], record["usage_source"]) == ("chatcmpl-42", "ABORTED")
    assert avro.decode_billing_event(avro.encode_billing_event(PROVEN)).provider_request_id is None


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_billing_event_of_before_version_4_reads_without_provider_request_id(
    version: int,
) -> None:
    record = avro.decode("BillingEvent", avro.encode_billing_event(ABORTED))
    record["usage_source"] = "MISSING"  # a symbol every version knows (v3 and later)
    old = avro.encode("BillingEvent", record, version=version)
    back = avro.decode_billing_event(old)
    assert back.provider_request_id is None
    assert back.request_id == ABORTED.request_id
    assert back.event_id == ABORTED.event_id


def test_a_version_3_reader_resolves_aborted_to_unknown() -> None:
    """Forward: a consumer built before v4 reads a v4 event; ABORTED, a symbol it does not
    know, resolves to the enum's default UNKNOWN, and provider_request_id is ignored."""
    data = avro.encode_billing_event(ABORTED)
    v3 = avro.history("BillingEvent")[2]
    out = fastavro.schemaless_reader(
        io.BytesIO(data[10:]), avro.current("BillingEvent").parsed, v3.parsed
    )
    assert out["usage_source"] == "UNKNOWN"
    assert "provider_request_id" not in out
    assert out["output_tokens"] == ABORTED.output_tokens


def test_tokens_version_3_adds_provider_request_id() -> None:
    history = avro.history("Tokens")
    assert [v.version for v in history] == [1, 2, 3]
    assert avro.current("Tokens").fingerprint.hex() == "10c12ff57095f7b9"
    v2, v3 = history[1].schema, history[2].schema
    assert [f["name"] for f in v3["fields"]] == [
        *(f["name"] for f in v2["fields"]),
        "provider_request_id",
    ]
    added = _field(v3, "provider_request_id")
    assert (added["type"], added["default"]) == (["null", "string"], None)
    for old in (v.schema for v in history[:2]):
        assert avro.compatibility_errors(old, v3) == []
        assert avro.compatibility_errors(v3, old) == []
    tokens = TOKENS[1].model_copy(
        update={"request_id": "chatcmpl-n3~1767225600000000", "provider_request_id": "chatcmpl-n3"}
    )
    data = avro.encode_tokens(tokens)
    back = avro.decode_tokens(data)
    assert back == tokens
    assert back.to_json_dict()["provider_request_id"] == "chatcmpl-n3"
    old = avro.encode("Tokens", avro.decode("Tokens", data), version=2)
    assert avro.decode_tokens(old).provider_request_id is None
    assert "provider_request_id" not in avro.decode_tokens(old).to_json_dict()


# --------------------------------------------------------------------------- dead letters

DEAD_LETTERS = [
    DeadLetter(
        topic="streamtally.raw.sse",
        partition=5,
        offset=2**40,
        key=b"req-\xe2\x9c\x93",
        value=bytes(range(256)),
        reason="unknown writer schema fingerprint 0011223344556677",
        error_type="AvroDecodeError",
        source="openai-responses",
        request_id="req-✓",
        dead_lettered_at=T0,
    ),
    DeadLetter(
        topic="t",
        partition=0,
        offset=0,
        key=None,
        value=b"",
        reason="",
        error_type="ValueError",
        dead_lettered_at=T0,
    ),
]


@pytest.mark.parametrize("letter", DEAD_LETTERS)
def test_dead_letter_round_trip(letter: DeadLetter) -> None:
    assert avro.decode_dead_letter(avro.encode_dead_letter(letter)) == letter


def test_dead_letter_from_exception() -> None:
    value = b"\xc3\x01garbage"
    try:
        avro.decode_chunk(value)
    except avro.AvroDecodeError as exc:
        letter = DeadLetter.from_exception(
            exc, topic="streamtally.chunks", partition=1, offset=9, key=b"req-1", value=value
        )
    assert letter.error_type == "AvroDecodeError"
    assert letter.request_id == "req-1"
    assert letter.value == value
    assert "too short" in letter.reason
    assert letter.dead_lettered_at.tzinfo is not None
    assert avro.decode_dead_letter(avro.encode_dead_letter(letter)) == letter


# --------------------------------------------------------------------------- bad input


def test_decode_errors_are_input_errors() -> None:
    assert issubclass(avro.AvroDecodeError, InputError)
    assert issubclass(avro.AvroEncodeError, InputError)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "too short"),
        (b"\xc3\x01\x09", "too short"),
        (b"\x01\x01" + bytes(20), "bad marker 0101"),
        # The Confluent framing's magic byte: an id no registry was asked for.
        (b"\x00\x01" + bytes(20), r"unknown schema id 16777216 \(Confluent framing\)"),
        (b'{"request_id": "r1"}', "bad marker 7b22"),
        (b"\xc3\x01" + bytes.fromhex("0011223344556677") + b"\x00", "unknown writer schema"),
    ],
)
def test_bad_framing(data: bytes, message: str) -> None:
    with pytest.raises(avro.AvroDecodeError, match=message):
        avro.decode_chunk(data)
    with pytest.raises(avro.AvroDecodeError, match=message):
        avro.decode("Tokens", data)


def test_every_truncation_of_a_message_is_refused() -> None:
    for message in (
        avro.encode_chunk(CHUNKS[1]),
        avro.encode_tokens(TOKENS[1]),
        avro.encode_billing_event(BILLING),
        avro.encode_raw_engine_output(
            RawEngineOutput(
                request_id="r",
                seq=0,
                source=Source.DYNAMO,
                tenant="t",
                received_at=T0,
                payload=DYNAMO_LINES[0],
            )
        ),
    ):
        name = avro.writer_of(message).name
        for end in range(len(message)):
            with pytest.raises(avro.AvroDecodeError):
                avro.decode(name, message[:end])


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(avro.AvroDecodeError, match="1 trailing bytes"):
        avro.decode_chunk(avro.encode_chunk(CHUNKS[0]) + b"\x00")


def test_a_message_of_another_record_is_refused() -> None:
    with pytest.raises(avro.AvroDecodeError, match="expected a Tokens message, got a Chunk v1"):
        avro.decode_tokens(avro.encode_chunk(CHUNKS[0]))


def test_random_bodies_raise_only_avro_decode_error() -> None:
    rng = random.Random(1234)
    for name in avro.RECORD_NAMES:
        header = avro.current(name).header
        for _ in range(300):
            body = rng.randbytes(rng.randrange(0, 64))
            with contextlib.suppress(avro.AvroDecodeError):
                avro.decode(name, header + body)


def test_unknown_enum_symbol_and_invalid_values_are_refused_by_typed_decoders() -> None:
    record = avro.decode("Chunk", avro.encode_chunk(CHUNKS[0]))
    unknown_source = avro.encode("Chunk", {**record, "source": "UNKNOWN"})
    with pytest.raises(avro.AvroDecodeError, match="source 'UNKNOWN' is unknown"):
        avro.decode_chunk(unknown_source)
    unknown_finish = avro.encode("Chunk", {**record, "finish_reason": "UNKNOWN"})
    with pytest.raises(avro.AvroDecodeError, match="finish reason 'UNKNOWN'"):
        avro.decode_chunk(unknown_finish)
    negative = avro.encode("Chunk", {**record, "seq": -1})
    with pytest.raises(avro.AvroDecodeError, match="not a valid Chunk"):
        avro.decode_chunk(negative)
    sse = avro.decode("RawSseEvent", avro.encode_raw_sse_event(SSE_EVENTS[0]))
    with pytest.raises(avro.AvroDecodeError, match="event kind 'UNKNOWN'"):
        avro.decode_raw_sse_event(avro.encode("RawSseEvent", {**sse, "kind": "UNKNOWN"}))
    with pytest.raises(avro.AvroDecodeError, match="not a valid RawSseEvent"):
        avro.decode_raw_sse_event(avro.encode("RawSseEvent", {**sse, "source": "VLLM"}))


@pytest.mark.parametrize(
    "record",
    [
        {"seq": 1},  # no request_id, which has no default
        {"request_id": 5, "seq": 1, "source": "OPENAI", "event_time": T0},
        {"request_id": "r", "seq": 1, "source": "NOT_A_SOURCE", "event_time": T0},
        {"request_id": "r", "seq": 2**64, "source": "OPENAI", "event_time": T0},
    ],
)
def test_encode_errors(record: dict[str, Any]) -> None:
    with pytest.raises(avro.AvroEncodeError, match="Chunk"):
        avro.encode("Chunk", record)


def test_unknown_record_name() -> None:
    with pytest.raises(KeyError, match="no Avro record named 'Nope'"):
        avro.encode("Nope", {})
    with pytest.raises(KeyError, match="no released version 99"):
        avro.encode("Chunk", {}, version=99)


# --------------------------------------------------------------------------- schema files

SCHEMA_FILES = sorted((ROOT / "schemas").glob("*.avsc"))


def _named_types(node: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(node, list):
        for branch in node:
            found += _named_types(branch)
    elif isinstance(node, dict):
        if node.get("type") in ("record", "enum", "fixed"):
            found.append(node)
        for fld in node.get("fields", ()):
            found += _named_types(fld["type"])
        for key in ("items", "values"):
            if key in node:
                found += _named_types(node[key])
        if isinstance(node.get("type"), (dict, list)):
            found += _named_types(node["type"])
    return found


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: p.stem)
def test_schema_files_are_documented(path: Path) -> None:
    schema = json.loads(path.read_text(encoding="utf-8"))
    assert schema["name"] == path.stem
    assert schema["namespace"] == "io.streamtally.v1"
    for named in _named_types(schema):
        assert named.get("doc"), f"{named['name']} has no doc"
        for fld in named.get("fields", ()):
            assert fld.get("doc"), f"{named['name']}.{fld['name']} has no doc"
        if named["type"] == "enum":
            assert named.get("default") == "UNKNOWN" == named["symbols"][0]


def test_every_record_file_is_a_record_name() -> None:
    records = {
        p.stem
        for p in SCHEMA_FILES
        if json.loads(p.read_text(encoding="utf-8"))["type"] == "record"
    }
    assert records == set(avro.RECORD_NAMES)
    assert {
        "Usage",
        "ToolCallDelta",
        "Chunk",
        "ToolCall",
        "ChoiceTokens",
        "Tokens",
        "RawSseEvent",
        "RawEngineOutput",
        "LLMEngineOutput",
        "RequestOutput",
        "TokenChunk",
        "BillingEvent",
        "DeadLetter",
    } <= records


def test_enum_symbols_match_the_models() -> None:
    def symbols(record: str, field: str) -> list[str]:
        for fld in avro.current(record).schema["fields"]:
            if fld["name"] == field:
                node = fld["type"]
                node = node[1] if isinstance(node, list) else node
                return list(node["symbols"])
        raise AssertionError(field)

    assert symbols("Chunk", "source") == ["UNKNOWN", *(s.name for s in Source)]
    assert symbols("Chunk", "finish_reason") == ["UNKNOWN", *(f.name for f in FinishReason)]
    assert symbols("RawSseEvent", "kind") == ["UNKNOWN", *(k.name for k in EventKind)]


#: The modules of the Avro codec that need fastavro; no other module may import it.
FASTAVRO_MODULES = {
    "streamtally/wire/avro/_schemas.py",  # parsing, canonical form, fingerprint
    "streamtally/wire/avro/_codec.py",  # writing and reading a datum
    "streamtally/wire/avro/_compat.py",  # round-trips between schema versions
}


def test_only_the_codec_imports_fastavro() -> None:
    pattern = re.compile(r"^\s*(import fastavro|from fastavro)", re.MULTILINE)
    importers = {
        path.relative_to(ROOT).as_posix()
        for package in ("streamtally", "topics", "producers", "processors", "benchmarks")
        for path in (ROOT / package).rglob("*.py")
        if pattern.search(path.read_text(encoding="utf-8"))
    }
    assert importers - FASTAVRO_MODULES == set()
    assert importers == FASTAVRO_MODULES  # the allowed list names only modules that need it


# --------------------------------------------------------------------------- evolution


@pytest.mark.parametrize("name", avro.RECORD_NAMES)
def test_history_is_complete(name: str) -> None:
    versions = avro.history(name)
    assert [v.version for v in versions] == list(range(1, len(versions) + 1)), (
        f"schemas/history/{name}/ must hold 1.avsc, 2.avsc, ... without gaps"
    )
    assert len({v.fingerprint for v in versions}) == len(versions), "two versions are identical"
    cur = avro.current(name)
    assert cur.version == versions[-1].version, (
        f"the current {name} schema is not released: run `python -m streamtally.wire.avro release` "
        "to add it to schemas/history (after this test's compatibility check passes)"
    )


@pytest.mark.parametrize(
    ("name", "version"),
    [(name, v.version) for name in avro.RECORD_NAMES for v in avro.history(name)],
)
def test_full_compatibility_with_every_released_version(name: str, version: int) -> None:
    old = next(v for v in avro.history(name) if v.version == version)
    new = avro.current(name)
    assert avro.compatibility_errors(old.schema, new.schema) == [], "backward"
    assert avro.compatibility_errors(new.schema, old.schema) == [], "forward"


def test_data_written_with_a_released_version_decodes() -> None:
    record = avro.decode("Chunk", avro.encode_chunk(CHUNKS[1]))
    for version in avro.history("Chunk"):
        data = avro.encode("Chunk", record, version=version.version)
        assert data[2:10] == version.fingerprint
        assert avro.decode_chunk(data) == CHUNKS[1]
        assert avro.writer_of(data).version == version.version


def _field(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in schema["fields"] if f["name"] == name)


def test_the_compatibility_check_catches_incompatible_edits() -> None:
    chunk = avro.current("Chunk").schema

    added = copy.deepcopy(chunk)
    added["fields"].append({"name": "tenant", "type": "string", "doc": "x"})
    assert avro.compatibility_errors(chunk, added)  # old data lacks it, no default

    retyped = copy.deepcopy(chunk)
    _field(retyped, "seq")["type"] = "string"
    assert avro.compatibility_errors(chunk, retyped)

    narrowed = copy.deepcopy(chunk)
    _field(narrowed, "seq")["type"] = "int"
    assert avro.compatibility_errors(chunk, narrowed)

    no_default = copy.deepcopy(chunk)
    source = _field(no_default, "source")["type"]
    source["symbols"] = [s for s in source["symbols"] if s != "ATOMR"]
    del source["default"]
    assert any("ATOMR" in e for e in avro.compatibility_errors(chunk, no_default))

    billing = avro.current("BillingEvent").schema
    rescaled = copy.deepcopy(billing)
    _field(rescaled, "cost")["type"]["scale"] = 10
    assert avro.canonical_form(rescaled) == avro.canonical_form(billing)  # invisible on the wire
    assert any("logical type" in e for e in avro.compatibility_errors(billing, rescaled))

    timestamps = copy.deepcopy(chunk)
    _field(timestamps, "seq")["type"] = {"type": "long", "logicalType": "timestamp-micros"}
    assert any("logical type" in e for e in avro.compatibility_errors(chunk, timestamps))


def test_the_compatibility_check_accepts_compatible_edits() -> None:
    chunk = avro.current("Chunk").schema

    optional = copy.deepcopy(chunk)
    optional["fields"].append(
        {"name": "tenant", "type": ["null", "string"], "default": None, "doc": "x"}
    )
    assert avro.compatibility_errors(chunk, optional) == []
    assert avro.compatibility_errors(optional, chunk) == []

    more_sources = copy.deepcopy(chunk)
    _field(more_sources, "source")["type"]["symbols"].append("BEDROCK")
    # a reader without BEDROCK resolves it to the UNKNOWN default (and the typed decoder refuses it)
    assert avro.compatibility_errors(more_sources, chunk) == []
    assert avro.compatibility_errors(chunk, more_sources) == []


def test_the_framing_doc_lists_the_current_fingerprints() -> None:
    doc = (ROOT / "docs" / "avro-framing.md").read_text(encoding="utf-8")
    rows = re.findall(
        r"^\| `(\w+)` \| [^|]+ \| (\d+) \| `([0-9a-f]{16})` \| `(-?\d+)` \|$", doc, re.M
    )
    listed = {name: (int(version), fp, int(long)) for name, version, fp, long in rows}
    assert set(listed) == set(avro.RECORD_NAMES)
    for name, (version, fp, long) in listed.items():
        cur = avro.current(name)
        assert (version, fp) == (cur.version, cur.fingerprint.hex()), name
        assert long == signed64(int.from_bytes(cur.fingerprint, "little")), name


RESOLUTION_SCRIPT = """
from datetime import UTC, datetime
from streamtally.wire import avro
from streamtally.core.models import Source

T = datetime(2025, 1, 1, tzinfo=UTC)
base = {"request_id": "r", "seq": 1, "source": "OPENAI", "event_time": T}
assert [v.version for v in avro.history("Chunk")] == [1, 2, 3]
assert avro.current("Chunk").version == 2

# v1 (older: no `error` field) resolves to the current v2, which defaults it
old = avro.encode("Chunk", {**base, "error": "dropped by v1"}, version=1)
assert avro.writer_of(old).version == 1
assert avro.decode("Chunk", old)["error"] is None
chunk = avro.decode_chunk(old)
assert (chunk.source, chunk.error) == (Source.OPENAI, None)

# v3 (newer: a BEDROCK source the current enum lacks) resolves to UNKNOWN
new = avro.encode("Chunk", {**base, "source": "BEDROCK"}, version=3)
assert avro.decode("Chunk", new)["source"] == "UNKNOWN"
try:
    avro.decode_chunk(new)
except avro.AvroDecodeError as exc:
    assert "source 'UNKNOWN' is unknown" in str(exc)
else:
    raise AssertionError("UNKNOWN source decoded")
print("ok")
"""


def test_decode_resolves_older_and_newer_writer_versions(tmp_path: Path) -> None:
    """Real schema resolution through `decode`, on a copy of the schemas with three versions.

    The schemas are package data (`streamtally/_schemas`), so the script runs
    against a copy of the package whose every entry links to the real one but
    `_schemas`, which links to the edited copy.
    """
    import os
    import shutil
    import subprocess
    import sys

    schemas = tmp_path / "schemas"
    shutil.copytree(ROOT / "schemas", schemas)
    history = schemas / "history" / "Chunk"
    for path in history.glob("*.avsc"):
        path.unlink()
    current = avro.current("Chunk").schema
    v1 = copy.deepcopy(current)
    v1["fields"] = [f for f in v1["fields"] if f["name"] != "error"]
    v3 = copy.deepcopy(current)
    _field(v3, "source")["type"]["symbols"].append("BEDROCK")
    for number, schema in ((1, v1), (2, current), (3, v3)):
        (history / f"{number}.avsc").write_text(json.dumps(schema), encoding="utf-8")

    package = tmp_path / "site" / "streamtally"
    package.mkdir(parents=True)
    for entry in (ROOT / "streamtally").iterdir():
        if entry.name not in ("_schemas", "__pycache__"):
            (package / entry.name).symlink_to(entry)
    (package / "_schemas").symlink_to(schemas, target_is_directory=True)

    result = subprocess.run(
        [sys.executable, "-c", RESOLUTION_SCRIPT],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(package.parent), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ------------------------------------------------ BillingEvent v5: revisions


AMENDED = BillingEvent(
    **{
        **_fields(PROVEN),
        "event_id": event_id("acme", PROVEN.request_id, 1),
        "tenant": "acme",
        "revision": 1,
        "supersedes": event_id("acme", PROVEN.request_id),
    }
)


def test_billing_event_version_5_adds_revision_and_supersedes() -> None:
    history = avro.history("BillingEvent")
    assert [v.version for v in history] == [1, 2, 3, 4, 5]
    assert avro.current("BillingEvent").version == 5
    assert avro.current("BillingEvent").fingerprint.hex() == "5a84dd931ca75013"
    v4, v5 = history[3].schema, history[4].schema
    assert [f["name"] for f in v5["fields"]] == [
        *(f["name"] for f in v4["fields"]),
        "revision",
        "supersedes",
    ]
    assert (_field(v5, "revision")["type"], _field(v5, "revision")["default"]) == ("int", 0)
    assert _field(v5, "supersedes")["default"] is None
    for old in (v.schema for v in history[:4]):
        assert avro.compatibility_errors(old, v5) == []  # backward: old events read
        assert avro.compatibility_errors(v5, old) == []  # forward: old readers read v5
    correction = avro.history("BillingCorrection")
    assert correction[-1].version == 3 == avro.current("BillingCorrection").version
    assert avro.compatibility_errors(correction[-2].schema, correction[-1].schema) == []


def test_a_revision_round_trips_and_has_an_id_of_its_own() -> None:
    data = avro.encode_billing_event(AMENDED)
    assert avro.decode_billing_event(data) == AMENDED
    record = avro.decode("BillingEvent", data)
    assert (record["revision"], record["supersedes"]) == (1, event_id("acme", PROVEN.request_id))
    assert AMENDED.event_id != AMENDED.supersedes
    assert event_id("acme", PROVEN.request_id, 0) == event_id("acme", PROVEN.request_id)
    assert len({event_id("acme", "r", n) for n in range(5)}) == 5


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_a_billing_event_of_before_version_5_reads_as_revision_0(version: int) -> None:
    record = avro.decode("BillingEvent", avro.encode_billing_event(PROVEN))
    old = avro.encode("BillingEvent", record, version=version)
    back = avro.decode_billing_event(old)
    assert (back.revision, back.supersedes) == (0, None)
    assert back.event_id == PROVEN.event_id


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"revision": 1}, "revision 1 with supersedes=None"),
        ({"supersedes": "abc"}, "revision 0 with supersedes='abc'"),
        ({"revision": -1, "supersedes": "abc"}, "revision must be in"),
        ({"revision": True, "supersedes": "abc"}, "revision must be an int"),
    ],
)
def test_a_revision_names_what_it_supersedes(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BillingEvent(**{**_fields(PROVEN), **changes})
