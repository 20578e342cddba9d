"""`extract` (producers/proxy/oversize.py): the usage of a body too large to tap, from its edges.

Each body is a non-streaming body of one of our transcripts (`tests.bodies`),
its longest string made a few MB long (text that also quotes a usage object,
as a model explaining an API might): the synthetic body made from its first
and last 64 KiB must fold to the usage, id, model and finish of the whole body.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import FinishReason, Source, Tokens
from streamtally.core.normalize import fold_stream
from streamtally.core.sse import SseEvent
from streamtally.producers.proxy.oversize import EDGE_BYTES, extract
from tests.bodies import body_of

SAMPLES = Path(__file__).resolve().parents[3] / "samples"

CASES: list[tuple[Source, str]] = [
    (Source.OPENAI, "openai/text_usage.sse"),
    (Source.OPENAI, "openai/parallel_tool_calls_cached.sse"),
    (Source.OPENAI, "openai/reasoning_cache_hit.sse"),
    (Source.OPENAI, "openai/n2_choices.sse"),
    (Source.OPENAI_RESPONSES, "openai-responses/reasoning_parallel_calls.sse"),
    (Source.OPENAI_RESPONSES, "openai-responses/incomplete_max_output.sse"),
    (Source.OPENAI_RESPONSES, "openai-responses/text_cached.sse"),
    (Source.ANTHROPIC, "anthropic/thinking_then_text.sse"),
    (Source.ANTHROPIC, "anthropic/parallel_tool_use_cache.sse"),
    (Source.GEMINI, "gemini/thoughts_cached.sse"),
    (Source.GEMINI, "gemini/max_tokens.sse"),
]

#: Text that mentions a usage object (JSON-escaped inside the body's string: no match).
DECOY = 'the reply had "usage": {"prompt_tokens": 999999, "output_tokens": 999999} é€😀 '


def inflated(value: Any, size: int) -> Any:
    """`value` with its longest string replaced by `size` characters of decoy text."""
    strings: list[tuple[int, list[Any]]] = []

    def walk(node: Any, path: list[Any]) -> None:
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, [*path, key])
        elif isinstance(node, list):
            for index, child in enumerate(node):
                walk(child, [*path, index])
        elif isinstance(node, str) and path[-1] not in ("id", "model", "modelVersion"):
            strings.append((len(node), path))

    walk(value, [])
    _, path = max(strings, key=lambda item: item[0])
    node = value
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = (DECOY * (size // len(DECOY) + 1))[:size]
    return value


def edges(text: str) -> tuple[str, str]:
    data = text.encode()
    return (
        data[:EDGE_BYTES].decode(errors="replace"),
        data[-EDGE_BYTES:].decode(errors="replace"),
    )


def whole(source: Source, text: str) -> Tokens:
    return fold_stream(source, [SseEvent(text)])


@pytest.mark.parametrize(("source", "name"), CASES, ids=[name for _, name in CASES])
def test_the_edges_give_the_usage_of_the_whole_body(source: Source, name: str) -> None:
    text = json.dumps(inflated(body_of(source, SAMPLES / name), 3 << 20), ensure_ascii=False)
    assert len(text) > 3 << 20
    want = whole(source, text)
    found = extract(source, *edges(text))
    assert found.usage
    got = whole(source, json.dumps(found.body))
    assert got.usage == want.usage
    assert got.usage.input_tokens > 0
    assert (found.request_id, found.model) == (want.request_id, want.model)
    assert (got.request_id, got.model) == (want.request_id, want.model)
    # One choice: its finish too (n > 1: the last one's).  A Response says `tool_calls` by
    # its output items, which the synthetic body has none of: its status says `stop`.
    if len(want.choices) <= 1 and not (
        source is Source.OPENAI_RESPONSES and want.finish_reason is FinishReason.TOOL_CALLS
    ):
        assert got.finish_reason == want.finish_reason
    assert len(json.dumps(found.body)) < 2000


def test_a_gemini_json_array_gives_the_usage_of_its_last_element() -> None:
    body = inflated(body_of(Source.GEMINI, SAMPLES / "gemini/text_stop.sse"), 2 << 20)
    head = {k: v for k, v in body.items() if k != "usageMetadata"}
    text = json.dumps([head, body])
    found = extract(Source.GEMINI, *edges(text))
    assert found.body["usageMetadata"] == body["usageMetadata"]
    assert found.request_id == body.get("responseId")


def test_nothing_found_gives_what_is_known() -> None:
    head = '{"id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o", "choices": ['
    found = extract(Source.OPENAI, head, '"content": ' + json.dumps(DECOY * 100)[:-1])
    assert not found.usage
    assert found.body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-4o",
        "choices": [],
    }
    # a usage cut by the window's edge does not parse: not found either
    found = extract(Source.ANTHROPIC, '{"id": "msg_1"', 'nd_turn", "usage": {"input_tokens": 3')
    assert not found.usage
    assert found.body["id"] == "msg_1"


def test_a_usage_key_inside_a_string_is_not_taken() -> None:
    tail = json.dumps({"text": DECOY})[1:]  # the escaped mention only
    assert "usage" in tail
    assert not extract(Source.OPENAI, "{", tail).usage
