"""What the proxy tees (`streamtally.producers.proxy.tee`): which calls, SSE or whole body,
in which events.

The last tests run a `Tee` into a real `Tap` whose Kafka sender is the fake
of `test_tap` and hand the records to the worker's `RequestProcessor`: a
non-streaming body of each API (gzip-compressed, in pieces) must end as the
Tokens `streamtally fold` gives for that body.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream
from streamtally.core.sse import SseEvent
from streamtally.producers import Tap
from streamtally.producers.proxy.tee import (
    DEFAULT_MAX_BODY_BYTES,
    Tee,
    Teeing,
    TeePlan,
    body_events,
    call_of,
    plan,
    source_of,
)
from streamtally.producers.tap import utf8_slices
from streamtally.wire.records import PART_BYTES
from tests.bodies import body_of
from tests.unit.tap.test_tap import FakeSender, as_called, worker_tokens

SAMPLES = Path(__file__).resolve().parents[3] / "samples"


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("/v1/chat/completions", Source.OPENAI),
        ("/openai/deployments/gpt-4o/chat/completions", Source.OPENAI),  # Azure
        ("/compatible-mode/v1/chat/completions", Source.OPENAI),  # DashScope
        ("/v1/responses", Source.OPENAI_RESPONSES),
        ("/v1/messages", Source.ANTHROPIC),
        ("/v1beta/models/gemini-2.5-pro:streamGenerateContent", Source.GEMINI),
        ("/v1beta/models/gemini-2.5-flash:generateContent", Source.GEMINI),
        (
            "/v1/projects/p/locations/us-central1/publishers/google/models/"
            "gemini-2.5-pro:streamGenerateContent",
            Source.GEMINI,
        ),  # Vertex AI
        ("/v1/completions", Source.OPENAI),  # legacy completions
        ("/openai/deployments/davinci/completions", Source.OPENAI),
        ("/v1/embeddings", Source.OPENAI),
        ("/v1beta/models/text-embedding-004:embedContent", Source.GEMINI),
        ("/v1beta/models/gemini-embedding-001:batchEmbedContents", Source.GEMINI),
        ("/v1/responses/resp_123/cancel", Source.OPENAI_RESPONSES),
        ("/v1/models", None),
        ("/v1/messages/count_tokens", None),  # counts, bills nothing
        ("/v1/messages/batches", None),
        ("/v1/responses/resp_123", None),  # a POST there is no API call
        ("/v1/responses/input_tokens", None),
        ("/v1beta/models/gemini-2.5-pro:countTokens", None),
    ],
)
def test_calls_are_recognised_by_their_path(path: str, source: Source | None) -> None:
    assert source_of(path) is source


def test_a_plan_needs_a_2xx_status_and_says_how_to_read_the_body() -> None:
    sse = "text/event-stream; charset=utf-8"
    messages = call_of("POST", "/v1/messages")
    responses = call_of("POST", "/v1/responses")
    chat = call_of("POST", "/v1/chat/completions")
    assert messages is not None
    assert responses is not None
    assert chat is not None
    assert plan(messages, 200, sse, "") == TeePlan(Source.ANTHROPIC, True, "identity", messages)
    assert plan(messages, 200, "application/json", "GZIP") == TeePlan(
        Source.ANTHROPIC, False, "gzip", messages
    )
    assert plan(responses, 201, "application/json", "deflate") == TeePlan(
        Source.OPENAI_RESPONSES, False, "deflate", responses
    )
    assert plan(chat, 200, sse, "gzip, br") == TeePlan(Source.OPENAI, True, "gzip, br", chat)
    assert plan(chat, 200, sse, "zstd") == TeePlan(Source.OPENAI, True, "zstd", chat)
    assert plan(messages, 529, "application/json", "") is None  # overloaded: not billed
    assert plan(chat, 400, sse, "") is None


def test_a_body_is_one_event_verbatim() -> None:
    for source in (Source.OPENAI, Source.OPENAI_RESPONSES, Source.ANTHROPIC, Source.GEMINI):
        text = json.dumps(body_of(source, SAMPLES / _SAMPLE[source]), indent=1)
        assert body_events(source, text) == [SseEvent(text)]


def test_a_gemini_array_is_one_event_per_chunk() -> None:
    chunks = [{"candidates": [{"content": {"parts": [{"text": str(i)}]}}]} for i in range(3)]
    events = body_events(Source.GEMINI, " \n" + json.dumps(chunks))
    assert [json.loads(e.data) for e in events] == chunks
    # An array is not a chunk list of the other sources: passed on whole (the worker decides).
    assert body_events(Source.OPENAI, json.dumps(chunks)) == [SseEvent(json.dumps(chunks))]


def test_a_responses_body_without_a_result_yet_is_not_teed() -> None:
    body = body_of(Source.OPENAI_RESPONSES, SAMPLES / _SAMPLE[Source.OPENAI_RESPONSES])
    for status in ("queued", "in_progress"):
        assert body_events(Source.OPENAI_RESPONSES, json.dumps(body | {"status": status})) == []
    text = json.dumps(body | {"status": "incomplete"})
    assert body_events(Source.OPENAI_RESPONSES, text) == [SseEvent(text)]


def test_text_that_is_not_json_is_passed_on_whole() -> None:
    for source in (Source.GEMINI, Source.OPENAI_RESPONSES, Source.ANTHROPIC):
        assert body_events(source, "[not json") == [SseEvent("[not json")]


_SAMPLE = {
    Source.OPENAI: "openai/parallel_tool_calls_cached.sse",
    Source.OPENAI_RESPONSES: "openai-responses/reasoning_parallel_calls.sse",
    Source.ANTHROPIC: "anthropic/parallel_tool_use_cache.sse",
    Source.GEMINI: "gemini/thoughts_cached.sse",
}


@pytest.mark.parametrize("source", list(_SAMPLE), ids=[s.value for s in _SAMPLE])
async def test_a_compressed_body_in_pieces_reaches_the_worker_as_its_fold(source: Source) -> None:
    text = json.dumps(body_of(source, SAMPLES / _SAMPLE[source]), ensure_ascii=False)
    data = gzip.compress(text.encode())
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        tee = Tee(tap, "acme", TeePlan(source, streaming=False, encoding="gzip"))
        for start in range(0, len(data), 50):
            await tee.feed(data[start : start + 50])
        assert sender.records == []  # nothing before the body is complete
        await tee.close()
        tee.end()
    [event, end] = sender.decoded()
    assert event.data == text
    assert end.seq == 1
    (tokens,), _ = worker_tokens(sender)
    assert tokens == as_called(fold_stream(source, [SseEvent(text)]), tokens)
    assert tokens.usage.input_tokens > 0


async def test_a_body_over_the_limit_is_teed_as_its_usage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Never a silent drop: the usage, id and model of its edges, counted and logged."""
    body = body_of(Source.ANTHROPIC, SAMPLES / _SAMPLE[Source.ANTHROPIC])
    text = json.dumps(body, ensure_ascii=False)
    padded = text.replace('"content": [', '"content": [' + " " * (3 << 20), 1)
    assert len(padded) > 3 << 20
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        teeing = Teeing(tap, max_body_bytes=1 << 20)
        call = call_of("POST", "/v1/messages")
        assert call is not None
        tee = teeing.tee(call, "acme", 200, {"Content-Type": "application/json"})
        assert tee is not None
        data = padded.encode()
        for start in range(0, len(data), 65536):
            await tee.feed(data[start : start + 65536])
        assert tee.oversize
        await tee.close()
        tee.end()
    assert teeing.stats.oversize == 1
    [event, _end] = sender.decoded()
    assert len(event.data) < 2000
    (tokens,), _ = worker_tokens(sender)
    want = fold_stream(Source.ANTHROPIC, [SseEvent(text)])
    assert tokens.usage == want.usage
    assert tokens.usage.input_tokens > 0
    assert (tokens.provider_request_id, tokens.model) == (want.request_id, want.model)
    assert tokens.finish_reason == want.finish_reason
    assert tokens.text == ""
    assert "over --max-body-bytes 1048576: teed as its usage" in caplog.text
    assert tee.size == len(data)


