"""`streamtally proxy` on the real stack: clients, the proxy, a replaying upstream, a worker.

A small aiohttp upstream replays our own transcripts (`samples/`): an OpenAI
stream, a Gemini non-streaming body (one event of a Gemini transcript), and
an Anthropic stream that stops after a few events and waits, so that its
client can go away mid-stream.  The proxy (`ProxyServer`, the command's own
code, with a real `Tap`) sits in front; plain aiohttp clients call it.
Every client must get exactly the upstream's bytes, and the Tokens and usage
rows in Redis must be what `streamtally fold` makes of the same transcripts;
the request whose client went away is closed `cancelled` with what it had.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from streamtally.cli.proxy import ProxyServer
from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, Source
from streamtally.core.normalize import read_events
from streamtally.producers import Tap
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics
from tests.integration.worker import SAMPLES, WorkerProcess, cli, forget_usage, wait_for_tokens

pytestmark = pytest.mark.integration

OPENAI_FILE = SAMPLES / "openai" / "text_usage.sse"
GEMINI_FILE = SAMPLES / "gemini" / "text_stop.sse"
ANTHROPIC_FILE = SAMPLES / "anthropic" / "text_end_turn.sse"
#: Events of the Anthropic transcript sent before the upstream waits (and the client leaves).
BEFORE_LEAVING = 5


def gemini_body() -> bytes:
    """A `generateContent` body: the last event of a Gemini transcript (finish and usage)."""
    with GEMINI_FILE.open("rb") as stream:
        *_, last = read_events(Source.GEMINI, stream)
    return str(last.data).encode()


def anthropic_prefix() -> bytes:
    blocks = ANTHROPIC_FILE.read_bytes().split(b"\n\n")
    return b"".join(block + b"\n\n" for block in blocks[:BEFORE_LEAVING])


class Upstream:
    """The provider: replays transcripts in small pieces."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.openai)
        app.router.add_post("/v1beta/models/gemini-2.5-flash-lite:generateContent", self.gemini)
        app.router.add_post("/v1/messages", self.anthropic)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        self.leave.set()
        assert self.runner is not None
        await self.runner.cleanup()

    async def _stream(self, request: web.Request, data: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(data), 97):
            await response.write(data[start : start + 97])
            await asyncio.sleep(0)
        return response

    async def openai(self, request: web.Request) -> web.StreamResponse:
        assert (await request.json())["stream"] is True
        response = await self._stream(request, OPENAI_FILE.read_bytes())
        await response.write_eof()
        return response

    async def gemini(self, request: web.Request) -> web.Response:
        return web.Response(body=gemini_body(), content_type="application/json")

    async def anthropic(self, request: web.Request) -> web.StreamResponse:
        response = await self._stream(request, anthropic_prefix())
        await asyncio.wait_for(self.leave.wait(), 60)  # the client leaves meanwhile
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})


@dataclass
class Seen:
    openai: bytes = b""
    gemini: bytes = b""
    anthropic: bytes = b""
    models: bytes = b""
    tap: Any = None


async def traffic(servers: str, namespace: str, tenants: dict[str, str]) -> Seen:
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    upstream = Upstream()
    seen = Seen()
    up_port = await upstream.start()
    async with Tap(servers, namespace=namespace) as tap:
        proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap)
        port = await proxy.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with ClientSession() as client:
                async with client.post(
                    f"{base}/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "stream": True, "messages": []},
                    headers={"X-Tenant": tenants["openai"]},
                ) as resp:
                    assert resp.status == 200
                    async for piece in resp.content.iter_any():
                        seen.openai += piece
                async with client.post(
                    f"{base}/v1beta/models/gemini-2.5-flash-lite:generateContent",
                    json={"contents": []},
                    headers={"X-Tenant": tenants["gemini"]},
                ) as resp:
                    seen.gemini = await resp.read()
                async with client.get(f"{base}/v1/models") as resp:
                    seen.models = await resp.read()
                want = anthropic_prefix()
                resp = await client.post(
                    f"{base}/v1/messages",
                    json={"model": "claude-haiku-4-5", "stream": True, "messages": []},
                    headers={"X-Tenant": tenants["anthropic"]},
                )
                while len(seen.anthropic) < len(want):
                    seen.anthropic += await asyncio.wait_for(resp.content.readany(), 10)
                resp.close()  # the client goes away mid-stream
                for _ in range(200):  # the proxy notices and ends the request cancelled
                    if tap.stats.requests == 3:
                        break
                    await asyncio.sleep(0.05)
        finally:
            await proxy.stop()
            await upstream.stop()
    seen.tap = tap.stats
    return seen


def folded(source: Source, path: Path) -> dict[str, Any]:
    """What `streamtally fold` prints for the transcript."""
    done = cli("fold", "--source", source.value, str(path))
    assert done.code == 0, done.err
    return dict(json.loads(done.out))


def test_the_proxy_forwards_unchanged_and_the_pipeline_counts_what_it_tapped(
    worker: WorkerProcess, bootstrap_servers: str, redis_url: str, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:10]
    tenants = {name: f"tap-{name}-{run}" for name in ("openai", "gemini", "anthropic")}
    namespace = Settings.load().namespace
    try:
        seen = asyncio.run(traffic(bootstrap_servers, namespace, tenants))
        assert seen.openai == OPENAI_FILE.read_bytes()
        assert seen.gemini == gemini_body()
        assert seen.anthropic == anthropic_prefix()
        assert json.loads(seen.models) == {"data": [{"id": "m"}]}
        assert seen.tap.requests == 3
        assert seen.tap.cancelled == 1
        assert seen.tap.dropped_over_budget == 0
        assert seen.tap.failed == 0

        gemini_sse = tmp_path / "gemini.sse"
        gemini_sse.write_bytes(b"data: " + gemini_body() + b"\n\n")
        cut_sse = tmp_path / "anthropic-cut.sse"
        cut_sse.write_bytes(anthropic_prefix())
        expected = {
            "openai": folded(Source.OPENAI, OPENAI_FILE),
            "gemini": folded(Source.GEMINI, gemini_sse),
            # What it had when its client left, closed `cancelled` rather than `error`.
            "anthropic": folded(Source.ANTHROPIC, cut_sse)
            | {"finish_reason": "cancelled", "finish_reason_raw": None, "error": None},
        }
        assert folded(Source.ANTHROPIC, cut_sse)["finish_reason"] == "error"

        refs = {
            name: RequestRef(tenants[name], exp["request_id"]) for name, exp in expected.items()
        }
        missing = wait_for_tokens(redis_url, refs.values(), timeout=60, worker=worker)
        assert not missing, f"no Tokens for {missing}"
        for name, ref in refs.items():
            got = cli("tokens", "get", ref.request_id, "--tenant", ref.tenant)
            assert got.code == 0, got.err
            assert json.loads(got.out) == expected[name], name
            rows = cli("usage", "--tenant", ref.tenant, "--json")
            assert rows.code == 0, rows.err
            [row] = json.loads(rows.out)
            assert row["requests"] == 1
            assert {f: row[f] for f in USAGE_FIELDS} == expected[name]["usage"], name
    finally:
        forget_usage(redis_url, tenants.values())
