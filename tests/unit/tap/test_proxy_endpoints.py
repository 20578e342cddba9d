"""Every billable endpoint through the proxy's tee (`streamtally.producers.proxy.tee`): which
calls are metered, how each response folds, encodings the tee must read, and the Responses API's
background mode billed once per response however many polls and resumes.

The provider bodies here are written for these tests.  Records go to a real `Tap` whose
Kafka sender is the fake of `test_tap`, and then through the worker's `RequestProcessor`.
"""

from __future__ import annotations

import gzip
import json
import logging
from typing import Any

import brotli
import pytest
import zstandard

from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream
from streamtally.core.sse import SseEvent, iter_events
from streamtally.producers import Tap
from streamtally.producers.proxy.tee import (
    Call,
    Tee,
    Teeing,
    TeePlan,
    call_of,
    metered,
    plan,
    route_of,
    upstream_headers,
)
from streamtally.wire.records import EventKind, UsageSource
from tests.unit.tap.test_tap import FakeSender, as_called, settle, worker_tokens

# ---------------------------------------------------------------- which calls are metered


@pytest.mark.parametrize(
    ("method", "path", "body", "expected"),
    [
        ("POST", "/v1/chat/completions", b"{}", (Source.OPENAI, "chat", False, None)),
        ("POST", "/v1/completions", b"{}", (Source.OPENAI, "completions", False, None)),
        ("POST", "/v1/embeddings", b"{}", (Source.OPENAI, "embeddings", False, None)),
        ("POST", "/v1/messages", b"{}", (Source.ANTHROPIC, "messages", False, None)),
        (
            "POST",
            "/v1beta/models/gemini-embedding-001:embedContent",
            b"{}",
            (Source.GEMINI, "embedContent", False, None),
        ),
        (
            "POST",
            "/v1beta/models/text-embedding-004:batchEmbedContents",
            b"{}",
            (Source.GEMINI, "batchEmbedContents", False, None),
        ),
        (
            "POST",
            "/v1/responses",
            b'{"model": "o3", "input": "hi"}',
            (Source.OPENAI_RESPONSES, "responses", False, None),
        ),
        (
            "POST",
            "/v1/responses",
            b'{"model": "o3", "background": true, "input": "hi"}',
            (Source.OPENAI_RESPONSES, "responses", True, None),
        ),
        (
            "POST",
            "/v1/responses",
            b'{"background": false}',
            (Source.OPENAI_RESPONSES, "responses", False, None),
        ),
        (
            "POST",
            "/v1/responses",
            b'{"background": true',  # not JSON: the upstream refuses it anyway
            (Source.OPENAI_RESPONSES, "responses", False, None),
        ),
        (
            "GET",
            "/v1/responses/resp_abc",
            b"",
            (Source.OPENAI_RESPONSES, "responses.retrieve", True, "resp_abc"),
        ),
        (
            "POST",
            "/v1/responses/resp_abc/cancel",
            b"",
            (Source.OPENAI_RESPONSES, "responses.cancel", True, "resp_abc"),
        ),
        ("GET", "/v1/responses/resp_abc/input_items", b"", None),
        ("DELETE", "/v1/responses/resp_abc", b"", None),
        ("GET", "/v1/chat/completions", b"", None),  # lists stored completions: free
        ("GET", "/v1/models", b"", None),
        ("POST", "/v1/messages/count_tokens", b"{}", None),
        ("POST", "/v1beta/models/gemini-2.5-pro:countTokens", b"{}", None),
        ("POST", "/v1/files", b"", None),
    ],
)
def test_each_call_is_metered_or_not_by_method_and_path(
    method: str, path: str, body: bytes, expected: tuple[Source, str, bool, str | None] | None
) -> None:
    call = call_of(method, path, body)
    if expected is None:
        assert call is None
        assert not metered(method, path)
        return
    assert call is not None
    assert (call.source, call.endpoint, call.background, call.response_id) == expected
    assert call.path == path
    assert metered(method, path)


