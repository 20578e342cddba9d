"""What an OpenAI-compatible server streams, with or without ``stream_options.include_usage``.

Our OpenAI transcripts (`samples/openai/`) were written as a server streams
when the client asks for usage: every chunk has ``"usage": null`` and a
usage-only chunk (``"choices": []``) comes before ``[DONE]``.  A server that
is not asked sends neither.  `openai_stream` gives both forms, each event
written as compact JSON, so that a test upstream answers a call the way a
real server would, and a test can say what a client that did not ask
should receive.
"""

from __future__ import annotations

import json
from typing import Any


def openai_stream(transcript: bytes, *, include_usage: bool) -> bytes:
    """The stream of `transcript` as a server sends it when asked for usage or not."""
    out = bytearray()
    for block in transcript.split(b"\n\n"):
        if not block.strip():
            continue
        if not block.startswith(b"data: "):  # a comment (keep-alive): as it is
            out += block + b"\n\n"
            continue
        data = block[len(b"data: ") :]
        if data == b"[DONE]":
            out += b"data: [DONE]\n\n"
            continue
        value: dict[str, Any] = json.loads(data)
        if not include_usage:
            if value.get("choices") == [] and value.get("usage"):
                continue
            if "usage" in value and value["usage"] is None:
                del value["usage"]  # (a server that puts usage on its last chunk keeps it)
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        out += b"data: " + text.encode() + b"\n\n"
    return bytes(out)


def openai_blocks(transcript: bytes) -> dict[bool, list[bytes]]:
    """`openai_stream` of `transcript` event by event (each block with its blank line), by
    whether the client asked for usage: what a test upstream writes one at a time."""
    return {
        asked: [
            block + b"\n\n"
            for block in openai_stream(transcript, include_usage=asked).split(b"\n\n")
            if block
        ]
        for asked in (True, False)
    }


def asked_for_usage(body: dict[str, Any]) -> bool:
    """Whether a request body asks for the usage chunk."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
