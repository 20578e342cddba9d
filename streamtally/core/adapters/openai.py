"""`openai`: Chat Completions SSE and every OpenAI-compatible server.

Covers OpenAI, Azure, DeepSeek, Qwen/DashScope (compatible mode and the native
`output.choices[].message` envelope), vLLM, SGLang, Groq, Mistral (content
arrays with thinking parts, tool calls without index), xAI, Together,
OpenRouter, Moonshot and Ollama.

Besides chat, two more OpenAI endpoints answer in this shape (the spec's
normalisation contract names neither; these rules are this adapter's):

- Legacy completions (`/v1/completions`, ``"object": "text_completion"``):
  a choice carries its text in ``choices[].text`` instead of a delta or a
  message; the finish reason and the usage (the last chunk with
  ``stream_options.include_usage``, or the body) are read as for chat.
- Embeddings (`/v1/embeddings`, ``"object": "list"`` of ``"embedding"``
  items): one event, the whole body.  It folds to no text and a `stop`
  finish (no raw finish reason: the provider gives none); its usage is
  input only, ``prompt_tokens`` (``total_tokens`` when that is all it
  says), and never any output tokens, whatever the report holds.  A body
  without usage is billed with `usage_source` missing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streamtally.core.adapters.base import Adapter, Draft, ToolKeys, as_str, event_object
from streamtally.core.adapters.finish import map_openai
from streamtally.core.adapters.usage import RawUsage
from streamtally.core.models import FinishReason, Source, ToolCallDelta, Usage, trusted_usage
from streamtally.core.sse import SseEvent
from streamtally.errors import InvalidEvent

__all__ = ["OpenAIChatAdapter", "is_embeddings"]

_SHAPE_KEYS = ("choices", "error", "usage", "output")


def _convert_usage(raw: Mapping[str, int]) -> Usage:
    prompt = raw.get("prompt", 0)
    completion = raw.get("completion", 0)
    reasoning = raw.get("reasoning", 0)
    output = completion
    # Reasoning reported outside completion (xAI): the report's own total says so.
    if reasoning and raw.get("total") == prompt + completion + reasoning:
        output = completion + reasoning
    return trusted_usage(
        input_tokens=prompt,
        output_tokens=output,
        reasoning_tokens=reasoning,
        cached_tokens=raw.get("cached", 0),
        cache_write_tokens=raw.get("cache_write", 0),
    )


def _usage_fields(usage: Mapping[str, Any]) -> dict[str, object]:
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = (
        usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    )
    cached = usage.get("prompt_cache_hit_tokens")  # DeepSeek
    if cached is None:
        cached = prompt_details.get("cached_tokens")
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if prompt is None and completion is None:  # DashScope native names
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    return {
        "prompt": prompt,
        "completion": completion,
        "total": usage.get("total_tokens"),
        "cached": cached,
        "cache_write": prompt_details.get("cache_write_tokens"),
        "reasoning": completion_details.get("reasoning_tokens"),
    }


def _embedding_usage(raw: Mapping[str, int]) -> Usage:
    """An embeddings report: input tokens only (`prompt`, else `total`), never output."""
    prompt = raw.get("prompt")
    return trusted_usage(
        input_tokens=raw.get("total", 0) if prompt is None else prompt,
        output_tokens=0,
        reasoning_tokens=0,
        cached_tokens=0,
        cache_write_tokens=0,
    )


def is_embeddings(obj: Mapping[str, Any]) -> bool:
    """Whether a JSON object is an embeddings response (a list whose items are embeddings)."""
    if obj.get("object") != "list":  # the common case (a chunk) leaves here
        return False
    data = obj.get("data")
    if not isinstance(data, list) or "choices" in obj:
        return False
    return all(
        isinstance(item, dict) and (item.get("object") == "embedding" or "embedding" in item)
        for item in data
    )


def _text_and_thinking(content: object) -> tuple[str, str]:
    """`delta.content`: a string, or (Mistral) an array of text/thinking parts."""
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return "", ""
    text: list[str] = []
    thinking: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "thinking":
            inner = part.get("thinking")
            if isinstance(inner, list):
                thinking.extend(as_str(p.get("text")) for p in inner if isinstance(p, dict))
            else:
                thinking.append(as_str(inner))
        else:
            text.append(as_str(part.get("text")))
    return "".join(text), "".join(thinking)


def _reasoning(delta: Mapping[str, Any]) -> str:
    for key in ("reasoning_content", "reasoning"):
        value = delta.get(key)
        if isinstance(value, str) and value:
            return value
    details = delta.get("reasoning_details")
    if isinstance(details, list):
        return "".join(
            as_str(d.get("text"))
            for d in details
            if isinstance(d, dict) and d.get("type") == "reasoning.text"
        )
    return ""


def _error_message(error: object) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message
        return str(error.get("type") or error.get("code") or error)
    return str(error)


class OpenAIChatAdapter(Adapter):
    source = Source.OPENAI

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._usage = RawUsage(_convert_usage)
        self._tools: dict[int, ToolKeys] = {}
        self._done = False

    def feed(self, event: SseEvent) -> list[Draft]:
        if self._done:
            return []  # nothing after `[DONE]` belongs to the stream
        data = event.data
        if data.startswith("[DONE]"):  # the sentinel (openai-python tests the same prefix)
            self._done = True
            return []
        obj = event_object(data, "chat completion chunk")
        if obj is None:
            return []  # a keep-alive
        if is_embeddings(obj):
            self._see_id(obj.get("id"))
            self._see_model(obj.get("model"))
            return [self._embeddings(obj)]
        if obj.keys().isdisjoint(_SHAPE_KEYS) or (
            isinstance(obj.get("type"), str) and "choices" not in obj and "output" not in obj
        ):  # no chat chunk shape, or a typed event (Anthropic, Responses)
            raise InvalidEvent(
                "not an OpenAI-compatible chat completion chunk "
                f"(expected one of {', '.join(_SHAPE_KEYS)}; got keys {', '.join(sorted(obj)[:8])})"
            )
        if self.provider_request_id is None:
            self._see_id(obj.get("id"))
            self._see_id(obj.get("request_id"))
        if self.model is None:
            self._see_model(obj.get("model"))
        drafts: list[Draft] = []
        if obj.get("error"):
            drafts.extend(self._error(obj["error"]))
        choices = obj.get("choices")
        output = obj.get("output")
        if isinstance(output, dict):  # DashScope native envelope
            choices = output.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    draft = self._choice(choice)
                    if draft.carries_anything():
                        drafts.append(draft)
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            x_groq = obj.get("x_groq")
            usage = x_groq.get("usage") if isinstance(x_groq, dict) else None
        if isinstance(usage, dict):
            total = self._usage.report(_usage_fields(usage))
            if drafts:
                drafts[0].usage = total
            else:
                drafts.append(Draft(usage=total))
        return drafts

    def _embeddings(self, obj: Mapping[str, Any]) -> Draft:
        """An embeddings body: a stop, and the input tokens its usage reports (no output)."""
        draft = Draft(finish=FinishReason.STOP)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            fields = _usage_fields(usage)
            embedding = RawUsage(_embedding_usage)
            draft.usage = embedding.report({"prompt": fields["prompt"], "total": fields["total"]})
        return draft

    def _error(self, error: object) -> list[Draft]:
        return [Draft(finish=FinishReason.ERROR, finish_raw="error", error=_error_message(error))]

    def _choice(self, choice: Mapping[str, Any]) -> Draft:
        index = choice.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise InvalidEvent(f"choice index is not a non-negative integer: {index!r}")
        draft = Draft(choice=index)
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = choice.get("message")
        if not isinstance(delta, dict):  # legacy completions: the choice's own `text`
            draft.text = as_str(choice.get("text"))
        else:
            text, thinking = _text_and_thinking(delta.get("content"))
            draft.text = text + as_str(delta.get("refusal"))
            draft.reasoning = thinking + _reasoning(delta)
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list) and tool_calls:
                draft.tools = self._tool_deltas(index, tool_calls)
        raw = choice.get("finish_reason")
        if isinstance(raw, str) and raw and raw != "null":
            draft.finish = map_openai(raw)
            draft.finish_raw = raw
        return draft

    def _tool_deltas(self, choice: int, entries: list[Any]) -> list[ToolCallDelta]:
        keys = self._tools.get(choice)
        if keys is None:
            keys = self._tools[choice] = ToolKeys()
        out: list[ToolCallDelta] = []
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            function = entry.get("function")
            if not isinstance(function, dict):
                function = {}
            arguments = function.get("arguments")
            if isinstance(arguments, dict):  # some servers send an object
                arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
            out.append(
                ToolCallDelta(
                    index=keys.index_of(entry),
                    id=as_str(entry.get("id")) or None,
                    name=as_str(function.get("name")) or None,
                    arguments_delta=as_str(arguments),
                )
            )
        return out