def test_a_counter_label_is_the_path_with_its_ids_out() -> None:
    assert route_of("/v1/files/file-AbC123dEf456gHi789") == "/v1/files/{id}"
    assert route_of("/v1/responses/resp_0a1b2c3d4e5f60718293/input_items") == (
        "/v1/responses/{id}/input_items"
    )
    assert route_of("/v1/batches/batch_abc123def456ghi") == "/v1/batches/{id}"
    assert route_of("/v1/threads/123/runs") == "/v1/threads/{id}/runs"
    assert route_of("/v1/models") == "/v1/models"
    model = "/v1beta/models/gemini-2.5-pro:countTokens"
    assert route_of(model) == model
    assert len(route_of("/x" * 1000)) <= 256


def test_upstream_is_asked_for_the_encodings_the_tee_reads_only() -> None:
    headers = [("Accept", "*/*"), ("accept-encoding", "br, compress"), ("X-Tenant", "a")]
    assert upstream_headers(headers) == [
        ("Accept", "*/*"),
        ("X-Tenant", "a"),
        ("Accept-Encoding", "br"),
    ]
    assert upstream_headers([("X-Tenant", "a")]) == [
        ("X-Tenant", "a"),
        ("Accept-Encoding", "identity"),
    ]


# ---------------------------------------------------------------- encodings


def _sse(events: list[dict[str, Any]], *, typed: bool = False) -> bytes:
    out = b""
    for event in events:
        if typed:
            out += f"event: {event['type']}\n".encode()
        out += b"data: " + json.dumps(event).encode() + b"\n\n"
    return out


def _events(data: bytes) -> list[SseEvent]:
    return list(iter_events([data]))


CHAT_STREAM = (
    _sse(
        [
            {
                "id": "chatcmpl-enc1",
                "object": "chat.completion.chunk",
                "model": "gpt-4o-mini",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Grüße"}}],
            },
            {
                "id": "chatcmpl-enc1",
                "object": "chat.completion.chunk",
                "model": "gpt-4o-mini",
                "choices": [
                    {"index": 0, "delta": {"content": " aus Köln ✓"}, "finish_reason": "stop"}
                ],
            },
            {
                "id": "chatcmpl-enc1",
                "object": "chat.completion.chunk",
                "model": "gpt-4o-mini",
                "choices": [],
                "usage": {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38},
            },
        ]
    )
    + b"data: [DONE]\n\n"
)

CHAT_BODY = json.dumps(
    {
        "id": "chatcmpl-enc2",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Ça va ✓ " * 40},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 160, "total_tokens": 172},
    },
    ensure_ascii=False,
).encode()

ENCODE = {
    "gzip": gzip.compress,
    "br": brotli.compress,
    "zstd": zstandard.ZstdCompressor().compress,
    "gzip, br": lambda data: brotli.compress(gzip.compress(data)),
    "br, zstd": lambda data: zstandard.ZstdCompressor().compress(brotli.compress(data)),
}


async def _tee_through(
    call: Call, data: bytes, encoding: str, content_type: str, step: int
) -> tuple[FakeSender, Teeing]:
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        teeing = Teeing(tap)
        tee = teeing.tee(
            call, "acme", 200, {"Content-Type": content_type, "Content-Encoding": encoding}
        )
        assert tee is not None
        for start in range(0, len(data), step):
            await tee.feed(data[start : start + step])
        await tee.close()
        tee.end()
    return sender, teeing


@pytest.mark.parametrize("step", [1, 7, 4093])
@pytest.mark.parametrize("encoding", list(ENCODE))
async def test_an_encoded_stream_and_body_reach_the_worker_as_their_fold(
    encoding: str, step: int
) -> None:
    chat = call_of("POST", "/v1/chat/completions")
    assert chat is not None
    sender, _ = await _tee_through(
        chat, ENCODE[encoding](CHAT_STREAM), encoding, "text/event-stream", step
    )
    (tokens,), _ = worker_tokens(sender)
    assert tokens == as_called(fold_stream(Source.OPENAI, _events(CHAT_STREAM)), tokens)
    assert tokens.text == "Grüße aus Köln ✓"
    assert tokens.usage.input_tokens == 31

    sender, _ = await _tee_through(
        chat, ENCODE[encoding](CHAT_BODY), encoding, "application/json", step
    )
    [event, end] = sender.decoded()
    assert event.data == CHAT_BODY.decode()
    assert end.kind is EventKind.END
    (tokens,), _ = worker_tokens(sender)
    assert tokens == as_called(fold_stream(Source.OPENAI, [SseEvent(CHAT_BODY.decode())]), tokens)
    assert tokens.usage.output_tokens == 160


