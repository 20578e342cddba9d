"""`streamtally proxy` on the real stack: encodings, background responses and embeddings.

A small aiohttp upstream answers with provider bodies written for this test: a
Chat Completions body compressed with br, a Chat Completions stream compressed
with zstd (flushed event by event, sent in small pieces), a Responses API
background response (the create answers ``queued``, a first poll
``in_progress``, then two polls the completed Response), and an OpenAI
embeddings body.  The proxy (`ProxyServer`, the command's own code, with a
real `Tap`) sits in front; plain aiohttp clients call it, offering the
encodings.  Every client must get exactly the upstream's bytes; the Tokens in
Redis must be what `streamtally fold` makes of the decoded bodies, the
background response billed once, the embeddings with the upstream's usage.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import brotli
import pytest
import zstandard
from aiohttp import ClientSession, web

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, Source
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyServer
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics
from tests.integration.worker import (
    WorkerProcess,
    as_called,
    cli,
    forget_usage,
    tapped_calls,
    wait_for_tokens,
)

pytestmark = pytest.mark.integration

RUN = uuid.uuid4().hex[:12]
BR_ID = f"chatcmpl-br-{RUN}"
ZSTD_ID = f"chatcmpl-zstd-{RUN}"
RESPONSE_ID = f"resp_bg{RUN}"

BR_BODY = json.dumps(
    {
        "id": BR_ID,
        "object": "chat.completion",
        "created": 1760000000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Brotli sagt grüß Gott ✓"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 1_234,
            "completion_tokens": 56,
            "total_tokens": 1_290,
            "prompt_tokens_details": {"cached_tokens": 1_024},
        },
    },
    ensure_ascii=False,
).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": ZSTD_ID,
        "object": "chat.completion.chunk",
        "created": 1760000000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


ZSTD_EVENTS = [
    _chunk({"role": "assistant", "content": ""}),
    *(_chunk({"content": piece}) for piece in ("Zstandard ", "streams ", "frames ", "fine.")),
    _chunk({}, "stop"),
    {
        "id": ZSTD_ID,
        "object": "chat.completion.chunk",
        "created": 1760000000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [],
        "usage": {"prompt_tokens": 321, "completion_tokens": 9, "total_tokens": 330},
    },
]
ZSTD_STREAM = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in ZSTD_EVENTS)
ZSTD_STREAM += b"data: [DONE]\n\n"


def _response(status: str) -> dict[str, Any]:
    done = status == "completed"
    return {
        "id": RESPONSE_ID,
        "object": "response",
        "created_at": 1760000000,
        "status": status,
        "background": True,
        "model": "o3-2025-04-16",
        "output": [
            {
                "id": "rs_1",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "Long thought."}],
            },
            {
                "id": "msg_1",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "The answer.", "annotations": []}],
            },
        ]
        if done
        else [],
        "usage": {
            "input_tokens": 50_000,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 20_000,
            "output_tokens_details": {"reasoning_tokens": 19_000},
            "total_tokens": 70_000,
        }
        if done
        else None,
    }


EMBEDDINGS_BODY = json.dumps(
    {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.0023, -0.0093, 0.0157]},
            {"object": "embedding", "index": 1, "embedding": [-0.0051, 0.0112, 0.0006]},
        ],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 4_321, "total_tokens": 4_321},
    }
).encode()


def _zstd_stream() -> bytes:
    """ZSTD_STREAM as a server compresses it: one frame, flushed after every event."""
    packer = zstandard.ZstdCompressor().compressobj()
    out = b""
    for block in ZSTD_STREAM.split(b"\n\n")[:-1]:
        out += packer.compress(block + b"\n\n") + packer.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    return out + packer.flush()


@dataclass
class Upstream:
    polls: int = 0
    offers: dict[str, str | None] = field(default_factory=dict)
    runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.poll)
        app.router.add_post("/v1/embeddings", self.embeddings)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.offers[f"chat-{body['stream']}"] = request.headers.get("Accept-Encoding")
        if not body["stream"]:
            return web.Response(
                body=brotli.compress(BR_BODY),
                headers={"Content-Type": "application/json", "Content-Encoding": "br"},
            )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Content-Encoding": "zstd"}
        )
        await response.prepare(request)
        data = _zstd_stream()
        for start in range(0, len(data), 23):
            await response.write(data[start : start + 23])
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    async def create(self, request: web.Request) -> web.Response:
        assert (await request.json())["background"] is True
        return web.json_response(_response("queued"))

    async def poll(self, request: web.Request) -> web.Response:
        assert request.match_info["id"] == RESPONSE_ID
        self.polls += 1
        return web.json_response(_response("in_progress" if self.polls == 1 else "completed"))

    async def embeddings(self, request: web.Request) -> web.Response:
        return web.Response(body=EMBEDDINGS_BODY, content_type="application/json")


@dataclass
class Seen:
    br: bytes = b""
    zstd: bytes = b""
    statuses: list[str] = field(default_factory=list)
    embeddings: bytes = b""
    upstream: Upstream | None = None
    proxy: ProxyServer | None = None
    tap: Any = None


async def traffic(servers: str, namespace: str, tenants: dict[str, str]) -> Seen:
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    upstream = Upstream()
    seen = Seen(upstream=upstream)
    up_port = await upstream.start()
    async with Tap(servers, namespace=namespace) as tap:
        proxy = seen.proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap)
        base = f"http://127.0.0.1:{await proxy.start('127.0.0.1', 0)}"
        try:
            async with ClientSession(auto_decompress=False) as client:
                async with client.post(
                    f"{base}/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "stream": False, "messages": []},
                    headers={"X-Tenant": tenants["br"], "Accept-Encoding": "br"},
                ) as resp:
                    assert resp.headers["Content-Encoding"] == "br"
                    seen.br = await resp.read()
                async with client.post(
                    f"{base}/v1/chat/completions",
                    # Usage asked by the client itself: the proxy asks nothing, so the
                    # call keeps its encodings (a call whose usage the proxy asks for is
                    # asked for identity: its usage chunk is held back from the bytes).
                    json={
                        "model": "gpt-4o-mini",
                        "stream": True,
                        "stream_options": {"include_usage": True},
                        "messages": [],
                    },
                    headers={"X-Tenant": tenants["zstd"], "Accept-Encoding": "zstd;q=1, exi"},
                ) as resp:
                    async for piece in resp.content.iter_any():
                        seen.zstd += piece
                background = {"X-Tenant": tenants["background"]}
                async with client.post(
                    f"{base}/v1/responses",
                    json={"model": "o3", "background": True, "input": "Think long."},
                    headers=background,
                ) as resp:
                    seen.statuses.append((await resp.json())["status"])
                for _ in range(3):  # in progress, completed, completed again
                    async with client.get(
                        f"{base}/v1/responses/{RESPONSE_ID}", headers=background
                    ) as resp:
                        seen.statuses.append((await resp.json())["status"])
                async with client.post(
                    f"{base}/v1/embeddings",
                    json={"model": "text-embedding-3-small", "input": ["a", "b"]},
                    headers={"X-Tenant": tenants["embeddings"]},
                ) as resp:
                    seen.embeddings = await resp.read()
        finally:
            await proxy.stop()
            await upstream.stop()
    seen.tap = tap.stats
    return seen


def folded(source: Source, path: Path) -> dict[str, Any]:
    done = cli("fold", "--source", source.value, str(path))
    assert done.code == 0, done.err
    return dict(json.loads(done.out))


def usage_row(tenant: str, timeout: float = 60.0) -> dict[str, Any]:
    """The tenant's one usage row, once the worker has written it."""
    deadline = time.monotonic() + timeout
    while True:
        rows = cli("usage", "--tenant", tenant, "--json")
        assert rows.code == 0, rows.err
        found = json.loads(rows.out)
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    [row] = found
    return dict(row)


