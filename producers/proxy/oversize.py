"""The usage of a non-streaming body too large to tap whole, from its first and last bytes.

A body over the proxy's ``--max-body-bytes`` is not teed whole; the tee keeps
its head and its tail (`EDGE_BYTES` each) and `extract` finds in them what
the bill needs: the provider's id and model (at the start of every body but
Gemini's, whose ``responseId`` and ``modelVersion`` come last), the finish
reason, and the usage object, which every provider writes after the content
(OpenAI chat completions' and the Responses API's ``usage``, Anthropic's
``usage``, Gemini's ``usageMetadata``).  From them it makes a small body of
the same source, with no content, that the source's adapter folds to the same
usage, id and model: the tee sends that instead.  Its finish reason is the
provider's last one (of the last choice when there are several; a Response's
status, so a Response that ended in tool calls reads `stop`); its content,
tool calls and other choices are not kept.

A key is found as JSON finds it: ``"usage"`` then a colon outside any string
(inside a JSON string a quote is escaped, so text that merely mentions the key
does not match), its value read with the JSON decoder from there; a value cut
by the edge of the window does not parse and the next occurrence is tried.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

from streamtally.core.models import Source

__all__ = ["EDGE_BYTES", "Extracted", "extract"]

#: Bytes kept of the head and of the tail of a body over the limit.
EDGE_BYTES: Final = 64 << 10

_DECODER: Final = json.JSONDecoder()
#: The key of the usage object, per source.
_USAGE_KEY: Final = {
    Source.OPENAI: "usage",
    Source.OPENAI_RESPONSES: "usage",
    Source.ANTHROPIC: "usage",
    Source.GEMINI: "usageMetadata",
}
#: The key of the finish reason, per source (the Responses API: the response's status).
_FINISH_KEY: Final = {
    Source.OPENAI: "finish_reason",
    Source.OPENAI_RESPONSES: "status",
    Source.ANTHROPIC: "stop_reason",
    Source.GEMINI: "finishReason",
}


@dataclass(frozen=True, slots=True)
class Extracted:
    """What the head and tail of a body said: a synthetic body of its source, and what of
    it was found (`usage` False: the body bills nothing, only what is known is teed)."""

    body: dict[str, Any]
    request_id: str | None
    model: str | None
    usage: bool


def _values(text: str, key: str) -> list[Any]:
    """Every value of `key` in `text` that parses, in order of appearance."""
    found = []
    for match in re.finditer(r'"' + re.escape(key) + r'"\s*:\s*', text):
        try:
            value, _ = _DECODER.raw_decode(text, match.end())
        except ValueError:  # cut by the edge of the window
            continue
        found.append(value)
    return found


def _first(kind: type, *found: list[Any], last: bool = False) -> Any:
    """The first (or last) value of type `kind` of the lists `found`, searched in order."""
    for values in found:
        for value in reversed(values) if last else values:
            if isinstance(value, kind) and not isinstance(value, bool):
                return value
    return None


def extract(source: Source, head: str, tail: str) -> Extracted:
    """The synthetic body of a `source` body whose first bytes are `head` and last `tail`.

    Gemini's id (``responseId``) and model (``modelVersion``) are sought at the end
    first, the others' at the start first; the usage object and the finish reason in
    the tail, last occurrence first (the top level's come after the content).
    """
    usage = _first(dict, _values(tail, _USAGE_KEY[source]), last=True)
    if source is Source.GEMINI:
        request_id = _first(str, _values(tail, "responseId"), _values(head, "responseId"))
        model = _first(str, _values(tail, "modelVersion"), _values(head, "modelVersion"))
    else:
        request_id = _first(str, _values(head, "id"))
        model = _first(str, _values(head, "model"), _values(tail, "model"))
    if source is Source.OPENAI_RESPONSES:  # the response's status is its first key but id's
        finish = _first(str, _values(head, "status"))
    else:
        finish = _first(str, _values(tail, _FINISH_KEY[source]), last=True)
    body = _body(source, request_id, model, finish, usage)
    return Extracted(body, request_id, model, usage is not None)


def _body(
    source: Source,
    request_id: str | None,
    model: str | None,
    finish: str | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    body: dict[str, Any]
    if source is Source.GEMINI:
        candidates = (
            [{"content": {"role": "model", "parts": []}, "finishReason": finish, "index": 0}]
            if finish
            else []
        )
        body = {"candidates": candidates, "usageMetadata": usage}
        body |= {"modelVersion": model, "responseId": request_id}
    elif source is Source.ANTHROPIC:
        body = {"id": request_id, "type": "message", "role": "assistant", "model": model}
        body |= {"content": [], "stop_reason": finish, "usage": usage}
    elif source is Source.OPENAI_RESPONSES:
        body = {"id": request_id, "object": "response", "status": finish or "completed"}
        body |= {"model": model, "output": [], "usage": usage}
    else:
        choices = (
            [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None},
                    "finish_reason": finish,
                }
            ]
            if finish
            else []
        )
        body = {"id": request_id, "object": "chat.completion", "model": model}
        body |= {"choices": choices, "usage": usage}
    return {key: value for key, value in body.items() if value is not None}