async def test_a_coding_it_cannot_read_is_forwarded_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chat = call_of("POST", "/v1/chat/completions")
    assert chat is not None
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        teeing = Teeing(tap)
        with caplog.at_level(logging.ERROR, "streamtally.producers.proxy"):
            tee = teeing.tee(
                chat, "acme", 200, {"Content-Type": "application/json", "Content-Encoding": "exi"}
            )
        assert tee is None
    assert teeing.stats.undecodable == {"/v1/chat/completions": 1}
    assert "/v1/chat/completions" in caplog.text
    assert "'exi'" in caplog.text
    assert sender.records == []


async def test_bytes_that_do_not_decode_are_logged_and_counted_not_teed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chat = call_of("POST", "/v1/chat/completions")
    assert chat is not None
    with caplog.at_level(logging.ERROR, "streamtally.producers.proxy"):
        sender, teeing = await _tee_through(
            chat, b"this was said to be zstd" * 3, "zstd", "application/json", 5
        )
    assert sender.records == []
    assert teeing.stats.undecodable == {"/v1/chat/completions": 1}
    assert "not a valid zstd body" in caplog.text
    # Cut short: the same.
    with caplog.at_level(logging.ERROR, "streamtally.producers.proxy"):
        sender, teeing = await _tee_through(
            chat, brotli.compress(CHAT_BODY)[:-4], "br", "application/json", 64
        )
    assert sender.records == []
    assert teeing.stats.undecodable == {"/v1/chat/completions": 1}


# ---------------------------------------------------------------- completions and embeddings

COMPLETIONS_STREAM = (
    _sse(
        [
            {
                "id": "cmpl-legacy1",
                "object": "text_completion",
                "created": 1,
                "model": "gpt-3.5-turbo-instruct",
                "choices": [{"text": "Once", "index": 0, "logprobs": None, "finish_reason": None}],
            },
            {
                "id": "cmpl-legacy1",
                "object": "text_completion",
                "created": 1,
                "model": "gpt-3.5-turbo-instruct",
                "choices": [{"text": " upon", "index": 0, "logprobs": None, "finish_reason": None}],
            },
            {
                "id": "cmpl-legacy1",
                "object": "text_completion",
                "created": 1,
                "model": "gpt-3.5-turbo-instruct",
                "choices": [
                    {"text": " a time", "index": 0, "logprobs": None, "finish_reason": "length"}
                ],
            },
            {
                "id": "cmpl-legacy1",
                "object": "text_completion",
                "created": 1,
                "model": "gpt-3.5-turbo-instruct",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
            },
        ]
    )
    + b"data: [DONE]\n\n"
)

COMPLETIONS_BODY = json.dumps(
    {
        "id": "cmpl-legacy2",
        "object": "text_completion",
        "created": 1,
        "model": "gpt-3.5-turbo-instruct",
        "choices": [
            {"text": "\n\nRoses are red", "index": 0, "logprobs": None, "finish_reason": "stop"},
            {"text": "\n\nViolets", "index": 1, "logprobs": None, "finish_reason": "length"},
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 9, "total_tokens": 17},
    }
)


