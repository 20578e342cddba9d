"""The fold: a request's normalised chunks become one `Tokens` (contract "Usage", "Finish
reason", "Text, reasoning, tool calls")."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from streamtally.core.fold import NO_FINISH, Fold, fold
from streamtally.core.models import (
    ZERO_USAGE,
    Chunk,
    FinishReason,
    Source,
    Tokens,
    ToolCall,
    ToolCallDelta,
    Usage,
)

F = FinishReason
T0 = datetime(2025, 1, 1, tzinfo=UTC)
REQUEST = "req-1"


def chunks(*specs: dict[str, Any]) -> list[Chunk]:
    return [
        Chunk(request_id=REQUEST, seq=seq, source=Source.OPENAI, event_time=T0, **spec)
        for seq, spec in enumerate(specs)
    ]


def run(*specs: dict[str, Any]) -> Tokens:
    return fold(chunks(*specs), REQUEST, Source.OPENAI)


def tool(
    index: int, call_id: str | None = None, name: str | None = None, args: str = ""
) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=call_id, name=name, arguments_delta=args)


def stop(raw: str = "stop") -> dict[str, Any]:
    return {"finish_reason": F.STOP, "finish_reason_raw": raw}


# --- usage ------------------------------------------------------------------------------


def test_usage_is_last_reported_wins() -> None:
    first = Usage(input_tokens=10, output_tokens=1)
    second = Usage(input_tokens=12, output_tokens=7, reasoning_tokens=3, cached_tokens=4)
    tokens = run({"usage": first}, {"text_delta": "x"}, {"usage": second}, stop())
    assert tokens.usage == second


def test_usage_is_never_summed() -> None:
    report = Usage(input_tokens=10, output_tokens=5, cache_write_tokens=2)
    tokens = run({"usage": report}, {"usage": report}, {"usage": report, **stop()})
    assert tokens.usage == report


def test_later_smaller_usage_still_wins() -> None:
    # Usage is not monotonic (Gemini prompt 2304 -> 2301): overwrite, never max.
    tokens = run(
        {"usage": Usage(input_tokens=2304, output_tokens=3)},
        {"usage": Usage(input_tokens=2301, output_tokens=9), **stop()},
    )
    assert tokens.usage == Usage(input_tokens=2301, output_tokens=9)


def test_chunk_without_usage_does_not_erase_usage() -> None:
    report = Usage(input_tokens=3, output_tokens=4)
    tokens = run({"usage": report, **stop()}, {"text_delta": ""}, {})
    assert tokens.usage == report


def test_no_usage_reported_is_all_zero() -> None:
    tokens = run({"text_delta": "hi"}, stop())
    assert tokens.usage == ZERO_USAGE
    assert tokens.to_json_dict()["usage"] == {
        "input_tokens": 0,
        "output_tokens": 0,
        "reasoning_tokens": 0,
        "cached_tokens": 0,
        "cache_write_tokens": 0,
    }


# --- finish reason --------------------------------------------------------------------------


def test_null_finish_never_overwrites_a_finish() -> None:
    tokens = run(
        {"text_delta": "a"},
        stop(),
        {"usage": Usage(input_tokens=1, output_tokens=1)},  # OpenRouter's usage chunk
        {"text_delta": ""},
    )
    assert tokens.finish_reason is F.STOP
    assert tokens.finish_reason_raw == "stop"
    assert tokens.error is None


ORDER = [F.STOP, F.TOOL_CALLS, F.CONTENT_FILTER, F.LENGTH]
PAIRS = [(ORDER[j], ORDER[i]) for i in range(len(ORDER)) for j in range(i + 1, len(ORDER))]
PAIRS += [(top, lower) for top in (F.ERROR, F.CANCELLED) for lower in ORDER]


@pytest.mark.parametrize("first_strong", [True, False], ids=["strong-first", "weak-first"])
@pytest.mark.parametrize(("strong", "weak"), PAIRS, ids=[f"{s.value}>{w.value}" for s, w in PAIRS])
def test_precedence_strongest_finish_wins_with_its_raw(
    strong: FinishReason, weak: FinishReason, first_strong: bool
) -> None:
    a = {"finish_reason": strong, "finish_reason_raw": f"raw-{strong.value}"}
    b = {"finish_reason": weak, "finish_reason_raw": f"raw-{weak.value}"}
    tokens = run(a, b) if first_strong else run(b, a)
    assert tokens.finish_reason is strong
    assert tokens.finish_reason_raw == f"raw-{strong.value}"


def test_first_raw_is_kept_at_the_same_level() -> None:
    tokens = run(stop("end_turn"), stop("stop"), stop("STOP"))
    assert tokens.finish_reason is F.STOP
    assert tokens.finish_reason_raw == "end_turn"


@pytest.mark.parametrize(("first", "second"), [(F.ERROR, F.CANCELLED), (F.CANCELLED, F.ERROR)])
def test_error_and_cancelled_share_the_top_level_first_wins(
    first: FinishReason, second: FinishReason
) -> None:
    tokens = run(
        {"finish_reason": first, "finish_reason_raw": first.value},
        {"finish_reason": second, "finish_reason_raw": second.value},
    )
    assert tokens.finish_reason is first
    assert tokens.finish_reason_raw == first.value


def test_stop_with_a_tool_call_is_tool_calls_keeping_raw_stop() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, "call_1", "get_weather", '{"city":"Paris"}'),)},
        stop("stop"),
    )
    assert tokens.finish_reason is F.TOOL_CALLS
    assert tokens.finish_reason_raw == "stop"


def test_stop_then_a_late_tool_call_is_still_tool_calls() -> None:
    tokens = run(stop("STOP"), {"tool_call_deltas": (tool(0, None, "f", "{}"),)})
    assert tokens.finish_reason is F.TOOL_CALLS
    assert tokens.finish_reason_raw == "STOP"


@pytest.mark.parametrize("strong", [F.LENGTH, F.CONTENT_FILTER, F.ERROR, F.CANCELLED])
def test_stronger_finish_with_a_tool_call_is_not_turned_into_tool_calls(
    strong: FinishReason,
) -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, "call_1", "f", '{"a": '),)},
        {"finish_reason": strong, "finish_reason_raw": strong.value},
    )
    assert tokens.finish_reason is strong
    assert tokens.finish_reason_raw == strong.value
    assert tokens.tool_calls == (ToolCall(index=0, id="call_1", name="f", arguments='{"a": '),)


def test_length_then_stop_with_a_truncated_tool_call_stays_length() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, "call_1", "f", '{"a": '),)},
        {"finish_reason": F.LENGTH, "finish_reason_raw": "max_tokens"},
        stop("stop"),
    )
    assert tokens.finish_reason is F.LENGTH
    assert tokens.finish_reason_raw == "max_tokens"


def test_stream_without_a_finish_is_an_error() -> None:
    tokens = run({"text_delta": "partial"}, {"usage": Usage(input_tokens=1)})
    assert tokens.finish_reason is F.ERROR
    assert tokens.finish_reason_raw is None
    assert tokens.error == "stream ended without a finish reason"
    assert NO_FINISH == "stream ended without a finish reason"
    assert tokens.text == "partial"
    assert tokens.usage == Usage(input_tokens=1)


def test_earlier_error_message_wins_over_no_finish() -> None:
    tokens = run({"text_delta": "a"}, {"error": "upstream overloaded"})
    assert tokens.finish_reason is F.ERROR
    assert tokens.error == "upstream overloaded"


def test_first_error_message_wins() -> None:
    tokens = run(
        {"error": "first", "finish_reason": F.ERROR, "finish_reason_raw": "error"},
        {"error": "second", "finish_reason": F.ERROR, "finish_reason_raw": "failed"},
    )
    assert tokens.error == "first"
    assert tokens.finish_reason_raw == "error"


def test_error_message_is_kept_even_when_finish_is_not_error() -> None:
    tokens = run({"error": "warning-ish"}, stop())
    assert tokens.error == "warning-ish"
    assert tokens.finish_reason is F.STOP


def test_a_finished_stream_has_no_error() -> None:
    tokens = run({"text_delta": "ok"}, stop())
    assert tokens.error is None


# --- text, reasoning -----------------------------------------------------------------------


def test_text_and_reasoning_are_joined_in_order() -> None:
    tokens = run(
        {"reasoning_delta": "think "},
        {"reasoning_delta": "more"},
        {"text_delta": "Hel"},
        {"text_delta": "lo", "reasoning_delta": "!"},
        stop(),
    )
    assert tokens.text == "Hello"
    assert tokens.reasoning == "think more!"


# --- tool calls ------------------------------------------------------------------------------


def test_tool_calls_keyed_by_index_fragments_joined_in_order() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, "call_a", "get_weather", ""),)},
        {"tool_call_deltas": (tool(0, args='{"ci'),)},
        {"tool_call_deltas": (tool(1, "call_b", "get_time", '{"tz"'),)},
        {"tool_call_deltas": (tool(0, args='ty":"Par'),)},
        {"tool_call_deltas": (tool(1, args=':"UTC"}'), tool(0, args='is"}'))},
        {"finish_reason": F.TOOL_CALLS, "finish_reason_raw": "tool_calls"},
    )
    assert tokens.tool_calls == (
        ToolCall(index=0, id="call_a", name="get_weather", arguments='{"city":"Paris"}'),
        ToolCall(index=1, id="call_b", name="get_time", arguments='{"tz":"UTC"}'),
    )
    assert tokens.finish_reason is F.TOOL_CALLS


def test_tool_call_indices_need_not_start_at_zero_or_be_dense() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(3, "c3", "g", "{}"),)},
        {"tool_call_deltas": (tool(1, "c1", "f", "{}"),)},
        stop(),
    )
    assert [(t.index, t.id) for t in tokens.tool_calls] == [(1, "c1"), (3, "c3")]


def test_tool_call_id_and_name_set_once_never_blanked_or_repeated() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, "call_1", "get_weather", '{"a"'),)},
        {"tool_call_deltas": (tool(0, "", "", ":1"),)},  # Qwen id "", Mistral name ""
        {"tool_call_deltas": (tool(0, "call_1", "get_weather", ""),)},  # repeated (vLLM)
        {"tool_call_deltas": (tool(0, "call_2", "other", "}"),)},  # a later, different value
        stop(),
    )
    assert tokens.tool_calls == (
        ToolCall(index=0, id="call_1", name="get_weather", arguments='{"a":1}'),
    )


def test_tool_call_name_arriving_after_arguments_is_taken() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, args='{"x":'),)},
        {"tool_call_deltas": (tool(0, "call_9", "late", "2}"),)},
        stop(),
    )
    assert tokens.tool_calls == (ToolCall(index=0, id="call_9", name="late", arguments='{"x":2}'),)


def test_empty_tool_arguments_mean_empty_object() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, "call_1", "no_args", ""),)},
        {"tool_call_deltas": (tool(0, args=""),)},
        stop(),
    )
    assert tokens.tool_calls[0].arguments == "{}"
    assert json.loads(tokens.tool_calls[0].arguments) == {}


def test_invalid_json_arguments_are_kept_raw() -> None:
    tokens = run(
        {"tool_call_deltas": (tool(0, "call_1", "f", '{"city": "Par'),)},
        {"finish_reason": F.LENGTH, "finish_reason_raw": "length"},
    )
    assert tokens.tool_calls[0].arguments == '{"city": "Par'


def test_no_tool_calls_is_an_empty_tuple() -> None:
    tokens = run({"text_delta": "x"}, stop())
    assert tokens.tool_calls == ()
    assert tokens.to_json_dict()["tool_calls"] == []


# --- several choices ---------------------------------------------------------------------------


def test_choices_are_folded_separately_top_level_is_choice_0() -> None:
    tokens = run(
        {"choice": 0, "text_delta": "A"},
        {"choice": 1, "text_delta": "B"},
        {"choice": 1, "tool_call_deltas": (tool(0, "c", "f", "{}"),)},
        {"choice": 0, "text_delta": "a", "reasoning_delta": "r0"},
        {"choice": 1, "text_delta": "b"},
        {"choice": 0, **stop()},
        {"choice": 1, "finish_reason": F.LENGTH, "finish_reason_raw": "length"},
        {"usage": Usage(input_tokens=5, output_tokens=6)},
    )
    assert tokens.text == "Aa"
    assert tokens.reasoning == "r0"
    assert tokens.tool_calls == ()
    assert tokens.finish_reason is F.STOP
    assert tokens.finish_reason_raw == "stop"
    assert tokens.usage == Usage(input_tokens=5, output_tokens=6)
    assert [c.index for c in tokens.choices] == [0, 1]
    zero, one = tokens.choices
    assert (zero.text, zero.finish_reason) == ("Aa", F.STOP)
    assert (one.text, one.reasoning, one.finish_reason, one.finish_reason_raw) == (
        "Bb",
        "",
        F.LENGTH,
        "length",
    )
    assert one.tool_calls == (ToolCall(index=0, id="c", name="f", arguments="{}"),)


def test_stop_with_tool_call_rewrite_is_per_choice() -> None:
    tokens = run(
        {"choice": 1, "tool_call_deltas": (tool(0, "c", "f", "{}"),)},
        {"choice": 0, **stop()},
        {"choice": 1, **stop()},
    )
    assert tokens.finish_reason is F.STOP
    assert tokens.choices[1].finish_reason is F.TOOL_CALLS


def test_choice_without_finish_is_error_while_others_keep_theirs() -> None:
    tokens = run({"choice": 0, **stop()}, {"choice": 1, "text_delta": "cut"})
    assert tokens.finish_reason is F.STOP
    assert tokens.choices[1].finish_reason is F.ERROR
    assert tokens.error == NO_FINISH


def test_choices_key_only_when_more_than_one_choice() -> None:
    single = run({"text_delta": "x"}, stop()).to_json_dict()
    assert "choices" not in single
    several = run({"choice": 0, **stop()}, {"choice": 1, **stop()}).to_json_dict()
    assert [c["index"] for c in several["choices"]] == [0, 1]


# --- envelope -----------------------------------------------------------------------------------


def test_model_is_first_non_null() -> None:
    tokens = run({"text_delta": "a"}, {"model": "m-1"}, {"model": "m-2", **stop()})
    assert tokens.model == "m-1"


def test_model_absent_everywhere_is_none() -> None:
    assert run(stop()).model is None


def test_chunk_count_counts_every_chunk() -> None:
    tokens = run({}, {"text_delta": "a"}, {}, stop(), {"usage": Usage()})
    assert tokens.chunks == 5


def test_request_id_and_source_are_the_folds() -> None:
    tokens = fold(chunks(stop()), "other-id", Source.ANTHROPIC)
    assert tokens.request_id == "other-id"
    assert tokens.source is Source.ANTHROPIC


def test_incremental_fold_matches_fold_and_reports_finished() -> None:
    items = chunks({"text_delta": "a"}, {"usage": Usage(output_tokens=1)}, stop())
    acc = Fold(REQUEST, Source.OPENAI)
    acc.add(items[0])
    before = acc.finished
    with pytest.raises(ValueError, match="has not finished"):
        acc.result(ended=False)
    for item in items[1:]:
        acc.add(item)
    assert (before, acc.finished) == (False, True)
    assert acc.result(ended=False) == fold(items, REQUEST, Source.OPENAI)


def test_custom_end_reason_is_the_error() -> None:
    acc = Fold(REQUEST, Source.OPENAI)
    for item in chunks({"text_delta": "a"}):
        acc.add(item)
    tokens = acc.result(reason="idle timeout")
    assert (tokens.finish_reason, tokens.error) == (F.ERROR, "idle timeout")
