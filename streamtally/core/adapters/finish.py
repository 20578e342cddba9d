"""Raw finish values of every wire format, mapped to the six normalised reasons.

An unknown raw value is not guessed into `stop`: it maps to `error`, keeping
the raw value beside it for audit.
"""

from __future__ import annotations

from streamtally.core.models import FinishReason

__all__ = ["map_anthropic", "map_engine", "map_gemini", "map_openai", "map_responses"]

F = FinishReason

_OPENAI = {
    "stop": F.STOP,
    "eos": F.STOP,  # Together
    "length": F.LENGTH,
    "tool_calls": F.TOOL_CALLS,
    "function_call": F.TOOL_CALLS,
    "content_filter": F.CONTENT_FILTER,
    "error": F.ERROR,  # OpenRouter
    "abort": F.CANCELLED,
    "cancelled": F.CANCELLED,
}

_ANTHROPIC = {
    "end_turn": F.STOP,
    "stop_sequence": F.STOP,
    "pause_turn": F.STOP,
    "max_tokens": F.LENGTH,
    "model_context_window_exceeded": F.LENGTH,
    "tool_use": F.TOOL_CALLS,
    "refusal": F.CONTENT_FILTER,
}

_GEMINI_FILTER = frozenset(
    {"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "LANGUAGE"}
)

_ENGINE = {
    "eos": F.STOP,
    "stop": F.STOP,
    "length": F.LENGTH,
    "abort": F.CANCELLED,
    "cancelled": F.CANCELLED,
    "content_filter": F.CONTENT_FILTER,
    "error": F.ERROR,
    "tool_calls": F.TOOL_CALLS,
    "repetition": F.STOP,
}


def map_openai(raw: str) -> FinishReason:
    return _OPENAI.get(raw, F.ERROR)


def map_anthropic(raw: str) -> FinishReason:
    return _ANTHROPIC.get(raw, F.ERROR)


def map_gemini(raw: str) -> FinishReason:
    if raw == "STOP":
        return F.STOP
    if raw == "MAX_TOKENS":
        return F.LENGTH
    if raw in _GEMINI_FILTER or raw.startswith("IMAGE_"):
        return F.CONTENT_FILTER
    return F.ERROR  # MALFORMED_FUNCTION_CALL, OTHER, UNEXPECTED_TOOL_CALL, …


def map_responses(status: str, incomplete_reason: str | None) -> FinishReason:
    if status == "completed":
        return F.STOP
    if status == "incomplete":
        return F.CONTENT_FILTER if incomplete_reason == "content_filter" else F.LENGTH
    if status == "cancelled":
        return F.CANCELLED
    return F.ERROR


def map_engine(raw: str) -> tuple[FinishReason, str | None]:
    """An engine finish value and, for the `error: msg` form, its message."""
    if raw.startswith("error:"):
        return F.ERROR, raw[len("error:") :].strip() or None
    return _ENGINE.get(raw, F.ERROR), None