async def test_legacy_completions_fold_their_text_finish_and_usage() -> None:
    completions = call_of("POST", "/v1/completions")
    assert completions is not None
    sender, _ = await _tee_through(completions, COMPLETIONS_STREAM, "", "text/event-stream", 13)
    (tokens,), out = worker_tokens(sender)
    assert tokens.provider_request_id == "cmpl-legacy1"
    assert tokens.model == "gpt-3.5-turbo-instruct"
    assert tokens.text == "Once upon a time"
    assert tokens.finish_reason.value == "length"
    assert tokens.usage.input_tokens == 5
    assert tokens.usage.output_tokens == 4
    assert out.completed[0].billing.usage_source is UsageSource.PROVIDER_REPORTED

    sender, _ = await _tee_through(
        completions, COMPLETIONS_BODY.encode(), "", "application/json", 1000
    )
    (tokens,), _ = worker_tokens(sender)
    assert tokens.text == "\n\nRoses are red"  # choice 0 at the top level
    assert tokens.finish_reason.value == "stop"
    assert (tokens.usage.input_tokens, tokens.usage.output_tokens) == (8, 9)


def _embeddings(usage: dict[str, int] | None) -> str:
    body: dict[str, Any] = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.0023, -0.0093, 0.0157]},
            {"object": "embedding", "index": 1, "embedding": [0.0101, 0.0042, -0.0088]},
        ],
        "model": "text-embedding-3-small",
    }
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body)


@pytest.mark.parametrize(
    ("usage", "billed_input", "source"),
    [
        ({"prompt_tokens": 17, "total_tokens": 17}, 17, UsageSource.PROVIDER_REPORTED),
        # A compatible server that says completion tokens: never billed as output.
        (
            {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
            9,
            UsageSource.PROVIDER_REPORTED,
        ),
        ({"total_tokens": 6}, 6, UsageSource.PROVIDER_REPORTED),
        (None, 0, UsageSource.MISSING),
    ],
)
async def test_openai_embeddings_bill_input_tokens_only(
    usage: dict[str, int] | None, billed_input: int, source: UsageSource
) -> None:
    embeddings = call_of("POST", "/v1/embeddings")
    assert embeddings is not None
    body = _embeddings(usage)
    sender, _ = await _tee_through(embeddings, body.encode(), "", "application/json", 100)
    (tokens,), out = worker_tokens(sender)
    assert tokens == fold_stream(Source.OPENAI, [SseEvent(body)], tokens.request_id)
    assert tokens.model == "text-embedding-3-small"
    assert tokens.text == ""
    assert tokens.reasoning == ""
    assert tokens.tool_calls == ()
    assert tokens.finish_reason.value == "stop"
    assert tokens.usage.input_tokens == billed_input
    assert tokens.usage.output_tokens == 0
    assert out.completed[0].billing.usage_source is source
    assert out.dead_letters == []


@pytest.mark.parametrize(
    ("path", "body", "billed_input", "source"),
    [
        (
            "/v1beta/models/gemini-embedding-001:embedContent",
            {"embedding": {"values": [0.013, -0.008, 0.021]}},
            0,
            UsageSource.MISSING,
        ),
        (
            "/v1beta/models/gemini-embedding-001:batchEmbedContents",
            {"embeddings": [{"values": [0.1, 0.2]}, {"values": [0.3, 0.4]}]},
            0,
            UsageSource.MISSING,
        ),
        (  # Vertex AI's embedContent reports usageMetadata
            "/v1/projects/p/locations/us-central1/publishers/google/models/"
            "gemini-embedding-001:embedContent",
            {
                "embedding": {"values": [0.5, 0.25]},
                "usageMetadata": {"promptTokenCount": 11, "totalTokenCount": 11},
                "truncated": False,
            },
            11,
            UsageSource.PROVIDER_REPORTED,
        ),
    ],
)
async def test_gemini_embeddings_are_recorded_with_the_usage_they_report(
    path: str, body: dict[str, Any], billed_input: int, source: UsageSource
) -> None:
    call = call_of("POST", path)
    assert call is not None
    text = json.dumps(body)
    sender, _ = await _tee_through(call, text.encode(), "", "application/json", 100)
    (tokens,), out = worker_tokens(sender)
    assert tokens == fold_stream(Source.GEMINI, [SseEvent(text)], tokens.request_id)
    assert tokens.model is None  # the body does not name it
    assert tokens.text == ""
    assert tokens.finish_reason.value == "stop"
    assert tokens.usage.input_tokens == billed_input
    assert tokens.usage.output_tokens == 0
    assert out.completed[0].billing.usage_source is source
    assert out.dead_letters == []


# ---------------------------------------------------------------- Responses background mode

RESPONSE_ID = "resp_bg0123456789abcdef"
MODEL = "o3-2025-04-16"


def _response(status: str, *, background: bool = True, done: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {
        "id": RESPONSE_ID,
        "object": "response",
        "created_at": 1760000000,
        "status": status,
        "background": background,
        "model": MODEL,
        "output": [],
        "usage": None,
    }
    if done:
        response["output"] = [
            {
                "id": "msg_1",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Forty-two.", "annotations": []}],
            }
        ]
        response["usage"] = {
            "input_tokens": 50_000,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 20_000,
            "output_tokens_details": {"reasoning_tokens": 19_000},
            "total_tokens": 70_000,
        }
    return response


def _stream_events() -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"type": "response.queued", "response": _response("queued")},
        {"type": "response.created", "response": _response("in_progress")},
        {"type": "response.in_progress", "response": _response("in_progress")},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []},
        },
    ]
    for piece in ("For", "ty-", "two."):
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": piece,
            }
        )
    events.append({"type": "response.completed", "response": _response("completed", done=True)})
    return [event | {"sequence_number": n} for n, event in enumerate(events)]


