"""Every source's raw events, through `fold_stream`, against the normalisation contract.

Inputs are tiny hand-written transcripts: `SseEvent`s for the SSE sources (or raw
bytes read by `read_events`, as `streamtally fold` and the producer read them,
where framing matters), dicts for the engines.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from typing import Any

import pytest

from streamtally.billing.pricing import PriceTable
from streamtally.core.adapters.base import AdapterOptions
from streamtally.core.adapters.gemini import RAW_ERROR_BODY
from streamtally.core.adapters.openai import OpenAIChatAdapter
from streamtally.core.fold import NO_FINISH
from streamtally.core.models import FinishReason, Source, Tokens, ToolCall, Usage
from streamtally.core.normalize import Normalizer, fold_stream, read_events
from streamtally.core.sse import NonSseLine, SseEvent
from streamtally.errors import InputError, InvalidEvent, NotAStream
from streamtally.processors.requests import Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key

F = FinishReason
Obj = dict[str, Any]


def events(*items: Obj | str) -> list[SseEvent]:
    """Untyped SSE events (OpenAI chat, Gemini): `data:` only."""
    return [SseEvent(item if isinstance(item, str) else json.dumps(item)) for item in items]


def typed(*items: Obj) -> list[SseEvent]:
    """Typed SSE events (Anthropic, Responses): `event:` equals the JSON `type`."""
    return [SseEvent(json.dumps(item), item["type"]) for item in items]


def fold_sse(source: Source, body: bytes) -> Tokens:
    return fold_stream(source, read_events(source, io.BytesIO(body)))


def sse_events(source: Source, body: bytes) -> tuple[list[SseEvent], list[NonSseLine]]:
    """What `read_events` yields for `body`, and the non-SSE lines it reports."""
    non_sse: list[NonSseLine] = []
    got = list(read_events(source, io.BytesIO(body), on_non_sse=non_sse.append))
    assert all(isinstance(event, SseEvent) for event in got)
    return got, non_sse


def fold_lines(source: Source, lines: Iterable[Obj], **kwargs: Any) -> Tokens:
    return fold_stream(source, list(lines), **kwargs)


# =====================================================================================
# openai
# =====================================================================================


def oa(choices: list[Obj] | None = None, **extra: Any) -> Obj:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4.1",
        "choices": [] if choices is None else choices,
        **extra,
    }


def choice(index: int = 0, finish: str | None = None, **delta: Any) -> Obj:
    return {"index": index, "delta": delta, "finish_reason": finish}


def usage_only(**usage: Any) -> Obj:
    return oa([], usage=usage)


def test_openai_text_finish_and_usage_chunk() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(role="assistant", content="")], usage=None),
            oa([choice(content="Hel")], usage=None),
            oa([choice(content="lo")], usage=None),
            oa([choice(finish="stop")], usage=None),
            usage_only(
                prompt_tokens=9,
                completion_tokens=2,
                total_tokens=11,
                prompt_tokens_details={"cached_tokens": 0},
                completion_tokens_details={"reasoning_tokens": 0},
            ),
            "[DONE]",
        ),
    )
    assert tokens.request_id == "chatcmpl-1"
    assert tokens.source is Source.OPENAI
    assert tokens.model == "gpt-4.1"
    assert tokens.text == "Hello"
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "stop")
    assert tokens.usage == Usage(input_tokens=9, output_tokens=2)
    assert tokens.error is None
    # One chunk per raw event that carries anything: the role-only chunk carries nothing.
    assert tokens.chunks == 4


def test_openai_reasoning_inside_completion_is_not_added_again() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(finish="stop", content="ok")]),
            usage_only(
                prompt_tokens=100,
                completion_tokens=50,
                total_tokens=150,
                prompt_tokens_details={"cached_tokens": 64},
                completion_tokens_details={"reasoning_tokens": 30},
            ),
        ),
    )
    assert tokens.usage == Usage(
        input_tokens=100, output_tokens=50, reasoning_tokens=30, cached_tokens=64
    )


def test_openai_xai_reasoning_outside_completion_is_added() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(reasoning_content="hmm")]),
            oa([choice(content="2")]),
            oa([choice(finish="stop")]),
            usage_only(
                prompt_tokens=291,
                completion_tokens=26,
                total_tokens=513,
                prompt_tokens_details={"cached_tokens": 5},
                completion_tokens_details={"reasoning_tokens": 196},
            ),
        ),
    )
    assert tokens.usage == Usage(
        input_tokens=291, output_tokens=222, reasoning_tokens=196, cached_tokens=5
    )
    assert tokens.reasoning == "hmm"


def test_openai_deepseek_prompt_cache_hit_tokens_is_the_cached_count() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa(
                [choice(finish="stop", content="x")],
                usage={
                    "prompt_tokens": 100,
                    "completion_tokens": 5,
                    "total_tokens": 105,
                    "prompt_cache_hit_tokens": 64,
                    "prompt_cache_miss_tokens": 36,
                },
            )
        ),
    )
    assert tokens.usage == Usage(input_tokens=100, output_tokens=5, cached_tokens=64)


def test_openai_deepseek_usage_on_the_finish_chunk() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(reasoning_content="r", content=None)], usage=None),
            oa([choice(content="a")], usage=None),
            oa(
                [choice(finish="stop", content="")],
                usage={
                    "prompt_tokens": 339,
                    "completion_tokens": 83,
                    "total_tokens": 422,
                    "prompt_tokens_details": {"cached_tokens": 320},
                    "completion_tokens_details": {"reasoning_tokens": 39},
                    "prompt_cache_hit_tokens": 320,
                    "prompt_cache_miss_tokens": 19,
                },
            ),
            "[DONE]",
        ),
    )
    assert tokens.usage == Usage(
        input_tokens=339, output_tokens=83, reasoning_tokens=39, cached_tokens=320
    )
    assert (tokens.text, tokens.reasoning) == ("a", "r")


def test_openai_groq_x_groq_usage_counts_when_top_level_usage_is_absent() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(content="hi")], x_groq={"id": "req_1"}),
            oa(
                [choice(finish="stop")],
                x_groq={
                    "id": "req_1",
                    "usage": {
                        "prompt_tokens": 40,
                        "completion_tokens": 7,
                        "total_tokens": 47,
                        "queue_time": 0.01,
                    },
                },
            ),
        ),
    )
    assert tokens.usage == Usage(input_tokens=40, output_tokens=7)


def test_openai_groq_top_level_usage_wins_over_x_groq_usage() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa(
                [choice(finish="stop", content="hi")],
                usage={"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47},
                x_groq={
                    "id": "req_1",
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                },
            ),
        ),
    )
    assert tokens.usage == Usage(input_tokens=40, output_tokens=7)


def test_openai_cache_write_tokens() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(finish="stop", content="x")]),
            usage_only(
                prompt_tokens=1000,
                completion_tokens=3,
                total_tokens=1003,
                prompt_tokens_details={"cached_tokens": 200, "cache_write_tokens": 700},
            ),
        ),
    )
    assert tokens.usage == Usage(
        input_tokens=1000, output_tokens=3, cached_tokens=200, cache_write_tokens=700
    )


def test_openai_continuous_usage_is_last_wins_never_summed() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa(
                [choice(content="a")],
                usage={"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
            ),
            oa(
                [choice(content="b")],
                usage={"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            ),
            oa(
                [choice(finish="stop", content="c")],
                usage={"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
            ),
        ),
    )
    assert tokens.usage == Usage(input_tokens=10, output_tokens=3)


def test_openai_done_then_junk_is_ignored() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(content="ok")]),
            oa([choice(finish="stop")]),
            "[DONE]",
            oa([choice(content=" junk", finish="length")], usage={"prompt_tokens": 99}),
            "not json at all",
            {"error": {"message": "after done"}},
        ),
    )
    assert tokens.text == "ok"
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "stop")
    assert tokens.usage == Usage()
    assert tokens.error is None


def test_openai_done_then_a_raw_json_tail_is_ignored() -> None:
    body = (
        b'data: {"id":"chatcmpl-1","model":"m","choices":[{"index":0,"delta":{"content":"ok"},'
        b'"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
        b'{"error": {"message": "after done"}}\n'
    )
    tokens = fold_sse(Source.OPENAI, body)
    assert tokens.text == "ok"
    assert tokens.finish_reason is F.STOP
    assert tokens.error is None


def test_openai_error_object_in_the_body_is_an_error() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(content="partial")]),
            {
                "error": {
                    "message": "The server had an error while processing your request.",
                    "type": "server_error",
                }
            },
        ),
    )
    assert tokens.finish_reason is F.ERROR
    assert tokens.error == "The server had an error while processing your request."
    assert tokens.text == "partial"


def test_openai_openrouter_error_with_finish_reason_error() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(content="a")]),
            oa(
                [choice(finish="error", content="")],
                error={"code": 502, "message": "Provider returned error"},
            ),
        ),
    )
    assert tokens.finish_reason is F.ERROR
    assert tokens.error == "Provider returned error"


def test_openai_usage_chunk_after_finish_does_not_clear_the_finish() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(content="a")]),
            oa([choice(finish="length")]),
            oa(
                [choice(role="assistant", content="")],
                usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            ),
            "[DONE]",
        ),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.LENGTH, "length")
    assert tokens.usage == Usage(input_tokens=3, output_tokens=4)


def test_openai_keep_alive_payloads_are_not_errors() -> None:
    body = (
        b": keep-alive\n\n"
        b"data: : keep-alive\n\n"
        b"data: \n\n"
        b'data: {"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":"x"},'
        b'"finish_reason":"stop"}]}\n\n'
        b": OPENROUTER PROCESSING\n\n"
        b"data: [DONE]\n\n"
    )
    tokens = fold_sse(Source.OPENAI, body)
    assert (tokens.text, tokens.finish_reason, tokens.error) == ("x", F.STOP, None)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("stop", F.STOP),
        ("length", F.LENGTH),
        ("tool_calls", F.TOOL_CALLS),
        ("function_call", F.TOOL_CALLS),
        ("content_filter", F.CONTENT_FILTER),
        ("error", F.ERROR),
    ],
)
def test_openai_finish_mapping(raw: str, expected: FinishReason) -> None:
    tokens = fold_stream(Source.OPENAI, events(oa([choice(finish=raw, content="x")])))
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (expected, raw)


def test_openai_tool_call_fragments_with_empty_id_continuations() -> None:
    def call(**entry: Any) -> Obj:
        return oa([choice(tool_calls=[entry])])

    tokens = fold_stream(
        Source.OPENAI,
        events(
            call(index=0, id="call_1", type="function", function={"name": "get_weather"}),
            call(index=0, id="", type="function", function={"arguments": '{"city":'}),
            call(index=0, id="", type="function", function={"name": "", "arguments": '"Paris"}'}),
            oa([choice(finish="tool_calls")]),
        ),
    )
    assert tokens.tool_calls == (
        ToolCall(index=0, id="call_1", name="get_weather", arguments='{"city":"Paris"}'),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.TOOL_CALLS, "tool_calls")


def test_openai_named_tool_choice_stop_with_tool_call_is_tool_calls() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa(
                [
                    choice(
                        tool_calls=[
                            {
                                "index": 0,
                                "id": "call_1",
                                "function": {"name": "f", "arguments": ""},
                            }
                        ]
                    )
                ]
            ),
            oa([choice(finish="stop")]),
        ),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.TOOL_CALLS, "stop")
    assert tokens.tool_calls[0].arguments == "{}"


def test_openai_mistral_tool_calls_without_index() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa(
                [
                    choice(
                        tool_calls=[
                            {"id": "a1", "function": {"name": "f", "arguments": '{"x":1}'}},
                        ]
                    )
                ]
            ),
            oa(
                [
                    choice(
                        finish="tool_calls",
                        tool_calls=[
                            {"id": "b2", "function": {"name": "g", "arguments": '{"y":2}'}},
                        ],
                    )
                ],
                usage={"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11},
            ),
        ),
    )
    assert tokens.tool_calls == (
        ToolCall(index=0, id="a1", name="f", arguments='{"x":1}'),
        ToolCall(index=1, id="b2", name="g", arguments='{"y":2}'),
    )
    assert tokens.usage == Usage(input_tokens=5, output_tokens=6)


def test_openai_n_greater_than_one_folds_each_choice() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(0, content="A")]),
            oa([choice(1, content="B")]),
            oa([choice(0, content="a")]),
            oa([choice(1, content="b")]),
            oa([choice(0, finish="stop")]),
            oa([choice(1, finish="length")]),
            usage_only(prompt_tokens=4, completion_tokens=8, total_tokens=12),
            "[DONE]",
        ),
    )
    assert tokens.text == "Aa"
    assert tokens.finish_reason is F.STOP
    assert [(c.index, c.text, c.finish_reason) for c in tokens.choices] == [
        (0, "Aa", F.STOP),
        (1, "Bb", F.LENGTH),
    ]
    assert tokens.usage == Usage(input_tokens=4, output_tokens=8)


def test_openai_reasoning_field_names() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            oa([choice(reasoning_content="one ")]),
            oa([choice(reasoning="two")]),
            oa([choice(content="answer", finish="stop")]),
        ),
    )
    assert (tokens.reasoning, tokens.text) == ("one two", "answer")


def test_openai_azure_empty_id_first_chunk_then_real_id() -> None:
    tokens = fold_stream(
        Source.OPENAI,
        events(
            {"choices": [], "created": 0, "id": "", "model": "", "object": "", "x": []},
            oa([choice(content="x", finish="stop")]),
        ),
    )
    assert (tokens.request_id, tokens.model) == ("chatcmpl-1", "gpt-4.1")


def test_openai_without_finish_is_an_error() -> None:
    tokens = fold_stream(Source.OPENAI, events(oa([choice(content="cut")])))
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, NO_FINISH)


@pytest.mark.parametrize(
    "foreign",
    [
        {"type": "message_start", "message": {"id": "msg_1", "model": "claude", "usage": {}}},
        {"candidates": [{"content": {"parts": [{"text": "x"}]}}], "modelVersion": "gemini"},
        {"type": "response.created", "response": {"id": "resp_1"}},
    ],
    ids=["anthropic", "gemini", "responses"],
)
def test_openai_rejects_events_of_another_source(foreign: Obj) -> None:
    with pytest.raises(InputError):  # every event invalid: not a stream of the source
        fold_stream(Source.OPENAI, events(foreign))


def test_openai_done_alone_is_not_a_stream() -> None:
    with pytest.raises(NotAStream):
        fold_stream(Source.OPENAI, events("[DONE]"))


# =====================================================================================
# anthropic
# =====================================================================================


def message_start(message_id: str = "msg_1", **usage: Any) -> Obj:
    return {
        "type": "message_start",
        "message": {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [],
            "stop_reason": None,
            "usage": usage,
        },
    }


def block_start(index: int, block: Obj) -> Obj:
    return {"type": "content_block_start", "index": index, "content_block": block}


def block_delta(index: int, **delta: Any) -> Obj:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def text(index: int, value: str) -> Obj:
    return block_delta(index, type="text_delta", text=value)


def partial_json(index: int, value: str) -> Obj:
    return block_delta(index, type="input_json_delta", partial_json=value)


def block_stop(index: int) -> Obj:
    return {"type": "content_block_stop", "index": index}


def message_delta(stop_reason: str | None, **usage: Any) -> Obj:
    return {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": usage,
    }


MESSAGE_STOP: Obj = {"type": "message_stop"}
PING: Obj = {"type": "ping"}


def test_anthropic_text_and_input_includes_cache_reads_and_writes() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(
                input_tokens=10,
                cache_creation_input_tokens=20,
                cache_read_input_tokens=300,
                output_tokens=1,
            ),
            block_start(0, {"type": "text", "text": ""}),
            PING,
            text(0, "Hello"),
            text(0, " world"),
            block_stop(0),
            message_delta("end_turn", output_tokens=6),
            MESSAGE_STOP,
        ),
    )
    assert (tokens.request_id, tokens.model) == ("msg_1", "claude-x")
    assert tokens.text == "Hello world"
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "end_turn")
    assert tokens.usage == Usage(
        input_tokens=330, output_tokens=6, cached_tokens=300, cache_write_tokens=20
    )
    assert tokens.error is None


def test_anthropic_message_delta_overrides_only_the_fields_it_carries() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(
                input_tokens=2,
                cache_creation_input_tokens=3068,
                cache_read_input_tokens=0,
                output_tokens=1,
            ),
            text(0, "x"),
            message_delta(
                "end_turn",
                input_tokens=6,
                cache_read_input_tokens=6289,
                output_tokens=40,
            ),
        ),
    )
    assert tokens.usage == Usage(
        input_tokens=6 + 6289 + 3068,
        output_tokens=40,
        cached_tokens=6289,
        cache_write_tokens=3068,
    )


def test_anthropic_message_delta_null_fields_do_not_override() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=43, cache_read_input_tokens=7, output_tokens=1),
            text(0, "x"),
            message_delta(
                "end_turn",
                input_tokens=None,
                cache_read_input_tokens=None,
                cache_creation_input_tokens=None,
                output_tokens=9,
            ),
        ),
    )
    assert tokens.usage == Usage(input_tokens=50, output_tokens=9, cached_tokens=7)


def test_anthropic_output_tokens_are_a_running_total_not_summed() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=5, output_tokens=1),
            text(0, "x"),
            message_delta(None, output_tokens=3),
            message_delta("end_turn", output_tokens=4),
        ),
    )
    assert tokens.usage == Usage(input_tokens=5, output_tokens=4)


def test_anthropic_thinking_is_reasoning_and_thinking_tokens_the_reasoning_count() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=5, output_tokens=1),
            block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
            block_delta(0, type="thinking_delta", thinking="Let me"),
            block_delta(0, type="thinking_delta", thinking=" think"),
            block_delta(0, type="signature_delta", signature="EqQBCgIYAhIM"),
            block_stop(0),
            block_start(1, {"type": "redacted_thinking", "data": "opaque-bytes"}),
            block_stop(1),
            block_start(2, {"type": "text", "text": ""}),
            text(2, "42"),
            block_stop(2),
            message_delta(
                "end_turn", output_tokens=50, output_tokens_details={"thinking_tokens": 30}
            ),
            MESSAGE_STOP,
        ),
    )
    assert tokens.reasoning == "Let me think"
    assert tokens.text == "42"
    assert tokens.usage == Usage(input_tokens=5, output_tokens=50, reasoning_tokens=30)


def test_anthropic_tool_use_block_is_a_tool_call() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=5, output_tokens=1),
            block_start(0, {"type": "text", "text": ""}),
            text(0, "Checking."),
            block_stop(0),
            block_start(
                1, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
            ),
            partial_json(1, ""),
            partial_json(1, '{"city":'),
            partial_json(1, ' "Paris"}'),
            block_stop(1),
            message_delta("tool_use", output_tokens=20),
            MESSAGE_STOP,
        ),
    )
    assert tokens.tool_calls == (
        ToolCall(index=1, id="toolu_1", name="get_weather", arguments='{"city": "Paris"}'),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.TOOL_CALLS, "tool_use")


def test_anthropic_no_argument_tool_is_empty_object() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=5, output_tokens=1),
            block_start(0, {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}),
            PING,
            partial_json(0, ""),
            block_stop(0),
            message_delta("tool_use", output_tokens=3),
        ),
    )
    assert tokens.tool_calls == (ToolCall(index=0, id="toolu_1", name="now", arguments="{}"),)


def test_anthropic_max_tokens_mid_tool_input_is_length_with_raw_arguments() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=5, output_tokens=1),
            block_start(0, {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}),
            partial_json(0, '{"city": "Pa'),
            message_delta("max_tokens", output_tokens=16),
            MESSAGE_STOP,
        ),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.LENGTH, "max_tokens")
    assert tokens.tool_calls[0].arguments == '{"city": "Pa'


def test_anthropic_server_tool_use_is_not_a_tool_call() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=5, output_tokens=1),
            block_start(
                0,
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
            ),
            partial_json(0, '{"query": "weather"}'),
            block_stop(0),
            block_start(
                1,
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            ),
            block_stop(1),
            block_start(2, {"type": "text", "text": ""}),
            text(2, "Sunny."),
            block_stop(2),
            message_delta("end_turn", output_tokens=30),
            MESSAGE_STOP,
        ),
    )
    assert tokens.tool_calls == ()
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "end_turn")
    assert tokens.text == "Sunny."


def test_anthropic_error_event_mid_stream() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=5, output_tokens=1),
            block_start(0, {"type": "text", "text": ""}),
            text(0, "Hel"),
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        ),
    )
    assert tokens.finish_reason is F.ERROR
    assert tokens.error == "Overloaded"
    assert tokens.text == "Hel"
    assert tokens.usage == Usage(input_tokens=5, output_tokens=1)


def test_anthropic_duplicate_message_start_with_the_same_id_changes_nothing() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=10, output_tokens=1),
            block_start(0, {"type": "text", "text": ""}),
            text(0, "Hi"),
            message_start(input_tokens=999, cache_read_input_tokens=999, output_tokens=999),
            text(0, " there"),
            message_delta("end_turn", output_tokens=5),
            MESSAGE_STOP,
        ),
    )
    assert tokens.text == "Hi there"
    assert (tokens.finish_reason, tokens.error) == (F.STOP, None)
    assert tokens.usage == Usage(input_tokens=10, output_tokens=5)
    assert tokens.request_id == "msg_1"


def test_anthropic_spliced_message_start_with_another_id_is_an_error() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=10, output_tokens=1),
            block_start(0, {"type": "text", "text": ""}),
            text(0, "Hello"),
            message_start("msg_2", input_tokens=10, output_tokens=1),
            block_start(0, {"type": "text", "text": ""}),
            text(0, "Hello again"),
            message_delta("end_turn", output_tokens=5),
            MESSAGE_STOP,
        ),
    )
    assert tokens.finish_reason is F.ERROR
    assert tokens.error is not None
    assert tokens.request_id == "msg_1"
    assert tokens.text.startswith("Hello")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("end_turn", F.STOP),
        ("stop_sequence", F.STOP),
        ("pause_turn", F.STOP),
        ("max_tokens", F.LENGTH),
        ("model_context_window_exceeded", F.LENGTH),
        ("tool_use", F.TOOL_CALLS),
        ("refusal", F.CONTENT_FILTER),
    ],
)
def test_anthropic_stop_reason_mapping(raw: str, expected: FinishReason) -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(
            message_start(input_tokens=1, output_tokens=1),
            text(0, "x"),
            message_delta(raw, output_tokens=2),
        ),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (expected, raw)


def test_anthropic_padded_json_and_missing_final_blank_line() -> None:
    body = (
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"id":"msg_p","model":"claude-x",'
        b'"usage":{"input_tokens":3,"output_tokens":1}}          }\n\n'
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"ok"}  }\n\n'
        b"event: message_delta\n"
        b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"output_tokens":2}          }\n\n'
        b"event: message_stop\n"
        b'data: {"type":"message_stop"}\n'
    )
    tokens = fold_sse(Source.ANTHROPIC, body)
    assert (tokens.request_id, tokens.text, tokens.finish_reason) == ("msg_p", "ok", F.STOP)
    assert tokens.usage == Usage(input_tokens=3, output_tokens=2)


def test_anthropic_without_message_delta_is_an_error() -> None:
    tokens = fold_stream(
        Source.ANTHROPIC,
        typed(message_start(input_tokens=1, output_tokens=1), text(0, "cut")),
    )
    assert (tokens.finish_reason, tokens.error, tokens.text) == (F.ERROR, NO_FINISH, "cut")


@pytest.mark.parametrize(
    "foreign",
    [
        oa([choice(content="x")]),
        {"candidates": [{"content": {"parts": [{"text": "x"}]}}], "modelVersion": "gemini"},
    ],
    ids=["openai", "gemini"],
)
def test_anthropic_rejects_events_of_another_source(foreign: Obj) -> None:
    with pytest.raises(InputError):  # every event invalid: not a stream of the source
        fold_stream(Source.ANTHROPIC, events(foreign))


# =====================================================================================
# openai-responses
# =====================================================================================


def response(status: str, **fields: Any) -> Obj:
    return {"id": "resp_1", "object": "response", "model": "gpt-5", "status": status, **fields}


RESPONSE_USAGE: Obj = {
    "input_tokens": 100,
    "input_tokens_details": {"cached_tokens": 64},
    "output_tokens": 20,
    "output_tokens_details": {"reasoning_tokens": 8},
    "total_tokens": 120,
}


def created() -> Obj:
    return {"type": "response.created", "response": response("in_progress", usage=None)}


def completed(**fields: Any) -> Obj:
    return {"type": "response.completed", "response": response("completed", **fields)}


def text_delta(value: str, output_index: int = 0) -> Obj:
    return {
        "type": "response.output_text.delta",
        "item_id": "msg_1",
        "output_index": output_index,
        "content_index": 0,
        "delta": value,
    }


def call_added(output_index: int, call_id: str, name: str, item_id: str = "fc_1") -> Obj:
    return {
        "type": "response.output_item.added",
        "output_index": output_index,
        "item": {
            "id": item_id,
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": call_id,
            "name": name,
        },
    }


def args_delta(output_index: int, value: str, item_id: str) -> Obj:
    return {
        "type": "response.function_call_arguments.delta",
        "item_id": item_id,
        "output_index": output_index,
        "delta": value,
    }


def args_done(output_index: int, value: str, item_id: str) -> Obj:
    return {
        "type": "response.function_call_arguments.done",
        "item_id": item_id,
        "output_index": output_index,
        "arguments": value,
    }


def test_responses_text_and_terminal_usage() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            created(),
            {"type": "response.in_progress", "response": response("in_progress")},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {"id": "msg_1", "type": "message", "content": [], "role": "assistant"},
            },
            text_delta("Hel"),
            text_delta("lo"),
            {"type": "response.output_text.done", "output_index": 0, "text": "Hello"},
            completed(usage=RESPONSE_USAGE),
        ),
    )
    assert (tokens.request_id, tokens.model, tokens.text) == ("resp_1", "gpt-5", "Hello")
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "completed")
    assert tokens.usage == Usage(
        input_tokens=100, output_tokens=20, reasoning_tokens=8, cached_tokens=64
    )


def test_responses_cache_write_tokens() -> None:
    usage = {
        "input_tokens": 50,
        "input_tokens_details": {"cached_tokens": 10, "cache_write_tokens": 30},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 52,
    }
    tokens = fold_stream(Source.OPENAI_RESPONSES, typed(text_delta("x"), completed(usage=usage)))
    assert tokens.usage == Usage(
        input_tokens=50, output_tokens=2, cached_tokens=10, cache_write_tokens=30
    )


def test_responses_tool_call_keyed_by_output_index_with_rotating_item_ids() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            created(),
            call_added(1, "call_AB", "calculator", item_id="capture-id-1"),
            args_delta(1, '{"a":', "capture-id-2"),
            args_delta(1, "12}", "capture-id-3"),
            args_done(1, '{"a":12}', "capture-id-4"),
            completed(usage=RESPONSE_USAGE),
        ),
    )
    assert tokens.tool_calls == (
        ToolCall(index=1, id="call_AB", name="calculator", arguments='{"a":12}'),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.TOOL_CALLS, "completed")


def test_responses_parallel_calls_interleaved() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            call_added(0, "call_1", "f", item_id="fc_1"),
            call_added(1, "call_2", "g", item_id="fc_2"),
            args_delta(1, '{"y"', "fc_2"),
            args_delta(0, '{"x"', "fc_1"),
            args_delta(0, ":1}", "fc_1"),
            args_delta(1, ":2}", "fc_2"),
            completed(),
        ),
    )
    assert tokens.tool_calls == (
        ToolCall(index=0, id="call_1", name="f", arguments='{"x":1}'),
        ToolCall(index=1, id="call_2", name="g", arguments='{"y":2}'),
    )


def test_responses_arguments_only_in_the_done_event() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(call_added(0, "call_1", "f"), args_done(0, '{"q":"x"}', "fc_1"), completed()),
    )
    assert tokens.tool_calls[0].arguments == '{"q":"x"}'


def test_responses_no_argument_call_is_empty_object() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(call_added(0, "call_1", "now"), args_done(0, "", "fc_1"), completed()),
    )
    assert tokens.tool_calls == (ToolCall(index=0, id="call_1", name="now", arguments="{}"),)


def test_responses_reasoning_summary_and_reasoning_text() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            {
                "type": "response.reasoning_summary_text.delta",
                "item_id": "rs_1",
                "output_index": 0,
                "summary_index": 0,
                "delta": "Summary. ",
            },
            {
                "type": "response.reasoning_text.delta",
                "item_id": "rs_1",
                "output_index": 0,
                "content_index": 0,
                "delta": "Raw.",
            },
            text_delta("A", output_index=1),
            completed(),
        ),
    )
    assert (tokens.reasoning, tokens.text) == ("Summary. Raw.", "A")


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("max_output_tokens", F.LENGTH), ("content_filter", F.CONTENT_FILTER)],
)
def test_responses_incomplete_by_reason(reason: str, expected: FinishReason) -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            text_delta("part"),
            {
                "type": "response.incomplete",
                "response": response(
                    "incomplete", incomplete_details={"reason": reason}, usage=RESPONSE_USAGE
                ),
            },
        ),
    )
    assert tokens.finish_reason is expected
    assert tokens.usage.output_tokens == 20
    assert tokens.text == "part"


def test_responses_incomplete_with_a_cut_tool_call_stays_length() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            call_added(0, "call_1", "f"),
            args_delta(0, '{"a": "b', "fc_1"),
            {
                "type": "response.incomplete",
                "response": response(
                    "incomplete", incomplete_details={"reason": "max_output_tokens"}
                ),
            },
        ),
    )
    assert tokens.finish_reason is F.LENGTH
    assert tokens.tool_calls[0].arguments == '{"a": "b'


def test_responses_failed_is_an_error_with_its_message() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            text_delta("x"),
            {
                "type": "response.failed",
                "response": response(
                    "failed", error={"code": "server_error", "message": "boom"}, usage=None
                ),
            },
        ),
    )
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, "boom")


def test_responses_error_event_is_terminal_and_its_message_wins() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            created(),
            text_delta("x"),
            {
                "type": "error",
                "code": "insufficient_quota",
                "message": "You exceeded your current quota",
                "param": None,
                "sequence_number": 3,
            },
            {
                "type": "response.failed",
                "response": response(
                    "failed", error={"code": "insufficient_quota", "message": "later message"}
                ),
            },
        ),
    )
    assert tokens.finish_reason is F.ERROR
    assert tokens.error == "You exceeded your current quota"


def test_responses_error_event_alone_is_an_error() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            text_delta("x"),
            {"type": "error", "code": "server_is_overloaded", "message": "Overloaded"},
        ),
    )
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, "Overloaded")


def test_responses_cancelled() -> None:
    tokens = fold_stream(
        Source.OPENAI_RESPONSES,
        typed(
            text_delta("x"),
            {"type": "response.cancelled", "response": response("cancelled")},
        ),
    )
    assert tokens.finish_reason is F.CANCELLED


def test_responses_without_terminal_event_is_an_error() -> None:
    tokens = fold_stream(Source.OPENAI_RESPONSES, typed(created(), text_delta("cut")))
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, NO_FINISH)


@pytest.mark.parametrize(
    "foreign",
    [message_start(input_tokens=1), oa([choice(content="x")])],
    ids=["anthropic", "openai"],
)
def test_responses_rejects_events_of_another_source(foreign: Obj) -> None:
    with pytest.raises(InputError):  # every event invalid: not a stream of the source
        fold_stream(Source.OPENAI_RESPONSES, events(foreign))


# =====================================================================================
# gemini
# =====================================================================================


def gm(
    parts: list[Obj] | None = None,
    finish: str | None = None,
    usage: Obj | None = None,
    **candidate: Any,
) -> Obj:
    cand: Obj = {**candidate}
    if parts is not None:
        cand["content"] = {"parts": parts, "role": "model"}
    if finish is not None:
        cand["finishReason"] = finish
    obj: Obj = {
        "candidates": [cand],
        "modelVersion": "gemini-2.5-flash",
        "responseId": "resp-g1",
    }
    if usage is not None:
        obj["usageMetadata"] = usage
    return obj


def test_gemini_thought_parts_are_reasoning_and_output_adds_thoughts() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"text": "Thinking...", "thought": True}]),
            gm([{"text": "1, 2"}]),
            gm(
                [{"text": ", 3"}, {"text": "", "thoughtSignature": "c2ln"}],
                "STOP",
                usage={
                    "promptTokenCount": 8,
                    "candidatesTokenCount": 7,
                    "thoughtsTokenCount": 23,
                    "cachedContentTokenCount": 4,
                    "totalTokenCount": 38,
                },
            ),
        ),
    )
    assert (tokens.request_id, tokens.model) == ("resp-g1", "gemini-2.5-flash")
    assert (tokens.text, tokens.reasoning) == ("1, 2, 3", "Thinking...")
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "STOP")
    assert tokens.usage == Usage(
        input_tokens=8, output_tokens=30, reasoning_tokens=23, cached_tokens=4
    )


def test_gemini_usage_is_a_running_total() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"text": "a"}], usage={"promptTokenCount": 2304, "candidatesTokenCount": 2}),
            gm(
                [{"text": "b"}], "STOP", usage={"promptTokenCount": 2301, "candidatesTokenCount": 5}
            ),
        ),
    )
    assert tokens.usage == Usage(input_tokens=2301, output_tokens=5)


def test_gemini_usage_merged_field_wise_count_less_objects_erase_nothing() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"text": "a"}], usage={"trafficType": "ON_DEMAND"}),
            gm(
                [{"text": "b"}],
                "STOP",
                usage={
                    "trafficType": "ON_DEMAND",
                    "promptTokenCount": 10,
                    "candidatesTokenCount": 5,
                    "thoughtsTokenCount": 2,
                    "totalTokenCount": 17,
                },
            ),
            {"usageMetadata": {"trafficType": "ON_DEMAND"}, "modelVersion": "gemini-3"},
        ),
    )
    assert tokens.usage == Usage(input_tokens=10, output_tokens=7, reasoning_tokens=2)


def test_gemini_usage_field_missing_later_keeps_its_last_value() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"text": "a"}], usage={"promptTokenCount": 29, "thoughtsTokenCount": 59}),
            gm([{"text": "b"}], "MAX_TOKENS", usage={"promptTokenCount": 29}),
        ),
    )
    assert tokens.usage == Usage(input_tokens=29, output_tokens=59, reasoning_tokens=59)
    assert tokens.finish_reason is F.LENGTH


def test_gemini_stop_with_function_calls_is_tool_calls() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}]),
            gm([{"functionCall": {"name": "read_theme"}}]),
            gm(
                [{"text": ""}],
                "STOP",
                finishMessage="Model generated function call(s).",
                usage={"promptTokenCount": 3, "candidatesTokenCount": 4},
            ),
        ),
    )
    assert [(t.index, t.name) for t in tokens.tool_calls] == [(0, "get_weather"), (1, "read_theme")]
    assert json.loads(tokens.tool_calls[0].arguments) == {"city": "Paris"}
    assert tokens.tool_calls[1].arguments == "{}"
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.TOOL_CALLS, "STOP")
    assert tokens.error is None


def test_gemini_malformed_function_call_is_an_error_with_its_finish_message() -> None:
    message = 'Malformed function call: print(default_api.archive(cities=["New'
    tokens = fold_stream(
        Source.GEMINI,
        events(
            {
                "candidates": [
                    {
                        "finishReason": "MALFORMED_FUNCTION_CALL",
                        "index": 0,
                        "finishMessage": message,
                    }
                ],
                "usageMetadata": {"promptTokenCount": 12, "totalTokenCount": 12},
                "modelVersion": "gemini-2.5-flash",
                "responseId": "r",
            }
        ),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (
        F.ERROR,
        "MALFORMED_FUNCTION_CALL",
    )
    assert tokens.error == message
    assert tokens.usage == Usage(input_tokens=12)


@pytest.mark.parametrize(
    "raw",
    [
        "SAFETY",
        "RECITATION",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
        "IMAGE_PROHIBITED_CONTENT",
        "IMAGE_RECITATION",
        "LANGUAGE",
    ],
)
def test_gemini_safety_family_is_content_filter(raw: str) -> None:
    tokens = fold_stream(Source.GEMINI, events(gm([{"text": "a"}]), gm(None, raw)))
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.CONTENT_FILTER, raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("MAX_TOKENS", F.LENGTH),
        ("OTHER", F.ERROR),
        ("UNEXPECTED_TOOL_CALL", F.ERROR),
        ("TOO_MANY_TOOL_CALLS", F.ERROR),
        ("FINISH_REASON_UNSPECIFIED", F.ERROR),
    ],
)
def test_gemini_other_finish_reasons(raw: str, expected: FinishReason) -> None:
    tokens = fold_stream(Source.GEMINI, events(gm([{"text": "a"}], raw)))
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (expected, raw)


def test_gemini_prompt_block_reason_is_content_filter() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            {
                "promptFeedback": {"blockReason": "PROHIBITED_CONTENT", "safetyRatings": []},
                "usageMetadata": {"promptTokenCount": 7, "totalTokenCount": 7},
                "modelVersion": "gemini-2.5-flash",
                "responseId": "r-blocked",
            }
        ),
    )
    assert tokens.finish_reason is F.CONTENT_FILTER
    assert tokens.finish_reason_raw == "PROHIBITED_CONTENT"
    assert tokens.usage == Usage(input_tokens=7)
    assert tokens.text == ""


def _partial(path: str, **value: Any) -> Obj:
    return {"functionCall": {"partialArgs": [{"jsonPath": path, **value}], "willContinue": True}}


def test_gemini_vertex_streamed_partial_args_nested_path_and_value_kinds() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"functionCall": {"name": "plan", "willContinue": True}}]),
            gm([_partial("$.a[0].b", stringValue="Bos", willContinue=True)]),
            gm([_partial("$.a[0].b", stringValue="ton", willContinue=True)]),
            gm([_partial("$.a[0].c", numberValue=3.5)]),
            gm([_partial("$.flag", boolValue=True)]),
            gm([_partial("$.location", stringValue="")]),
            gm([{"functionCall": {}}]),
            gm(
                [{"text": ""}],
                "STOP",
                usage={"promptTokenCount": 9, "candidatesTokenCount": 11},
            ),
        ),
    )
    assert len(tokens.tool_calls) == 1
    call = tokens.tool_calls[0]
    assert (call.index, call.name) == (0, "plan")
    assert json.loads(call.arguments) == {
        "a": [{"b": "Boston", "c": 3.5}],
        "flag": True,
        "location": "",
    }
    assert tokens.finish_reason is F.TOOL_CALLS


def test_gemini_vertex_streamed_call_closed_by_the_finish_then_a_second_call() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"functionCall": {"name": "first", "willContinue": True}}]),
            gm([_partial("$.x", numberValue=1)]),
            gm([{"functionCall": {}}]),
            gm([{"functionCall": {"name": "second", "args": {"y": False}}}]),
            gm([{"text": ""}], "STOP"),
        ),
    )
    assert [(t.index, t.name) for t in tokens.tool_calls] == [(0, "first"), (1, "second")]
    assert json.loads(tokens.tool_calls[0].arguments) == {"x": 1}
    assert json.loads(tokens.tool_calls[1].arguments) == {"y": False}


def test_gemini_error_data_event_is_an_error() -> None:
    tokens = fold_stream(
        Source.GEMINI,
        events(
            gm([{"text": "part"}]),
            {
                "error": {
                    "code": 503,
                    "message": "The model is overloaded.",
                    "status": "UNAVAILABLE",
                }
            },
        ),
    )
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, "The model is overloaded.")
    assert tokens.text == "part"


def test_gemini_raw_json_error_tail_after_the_events_is_an_error() -> None:
    body = (
        b'data: {"candidates": [{"content": {"parts": [{"text": "Hello"}],"role": "model"}}],'
        b'"usageMetadata": {"promptTokenCount": 5,"candidatesTokenCount": 1},'
        b'"modelVersion": "gemini-2.5-flash","responseId": "rid"}\r\n\r\n'
        b"{\n"
        b'  "error": {\n'
        b'    "code": 503,\n'
        b'    "message": "The model is overloaded. Please try again later.",\n'
        b'    "status": "UNAVAILABLE"\n'
        b"  }\n"
        b"}\n"
    )
    tokens = fold_sse(Source.GEMINI, body)
    assert tokens.finish_reason is F.ERROR
    assert tokens.error == "The model is overloaded. Please try again later."
    assert tokens.text == "Hello"
    assert tokens.usage == Usage(input_tokens=5, output_tokens=1)


def test_gemini_crlf_framing() -> None:
    body = (
        b'data: {"candidates": [{"content": {"parts": [{"text": "a"}]}}],"responseId": "r"}\r\n'
        b"\r\n"
        b'data: {"candidates": [{"content": {"parts": [{"text": "b"}]},'
        b'"finishReason": "STOP"}],"responseId": "r"}\r\n'
        b"\r\n"
    )
    tokens = fold_sse(Source.GEMINI, body)
    assert (tokens.text, tokens.finish_reason, tokens.request_id) == ("ab", F.STOP, "r")


def test_gemini_without_finish_is_an_error() -> None:
    tokens = fold_stream(Source.GEMINI, events(gm([{"text": "cut"}])))
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, NO_FINISH)


@pytest.mark.parametrize(
    "foreign",
    [oa([choice(content="x")]), message_start(input_tokens=1)],
    ids=["openai", "anthropic"],
)
def test_gemini_rejects_events_of_another_source(foreign: Obj) -> None:
    with pytest.raises(InputError):  # every event invalid: not a stream of the source
        fold_stream(Source.GEMINI, events(foreign))


# =====================================================================================
# dynamo
# =====================================================================================


def test_dynamo_output_tokens_count_token_ids_without_completion_usage() -> None:
    tokens = fold_lines(
        Source.DYNAMO,
        [
            {"token_ids": [101, 102], "text": "Hel"},
            {"token_ids": [103], "text": "lo"},
            {"token_ids": [], "finish_reason": "eos"},
        ],
        request_id="dyn-1",
    )
    assert (tokens.request_id, tokens.text) == ("dyn-1", "Hello")
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "eos")
    assert tokens.usage == Usage(output_tokens=3)


def test_dynamo_completion_usage_wins_when_present() -> None:
    tokens = fold_lines(
        Source.DYNAMO,
        [
            {"token_ids": [1, 2], "text": "a"},
            {"token_ids": [3], "text": "b"},
            {
                "token_ids": [],
                "finish_reason": "stop",
                "completion_usage": {
                    "prompt_tokens": 12,
                    "completion_tokens": 5,
                    "total_tokens": 17,
                    "prompt_tokens_details": {"cached_tokens": 4},
                    "completion_tokens_details": {"reasoning_tokens": 2},
                },
            },
        ],
        request_id="dyn-1",
    )
    assert tokens.usage == Usage(
        input_tokens=12, output_tokens=5, reasoning_tokens=2, cached_tokens=4
    )


def test_dynamo_text_from_tokens_when_no_text() -> None:
    tokens = fold_lines(
        Source.DYNAMO,
        [
            {"token_ids": [1, 2], "tokens": ["He", "y"]},
            {"token_ids": [], "finish_reason": "length"},
        ],
        request_id="d",
    )
    assert (tokens.text, tokens.finish_reason) == ("Hey", F.LENGTH)


@pytest.mark.parametrize(
    ("raw", "finish", "error"),
    [
        ("eos", F.STOP, None),
        ("stop", F.STOP, None),
        ("length", F.LENGTH, None),
        ("abort", F.CANCELLED, None),
        ("cancelled", F.CANCELLED, None),
        ("content_filter", F.CONTENT_FILTER, None),
        ({"error": "kv load failed"}, F.ERROR, "kv load failed"),
        ("error: kv load failed", F.ERROR, "kv load failed"),
    ],
)
def test_dynamo_finish_forms(raw: Any, finish: FinishReason, error: str | None) -> None:
    tokens = fold_lines(
        Source.DYNAMO,
        [{"token_ids": [1], "text": "a"}, {"token_ids": [], "finish_reason": raw}],
        request_id="d",
    )
    assert tokens.finish_reason is finish
    assert tokens.error == error


def test_dynamo_plain_error_string_is_an_error_with_a_message() -> None:
    tokens = fold_lines(
        Source.DYNAMO,
        [{"token_ids": [1], "text": "a"}, {"token_ids": [], "finish_reason": "error"}],
        request_id="d",
    )
    assert tokens.finish_reason is F.ERROR
    assert tokens.error


def test_dynamo_without_finish_is_an_error() -> None:
    tokens = fold_lines(Source.DYNAMO, [{"token_ids": [1], "text": "a"}], request_id="d")
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, NO_FINISH)


@pytest.mark.parametrize(
    "foreign",
    [
        {"request_id": "r", "outputs": [{"index": 0, "text": "a", "token_ids": [1]}]},
        {"request_id": "r", "text_delta": "a"},
    ],
    ids=["vllm", "atomr"],
)
def test_dynamo_rejects_lines_of_another_source(foreign: Obj) -> None:
    with pytest.raises(InputError):  # every line invalid: not a stream of the source
        fold_lines(Source.DYNAMO, [foreign])


# =====================================================================================
# vllm
# =====================================================================================

PROMPT = [1, 2, 3, 4]


def request_output(
    text_value: str, token_ids: list[int], finish: str | None = None, **extra: Any
) -> Obj:
    return {
        "request_id": "cmpl-1",
        "prompt_token_ids": PROMPT,
        "num_cached_tokens": 2,
        "outputs": [
            {"index": 0, "text": text_value, "token_ids": token_ids, "finish_reason": finish}
        ],
        "finished": finish is not None,
        **extra,
    }


DELTA_LINES = [
    request_output("Hel", [10, 11]),
    request_output("", [12]),  # text held back (incomplete UTF-8 / stop-string prefix)
    request_output("lo!", [13], "stop"),
]
CUMULATIVE_LINES = [
    request_output("Hel", [10, 11]),
    request_output("Hel", [10, 11, 12]),
    request_output("Hello!", [10, 11, 12, 13], "stop"),
]


def test_vllm_delta_output_kind() -> None:
    tokens = fold_lines(Source.VLLM, DELTA_LINES)
    assert (tokens.request_id, tokens.text) == ("cmpl-1", "Hello!")
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.STOP, "stop")
    assert tokens.usage == Usage(input_tokens=4, output_tokens=4, cached_tokens=2)


def test_vllm_cumulative_output_kind_folds_like_delta() -> None:
    cumulative = fold_lines(
        Source.VLLM, CUMULATIVE_LINES, options=AdapterOptions(vllm_output_kind="CUMULATIVE")
    )
    delta = fold_lines(Source.VLLM, DELTA_LINES)
    assert cumulative.text == delta.text == "Hello!"
    assert (
        cumulative.usage == delta.usage == Usage(input_tokens=4, output_tokens=4, cached_tokens=2)
    )
    assert cumulative.finish_reason is delta.finish_reason is F.STOP


def test_vllm_cumulative_read_as_delta_would_differ() -> None:
    # Guards the test above: the kind really matters for these lines.
    assert fold_lines(Source.VLLM, CUMULATIVE_LINES).text != "Hello!"


def test_vllm_later_line_without_prompt_counts_keeps_them() -> None:
    lines = [
        request_output("a", [10]),
        {**request_output("b", [11], "stop"), "prompt_token_ids": None, "num_cached_tokens": None},
    ]
    tokens = fold_lines(Source.VLLM, lines)
    assert tokens.usage == Usage(input_tokens=4, output_tokens=2, cached_tokens=2)


@pytest.mark.parametrize("kind", ["CUMULATIVE", 0], ids=["name", "RequestOutputKind-0"])
def test_vllm_line_naming_cumulative_kind_overrides_the_delta_default(kind: object) -> None:
    lines = [{**line, "output_kind": kind} for line in CUMULATIVE_LINES]
    tokens = fold_lines(Source.VLLM, lines)
    assert tokens.text == "Hello!"
    assert tokens.usage == Usage(input_tokens=4, output_tokens=4, cached_tokens=2)


@pytest.mark.parametrize("kind", ["DELTA", 1], ids=["name", "RequestOutputKind-1"])
def test_vllm_line_naming_delta_kind_overrides_the_cumulative_default(kind: object) -> None:
    lines = [{**line, "output_kind": kind} for line in DELTA_LINES]
    tokens = fold_lines(Source.VLLM, lines, options=AdapterOptions(vllm_output_kind="CUMULATIVE"))
    assert tokens.text == "Hello!"
    assert tokens.usage == Usage(input_tokens=4, output_tokens=4, cached_tokens=2)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("stop", F.STOP), ("length", F.LENGTH), ("abort", F.CANCELLED), ("error", F.ERROR)],
)
def test_vllm_finish_reasons(raw: str, expected: FinishReason) -> None:
    tokens = fold_lines(Source.VLLM, [request_output("a", [1], raw)])
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (expected, raw)


def test_vllm_several_outputs_are_several_choices() -> None:
    lines = [
        {
            "request_id": "cmpl-2",
            "prompt_token_ids": [1, 2],
            "outputs": [
                {"index": 0, "text": "A", "token_ids": [5], "finish_reason": None},
                {"index": 1, "text": "B", "token_ids": [6, 7], "finish_reason": None},
            ],
            "finished": False,
        },
        {
            "request_id": "cmpl-2",
            "prompt_token_ids": [1, 2],
            "outputs": [
                {"index": 0, "text": "a", "token_ids": [8], "finish_reason": "stop"},
                {"index": 1, "text": "b", "token_ids": [9], "finish_reason": "length"},
            ],
            "finished": True,
        },
    ]
    tokens = fold_lines(Source.VLLM, lines)
    assert tokens.text == "Aa"
    assert [(c.text, c.finish_reason) for c in tokens.choices] == [
        ("Aa", F.STOP),
        ("Bb", F.LENGTH),
    ]
    assert tokens.usage == Usage(input_tokens=2, output_tokens=5)


def test_vllm_without_finish_is_an_error() -> None:
    tokens = fold_lines(Source.VLLM, [request_output("a", [1])])
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, NO_FINISH)


@pytest.mark.parametrize(
    "foreign",
    [{"token_ids": [1], "text": "a"}, {"request_id": "r", "text_delta": "a"}],
    ids=["dynamo", "atomr"],
)
def test_vllm_rejects_lines_of_another_source(foreign: Obj) -> None:
    with pytest.raises(InputError):  # every line invalid: not a stream of the source
        fold_lines(Source.VLLM, [foreign])


# =====================================================================================
# atomr
# =====================================================================================


def test_atomr_usage_increments_are_added_field_by_field() -> None:
    tokens = fold_lines(
        Source.ATOMR,
        [
            {
                "request_id": "at-1",
                "text_delta": "Hi",
                "usage": {"input_tokens": 5, "output_tokens": 1},
            },
            {
                "request_id": "at-1",
                "text_delta": " there",
                "usage": {"output_tokens": 2, "reasoning_tokens": 1},
            },
            {
                "request_id": "at-1",
                "text_delta": "",
                "finish_reason": "stop",
                "usage": {"output_tokens": 1, "cached_tokens": 3},
            },
        ],
    )
    assert (tokens.request_id, tokens.text) == ("at-1", "Hi there")
    assert tokens.usage == Usage(
        input_tokens=5, output_tokens=4, reasoning_tokens=1, cached_tokens=3
    )
    assert tokens.finish_reason is F.STOP


def test_atomr_tool_call_delta_as_object_and_as_json_string() -> None:
    tokens = fold_lines(
        Source.ATOMR,
        [
            {
                "request_id": "at-2",
                "text_delta": "",
                "tool_call_delta": {
                    "index": 0,
                    "id": "call_1",
                    "name": "get_weather",
                    "arguments_delta": '{"city":',
                },
            },
            {
                "request_id": "at-2",
                "text_delta": "",
                "tool_call_delta": json.dumps({"index": 0, "arguments_delta": '"Oslo"}'}),
            },
            {"request_id": "at-2", "text_delta": "", "finish_reason": "stop"},
        ],
    )
    assert tokens.tool_calls == (
        ToolCall(index=0, id="call_1", name="get_weather", arguments='{"city":"Oslo"}'),
    )
    assert (tokens.finish_reason, tokens.finish_reason_raw) == (F.TOOL_CALLS, "stop")


@pytest.mark.parametrize(
    "foreign",
    [{"token_ids": [1], "text": "a"}, {"request_id": "r", "outputs": []}],
    ids=["dynamo", "vllm"],
)
def test_atomr_rejects_lines_of_another_source(foreign: Obj) -> None:
    with pytest.raises(InputError):  # every line invalid: not a stream of the source
        fold_lines(Source.ATOMR, [foreign])


# =====================================================================================
# every SSE source: an event must carry JSON; keep-alives stay silent
# =====================================================================================

SSE_SOURCES = [source for source in Source if source.is_sse]
TRUNCATED = '{"id":"x","choices":['


@pytest.mark.parametrize("source", SSE_SOURCES)
@pytest.mark.parametrize("kind", ["message", "message_start", "response.completed"])
def test_truncated_json_event_is_invalid_not_a_keep_alive(source: Source, kind: str) -> None:
    with pytest.raises(InvalidEvent, match="not valid JSON") as caught:
        Normalizer(source, "r").feed(SseEvent(TRUNCATED, kind))
    assert isinstance(caught.value, InputError)  # what the processors dead-letter
    assert repr(TRUNCATED) in str(caught.value)


@pytest.mark.parametrize("source", SSE_SOURCES)
@pytest.mark.parametrize(
    "data",
    [
        "hello",
        "<html><body>502 Bad Gateway</body></html>",
        '{"a": 1} trailing',
        "{'single': 'quotes'}",
        "[1, 2]",
        "42",
        '"a string"',
        "null",
        "true",
        "[DONE",
    ],
)
def test_data_that_is_not_one_json_object_is_invalid(source: Source, data: str) -> None:
    with pytest.raises(InvalidEvent, match=r"not valid JSON|not an object"):
        Normalizer(source, "r").feed(SseEvent(data))


@pytest.mark.parametrize("source", SSE_SOURCES)
def test_deeply_nested_json_is_invalid_not_a_crash(source: Source) -> None:
    with pytest.raises(InvalidEvent):
        Normalizer(source, "r").feed(SseEvent('{"a":' * 100_000))


@pytest.mark.parametrize("source", SSE_SOURCES)
@pytest.mark.parametrize("data", ["", " ", "\n", " \n\t", ": keep-alive", "  :ping"])
def test_keep_alive_data_is_silent(source: Source, data: str) -> None:
    assert Normalizer(source, "r").feed(SseEvent(data)) == []


def test_done_is_openai_only() -> None:
    assert Normalizer(Source.OPENAI, "r").feed(SseEvent("[DONE]")) == []
    for source in SSE_SOURCES:
        if source is not Source.OPENAI:
            with pytest.raises(InvalidEvent, match="not valid JSON"):
                Normalizer(source, "r").feed(SseEvent("[DONE]"))


def test_truncated_event_is_skipped_and_reported_by_the_fold() -> None:
    skipped: list[tuple[int, str]] = []
    body = (
        b'data: {"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        b'data: {"id":"x","choices":[\n\n'
        b": keep-alive\n\n"
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"b"},'
        b'"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    tokens = fold_stream(
        Source.OPENAI,
        read_events(Source.OPENAI, io.BytesIO(body)),
        on_invalid=lambda number, exc: skipped.append((number, str(exc))),
    )
    assert (tokens.text, tokens.finish_reason) == ("ab", F.STOP)
    assert [number for number, _ in skipped] == [2]
    assert "not valid JSON" in skipped[0][1]


def test_truncated_event_is_dead_lettered_by_the_processor() -> None:
    body = (
        b'data: {"candidates":[{"content":{"parts":[{"text":"a"}]}}],"responseId":"g1"}\r\n\r\n'
        b'data: {"candidates":[{"content":{"parts":[{"te\r\n\r\n'
        b'data: {"candidates":[{"content":{"parts":[{"text":"b"}]},"finishReason":"STOP"}],'
        b'"responseId":"g1"}\r\n\r\n'
    )
    topics = Topics.in_namespace()
    request_id, records = raw_records(Source.GEMINI, body, tenant="t")
    processor = RequestProcessor(PriceTable.default(), timeout=30.0, clock=lambda: 0.0)
    dead = []
    done = []
    for offset, value in enumerate(records):
        position = Position(topics.raw_sse.name, 0, offset, 1_777_000_000.0)
        out = processor.handle_sse(encode_key(request_id), value, position)
        dead.extend(out.dead_letters)
        done.extend(out.completed)
    assert [letter.offset for letter in dead] == [1]
    assert "not valid JSON" in dead[0].reason
    assert [c.tokens.text for c in done] == ["ab"]
    assert done[0].tokens.finish_reason is F.STOP


# =====================================================================================
# the end of the stream and the side channel (text that is not SSE)
# =====================================================================================

RAW_ERROR = (
    b"{\n"
    b'  "error": {\n'
    b'    "code": 503,\n'
    b'    "message": "The model is overloaded.",\n'
    b'    "status": "UNAVAILABLE"\n'
    b"  }\n"
    b"}\n"
)
GEMINI_STOP = (
    b'data: {"candidates": [{"content": {"parts": [{"text": "Hi"}]},"finishReason": "STOP"}],'
    b'"responseId": "g1"}\r\n\r\n'
)


def test_gemini_raw_error_body_becomes_one_event_from_the_side_channel() -> None:
    got, non_sse = sse_events(Source.GEMINI, GEMINI_STOP + RAW_ERROR)
    assert [event.event for event in got] == ["message", RAW_ERROR_BODY]
    assert json.loads(got[1].data)["error"]["code"] == 503
    assert non_sse == []  # taken: not reported as left over
    tokens = fold_sse(Source.GEMINI, GEMINI_STOP + RAW_ERROR)
    assert (tokens.text, tokens.finish_reason, tokens.error) == (
        "Hi",
        F.ERROR,
        "The model is overloaded.",
    )


def test_gemini_raw_error_body_on_one_line_and_without_final_newline() -> None:
    body = GEMINI_STOP + b'{"error": {"code": 429, "message": "quota", "status": "X"}}'
    got, _ = sse_events(Source.GEMINI, body)
    assert got[-1] == SseEvent(
        '{"error": {"code": 429, "message": "quota", "status": "X"}}', RAW_ERROR_BODY
    )
    assert fold_sse(Source.GEMINI, body).error == "quota"


@pytest.mark.parametrize(
    "tail",
    [
        b'{\n  "candidates": [{"content": {"parts": [{"text": "sneaky"}]}}]\n}\n',
        b'{\n  "error": {"code": 503,\n',  # cut off: not one JSON object
        b'[\n  {"error": {"code": 1}}\n]\n',
        b"<html>502 Bad Gateway</html>\n",
    ],
    ids=["not-an-error", "truncated", "array", "html"],
)
def test_gemini_other_trailing_text_stays_on_the_side_channel(tail: bytes) -> None:
    got, non_sse = sse_events(Source.GEMINI, GEMINI_STOP + tail)
    assert [event.event for event in got] == ["message"]
    assert [line.text for line in non_sse] == tail.decode().splitlines()
    tokens = fold_sse(Source.GEMINI, GEMINI_STOP + tail)
    assert (tokens.text, tokens.finish_reason, tokens.error) == ("Hi", F.STOP, None)


def test_gemini_raw_error_body_before_more_events_is_not_trailing() -> None:
    body = RAW_ERROR + b"\r\n" + GEMINI_STOP
    got, non_sse = sse_events(Source.GEMINI, body)
    assert [event.event for event in got] == ["message"]
    assert len(non_sse) == len(RAW_ERROR.splitlines())
    assert fold_sse(Source.GEMINI, body).finish_reason is F.STOP


@pytest.mark.parametrize(
    ("source", "body"),
    [
        (
            Source.OPENAI,
            b'data: {"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":"Hi"},'
            b'"finish_reason":"stop"}]}\n\n',
        ),
        (
            Source.ANTHROPIC,
            b"event: message_start\n"
            b'data: {"type":"message_start","message":{"id":"msg_1","model":"c",'
            b'"usage":{"input_tokens":1,"output_tokens":1}}}\n\n'
            b"event: content_block_delta\n"
            b'data: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
            b"event: message_delta\n"
            b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
            b'"usage":{"output_tokens":2}}\n\n',
        ),
        (
            Source.OPENAI_RESPONSES,
            b"event: response.output_text.delta\n"
            b'data: {"type":"response.output_text.delta","output_index":0,"delta":"Hi"}\n\n'
            b"event: response.completed\n"
            b'data: {"type":"response.completed","response":{"id":"resp_1","model":"m",'
            b'"status":"completed"}}\n\n',
        ),
    ],
    ids=["openai", "anthropic", "openai-responses"],
)
def test_a_raw_json_error_body_is_taken_for_gemini_only(source: Source, body: bytes) -> None:
    got, non_sse = sse_events(source, body + RAW_ERROR)
    assert all(event.event != RAW_ERROR_BODY for event in got)
    assert [line.text for line in non_sse] == RAW_ERROR.decode().splitlines()
    assert all(line.reason.startswith("not an SSE field") for line in non_sse)
    tokens = fold_sse(source, body + RAW_ERROR)
    assert (tokens.text, tokens.finish_reason, tokens.error) == ("Hi", F.STOP, None)


def test_non_sse_lines_are_reported_in_order_with_their_numbers() -> None:
    body = b"oops\n" + GEMINI_STOP + b"<br>\n"
    _, non_sse = sse_events(Source.GEMINI, body)
    assert [(line.number, line.text) for line in non_sse] == [(1, "oops"), (4, "<br>")]


def test_gemini_last_event_without_its_blank_line_is_discarded() -> None:
    body = (
        b'data: {"candidates": [{"content": {"parts": [{"text": "a"}]}}],"responseId": "g"}\r\n'
        b"\r\n" + GEMINI_STOP.rstrip(b"\r\n")
    )
    tokens = fold_sse(Source.GEMINI, body)
    assert (tokens.text, tokens.finish_reason, tokens.error) == ("a", F.ERROR, NO_FINISH)


def test_anthropic_message_delta_without_its_blank_line_is_discarded() -> None:
    body = (
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"id":"msg_1","model":"c",'
        b'"usage":{"input_tokens":1,"output_tokens":1}}}\n\n'
        b"event: message_delta\n"
        b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"output_tokens":2}}\n'
    )
    tokens = fold_sse(Source.ANTHROPIC, body)
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, NO_FINISH)
    assert tokens.usage == Usage(input_tokens=1, output_tokens=1)


# =====================================================================================
# fold_stream envelope
# =====================================================================================


def test_request_id_argument_overrides_the_provider_id() -> None:
    tokens = fold_stream(
        Source.OPENAI, events(oa([choice(content="x", finish="stop")])), request_id="mine"
    )
    assert tokens.request_id == "mine"


def test_fallback_request_id_names_a_request_without_any_id() -> None:
    tokens = fold_lines(
        Source.DYNAMO,
        [{"token_ids": [1], "text": "a", "finish_reason": "eos"}],
        fallback_request_id="fallback-1",
    )
    assert tokens.request_id == "fallback-1"


@pytest.mark.parametrize("source", list(Source))
def test_no_events_is_not_a_stream(source: Source) -> None:
    with pytest.raises(NotAStream):
        fold_stream(source, [])


# -- legacy completions and embeddings (bodies written for these tests) ---------------


def test_legacy_completion_chunks_carry_their_text_in_the_choice() -> None:
    chunks = [
        {
            "id": "cmpl-a",
            "object": "text_completion",
            "model": "gpt-3.5-turbo-instruct",
            "choices": [{"index": 0, "text": "Hello", "finish_reason": None}],
        },
        {
            "id": "cmpl-a",
            "object": "text_completion",
            "model": "gpt-3.5-turbo-instruct",
            "choices": [
                {"index": 1, "text": "Bye", "finish_reason": "stop"},
                {"index": 0, "text": " there", "finish_reason": "length"},
            ],
        },
        {
            "id": "cmpl-a",
            "object": "text_completion",
            "model": "gpt-3.5-turbo-instruct",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        },
    ]
    tokens = fold_stream(Source.OPENAI, [SseEvent(json.dumps(c)) for c in chunks])
    assert tokens.request_id == "cmpl-a"
    assert tokens.text == "Hello there"
    assert tokens.finish_reason.value == "length"
    assert [(c.index, c.text) for c in tokens.choices] == [(0, "Hello there"), (1, "Bye")]
    assert (tokens.usage.input_tokens, tokens.usage.output_tokens) == (3, 4)


def test_an_openai_embeddings_body_is_input_tokens_and_a_stop() -> None:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2]}],
        "model": "text-embedding-3-large",
        "usage": {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13},
    }
    tokens = fold_stream(Source.OPENAI, [SseEvent(json.dumps(body))], "emb-1")
    assert tokens.model == "text-embedding-3-large"
    assert tokens.text == ""
    assert tokens.finish_reason.value == "stop"
    assert tokens.finish_reason_raw is None
    assert tokens.usage.input_tokens == 8
    assert tokens.usage.output_tokens == 0  # never output, whatever the report says
    del body["usage"]
    tokens = fold_stream(Source.OPENAI, [SseEvent(json.dumps(body))], "emb-2")
    assert tokens.usage.input_tokens == 0
    assert tokens.finish_reason.value == "stop"


def test_a_list_that_is_not_of_embeddings_is_no_embeddings_body() -> None:
    listing = {"object": "list", "data": [{"id": "gpt-4o", "object": "model"}]}
    with pytest.raises(InvalidEvent):
        OpenAIChatAdapter().feed(SseEvent(json.dumps(listing)))


def test_gemini_embeddings_bodies_are_a_stop_with_what_usage_they_report() -> None:
    single = {"embedding": {"values": [0.5, 0.25]}}
    batch = {"embeddings": [{"values": [0.5]}, {"values": [0.25]}]}
    vertex = single | {"usageMetadata": {"promptTokenCount": 21, "totalTokenCount": 21}}
    for body, billed in ((single, 0), (batch, 0), (vertex, 21)):
        tokens = fold_stream(Source.GEMINI, [SseEvent(json.dumps(body))], "g-1")
        assert tokens.text == ""
        assert tokens.finish_reason.value == "stop"
        assert tokens.usage.input_tokens == billed
        assert tokens.usage.output_tokens == 0
        assert tokens.model is None
