"""`streamtally fold --source SOURCE FILE` (contract "`streamtally fold`")."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from streamtally.cli import main

SPEC_KEYS = {
    "request_id",
    "source",
    "model",
    "text",
    "reasoning",
    "tool_calls",
    "usage",
    "finish_reason",
    "finish_reason_raw",
    "error",
    "chunks",
}
USAGE_KEYS = {
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cached_tokens",
    "cache_write_tokens",
}

OPENAI_SSE = (
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","model":"gpt-4.1",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","model":"gpt-4.1",'
    b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","model":"gpt-4.1",'
    b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
    b'"function":{"name":"get_weather","arguments":"{\\"city\\":"}}]},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","model":"gpt-4.1",'
    b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
    b'{"arguments":"\\"Paris\\"}"}}]},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","model":"gpt-4.1",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\n'
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","model":"gpt-4.1","choices":[],'
    b'"usage":{"prompt_tokens":20,"completion_tokens":9,"total_tokens":29,'
    b'"prompt_tokens_details":{"cached_tokens":8},'
    b'"completion_tokens_details":{"reasoning_tokens":0}}}\n\n'
    b"data: [DONE]\n\n"
)

ANTHROPIC_SSE = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_9","type":"message","role":"assistant",'
    b'"model":"claude-x","content":[],"usage":{"input_tokens":4,"cache_read_input_tokens":6,'
    b'"cache_creation_input_tokens":0,"output_tokens":1}}}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hello"}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"output_tokens":3}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)

VLLM_CUMULATIVE = (
    b'{"request_id":"cmpl-3","prompt_token_ids":[1,2,3],"num_cached_tokens":0,'
    b'"outputs":[{"index":0,"text":"ab","token_ids":[7,8],"finish_reason":null}],'
    b'"finished":false}\n'
    b'{"request_id":"cmpl-3","prompt_token_ids":[1,2,3],"num_cached_tokens":0,'
    b'"outputs":[{"index":0,"text":"abc","token_ids":[7,8,9],"finish_reason":"length"}],'
    b'"finished":true}\n'
)


def run_fold(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["fold", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def only_json(out: str) -> dict[str, Any]:
    assert out.endswith("\n")
    assert out.count("\n") == 1, "one JSON object on one line"
    value = json.loads(out)
    assert isinstance(value, dict)
    return value


def write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_fold_prints_exactly_the_spec_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_fold(capsys, "--source", "openai", write(tmp_path, "chat.sse", OPENAI_SSE))
    assert (code, err) == (0, "")
    got = only_json(out)
    assert set(got) == SPEC_KEYS
    assert set(got["usage"]) == USAGE_KEYS
    assert got == {
        "request_id": "chatcmpl-7",
        "source": "openai",
        "model": "gpt-4.1",
        "text": "Hi",
        "reasoning": "",
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            }
        ],
        "usage": {
            "input_tokens": 20,
            "output_tokens": 9,
            "reasoning_tokens": 0,
            "cached_tokens": 8,
            "cache_write_tokens": 0,
        },
        "finish_reason": "tool_calls",
        "finish_reason_raw": "tool_calls",
        "error": None,
        "chunks": 5,
    }


def test_fold_anthropic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_fold(
        capsys, "--source", "anthropic", write(tmp_path, "msg.sse", ANTHROPIC_SSE)
    )
    assert code == 0
    got = only_json(out)
    assert set(got) == SPEC_KEYS
    assert (got["request_id"], got["source"], got["text"]) == ("msg_9", "anthropic", "Hello")
    assert got["usage"]["input_tokens"] == 10
    assert got["usage"]["cached_tokens"] == 6
    assert (got["finish_reason"], got["finish_reason_raw"]) == ("stop", "end_turn")


def test_request_id_option_overrides_the_provider_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "chat.sse", OPENAI_SSE)
    code, out, _ = run_fold(capsys, "--source", "openai", "--request-id", "req-42", path)
    assert code == 0
    assert only_json(out)["request_id"] == "req-42"


def test_dash_reads_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(ANTHROPIC_SSE)))
    code, out, _ = run_fold(capsys, "--source", "anthropic", "-")
    assert code == 0
    got = only_json(out)
    assert (got["request_id"], got["text"]) == ("msg_9", "Hello")


def test_vllm_output_kind_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "vllm.jsonl", VLLM_CUMULATIVE)
    code, out, _ = run_fold(capsys, "--source", "vllm", "--vllm-output-kind", "CUMULATIVE", path)
    assert code == 0
    got = only_json(out)
    assert (got["text"], got["finish_reason"]) == ("abc", "length")
    assert got["usage"]["input_tokens"] == 3
    assert got["usage"]["output_tokens"] == 3


def test_engine_lines_with_blank_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = b'\n{"token_ids":[1,2],"text":"ok"}\n\n{"token_ids":[],"finish_reason":"eos"}\n\n'
    path = write(tmp_path, "dynamo.jsonl", data)
    code, out, _ = run_fold(capsys, "--source", "dynamo", "--request-id", "d-1", path)
    assert code == 0
    got = only_json(out)
    assert (got["request_id"], got["text"], got["finish_reason"]) == ("d-1", "ok", "stop")
    assert got["usage"]["output_tokens"] == 2


def test_truncated_json_event_is_skipped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = OPENAI_SSE.split(b"\n\n")
    truncated = b'data: {"id":"chatcmpl-7","choices":['
    data = b"\n\n".join([*events[:2], truncated, *events[2:]])
    code, out, err = run_fold(capsys, "--source", "openai", write(tmp_path, "chat.sse", data))
    assert code == 0
    assert only_json(out)["text"] == "Hi"
    assert err.count("\n") == 1
    assert err.startswith("streamtally fold: skipped event 3: event data is not valid JSON")


def test_unfinished_last_event_and_non_sse_lines_change_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = write(tmp_path, "plain.sse", ANTHROPIC_SSE)
    noisy = write(
        tmp_path,
        "noisy.sse",
        b"HTTP/1.1 200 OK\n" + ANTHROPIC_SSE + b'{"error": {"type": "overloaded_error"}}\n'
        b"event: message_delta\n"
        b'data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"}}',
    )
    code, out, err = run_fold(capsys, "--source", "anthropic", plain)
    assert (code, err) == (0, "")
    code, noisy_out, err = run_fold(capsys, "--source", "anthropic", noisy)
    assert (code, err) == (0, "")
    assert only_json(noisy_out) == only_json(out)


BAD_INPUTS = [
    pytest.param("openai", ANTHROPIC_SSE, id="anthropic-file-as-openai"),
    pytest.param("anthropic", OPENAI_SSE, id="openai-file-as-anthropic"),
    pytest.param("openai-responses", ANTHROPIC_SSE, id="anthropic-file-as-responses"),
    pytest.param("gemini", OPENAI_SSE, id="openai-file-as-gemini"),
    pytest.param("vllm", OPENAI_SSE, id="sse-file-as-vllm"),
    pytest.param("dynamo", VLLM_CUMULATIVE, id="vllm-file-as-dynamo"),
    pytest.param("openai", b"", id="empty-openai"),
    pytest.param("dynamo", b"", id="empty-dynamo"),
    pytest.param("openai", b": keep-alive\n\ndata: [DONE]\n\n", id="nothing-but-done"),
    pytest.param("dynamo", b'{"token_ids":[1],"text":"a"}\nnot json\n', id="non-json-line"),
    pytest.param("atomr", b"[1, 2, 3]\n", id="json-array-line"),
]


@pytest.mark.parametrize(("source", "data"), BAD_INPUTS)
def test_bad_input_exits_2_with_one_line_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, data: bytes
) -> None:
    code, out, err = run_fold(capsys, "--source", source, write(tmp_path, "in", data))
    assert code == 2
    assert out == ""
    assert err.startswith("streamtally fold: ")
    assert err.endswith("\n")
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.sse"
    code, out, err = run_fold(capsys, "--source", "openai", str(missing))
    assert (code, out) == (2, "")
    assert err.startswith("streamtally fold: ")
    assert err.count("\n") == 1
    assert "nope.sse" in err
    assert "Traceback" not in err


def test_directory_as_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_fold(capsys, "--source", "openai", str(tmp_path))
    assert (code, out) == (2, "")
    assert err.startswith("streamtally fold: ")
    assert err.count("\n") == 1


def test_unknown_source_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fold", "--source", "bedrock", "x.sse"])
    assert exc.value.code == 2
    assert "--source" in capsys.readouterr().err


STREAMTALLY = Path(sys.executable).with_name("streamtally")


def test_installed_command_reads_stdin() -> None:
    result = subprocess.run(
        [str(STREAMTALLY), "fold", "--source", "anthropic", "-"],
        input=ANTHROPIC_SSE,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
    got = json.loads(result.stdout)
    assert set(got) == SPEC_KEYS
    assert (got["request_id"], got["text"], got["finish_reason"]) == ("msg_9", "Hello", "stop")


def test_installed_command_bad_input_has_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.jsonl", b"not json\n")
    result = subprocess.run(
        [str(STREAMTALLY), "fold", "--source", "dynamo", path],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == b""
    err = result.stderr.decode()
    assert err.startswith("streamtally fold: ")
    assert err.count("\n") == 1
    assert "Traceback" not in err