async def _body_call(teeing: Teeing, call: Call, body: dict[str, Any]) -> None:
    tee = teeing.tee(call, "acme", 200, {"Content-Type": "application/json"})
    assert tee is not None
    data = json.dumps(body).encode()
    await tee.feed(data[:10])
    await tee.feed(data[10:])
    await tee.close()
    tee.end()


async def test_a_background_response_created_then_polled_is_billed_once() -> None:
    create = call_of("POST", "/v1/responses", b'{"model": "o3", "background": true}')
    poll = call_of("GET", f"/v1/responses/{RESPONSE_ID}")
    assert create is not None
    assert poll is not None
    assert create.background
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        teeing = Teeing(tap)
        await _body_call(teeing, create, _response("queued"))
        await _body_call(teeing, poll, _response("in_progress"))
        assert sender.records == []  # nothing to bill yet
        completed = _response("completed", done=True)
        await _body_call(teeing, poll, completed)
        await _body_call(teeing, poll, completed)  # the client polls once more
        assert teeing.stats.repeats == 1
    records = sender.decoded()
    assert [(r.request_id, r.seq, r.kind) for r in records] == [
        (RESPONSE_ID, 0, EventKind.EVENT),
        (RESPONSE_ID, 1, EventKind.END),
    ]
    (tokens,), out = worker_tokens(sender)
    assert tokens.request_id == RESPONSE_ID
    assert tokens.text == "Forty-two."
    assert (tokens.usage.input_tokens, tokens.usage.output_tokens) == (50_000, 20_000)
    assert tokens.finish_reason.value == "stop"
    assert out.completed[0].billing.usage_source is UsageSource.PROVIDER_REPORTED


async def test_polls_through_two_proxies_are_still_billed_once() -> None:
    # Two proxies (or one restarted) each tee the finished response: the same records,
    # keyed by the response id; the worker bills the first and bills no later copy.
    poll = call_of("GET", f"/v1/responses/{RESPONSE_ID}")
    assert poll is not None
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        for _ in range(2):
            await _body_call(Teeing(tap), poll, _response("completed", done=True))
    assert len(sender.records) == 4
    completed, out = worker_tokens(sender)
    assert len(completed) == 1
    assert len(out.completed) == 1
    assert completed[0].usage.output_tokens == 20_000
    # The second copy is refused as records of a closed request, never billed.
    assert len(out.dead_letters) == 2


async def test_a_retrieved_foreground_response_is_not_billed_again() -> None:
    poll = call_of("GET", f"/v1/responses/{RESPONSE_ID}")
    assert poll is not None
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        await _body_call(Teeing(tap), poll, _response("completed", background=False, done=True))
    assert sender.records == []


