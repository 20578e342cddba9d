"""`gemini`: `streamGenerateContent?alt=sse` of the Gemini API and Vertex AI.

Function calls arrive whole (`args` as an object, serialised here as compact
JSON) or, on Vertex with streamed arguments, as a named start part, then
`partialArgs` parts addressed by JSON path, then an empty `functionCall`.
Calls are numbered in order of appearance.  `usageMetadata` is a running
total, merged field by field (Vertex sends count-less objects until the end).

The raw JSON error body (a rule of this source only).  On HTTP 200 the Gemini
API may end a stream with its error as a raw JSON object, usually
pretty-printed over several lines, appended after the SSE events:
`{"error": {"code": 503, "message": ..., "status": "UNAVAILABLE"}}`
(vercel/ai#5217; `wire-formats.md`, Gemini).  That text is not SSE: the
decoder never makes it an event and reports its lines on its side channel.
`GeminiAdapter.take_trailing_body` reads it from there: the non-SSE lines
after the stream's last SSE line, joined with LF, become one more event of
type `RAW_ERROR_BODY` after the SSE events when, and only when, they are
one JSON object with an `error` member.  Any other non-SSE text, of this
source or any other, stays on the side channel.

Embeddings (the spec names them not; this adapter's rule).  The body of
`embedContent` (``{"embedding": {"values": [...]}}``) or
`batchEmbedContents` (``{"embeddings": [...]}``) is one event.  It folds to
no text and a `stop` finish (no raw finish reason: none is given).  The
Gemini API reports no token counts for them: such a call is billed with no
usage (`usage_source` missing, 0 tokens), recorded all the same.  Where a
body carries `usageMetadata` (Vertex AI's `embedContent`), its
``promptTokenCount`` is the input; an embedding is never billed output
tokens.  Vertex's ``metadata.billableCharacterCount`` counts characters,
not tokens: not read.  The body names no model (the path does), so the
Tokens of an embedding has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from streamtally.core.adapters.base import Adapter, Draft, as_str, event_object, load_json
from streamtally.core.adapters.finish import map_gemini
from streamtally.core.adapters.usage import RawCounts
from streamtally.core.models import FinishReason, Source, ToolCallDelta, Usage, trusted_usage
from streamtally.core.sse import NonSseLine, SseEvent
from streamtally.errors import InvalidEvent

__all__ = ["RAW_ERROR_BODY", "GeminiAdapter"]

#: Event type of Gemini's raw JSON error body, taken from the decoder's side channel.
RAW_ERROR_BODY = "__gemini_raw_error_body__"

_SHAPE_KEYS = ("candidates", "usageMetadata", "promptFeedback", "error", "modelVersion")
#: The members of an `embedContent` / `batchEmbedContents` body.
_EMBEDDING_KEYS = ("embedding", "embeddings")
_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _convert_usage(prompt: int, candidates: int, thoughts: int, cached: int) -> Usage:
    return trusted_usage(prompt, candidates + thoughts, thoughts, cached, 0)


#: The raw fields of `usageMetadata`, in the order `_convert_usage` takes them.
_USAGE_FIELDS = (
    "promptTokenCount",
    "candidatesTokenCount",
    "thoughtsTokenCount",
    "cachedContentTokenCount",
)


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class _StreamedArgs:
    """Builds one call's arguments from Vertex `partialArgs` (JSON path → value)."""

    __slots__ = ("root",)

    def __init__(self) -> None:
        self.root: dict[str, Any] = {}

    def apply(self, partial: Mapping[str, Any]) -> None:
        path = as_str(partial.get("jsonPath"))
        if not path.startswith("$"):
            raise InvalidEvent(f"partialArgs jsonPath does not start with $: {path!r}")
        steps: list[str | int] = []
        pos = 1
        while pos < len(path):
            match = _PATH_STEP.match(path, pos)
            if match is None:
                raise InvalidEvent(f"unsupported partialArgs jsonPath: {path!r}")
            steps.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
            pos = match.end()
        if not steps:
            raise InvalidEvent(f"partialArgs jsonPath names no field: {path!r}")
        if "stringValue" in partial:
            value: Any = as_str(partial["stringValue"])
        elif "numberValue" in partial:
            value = partial["numberValue"]
        elif "boolValue" in partial:
            value = partial["boolValue"]
        else:
            value = None
        self._set(steps, value)

    def _set(self, steps: list[str | int], value: Any) -> None:
        node: Any = self.root
        for step, following in pairwise(steps):
            child = _get(node, step)
            if child is None:
                child = [] if isinstance(following, int) else {}
                _put(node, step, child)
            node = child
        last = steps[-1]
        current = _get(node, last)
        if isinstance(value, str) and isinstance(current, str):
            value = current + value
        _put(node, last, value)