def test_encodings_background_responses_and_embeddings_are_billed_as_the_provider_says(
    worker: WorkerProcess, bootstrap_servers: str, redis_url: str, tmp_path: Path
) -> None:
    tenants = {name: f"tap-{name}-{RUN}" for name in ("br", "zstd", "background", "embeddings")}
    namespace = Settings.load().namespace
    try:
        seen = asyncio.run(traffic(bootstrap_servers, namespace, tenants))
        assert seen.upstream is not None
        assert seen.proxy is not None
        # Forwarded as sent; asked upstream only in codings the tee reads.
        assert seen.br == brotli.compress(BR_BODY)
        assert seen.zstd == _zstd_stream()
        assert seen.embeddings == EMBEDDINGS_BODY
        assert seen.statuses == ["queued", "in_progress", "completed", "completed"]
        assert seen.upstream.offers == {"chat-False": "br", "chat-True": "zstd;q=1"}
        assert seen.proxy.tees.stats.undecodable == {}
        assert seen.proxy.tees.stats.repeats == 1  # the second completed poll
        assert seen.tap.failed == 0
        assert seen.tap.appended == seen.tap.sent  # every record spooled was sent
        assert seen.tap.requests == 4  # br, zstd, the background response once, embeddings

        bodies = {
            "br": BR_BODY,
            "zstd": ZSTD_STREAM,
            "background": json.dumps(_response("completed")).encode(),
        }
        expected = {}
        for name, data in bodies.items():
            path = tmp_path / f"{name}.sse"
            path.write_bytes(data if name == "zstd" else b"data: " + data + b"\n\n")
            source = Source.OPENAI_RESPONSES if name == "background" else Source.OPENAI
            expected[name] = folded(source, path)
        assert expected["background"]["request_id"] == RESPONSE_ID
        assert expected["background"]["usage"]["output_tokens"] == 20_000
        # A plain call is keyed by an id of its own; a background response by its id.
        calls = tapped_calls(bootstrap_servers, namespace, tenants.values())
        assert calls[tenants["background"]] == [RESPONSE_ID]
        refs = {name: RequestRef(tenants[name], calls[tenants[name]][0]) for name in expected}
        missing = wait_for_tokens(redis_url, refs.values(), timeout=60, worker=worker)
        assert not missing, f"no Tokens for {missing}"
        for name, ref in refs.items():
            got = cli("tokens", "get", ref.request_id, "--tenant", ref.tenant)
            assert got.code == 0, got.err
            assert json.loads(got.out) == as_called(expected[name], ref.request_id), name
            row = usage_row(ref.tenant)
            assert row["requests"] == 1, name  # billed once
            assert {f: row[f] for f in USAGE_FIELDS} == expected[name]["usage"], name

        row = usage_row(tenants["embeddings"])
        assert row["requests"] == 1
        assert row["input_tokens"] == 4_321  # the upstream's usage
        assert row["output_tokens"] == 0
    finally:
        forget_usage(redis_url, tenants.values())
