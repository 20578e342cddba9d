"""The content policy: how much of a request's text the worker keeps downstream of the raw topics.

Prompts and outputs would otherwise be kept wherever the worker writes: the
chunks topic (7 days), the Tokens topic (compacted, for ever), the dead-letter
topic (30 days) and Redis.  `STREAMTALLY_CONTENT` chooses, for all of them:

``full`` (default)
    Everything as folded: nothing is rewritten, no copy is made.
``redacted``
    Every non-empty content string is replaced by its UTF-8 length and its
    HMAC-SHA256 under the content key (``STREAMTALLY_CONTENT_KEY``):
    ``st-redacted:v1:<bytes>:<64 lower-case hex digits>``.  Whoever holds the
    key can check whether a request produced a given text (HMAC its UTF-8
    bytes); nobody else learns more than its length.
``none``
    Every non-empty content string is replaced by its UTF-8 length only:
    ``st-removed:v1:<bytes>``.

What is content: the text, the reasoning and every tool call's arguments of a
Tokens record (choice 0 and each of `choices`), the text, reasoning and
argument deltas of a chunk, and the original value bytes of a dead letter (its
marker is the value's length and, redacted, the HMAC of those bytes, written
as ASCII bytes).  What is not, and is kept under every policy: identities
(request id, tenant, the dead letter's key), the model, tool names and ids,
usage, finish reasons, the error message a stream carried, times and counts,
and so every billing event and usage row (they carry no text).  An empty
string stays empty (it tells nothing), so ``""`` still means "no text".

A dead letter's reason may quote a value of the event that failed (a malformed
field, as Python quotes it); under ``redacted`` and ``none`` each quoted
fragment of such a reason becomes its marker too (`ContentPolicy.reason`).

A marker is the whole field: it starts with ``st-redacted:v1:`` or
``st-removed:v1:`` and is read back by `marked_size`.  Text kept under the
text limit (``STREAMTALLY_MAX_TEXT_BYTES``) is hashed as kept (the prefix).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, TypeVar

from pydantic import BaseModel

from streamtally.core.models import ChoiceTokens, Chunk, Tokens, ToolCall, chunk_of

__all__ = [
    "FULL",
    "MIN_KEY_BYTES",
    "REDACTED_PREFIX",
    "REMOVED_PREFIX",
    "Content",
    "ContentPolicy",
    "capped_chunk",
    "marked_size",
]


_M = TypeVar("_M", bound=BaseModel)


class Content(StrEnum):
    """The values of ``STREAMTALLY_CONTENT``."""

    FULL = "full"
    REDACTED = "redacted"
    NONE = "none"


#: The start of a redacted field: then ``<bytes>:<hmac hex>``.
REDACTED_PREFIX: Final = "st-redacted:v1:"
#: The start of a removed field: then ``<bytes>``.
REMOVED_PREFIX: Final = "st-removed:v1:"
#: A content key has at least this many bytes (HMAC-SHA256's own output size).
MIN_KEY_BYTES: Final = 32

#: No marker is longer (a 20-digit size, a 64-digit HMAC).
_MARKER_MAX: Final = len(REDACTED_PREFIX) + 20 + 1 + 64
_MARKER: Final = re.compile(r"st-(?:redacted:v1:(\d+):[0-9a-f]{64}|removed:v1:(\d+))")
#: A quoted value in an exception message, as Python's repr writes it ('..', "..",
#: b'..'): an opening quote not glued to a word before it ("record's" is no quote),
#: a closing one not glued to a word after it.
_QUOTED: Final = re.compile(
    r"""(?<![\w'"])b?(?P<q>['"])(?P<body>(?:\\.|(?!(?P=q)).)*?)(?P=q)(?![\w])""", re.DOTALL
)


@dataclass(frozen=True, slots=True)
class ContentPolicy:
    """What the worker keeps of content (see the module docstring); `key` is never shown."""

    content: Content = Content.FULL
    key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.content is Content.REDACTED and len(self.key) < MIN_KEY_BYTES:
            raise ValueError(
                f"STREAMTALLY_CONTENT=redacted needs a content key of at least "
                f"{MIN_KEY_BYTES} bytes (STREAMTALLY_CONTENT_KEY)"
            )

    @property
    def keeps_content(self) -> bool:
        """True under ``full``: outputs are written as they are (the hot path)."""
        return self.content is Content.FULL

    # -- one value ---------------------------------------------------------------------

    def text(self, value: str) -> str:
        """`value` as kept: itself (``full``, or empty), else its marker.

        Raises UnicodeEncodeError for a string that is not Unicode text (a lone
        surrogate), as encoding it for a topic would.
        """
        if not value or self.content is Content.FULL:
            return value
        return self._marker(value.encode())

    def data(self, value: bytes) -> bytes:
        """Bytes as kept: themselves (``full``, or empty), else their marker as ASCII."""
        if not value or self.content is Content.FULL:
            return value
        return self._marker(value).encode("ascii")

    def _marker(self, data: bytes) -> str:
        if self.content is Content.REDACTED:
            digest = hmac.new(self.key, data, hashlib.sha256).hexdigest()
            return f"{REDACTED_PREFIX}{len(data)}:{digest}"
        return f"{REMOVED_PREFIX}{len(data)}"

    def reason(self, text: str) -> str:
        """A dead letter's reason with every quoted value replaced by its (quoted) marker."""
        if self.content is Content.FULL:
            return text
        return _QUOTED.sub(lambda m: repr(self.text(m.group("body"))), text)

    # -- records -----------------------------------------------------------------------

    def tokens(self, tokens: Tokens) -> Tokens:
        """The Tokens record as kept: text, reasoning and tool arguments of every choice."""
        if self.content is Content.FULL:
            return tokens
        return _with(
            tokens,
            text=self.text(tokens.text),
            reasoning=self.text(tokens.reasoning),
            tool_calls=self._calls(tokens.tool_calls),
            choices=tuple(self._choice(c) for c in tokens.choices),
        )

    def _calls(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        return tuple(_with(c, arguments=self.text(c.arguments)) for c in calls)

    def _choice(self, choice: ChoiceTokens) -> ChoiceTokens:
        return _with(
            choice,
            text=self.text(choice.text),
            reasoning=self.text(choice.reasoning),
            tool_calls=self._calls(choice.tool_calls),
        )

    def chunk(self, chunk: Chunk) -> Chunk:
        """The chunk as kept; the same object when it carries no content (usage, finish)."""
        if self.content is Content.FULL or not (
            chunk.text_delta or chunk.reasoning_delta or chunk.tool_call_deltas
        ):
            return chunk
        fields = dict(chunk.__dict__)  # in field order, as `chunk_of` needs
        fields["text_delta"] = self.text(chunk.text_delta)
        fields["reasoning_delta"] = self.text(chunk.reasoning_delta)
        fields["tool_call_deltas"] = tuple(
            _with(d, arguments_delta=self.text(d.arguments_delta)) for d in chunk.tool_call_deltas
        )
        return chunk_of(fields)


def _prefix(text: str, budget: int) -> str:
    """The longest prefix of `text` of at most `budget` UTF-8 bytes (whole characters)."""
    if len(text) * 4 <= budget:
        return text
    return text.encode("utf-8", "surrogatepass")[:budget].decode("utf-8", "ignore")


def capped_chunk(chunk: Chunk, limit: int) -> Chunk:
    """The chunk as written to the chunks topic: its text, reasoning and tool arguments
    together at most `limit` UTF-8 bytes (a prefix of each, in that order); the same
    object when they fit.  One event of many MB (a whole body, joined from part records)
    makes one chunk, which must still fit its topic; its Tokens keeps a prefix too
    (`STREAMTALLY_MAX_TEXT_BYTES`), and its usage counts in full.
    """
    text, reasoning = chunk.text_delta, chunk.reasoning_delta
    chars = len(text) + len(reasoning)
    if chunk.tool_call_deltas:
        chars += sum(len(d.arguments_delta) for d in chunk.tool_call_deltas)
    if chars * 4 <= limit:  # at most 4 UTF-8 bytes a character: it fits
        return chunk
    budget = limit
    kept_text = _prefix(text, budget)
    budget -= len(kept_text.encode("utf-8", "surrogatepass"))
    kept_reasoning = _prefix(reasoning, budget)
    budget -= len(kept_reasoning.encode("utf-8", "surrogatepass"))
    deltas = []
    for delta in chunk.tool_call_deltas:
        kept = _prefix(delta.arguments_delta, budget)
        budget -= len(kept.encode("utf-8", "surrogatepass"))
        deltas.append(
            delta if kept == delta.arguments_delta else _with(delta, arguments_delta=kept)
        )
    if (
        kept_text == text
        and kept_reasoning == reasoning
        and budget >= 0
        and all(d is o for d, o in zip(deltas, chunk.tool_call_deltas, strict=True))
    ):
        return chunk
    fields = dict(chunk.__dict__)  # in field order, as `chunk_of` needs
    fields["text_delta"] = kept_text
    fields["reasoning_delta"] = kept_reasoning
    fields["tool_call_deltas"] = tuple(deltas)
    return chunk_of(fields)


def _with(model: _M, **changes: Any) -> _M:
    """`model` with `changes`: strings for strings, nothing to validate again.

    (pydantic's `model_copy` fails on models built without validation, as the
    normaliser's are; `model_construct` takes every field and sets them all.)
    """
    return type(model).model_construct(**{**model.__dict__, **changes})


#: The default policy: everything kept.
FULL: Final = ContentPolicy()


def marked_size(value: str | bytes) -> int | None:
    """The original UTF-8 size a marker stands for; None when `value` is not a marker."""
    if isinstance(value, bytes):  # a dead letter's value: up to 4 MiB, mostly not a marker
        if not value.startswith(b"st-") or len(value) > _MARKER_MAX:
            return None
        value = value.decode("ascii", "replace")
    found = _MARKER.fullmatch(value)
    if found is None:
        return None
    return int(found.group(1) or found.group(2))
