"""`openai-responses`: the Responses API SSE stream, or the body of a non-streaming call.

Items are keyed by `output_index` (proxies rotate item ids).  The finish and
the usage come from the terminal `response.*` event; an `error` event is
terminal too.

A non-streaming call answers with the Response object itself (`"object":
"response"`, no `type`), the object the terminal event of a stream carries; a
tap sends it as one event.  It folds to one draft: the text and refusals of
its message items, the summaries and reasoning text of its reasoning items,
its tool calls keyed by their position in `output`, then the finish and usage
as the terminal event gives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from streamtally.core.adapters.base import Adapter, Draft, as_str, event_object
from streamtally.core.adapters.finish import map_responses
from streamtally.core.adapters.usage import RawUsage
from streamtally.core.models import FinishReason, Source, ToolCallDelta, Usage, trusted_usage
from streamtally.core.sse import SseEvent
from streamtally.errors import InvalidEvent

__all__ = ["OpenAIResponsesAdapter"]

_TOOL_ITEMS = frozenset({"function_call", "custom_tool_call"})
_TEXT_DELTAS = frozenset({"response.output_text.delta", "response.refusal.delta"})
_REASONING_DELTAS = frozenset(
    {"response.reasoning_summary_text.delta", "response.reasoning_text.delta"}
)
_ARGUMENT_DELTAS = frozenset(
    {"response.function_call_arguments.delta", "response.custom_tool_call_input.delta"}
)
_ARGUMENT_DONE = frozenset(
    {"response.function_call_arguments.done", "response.custom_tool_call_input.done"}
)
_TERMINAL = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)

#: In a whole Response: the parts of an item that carry text, and the field that holds it.
_MESSAGE_PARTS: Final = {"output_text": "text", "refusal": "refusal"}
_SUMMARY_PARTS: Final = {"summary_text": "text"}
_REASONING_PARTS: Final = {"reasoning_text": "text"}


def _convert_usage(raw: Mapping[str, int]) -> Usage:
    return trusted_usage(
        input_tokens=raw.get("input", 0),
        output_tokens=raw.get("output", 0),
        reasoning_tokens=raw.get("reasoning", 0),
        cached_tokens=raw.get("cached", 0),
        cache_write_tokens=raw.get("cache_write", 0),
    )


def _usage_fields(usage: Mapping[str, Any]) -> dict[str, object]:
    inputs = usage.get("input_tokens_details") or {}
    outputs = usage.get("output_tokens_details") or {}
    return {
        "input": usage.get("input_tokens"),
        "output": usage.get("output_tokens"),
        "cached": inputs.get("cached_tokens"),
        "cache_write": inputs.get("cache_write_tokens"),
        "reasoning": outputs.get("reasoning_tokens"),
    }


def _output_index(obj: Mapping[str, Any]) -> int:
    index = obj.get("output_index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise InvalidEvent(f"{obj.get('type')} without a valid output_index: {index!r}")
    return index


def _joined(parts: object, fields: Mapping[str, str]) -> str:
    """The text of the `parts` whose type `fields` names, each from the field it names."""
    if not isinstance(parts, list):
        return ""
    return "".join(
        as_str(part.get(fields[part["type"]]))
        for part in parts
        if isinstance(part, dict) and part.get("type") in fields
    )


class OpenAIResponsesAdapter(Adapter):
    source = Source.OPENAI_RESPONSES

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._usage = RawUsage(_convert_usage)
        self._with_arguments: set[int] = set()

    def feed(self, event: SseEvent) -> list[Draft]:
        obj = event_object(event.data, "Responses API event")
        if obj is None:
            return []  # a keep-alive
        kind = obj.get("type")
        if kind is None and obj.get("object") == "response":
            return self._whole_response(obj)
        if not isinstance(kind, str):
            raise InvalidEvent(
                f'not a Responses API event (no "type"; keys {", ".join(sorted(obj)[:8])})'
            )
        if kind in _TEXT_DELTAS:
            return self._some(Draft(text=as_str(obj.get("delta"))))
        if kind in _REASONING_DELTAS:
            return self._some(Draft(reasoning=as_str(obj.get("delta"))))
        if kind in _ARGUMENT_DELTAS:
            index = _output_index(obj)
            self._with_arguments.add(index)
            return self._arguments(index, as_str(obj.get("delta")))
        if kind in _ARGUMENT_DONE:
            index = _output_index(obj)
            if index in self._with_arguments:
                return []
            self._with_arguments.add(index)
            return self._arguments(index, as_str(obj.get("arguments") or obj.get("input")))
        if kind == "response.output_item.added":
            return self._item_added(obj)
        if kind in _TERMINAL:
            return self._terminal(obj)
        if kind == "error":
            inner = obj.get("error")
            body = inner if isinstance(inner, dict) else obj
            message = as_str(body.get("message")) or as_str(body.get("code")) or "error event"
            return [Draft(finish=FinishReason.ERROR, finish_raw="error", error=message)]
        if kind.startswith("response."):
            response = obj.get("response")
            if isinstance(response, dict):
                self._see_id(response.get("id"))
                self._see_model(response.get("model"))
            return []
        raise InvalidEvent(f"not a Responses API event type: {kind!r}")

    def _some(self, draft: Draft) -> list[Draft]:
        return [draft] if draft.carries_anything() else []

    def _arguments(self, index: int, fragment: str) -> list[Draft]:
        return self._some(Draft(tools=[ToolCallDelta(index=index, arguments_delta=fragment)]))

    def _item_added(self, obj: Mapping[str, Any]) -> list[Draft]:
        item = obj.get("item")
        if not isinstance(item, dict) or item.get("type") not in _TOOL_ITEMS:
            return []
        index = _output_index(obj)
        arguments = as_str(item.get("arguments") or item.get("input"))
        if arguments:
            self._with_arguments.add(index)
        delta = ToolCallDelta(
            index=index,
            id=as_str(item.get("call_id")) or as_str(item.get("id")) or None,
            name=as_str(item.get("name")) or None,
            arguments_delta=arguments,
        )
        return [Draft(tools=[delta])]

    def _whole_response(self, response: Mapping[str, Any]) -> list[Draft]:
        """The body of a non-streaming call: the Response, complete, as one draft."""
        status = as_str(response.get("status"))
        [draft] = self._terminal({"type": f"response.{status}", "response": response})
        if f"response.{status}" not in _TERMINAL:  # queued, in progress (background): no finish
            draft.finish, draft.finish_raw, draft.error = None, None, None
        output = response.get("output")
        tools: list[ToolCallDelta] = []
        for index, item in enumerate(output if isinstance(output, list) else ()):
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "message":
                draft.text += _joined(item.get("content"), _MESSAGE_PARTS)
            elif kind == "reasoning":
                draft.reasoning += _joined(item.get("summary"), _SUMMARY_PARTS)
                draft.reasoning += _joined(item.get("content"), _REASONING_PARTS)
            elif kind in _TOOL_ITEMS:
                self._with_arguments.add(index)
                tools.append(
                    ToolCallDelta(
                        index=index,
                        id=as_str(item.get("call_id")) or as_str(item.get("id")) or None,
                        name=as_str(item.get("name")) or None,
                        arguments_delta=as_str(item.get("arguments") or item.get("input")),
                    )
                )
        if tools:
            draft.tools = tools
        return [draft] if draft.carries_anything() else []

    def _terminal(self, obj: Mapping[str, Any]) -> list[Draft]:
        response = obj.get("response")
        if not isinstance(response, dict):
            raise InvalidEvent(f"{obj.get('type')} without a response object")
        self._see_id(response.get("id"))
        self._see_model(response.get("model"))
        status = as_str(response.get("status")) or as_str(obj.get("type")).removeprefix("response.")
        details = response.get("incomplete_details")
        reason = as_str(details.get("reason")) if isinstance(details, dict) else ""
        draft = Draft(
            finish=map_responses(status, reason or None),
            finish_raw=reason if status == "incomplete" and reason else status,
        )
        error = response.get("error")
        if isinstance(error, dict):
            draft.error = as_str(error.get("message")) or as_str(error.get("code")) or None
        if draft.finish is FinishReason.ERROR and draft.error is None:
            draft.error = f"response {status}"
        usage = response.get("usage")
        if isinstance(usage, dict):
            draft.usage = self._usage.report(_usage_fields(usage))
        return [draft]
