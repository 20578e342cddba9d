"""Non-streaming bodies through the fold: one event, the Tokens the stream would give.

Each body is what the provider returns for the same call without streaming,
assembled from one of our stream transcripts (`tests.bodies`, from the raw
events, not from the fold).  Folded as one event it must give the stream's
Tokens, the number of chunks aside (one).  Error transcripts have no
non-streaming counterpart (the call fails with a non-2xx status, which the
proxy does not tap), nor has a tool call cut by `max_tokens` mid-arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import FinishReason, Source, Tokens
from streamtally.core.normalize import fold_stream, read_events
from streamtally.core.sse import SseEvent
from streamtally.errors import NotAStream
from tests.bodies import anthropic_body, body_of, responses_body

SAMPLES = Path(__file__).resolve().parents[3] / "samples"

#: Every transcript of the four SSE sources that a non-streaming call could also answer.
WHOLE: list[tuple[Source, str]] = [
    (Source.OPENAI, "openai/length_max_tokens.sse"),
    (Source.OPENAI, "openai/long_text_bench.sse"),
    (Source.OPENAI, "openai/n2_choices.sse"),
    (Source.OPENAI, "openai/named_tool_choice_stop.sse"),
    (Source.OPENAI, "openai/parallel_tool_calls_cached.sse"),
    (Source.OPENAI, "openai/reasoning_cache_hit.sse"),
    (Source.OPENAI, "openai/reasoning_outside_completion.sse"),
    (Source.OPENAI, "openai/text_usage.sse"),
    (Source.OPENAI_RESPONSES, "openai-responses/incomplete_max_output.sse"),
    (Source.OPENAI_RESPONSES, "openai-responses/long_text_bench.sse"),
    (Source.OPENAI_RESPONSES, "openai-responses/reasoning_parallel_calls.sse"),
    (Source.OPENAI_RESPONSES, "openai-responses/text_cached.sse"),
    (Source.ANTHROPIC, "anthropic/long_text_bench.sse"),
    (Source.ANTHROPIC, "anthropic/parallel_tool_use_cache.sse"),
    (Source.ANTHROPIC, "anthropic/text_end_turn.sse"),
    (Source.ANTHROPIC, "anthropic/thinking_then_text.sse"),
    (Source.GEMINI, "gemini/long_text_bench.sse"),
    (Source.GEMINI, "gemini/max_tokens.sse"),
    (Source.GEMINI, "gemini/parallel_function_calls.sse"),
    (Source.GEMINI, "gemini/safety_filter.sse"),
    (Source.GEMINI, "gemini/text_stop.sse"),
    (Source.GEMINI, "gemini/thoughts_cached.sse"),
]


def streamed(source: Source, name: str) -> Tokens:
    with (SAMPLES / name).open("rb") as stream:
        return fold_stream(source, read_events(source, stream))


def whole(source: Source, body: dict[str, Any]) -> Tokens:
    return fold_stream(source, [SseEvent(json.dumps(body, ensure_ascii=False))])


@pytest.mark.parametrize(("source", "name"), WHOLE, ids=[name for _, name in WHOLE])
def test_a_body_folds_to_the_tokens_of_its_stream(source: Source, name: str) -> None:
    want = streamed(source, name)
    got = whole(source, body_of(source, SAMPLES / name))
    assert got.model_copy(update={"chunks": want.chunks}) == want
    assert got.chunks == max(1, len(got.choices))  # one event: one chunk per choice


def test_every_sse_sample_is_either_covered_or_has_no_whole_body() -> None:
    """A new sample of these sources is added to WHOLE, or to the reasons below."""
    no_body = {
        "openai/error_mid_stream.sse",  # errors: a non-2xx answer, not tapped
        "openai-responses/error_event_mid_stream.sse",
        "openai-responses/failed_mid_stream.sse",
        "anthropic/error_overloaded.sse",
        "anthropic/dropped_connection.sse",  # a broken stream has no body
        "anthropic/max_tokens_truncated_tool.sse",  # arguments cut mid-JSON: no `input` object
        "gemini/error_raw_json_tail.sse",
    }
    folders = ("openai", "openai-responses", "anthropic", "gemini")
    names = {f"{d}/{p.name}" for d in folders for p in (SAMPLES / d).glob("*.sse")}
    assert names == {name for _, name in WHOLE} | no_body


def test_an_anthropic_tool_input_is_its_json_and_server_tools_are_not_calls() -> None:
    body = {
        "id": "msg_w1",
        "type": "message",
        "model": "claude-sonnet-4-5",
        "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "text", "text": "Zürich: "},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Zürich"}},
            {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}},
        ],
        "stop_reason": "tool_use",
        "usage": {
            "input_tokens": 10,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 5,
            "output_tokens": 42,
        },
    }
    tokens = whole(Source.ANTHROPIC, body)
    assert tokens.request_id == "msg_w1"
    assert tokens.model == "claude-sonnet-4-5"
    assert tokens.text == "Zürich: "
    assert tokens.reasoning == "Look it up."
    assert [(c.index, c.id, c.name, c.arguments) for c in tokens.tool_calls] == [
        (5, "toolu_1", "weather", '{"city": "Zürich"}'),
        (6, "toolu_2", "now", "{}"),
    ]
    assert tokens.finish_reason is FinishReason.TOOL_CALLS
    assert tokens.finish_reason_raw == "tool_use"
    assert (tokens.usage.input_tokens, tokens.usage.cached_tokens) == (115, 100)
    assert (tokens.usage.cache_write_tokens, tokens.usage.output_tokens) == (5, 42)


def test_an_anthropic_body_arguments_match_the_streamed_text() -> None:
    """Anthropic streams `{"key": "value"}`: the body's `input` is written the same way."""
    name = "anthropic/parallel_tool_use_cache.sse"
    want = streamed(Source.ANTHROPIC, name)
    got = whole(Source.ANTHROPIC, anthropic_body(SAMPLES / name))
    assert [c.arguments for c in got.tool_calls] == [c.arguments for c in want.tool_calls]
    assert all(isinstance(json.loads(c.arguments), dict) for c in got.tool_calls)


def test_a_responses_body_still_queued_carries_nothing_and_a_failed_one_is_an_error() -> None:
    base = responses_body(SAMPLES / "openai-responses" / "text_cached.sse")
    queued = base | {"status": "queued", "output": [], "usage": None}
    with pytest.raises(NotAStream):  # no finish, no usage yet: nothing to fold
        whole(Source.OPENAI_RESPONSES, queued)
    failed = whole(
        Source.OPENAI_RESPONSES,
        base | {"status": "failed", "error": {"code": "server_error", "message": "boom"}},
    )
    assert failed.finish_reason is FinishReason.ERROR
    assert failed.finish_reason_raw == "failed"
    assert failed.error == "boom"
    assert (
        failed.usage == streamed(Source.OPENAI_RESPONSES, "openai-responses/text_cached.sse").usage
    )


def test_a_responses_event_without_type_or_response_object_is_still_invalid() -> None:
    invalid: list[int] = []
    with pytest.raises(NotAStream, match="no openai-responses content"):
        fold_stream(
            Source.OPENAI_RESPONSES,
            [SseEvent(json.dumps({"id": "resp_x", "object": "list"}))],
            on_invalid=lambda number, _: invalid.append(number),
        )
    assert invalid == [1]
