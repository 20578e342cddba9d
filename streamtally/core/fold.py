"""The fold: a request's chunks, applied in order, become one `Tokens` record.

This is the single implementation behind both `streamtally fold` and the
stream processors.  The rules are those of the normalisation contract:

* usage is a running total: the last reported value wins, never a sum;
* a null never overwrites a finish reason already seen, and when several
  apply the strongest wins (error, cancelled > length > content_filter >
  tool_calls > stop);
* a choice that called tools and finished with a plain stop finished with
  `tool_calls`;
* a choice that never saw a finish signal finished with `error`, or with
  `cancelled` when the request was cancelled (its client went away, `cancel`);
* tool calls are keyed by index; `id` and `name` are set once and never
  blanked; argument fragments are joined in order and `""` means `{}`.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamtally.core.models import (
    PRECEDENCE,
    ZERO_USAGE,
    ChoiceTokens,
    Chunk,
    FinishReason,
    Source,
    Tokens,
    ToolCall,
    ToolCallDelta,
    Usage,
)

__all__ = ["MAX_TEXT_BYTES", "NO_FINISH", "Fold", "fold"]

#: The error recorded for a stream that ended without any finish signal.
NO_FINISH = "stream ended without a finish reason"
#: UTF-8 bytes of text, reasoning and tool arguments a request keeps by default: beyond it
#: the Tokens keeps a prefix and says so (`truncated`), so one request cannot grow a
#: worker's memory without bound, and its Tokens fits the tokens topic (8 MiB records).
MAX_TEXT_BYTES = 4 << 20


class _Tool:
    __slots__ = ("args", "id", "name")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name: str | None = None
        self.args: list[str] = []

    def result(self, index: int) -> ToolCall:
        return ToolCall(
            index=index, id=self.id, name=self.name, arguments="".join(self.args) or "{}"
        )


class _Choice:
    __slots__ = ("finish", "finish_raw", "rank", "reasoning", "text", "tools")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tools: dict[int, _Tool] = {}
        self.finish: FinishReason | None = None
        self.finish_raw: str | None = None
        self.rank = -1

    def result(self, index: int, finish: FinishReason, raw: str | None) -> ChoiceTokens:
        return ChoiceTokens(
            index=index,
            text="".join(self.text),
            reasoning="".join(self.reasoning),
            tool_calls=tuple(self.tools[i].result(i) for i in sorted(self.tools)),
            finish_reason=finish,
            finish_reason_raw=raw,
        )


class Fold:
    """Accumulates one request's chunks; `result()` gives its `Tokens`."""

    __slots__ = (
        "_bound",
        "_cancelled",
        "_choices",
        "_limit",
        "_room",
        "chunks",
        "error",
        "model",
        "provider_request_id",
        "request_id",
        "source",
        "truncated",
        "usage",
    )

    def __init__(
        self, request_id: str, source: Source, *, max_text_bytes: int = MAX_TEXT_BYTES
    ) -> None:
        self.request_id = request_id
        self.source = source
        #: The provider's own id of the call, when its stream named one (the `Normalizer`'s
        #: `provider_request_id`, set by whoever folds: chunks carry the request id only).
        self.provider_request_id: str | None = None
        #: The model the first chunk naming one named; when none did, whoever folds sets
        #: the `Normalizer`'s (a request cut after a first event without content).
        self.model: str | None = None
        self.usage: Usage | None = None
        self.error: str | None = None
        self.chunks = 0
        self.truncated = False
        #: UTF-8 bytes of text, reasoning and tool arguments a request may keep.
        self._limit = max_text_bytes
        #: An upper bound of the bytes kept (4 per character) while far from the limit.
        self._bound = 0
        #: Exact bytes still to be kept, once near the limit (-1: not counted yet).
        self._room = -1
        self._choices: dict[int, _Choice] = {0: _Choice()}
        self._cancelled = False

    def _keep(self, delta: str) -> str:
        """What of `delta` fits the request's text limit (all of it, a prefix, or nothing).

        Far from the limit a character counts as 4 bytes (its most in UTF-8), so
        nothing is encoded; near it the bytes are counted exactly.
        """
        bound = self._bound + 4 * len(delta)
        if bound <= self._limit:
            self._bound = bound
            return delta
        if self._room < 0:  # first time near the limit: count what is kept exactly
            self._room = self._limit - self._kept_bytes()
        data = delta.encode("utf-8")
        if len(data) <= self._room:
            self._room -= len(data)
            return delta
        self.truncated = True
        kept = data[: self._room].decode("utf-8", errors="ignore")  # never half a character
        self._room = 0
        return kept

    def _kept_bytes(self) -> int:
        return sum(
            len(part.encode("utf-8"))
            for choice in self._choices.values()
            for parts in (choice.text, choice.reasoning, *(t.args for t in choice.tools.values()))
            for part in parts
        )

    def add(self, chunk: Chunk) -> None:
        self.chunks += 1
        fields = chunk.__dict__  # a model's fields, read without its attribute hook
        if self.model is None and fields["model"]:
            self.model = fields["model"]
        usage = fields["usage"]
        if usage is not None:
            self.usage = usage
        if fields["error"] is not None and self.error is None:
            self.error = fields["error"]
        choice = self._choices.get(fields["choice"])
        if choice is None:
            choice = self._choices[fields["choice"]] = _Choice()
        text = fields["text_delta"]
        if text:
            bound = self._bound + 4 * len(text)
            if bound <= self._limit:  # `_keep`'s first case, inline: far from the limit
                self._bound = bound
                choice.text.append(text)
            elif kept := self._keep(text):
                choice.text.append(kept)
        if fields["reasoning_delta"] and (kept := self._keep(fields["reasoning_delta"])):
            choice.reasoning.append(kept)
        if fields["tool_call_deltas"]:
            self._tools(choice, fields["tool_call_deltas"])
        finish = fields["finish_reason"]
        if finish is not None and PRECEDENCE[finish] > choice.rank:
            choice.finish = finish
            choice.finish_raw = fields["finish_reason_raw"]
            choice.rank = PRECEDENCE[finish]

    def _tools(self, choice: _Choice, deltas: tuple[ToolCallDelta, ...]) -> None:
        for delta in deltas:
            tool = choice.tools.get(delta.index)
            if tool is None:
                tool = choice.tools[delta.index] = _Tool()
            if delta.id and tool.id is None:
                tool.id = delta.id
            if delta.name and tool.name is None:
                tool.name = delta.name
            if delta.arguments_delta and (kept := self._keep(delta.arguments_delta)):
                tool.args.append(kept)

    def fail(self, message: str) -> None:
        """A request-level failure (raw events missing): every choice finishes `error`."""
        if self.error is None:
            self.error = message
        for choice in self._choices.values():
            if PRECEDENCE[FinishReason.ERROR] > choice.rank:
                choice.finish, choice.finish_raw = FinishReason.ERROR, None
                choice.rank = PRECEDENCE[FinishReason.ERROR]

    @property
    def cancelled(self) -> bool:
        """Whether `cancel` was called: the request's END marker said it was cancelled."""
        return self._cancelled

    def cancel(self) -> None:
        """The request was cancelled mid-stream: a choice without a finish signal finishes
        `cancelled` (raw value null, no error) in `result`; finished choices keep theirs."""
        self._cancelled = True

    @property
    def finished(self) -> bool:
        """True once every choice seen so far has a finish signal."""
        return all(c.finish is not None for c in self._choices.values())

    def result(self, *, ended: bool = True, reason: str = NO_FINISH) -> Tokens:
        """The request's `Tokens`.

        `ended` says the stream is over, so a choice without a finish signal
        finished with `error` and `reason` becomes the error message (unless
        an error was already reported); after `cancel`, with `cancelled`.
        """
        error = self.error
        results: list[ChoiceTokens] = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            finish, raw = choice.finish, choice.finish_raw
            if finish is None:
                if not ended:
                    raise ValueError(f"request {self.request_id!r} has not finished")
                if self._cancelled:
                    finish, raw = FinishReason.CANCELLED, None
                else:
                    finish, raw = FinishReason.ERROR, None
                    if error is None:
                        error = reason
            elif finish is FinishReason.STOP and choice.tools:
                finish = FinishReason.TOOL_CALLS
            results.append(choice.result(index, finish, raw))
        first = results[0]
        return Tokens(
            request_id=self.request_id,
            source=self.source,
            model=self.model,
            text=first.text,
            reasoning=first.reasoning,
            tool_calls=first.tool_calls,
            usage=self.usage or ZERO_USAGE,
            finish_reason=first.finish_reason,
            finish_reason_raw=first.finish_reason_raw,
            error=error,
            chunks=self.chunks,
            choices=tuple(results) if len(results) > 1 else (),
            truncated=self.truncated,
            provider_request_id=self.provider_request_id,
        )


def fold(
    chunks: Iterable[Chunk],
    request_id: str,
    source: Source,
    *,
    max_text_bytes: int = MAX_TEXT_BYTES,
) -> Tokens:
    """Fold a complete stream of one request's chunks into its `Tokens`."""
    acc = Fold(request_id, source, max_text_bytes=max_text_bytes)
    for chunk in chunks:
        acc.add(chunk)
    return acc.result()