def _get(node: Any, step: str | int) -> Any:
    if isinstance(step, int):
        return node[step] if isinstance(node, list) and step < len(node) else None
    return node.get(step) if isinstance(node, dict) else None


def _put(node: Any, step: str | int, value: Any) -> None:
    if isinstance(step, int):
        if not isinstance(node, list):
            raise InvalidEvent("partialArgs path indexes a value that is not a list")
        node.extend([None] * (step + 1 - len(node)))
        node[step] = value
    elif isinstance(node, dict):
        node[step] = value
    else:
        raise InvalidEvent("partialArgs path names a field of a value that is not an object")


class GeminiAdapter(Adapter):
    source = Source.GEMINI

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._usage = RawCounts(_USAGE_FIELDS, _convert_usage)
        self._calls: dict[int, int] = {}  # candidate -> number of calls started
        self._open: dict[int, tuple[int, _StreamedArgs]] = {}  # candidate -> streamed call

    def feed(self, event: SseEvent) -> list[Draft]:
        obj = event_object(event.data, "Gemini GenerateContentResponse")
        if obj is None:
            return []  # a keep-alive
        if "candidates" not in obj and not obj.keys().isdisjoint(_EMBEDDING_KEYS):
            return [self._embeddings(obj)]
        if "candidates" not in obj and obj.keys().isdisjoint(_SHAPE_KEYS):
            raise InvalidEvent(
                "not a Gemini GenerateContentResponse "
                f"(expected one of {', '.join(_SHAPE_KEYS)}; got keys {', '.join(sorted(obj)[:8])})"
            )
        get = obj.get
        if get("error"):
            return [self._error(obj["error"])]
        if self.provider_request_id is None:
            self._see_id(get("responseId"))
        if self.model is None:
            self._see_model(get("modelVersion"))
        drafts: list[Draft] = []
        candidates = get("candidates")
        if isinstance(candidates, list):
            for candidate in candidates:
                if isinstance(candidate, dict):
                    draft = self._candidate(candidate)
                    # `draft.carries_anything()`, inline: a candidate's draft has no usage yet
                    if draft.text or draft.reasoning or draft.tools or draft.finish is not None:
                        drafts.append(draft)
        feedback = get("promptFeedback")
        if isinstance(feedback, dict) and feedback.get("blockReason"):
            raw = as_str(feedback["blockReason"])
            drafts.append(Draft(finish=FinishReason.CONTENT_FILTER, finish_raw=raw))
        usage = get("usageMetadata")
        if isinstance(usage, dict) and (
            "promptTokenCount" in usage or not usage.keys().isdisjoint(_USAGE_FIELDS)
        ):
            field = usage.get  # an absent field is None: not reported
            total = self._usage.report(
                field("promptTokenCount"),
                field("candidatesTokenCount"),
                field("thoughtsTokenCount"),
                field("cachedContentTokenCount"),
            )
            if drafts:
                drafts[0].usage = total
            else:
                drafts.append(Draft(usage=total))
        return drafts

    @classmethod
    def take_trailing_body(cls, lines: Sequence[NonSseLine]) -> SseEvent | None:
        """Gemini's raw JSON error body after the SSE events, as one event (module docstring)."""
        if not lines:
            return None
        body = "\n".join(line.text for line in lines)
        try:
            value = load_json(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or "error" not in value:
            return None
        return SseEvent(body, RAW_ERROR_BODY)

    def _embeddings(self, obj: Mapping[str, Any]) -> Draft:
        """An embeddings body: a stop; input tokens only where `usageMetadata` has them."""
        draft = Draft(finish=FinishReason.STOP)
        usage = obj.get("usageMetadata")
        if isinstance(usage, dict) and usage.get("promptTokenCount") is not None:
            draft.usage = self._usage.report(usage["promptTokenCount"], 0, 0, 0)
        return draft

    def end(self) -> list[Draft]:
        drafts = [self._close(candidate) for candidate in sorted(self._open)]
        self._open.clear()
        return drafts

    def _error(self, error: object) -> Draft:
        message = ""
        if isinstance(error, dict):
            message = as_str(error.get("message")) or as_str(error.get("status"))
        return Draft(finish=FinishReason.ERROR, finish_raw="error", error=message or str(error))

    def _candidate(self, candidate: Mapping[str, Any]) -> Draft:
        index = candidate.get("index", 0)
        # An exact int is the usual index: the full type check (a bool is no index) otherwise.
        if (
            type(index) is not int and (not isinstance(index, int) or isinstance(index, bool))
        ) or index < 0:
            raise InvalidEvent(f"candidate index is not a non-negative integer: {index!r}")
        draft = Draft(index)
        content = candidate.get("content")
        parts = content.get("parts") if isinstance(content, dict) else None
        if isinstance(parts, list):
            part = parts[0] if len(parts) == 1 else None
            if isinstance(part, dict) and "functionCall" not in part:  # the usual: one text
                if "text" in part:
                    value = part["text"]
                    if isinstance(value, str) and value:
                        if part.get("thought") is True:
                            draft.reasoning = value
                        else:
                            draft.text = value
            else:
                self._parts(draft, parts)
        raw = candidate.get("finishReason")
        if isinstance(raw, str) and raw:
            if index in self._open:
                draft.tools = [*draft.tools, *self._close(index).tools]
                del self._open[index]
            draft.finish = map_gemini(raw)
            draft.finish_raw = raw
            if draft.finish is FinishReason.ERROR:
                draft.error = as_str(candidate.get("finishMessage")) or raw
        return draft

    def _parts(self, draft: Draft, parts: list[Any]) -> None:
        """The text, thoughts and function calls of a candidate's parts, into its draft."""
        text: list[str] = []
        thoughts: list[str] = []
        tools: list[ToolCallDelta] = []
        for part in parts:
            if not isinstance(part, dict):
                continue
            if "text" in part:
                value = part["text"]
                (thoughts if part.get("thought") is True else text).append(
                    value if isinstance(value, str) else ""
                )
            call = part.get("functionCall")
            if isinstance(call, dict):
                tools.extend(self._function_call(draft.choice, call))
        draft.text = "".join(text)
        draft.reasoning = "".join(thoughts)
        if tools:
            draft.tools = tools

    def _function_call(self, candidate: int, call: Mapping[str, Any]) -> list[ToolCallDelta]:
        name = as_str(call.get("name"))
        out: list[ToolCallDelta] = []
        if name:
            if candidate in self._open:
                out.extend(self._close(candidate).tools)
                del self._open[candidate]
            number = self._calls.get(candidate, 0)
            self._calls[candidate] = number + 1
            call_id = as_str(call.get("id")) or None
            if call.get("willContinue") is True:
                args = _StreamedArgs()
                self._apply_partials(args, call)
                self._open[candidate] = (number, args)
                out.append(ToolCallDelta(index=number, id=call_id, name=name))
            else:
                arguments = call.get("args")
                rendered = _compact(arguments) if arguments is not None else ""
                out.append(
                    ToolCallDelta(index=number, id=call_id, name=name, arguments_delta=rendered)
                )
            return out
        if candidate not in self._open:
            return out  # an empty terminator or stray partials with no open call
        if "partialArgs" in call or call.get("willContinue") is True:
            self._apply_partials(self._open[candidate][1], call)
        else:  # `functionCall: {}` ends the streamed call
            out.extend(self._close(candidate).tools)
            del self._open[candidate]
        return out

    def _apply_partials(self, args: _StreamedArgs, call: Mapping[str, Any]) -> None:
        partials = call.get("partialArgs")
        if isinstance(partials, list):
            for partial in partials:
                if isinstance(partial, dict):
                    args.apply(partial)

    def _close(self, candidate: int) -> Draft:
        number, args = self._open[candidate]
        rendered = _compact(args.root) if args.root else ""
        return Draft(
            choice=candidate, tools=[ToolCallDelta(index=number, arguments_delta=rendered)]
        )
