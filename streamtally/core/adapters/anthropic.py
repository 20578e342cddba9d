"""`anthropic`: the Messages API SSE stream, or the body of a non-streaming call.

Content blocks are keyed by their `index`.  Only client `tool_use` blocks are
tool calls: `server_tool_use` and the `*_tool_result` blocks run at the
provider.  Usage fields in `message_delta` override those of `message_start`
field by field; the normalised input counts cache reads and writes too.

A non-streaming call (`"stream": false`) answers with the whole Message
(`"type": "message"`), which a tap sends as one event: it folds to one draft
with everything the stream would have carried (blocks keyed by their position
in `content`, a tool's `input` object as its JSON arguments).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streamtally.core.adapters.base import Adapter, Draft, as_str, event_object
from streamtally.core.adapters.finish import map_anthropic
from streamtally.core.adapters.usage import RawUsage
from streamtally.core.models import FinishReason, Source, ToolCallDelta, Usage, trusted_usage
from streamtally.core.sse import SseEvent
from streamtally.errors import InvalidEvent

__all__ = ["AnthropicAdapter"]

_USAGE_FIELDS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def _convert_usage(raw: Mapping[str, int]) -> Usage:
    uncached = raw.get("input_tokens", 0)
    read = raw.get("cache_read_input_tokens", 0)
    written = raw.get("cache_creation_input_tokens", 0)
    return trusted_usage(
        input_tokens=uncached + read + written,
        output_tokens=raw.get("output_tokens", 0),
        reasoning_tokens=raw.get("thinking_tokens", 0),
        cached_tokens=read,
        cache_write_tokens=written,
    )


def _usage_fields(usage: Mapping[str, Any]) -> dict[str, object]:
    fields: dict[str, object] = {name: usage.get(name) for name in _USAGE_FIELDS}
    fields["output_tokens"] = usage.get("output_tokens")
    details = usage.get("output_tokens_details")
    if isinstance(details, dict):
        fields["thinking_tokens"] = details.get("thinking_tokens")
    return fields


def _arguments(value: object) -> str:
    """A `tool_use` block's `input` (an object) as JSON text.

    Written as the Messages API streams it (`{"key": "value"}`: a space after
    `:` and `,`, non-ASCII kept), so a call usually gets the same arguments
    text streamed or not; the same object in any case.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


class AnthropicAdapter(Adapter):
    source = Source.ANTHROPIC

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._usage = RawUsage(_convert_usage)
        self._tool_blocks: set[int] = set()
        self._spliced = False

    def feed(self, event: SseEvent) -> list[Draft]:
        if self._spliced:
            return []
        obj = event_object(event.data, "Messages API event")
        if obj is None:
            return []  # a keep-alive
        kind = obj.get("type")
        if not isinstance(kind, str):
            raise InvalidEvent(
                f'not an Anthropic Messages event (no "type"; keys {", ".join(sorted(obj)[:8])})'
            )
        if kind == "content_block_delta":
            return self._block_delta(obj)
        if kind == "content_block_start":
            return self._block_start(obj)
        if kind == "message_start":
            return self._message_start(obj)
        if kind == "message_delta":
            return self._message_delta(obj)
        if kind == "error":
            return self._error(obj.get("error"))
        if kind == "message":
            return self._whole_message(obj)
        return []  # ping, content_block_stop, message_stop, future event types

    def _message_start(self, obj: Mapping[str, Any]) -> list[Draft]:
        message = obj.get("message")
        if not isinstance(message, dict):
            raise InvalidEvent("message_start without a message object")
        message_id = as_str(message.get("id"))
        if self.provider_request_id is not None and message_id != self.provider_request_id:
            # A gateway spliced a retried response into this stream: nothing after
            # this point belongs to the request we started folding.
            self._spliced = True
            return [
                Draft(
                    finish=FinishReason.ERROR,
                    finish_raw="error",
                    error=(
                        f"spliced stream: a second message_start ({message_id or 'no id'}) "
                        f"arrived inside message {self.provider_request_id}"
                    ),
                )
            ]
        first = self.provider_request_id is None
        self._see_id(message_id)
        self._see_model(message.get("model"))
        usage = message.get("usage")
        if not first or not isinstance(usage, dict):
            return []  # a duplicate message_start of the same message changes nothing
        return [Draft(usage=self._usage.report(_usage_fields(usage)))]

    def _whole_message(self, message: Mapping[str, Any]) -> list[Draft]:
        """The body of a non-streaming call: the Message, complete, as one draft."""
        drafts = self._message_start({"message": message})
        if self._spliced:
            return drafts
        draft = drafts[0] if drafts else Draft()
        content = message.get("content")
        tools: list[ToolCallDelta] = []
        for index, block in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                draft.text += as_str(block.get("text"))
            elif kind == "thinking":
                draft.reasoning += as_str(block.get("thinking"))
            elif kind == "tool_use":
                self._tool_blocks.add(index)
                tools.append(
                    ToolCallDelta(
                        index=index,
                        id=as_str(block.get("id")) or None,
                        name=as_str(block.get("name")) or None,
                        arguments_delta=_arguments(block.get("input")),
                    )
                )
        if tools:
            draft.tools = tools
        raw = message.get("stop_reason")
        if isinstance(raw, str) and raw:
            draft.finish = map_anthropic(raw)
            draft.finish_raw = raw
        return [draft] if draft.carries_anything() else []

    def _block_start(self, obj: Mapping[str, Any]) -> list[Draft]:
        block = obj.get("content_block")
        index = obj.get("index")
        if not isinstance(block, dict) or not isinstance(index, int) or index < 0:
            raise InvalidEvent("content_block_start without an index and a content_block")
        if block.get("type") != "tool_use":
            return []
        self._tool_blocks.add(index)
        delta = ToolCallDelta(
            index=index, id=as_str(block.get("id")) or None, name=as_str(block.get("name")) or None
        )
        return [Draft(tools=[delta])]

    def _block_delta(self, obj: Mapping[str, Any]) -> list[Draft]:
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            raise InvalidEvent("content_block_delta without a delta object")
        kind = delta.get("type")
        if kind == "text_delta":
            draft = Draft(text=as_str(delta.get("text")))
        elif kind == "thinking_delta":
            draft = Draft(reasoning=as_str(delta.get("thinking")))
        elif kind == "input_json_delta" and obj.get("index") in self._tool_blocks:
            index = obj["index"]
            draft = Draft(
                tools=[
                    ToolCallDelta(index=index, arguments_delta=as_str(delta.get("partial_json")))
                ]
            )
        else:
            return []  # signatures, citations, server-tool input
        return [draft] if draft.carries_anything() else []

    def _message_delta(self, obj: Mapping[str, Any]) -> list[Draft]:
        draft = Draft()
        delta = obj.get("delta")
        if isinstance(delta, dict):
            raw = delta.get("stop_reason")
            if isinstance(raw, str) and raw:
                draft.finish = map_anthropic(raw)
                draft.finish_raw = raw
        usage = obj.get("usage")
        if isinstance(usage, dict):
            draft.usage = self._usage.report(_usage_fields(usage))
        return [draft] if draft.carries_anything() else []

    def _error(self, error: object) -> list[Draft]:
        message = None
        if isinstance(error, dict):
            message = as_str(error.get("message")) or as_str(error.get("type"))
        return [
            Draft(
                finish=FinishReason.ERROR,
                finish_raw="error",
                error=message or "error event in the stream",
            )
        ]