async def test_a_body_whose_usage_is_not_found_is_teed_with_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = b'{"id": "chatcmpl-cut", "model": "gpt-4o-mini", "choices": [' + b" " * 300_000
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        plan_ = TeePlan(
            Source.OPENAI,
            streaming=False,
            encoding="identity",
            call=call_of("POST", "/v1/chat/completions"),
            max_body_bytes=100_000,
        )
        tee = Tee(tap, "acme", plan_)
        await tee.feed(data)
        await tee.close()
        tee.end()
    [event, _end] = sender.decoded()
    assert json.loads(event.data) == {
        "id": "chatcmpl-cut",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [],
    }
    (tokens,), _ = worker_tokens(sender)
    assert tokens.provider_request_id == "chatcmpl-cut"
    assert tokens.usage.input_tokens == 0
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert "request chatcmpl-cut" in errors[0].getMessage()
    assert "tenant acme" in errors[0].getMessage()


async def test_a_body_under_the_limit_is_spooled_and_teed_whole_in_parts() -> None:
    body = body_of(Source.OPENAI, SAMPLES / _SAMPLE[Source.OPENAI])
    body["choices"][0]["message"]["content"] = "é€😀 " * 300_000  # 3.3 MB
    text = json.dumps(body, ensure_ascii=False)
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        tee = Tee(tap, "acme", TeePlan(Source.OPENAI, streaming=False, encoding="identity"))
        data = text.encode()
        for start in range(0, len(data), 10_000):
            await tee.feed(data[start : start + 10_000])
        assert tee._spool is not None
        assert tee._spool._rolled  # type: ignore[attr-defined]  # on disk past 1 MiB
        await tee.close()
        tee.end()
    assert not tee.oversize
    records = sender.decoded()
    assert len(records) == len(utf8_slices(text, PART_BYTES)) + 1 == 7  # the body, the END
    assert "".join(r.data for r in records[:-1]) == text
    (tokens,), _ = worker_tokens(sender)
    assert tokens == as_called(fold_stream(Source.OPENAI, [SseEvent(text)]), tokens)


async def test_the_body_limit_must_be_positive() -> None:
    async with Tap(sender=FakeSender()) as tap:
        with pytest.raises(ValueError, match="max_body_bytes must be >= 1"):
            Tee(tap, "acme", TeePlan(Source.OPENAI, False, "identity", max_body_bytes=0))
        with pytest.raises(ValueError, match="max_body_bytes must be >= 1"):
            Teeing(tap, max_body_bytes=0)
    call = call_of("POST", "/v1/messages")
    assert call is not None
    planned = plan(call, 200, "application/json", "", max_body_bytes=5)
    assert planned == TeePlan(Source.ANTHROPIC, False, "identity", call, 5)
    default = plan(call, 200, "application/json", "")
    assert default is not None
    assert default.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 64 << 20


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "64MiB", "nan"])
def test_the_command_refuses_a_body_limit_that_is_not_a_positive_integer(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamtally.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["proxy", "--upstream", "http://127.0.0.1:9", "--max-body-bytes", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--max-body-bytes" in err
    assert repr(value) in err
