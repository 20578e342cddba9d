"""The proxy asks OpenAI-compatible streams for their usage and hides it from the client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamtally.producers.proxy.usage_ask import UsageStripper, ask_for_usage, asks_for_usage
from tests.integration.worker import SAMPLES
from tests.openai_upstream import openai_stream

OPENAI_SAMPLES = sorted((SAMPLES / "openai").glob("*.sse"))


def strip(data: bytes, piece: int) -> tuple[bytes, UsageStripper]:
    stripper = UsageStripper()
    out = b"".join(stripper.feed(data[i : i + piece]) for i in range(0, len(data), piece))
    return out + stripper.close(), stripper


@pytest.mark.parametrize(
    ("method", "path", "asked"),
    [
        ("POST", "/v1/chat/completions", True),
        ("post", "/openai/deployments/x/chat/completions", True),
        ("POST", "/v1/completions", True),
        ("GET", "/v1/chat/completions", False),
        ("POST", "/v1/responses", False),
        ("POST", "/v1/messages", False),
    ],
)
def test_which_calls_are_asked(method: str, path: str, asked: bool) -> None:
    assert asks_for_usage(method, path) is asked


def test_a_streamed_call_without_usage_is_asked_and_keeps_the_rest() -> None:
    body = '{"model":"m","stream":true,"messages":[{"role":"user","content":"héllo"}],"n":2}'
    asked = ask_for_usage(body.encode())
    assert asked is not None
    value = json.loads(asked)
    assert list(value) == ["model", "stream", "messages", "n", "stream_options"]
    assert value["stream_options"] == {"include_usage": True}
    assert value["messages"][0]["content"] == "héllo"
    assert "héllo".encode() in asked  # not escaped


def test_other_stream_options_are_kept_and_a_refusal_of_usage_is_overridden() -> None:
    asked = ask_for_usage(b'{"stream":true,"stream_options":{"include_usage":false,"x":1}}')
    assert asked is not None
    assert json.loads(asked)["stream_options"] == {"include_usage": True, "x": 1}


@pytest.mark.parametrize(
    "body",
    [
        b'{"stream":true,"stream_options":{"include_usage":true}}',  # asked by the client
        b'{"model":"m","messages":[]}',  # not streamed: the body has its usage
        b'{"stream":false}',
        b'{"stream":"true"}',
        b'{"stream":true,"stream_options":"yes"}',  # the server's to refuse
        b"[1, 2]",
        b"not json",
        b"",
    ],
)
def test_bodies_left_as_they_are(body: bytes) -> None:
    assert ask_for_usage(body) is None


@pytest.mark.parametrize("sample", OPENAI_SAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("piece", [1, 7, 97, 1 << 20])
def test_the_client_gets_the_stream_it_would_have_had(sample: Path, piece: int) -> None:
    transcript = sample.read_bytes()
    asked = openai_stream(transcript, include_usage=True)
    out, stripper = strip(asked, piece)
    assert out == openai_stream(transcript, include_usage=False)
    assert stripper.unchanged == 0


def test_the_usage_chunk_is_held_back_and_counted() -> None:
    transcript = (SAMPLES / "openai" / "text_usage.sse").read_bytes()
    out, stripper = strip(transcript, 64)
    assert stripper.dropped == 1
    assert b'"usage":{' in transcript
    assert b'"usage"' not in out
    assert out.endswith(b"data: [DONE]\n\n")


def test_crlf_and_cr_framing_is_kept_byte_for_byte() -> None:
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}'
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1}}'
    for end in (b"\r\n", b"\r", b"\n"):
        stream = chunk + end + end + b": ping" + end + end + usage + end + end
        stream += b"data: [DONE]" + end + end
        out, _ = strip(stream, 1)  # a lone "\r" at a piece's end waits for the next byte
        want = chunk.replace(b',"usage":null', b"") + end + end + b": ping" + end + end
        assert out == want + b"data: [DONE]" + end + end


def test_usage_null_inside_a_string_is_not_touched() -> None:
    text = json.dumps({"content": ',"usage":null,'})
    data = b'{"id":"c","choices":[{"delta":' + text.encode() + b'}],"usage":null}'
    out, stripper = strip(b"data: " + data + b"\n\n", 5)
    assert json.loads(out[len(b"data: ") :]) == {
        "id": "c",
        "choices": [{"delta": {"content": ',"usage":null,'}}],
    }
    assert stripper.unchanged == 0


def test_a_chunk_that_cannot_be_cut_exactly_is_forwarded_as_it_came() -> None:
    # Two members named usage at two levels: which one the server added is not certain.
    block = b'data: {"choices":[{"delta":{},"usage":null}],"usage":null}\n\n'
    out, stripper = strip(block, 3)
    assert out == block
    assert stripper.unchanged == 1


def test_a_usage_on_a_chunk_with_choices_is_kept() -> None:
    # Some servers put the usage on their last chunk whatever the request said.
    block = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"x":1}}\n\n'
    out, stripper = strip(block, 4)
    assert out == block
    assert stripper.dropped == 0


def test_an_unfinished_block_comes_out_at_the_end_as_it_came() -> None:
    stripper = UsageStripper()
    assert stripper.feed(b'data: {"choices":[],"usage":{"a":1}}\n') == b""
    assert stripper.close() == b'data: {"choices":[],"usage":{"a":1}}\n'