async def test_a_cancelled_background_response_is_billed_what_it_used() -> None:
    cancel = call_of("POST", f"/v1/responses/{RESPONSE_ID}/cancel")
    assert cancel is not None
    body = _response("cancelled", done=True)
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        await _body_call(Teeing(tap), cancel, body)
    (tokens,), _ = worker_tokens(sender)
    assert tokens.request_id == RESPONSE_ID
    assert tokens.finish_reason.value == "cancelled"
    assert tokens.usage.output_tokens == 20_000


async def _stream_call(
    teeing: Teeing, call: Call, events: list[dict[str, Any]], *, cancelled: bool = False
) -> None:
    tee = teeing.tee(call, "acme", 200, {"Content-Type": "text/event-stream"})
    assert tee is not None
    data = _sse(events, typed=True)
    for start in range(0, len(data), 61):
        await tee.feed(data[start : start + 61])
    if not cancelled:
        await tee.close()
    tee.end(cancelled=cancelled)


async def test_a_background_stream_is_keyed_by_the_response_and_its_sequence_numbers() -> None:
    create = call_of("POST", "/v1/responses", b'{"background": true, "stream": true}')
    assert create is not None
    events = _stream_events()
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        await _stream_call(Teeing(tap), create, events)
    records = sender.decoded()
    assert {r.request_id for r in records} == {RESPONSE_ID}
    assert [r.seq for r in records] == list(range(len(events) + 1))
    assert records[-1].kind is EventKind.END
    assert not records[-1].cancelled
    (tokens,), _ = worker_tokens(sender)
    expected = fold_stream(Source.OPENAI_RESPONSES, _events(_sse(events, typed=True)))
    assert tokens == expected
    assert tokens.text == "Forty-two."
    assert tokens.usage.input_tokens == 50_000


async def test_a_background_stream_cut_then_resumed_is_billed_once() -> None:
    create = call_of("POST", "/v1/responses", b'{"background": true, "stream": true}')
    resume = call_of("GET", f"/v1/responses/{RESPONSE_ID}")  # ?stream=true&starting_after=3
    assert create is not None
    assert resume is not None
    events = _stream_events()
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        teeing = Teeing(tap)
        # The connection drops after event 5: no END (the response goes on upstream).
        await _stream_call(teeing, create, events[:6], cancelled=True)
        await settle()
        assert sender.decoded()[-1].kind is EventKind.EVENT
        # The client resumes after the last event it got (3): 4 and 5 come again.
        await _stream_call(teeing, resume, events[4:])
        # Polled afterwards: already teed to its end here, not again.
        await _body_call(teeing, resume, _response("completed", done=True))
        assert teeing.stats.repeats == 1
    records = sender.decoded()
    assert [r.seq for r in records] == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    completed, out = worker_tokens(sender)
    assert len(out.completed) == 1
    assert out.completed[0].duplicates == 2
    [tokens] = completed
    assert tokens == fold_stream(Source.OPENAI_RESPONSES, _events(_sse(events, typed=True)))


async def test_a_background_stream_that_names_no_response_is_still_teed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    create = call_of("POST", "/v1/responses", b'{"background": true, "stream": true}')
    assert create is not None
    deltas = [
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "delta": "x",
            "sequence_number": n,
        }
        for n in range(20)
    ]
    sender = FakeSender()
    with caplog.at_level(logging.ERROR, "streamtally.producers.proxy"):
        async with Tap(sender=sender) as tap:
            await _stream_call(Teeing(tap), create, deltas)
    assert "no response id" in caplog.text
    records = sender.decoded()
    assert len(records) == 21
    assert records[-1].kind is EventKind.END


def test_a_tee_plan_without_a_call_is_a_plain_call() -> None:
    assert TeePlan(Source.OPENAI, True, "identity").call is None
    chat = call_of("POST", "/v1/chat/completions")
    assert chat is not None
    assert plan(chat, 204, "application/json", "").streaming is False  # type: ignore[union-attr]


async def test_a_plain_tee_ends_its_request_cancelled_when_the_client_left() -> None:
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        tee = Tee(tap, "acme", TeePlan(Source.OPENAI, True, "identity"))
        await tee.feed(CHAT_STREAM[:200])
        tee.end(cancelled=True)
    assert sender.decoded()[-1].cancelled
