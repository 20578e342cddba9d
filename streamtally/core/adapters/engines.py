"""Engine outputs: `dynamo` (LLMEngineOutput), `vllm` (RequestOutput), `atomr` (TokenChunk).

One raw event is one JSON object (a JSON line, or a decoded Avro record of
the same shape).  When the engine reports no usage, the output count is the
number of token ids it emitted: the engine produced exactly those.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streamtally.core.adapters.base import Adapter, Draft, ToolKeys, as_int, as_str, load_json
from streamtally.core.adapters.finish import map_engine
from streamtally.core.adapters.usage import RawCounts, RawUsage
from streamtally.core.models import (
    ZERO_USAGE,
    FinishReason,
    Source,
    ToolCallDelta,
    Usage,
    trusted_usage,
)
from streamtally.errors import InvalidEvent

__all__ = ["AtomrAdapter", "DynamoAdapter", "VllmAdapter"]


def _object(event: object, what: str) -> Mapping[str, Any]:
    if type(event) is dict:  # what JSON and Avro give: no ABC check
        return event
    if not isinstance(event, Mapping):
        raise InvalidEvent(f"a {what} must be a JSON object, got {type(event).__name__}")
    return event


def _choice_index(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidEvent(f"choice index is not a non-negative integer: {value!r}")
    return value


def _token_ids(value: object, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidEvent(f"{what} is not a list")
    return value


def _finish(draft: Draft, raw: object) -> None:
    """Engine finish values: a string (`"error: msg"` included) or `{"error": msg}`."""
    if raw is None:
        return
    if isinstance(raw, Mapping) and len(raw) == 1:
        ((key, message),) = raw.items()
        if str(key).lower() == "error":
            draft.finish, draft.finish_raw = FinishReason.ERROR, "error"
            draft.error = as_str(message) or "engine error"
            return
    if not isinstance(raw, str) or not raw:
        raise InvalidEvent(f"unknown finish_reason: {raw!r}")
    draft.finish, message = map_engine(raw)
    draft.finish_raw = raw
    if draft.finish is FinishReason.ERROR:
        draft.error = message or "engine error"


def _convert_completion_usage(raw: Mapping[str, int]) -> Usage:
    return trusted_usage(
        input_tokens=raw.get("prompt", 0),
        output_tokens=raw.get("completion", 0),
        reasoning_tokens=raw.get("reasoning", 0),
        cached_tokens=raw.get("cached", 0),
    )


class DynamoAdapter(Adapter):
    source = Source.DYNAMO

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._reported = RawUsage(_convert_completion_usage)
        self._has_report = False
        self._emitted = 0

    def feed(self, event: object) -> list[Draft]:
        obj = _object(event, "Dynamo LLMEngineOutput")
        if "token_ids" not in obj:
            raise InvalidEvent('not a Dynamo LLMEngineOutput (no "token_ids")')
        token_ids = _token_ids(obj["token_ids"], "token_ids")
        draft = Draft(choice=_choice_index(obj.get("index")))
        text = obj.get("text")
        if isinstance(text, str):
            draft.text = text
        elif isinstance(obj.get("tokens"), list):
            draft.text = "".join(t for t in obj["tokens"] if isinstance(t, str))
        _finish(draft, obj.get("finish_reason"))
        self._emitted += len(token_ids)
        usage = obj.get("completion_usage")
        if isinstance(usage, Mapping):
            self._has_report = True
            prompt_details = usage.get("prompt_tokens_details") or {}
            completion_details = usage.get("completion_tokens_details") or {}
            draft.usage = self._reported.report(
                {
                    "prompt": usage.get("prompt_tokens"),
                    "completion": usage.get("completion_tokens"),
                    "cached": prompt_details.get("cached_tokens"),
                    "reasoning": completion_details.get("reasoning_tokens"),
                }
            )
            self.counted = False
        elif token_ids and not self._has_report:
            draft.usage = trusted_usage(output_tokens=self._emitted)
            self.counted = True
        return [draft] if draft.carries_anything() else []


def _convert_request_output_usage(prompt: int, output: int, cached: int) -> Usage:
    return trusted_usage(prompt, output, 0, cached, 0)


#: The raw usage of a `RequestOutput`, in the order `_convert_request_output_usage` takes it.
_REQUEST_OUTPUT_USAGE = ("input", "output", "cached")


class VllmAdapter(Adapter):
    """vLLM `RequestOutput`: its usage is counted here from the token ids (`counted`)."""

    source = Source.VLLM
    counted = True

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._text_len: dict[int, int] = {}
        self._token_count: dict[int, int] = {}
        self._usage = RawCounts(_REQUEST_OUTPUT_USAGE, _convert_request_output_usage)

    def feed(self, event: object) -> list[Draft]:
        obj = event if type(event) is dict else _object(event, "vLLM RequestOutput")
        get = obj.get
        outputs = get("outputs")
        if not isinstance(outputs, list):
            raise InvalidEvent('not a vLLM RequestOutput (no "outputs" list)')
        if self.provider_request_id is None:
            self._see_id(get("request_id"))
        kind = get("output_kind")
        if kind is None:
            kind = self.options.vllm_output_kind
        if kind == "DELTA":
            cumulative = False
        elif kind in ("CUMULATIVE", 0, 1):
            cumulative = kind in ("CUMULATIVE", 0)
        else:
            raise InvalidEvent(f"unknown vLLM output_kind: {kind!r} (DELTA or CUMULATIVE)")
        drafts: list[Draft] = []
        for output in outputs:
            checked = output if type(output) is dict else _object(output, "vLLM CompletionOutput")
            drafts.append(self._output(checked, cumulative))
        if not drafts:
            drafts.append(Draft())
        prompt = get("prompt_token_ids")
        if prompt is not None and type(prompt) is not list:
            prompt = _token_ids(prompt, "prompt_token_ids")  # raises: not a list
        drafts[0].usage = self._usage.report(
            None if prompt is None else len(prompt),
            sum(self._token_count.values()),
            get("num_cached_tokens"),
        )
        if get("finished") is True and not outputs:
            drafts[0].finish, drafts[0].finish_raw = FinishReason.ERROR, "error"
            drafts[0].error = "finished RequestOutput without outputs"
        if len(drafts) == 1:
            return drafts  # it carries the usage at least
        return [d for d in drafts if d.carries_anything()]

    def _output(self, output: Mapping[str, Any], cumulative: bool) -> Draft:
        index = output.get("index")
        if type(index) is not int or index < 0:
            index = _choice_index(index)
        text = output.get("text")
        if type(text) is not str:
            text = as_str(text)
        token_ids = output.get("token_ids")
        if type(token_ids) is not list:
            token_ids = _token_ids(token_ids, "token_ids")
        counts = self._token_count
        if cumulative:
            seen = self._text_len.get(index, 0)
            draft = Draft(index, text[seen:])
            self._text_len[index] = max(seen, len(text))
            counts[index] = max(counts.get(index, 0), len(token_ids))
        else:
            draft = Draft(index, text)
            counts[index] = counts.get(index, 0) + len(token_ids)
        finish = output.get("finish_reason")
        if finish is not None:
            _finish(draft, finish)
        return draft


class AtomrAdapter(Adapter):
    """atomr `TokenChunk`: usage is an increment, added field by field."""

    source = Source.ATOMR

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._total = ZERO_USAGE
        self._tools = ToolKeys()

    def feed(self, event: object) -> list[Draft]:
        obj = _object(event, "atomr TokenChunk")
        if "text_delta" not in obj or "request_id" not in obj:
            raise InvalidEvent('not an atomr TokenChunk (needs "request_id" and "text_delta")')
        self._see_id(obj.get("request_id"))
        draft = Draft(text=as_str(obj.get("text_delta")))
        delta = obj.get("tool_call_delta")
        if isinstance(delta, str) and delta:
            try:
                delta = load_json(delta)
            except ValueError as exc:
                raise InvalidEvent(f"tool_call_delta is not JSON: {exc}") from exc
        if isinstance(delta, Mapping):
            delta = [delta]
        if isinstance(delta, list):
            draft.tools = [self._tool(d) for d in delta if isinstance(d, Mapping)]
        usage = obj.get("usage")
        if isinstance(usage, Mapping):
            # Checked counts (as_int): their sums need no validation again.
            inputs = as_int(usage.get("input_tokens"), "input_tokens") or 0
            outputs = as_int(usage.get("output_tokens"), "output_tokens") or 0
            reasoning = as_int(usage.get("reasoning_tokens"), "reasoning_tokens") or 0
            cached = as_int(usage.get("cached_tokens"), "cached_tokens") or 0
            total = self._total
            self._total = trusted_usage(
                input_tokens=total.input_tokens + inputs,
                output_tokens=total.output_tokens + outputs,
                reasoning_tokens=total.reasoning_tokens + reasoning,
                cached_tokens=total.cached_tokens + cached,
                cache_write_tokens=total.cache_write_tokens,
            )
            draft.usage = self._total
        _finish(draft, obj.get("finish_reason"))
        return [draft] if draft.carries_anything() else []

    def _tool(self, entry: Mapping[str, Any]) -> ToolCallDelta:
        function = entry.get("function")
        fields = function if isinstance(function, Mapping) else entry
        arguments = fields.get("arguments", fields.get("arguments_delta"))
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        return ToolCallDelta(
            index=self._tools.index_of(entry),
            id=as_str(entry.get("id")) or None,
            name=as_str(fields.get("name")) or None,
            arguments_delta=as_str(arguments),
        )
