"""The body a provider answers a non-streaming call with, made from one of our stream transcripts.

A non-streaming call of each API returns the object its stream builds up:
Chat Completions a `chat.completion`, the Responses API the Response its
terminal event carries, the Messages API a Message, Gemini one
`GenerateContentResponse`.  These helpers assemble that object from a
transcript of `samples/` the way the providers document it (content
concatenated, the last usage and finish), so the tests that need a
non-streaming body replay our own transcripts instead of made-up JSON.  They
read the raw events only (`read_events`), never the fold: a body the fold
gets wrong must not be built wrong the same way.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from streamtally.core.models import Source
from streamtally.core.normalize import read_events

__all__ = ["anthropic_body", "body_of", "chat_completion_body", "gemini_body", "responses_body"]


def _objects(source: Source, path: Path) -> list[dict[str, Any]]:
    with path.open("rb") as stream:
        events = list(read_events(source, stream))
    out: list[dict[str, Any]] = []
    for event in events:
        data = str(event.data).strip()
        if data.startswith("{"):
            out.append(json.loads(data))
    return out


def chat_completion_body(path: Path) -> dict[str, Any]:
    """A `chat.completion`: each choice's content and tool calls joined, the last usage."""
    chunks = _objects(Source.OPENAI, path)
    first = chunks[0]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            message = choices.setdefault(
                index,
                {"index": index, "message": {"role": "assistant", "content": None}, "tools": {}},
            )
            delta = choice.get("delta") or {}
            for key in ("reasoning_content", "reasoning"):
                if delta.get(key):
                    message["message"][key] = message["message"].get(key, "") + delta[key]
            if delta.get("content"):
                message["message"]["content"] = (message["message"]["content"] or "") + delta[
                    "content"
                ]
            for call in delta.get("tool_calls") or []:
                slot = message["tools"].setdefault(
                    call["index"], {"id": None, "type": "function", "function": {}}
                )
                slot["id"] = slot["id"] or call.get("id")
                function = call.get("function") or {}
                if function.get("name"):
                    slot["function"]["name"] = function["name"]
                slot["function"]["arguments"] = slot["function"].get("arguments", "") + (
                    function.get("arguments") or ""
                )
            if choice.get("finish_reason"):
                message["finish_reason"] = choice["finish_reason"]
    out_choices = []
    for index in sorted(choices):
        choice = choices[index]
        tools = choice.pop("tools")
        if tools:
            choice["message"]["tool_calls"] = [tools[i] for i in sorted(tools)]
        choice.setdefault("finish_reason", None)
        out_choices.append(choice)
    body = {
        "id": first["id"],
        "object": "chat.completion",
        "created": first.get("created", 0),
        "model": first["model"],
        "choices": out_choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def responses_body(path: Path) -> dict[str, Any]:
    """The Response the stream's terminal `response.*` event carries (a non-streaming answer)."""
    events = _objects(Source.OPENAI_RESPONSES, path)
    terminal = [e for e in events if e.get("type") in {"response.completed", "response.incomplete"}]
    return dict(terminal[-1]["response"])


def anthropic_body(path: Path) -> dict[str, Any]:
    """The Message: `message_start`'s, its content blocks built up, `message_delta` applied."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for event in _objects(Source.ANTHROPIC, path):
        kind = event["type"]
        if kind == "message_start":
            message = copy.deepcopy(event["message"])
        elif kind == "content_block_start":
            message["content"].append(copy.deepcopy(event["content_block"]))
        elif kind == "content_block_delta":
            block = message["content"][event["index"]]
            delta = event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and event["index"] in partial:
            message["content"][event["index"]]["input"] = json.loads(
                partial[event["index"]] or "{}"
            )
        elif kind == "message_delta":
            message.update(event.get("delta") or {})
            message["usage"] = {**message["usage"], **(event.get("usage") or {})}
    return message


def gemini_body(path: Path) -> dict[str, Any]:
    """One `GenerateContentResponse`: text and thoughts joined, calls kept, the last finish."""
    chunks = _objects(Source.GEMINI, path)
    last = chunks[-1]
    thought, text = "", ""
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        for candidate in chunk.get("candidates") or []:
            for part in (candidate.get("content") or {}).get("parts") or []:
                if "functionCall" in part:
                    calls.append(part)
                elif part.get("thought"):
                    thought += part.get("text", "")
                else:
                    text += part.get("text", "")
    parts = [{"text": thought, "thought": True}] if thought else []
    parts += ([{"text": text}] if text else []) + calls
    candidate = {
        "content": {"role": "model", "parts": parts},
        "finishReason": last["candidates"][0]["finishReason"],
        "index": 0,
    }
    body = {"candidates": [candidate], "usageMetadata": last["usageMetadata"]}
    for key in ("modelVersion", "responseId"):
        if key in last:
            body[key] = last[key]
    return body


def body_of(source: Source, path: Path) -> dict[str, Any]:
    """The non-streaming body of `path`'s transcript of `source`."""
    builders = {
        Source.OPENAI: chat_completion_body,
        Source.OPENAI_RESPONSES: responses_body,
        Source.ANTHROPIC: anthropic_body,
        Source.GEMINI: gemini_body,
    }
    return builders[source](path)
