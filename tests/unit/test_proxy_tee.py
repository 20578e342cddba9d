"""What the proxy tees (`streamtally.cli._tee`): which calls, SSE or whole body, in which events.

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

from streamtally.cli._tee import (
    MAX_BODY_BYTES,
    Tee,
    TeePlan,
    body_events,
    call_of,
    plan,
    source_of,
)
from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream
from streamtally.core.sse import SseEvent
from streamtally.producers import Tap
from tests.bodies import body_of
from tests.unit.test_tap import FakeSender, worker_tokens

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


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
    assert tokens == fold_stream(source, [SseEvent(text)])
    assert tokens.usage.input_tokens > 0


async def test_a_body_over_the_limit_is_forwarded_only() -> None:
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        tee = Tee(tap, "acme", TeePlan(Source.ANTHROPIC, streaming=False, encoding="identity"))
        piece = b" " * (1 << 20)
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):
            await tee.feed(piece)
        await tee.feed(b'{"type": "message"}')
        await tee.close()
        tee.end()
    assert sender.records == []
    assert tap.stats.requests == 0
