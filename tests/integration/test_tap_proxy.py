"""`streamtally proxy` on the real stack: clients, the proxy, a replaying upstream, a worker.

A small aiohttp upstream replays our own transcripts (`samples/`): an OpenAI
stream (with its usage only when the request asks for it, as a real
OpenAI-compatible server does: `tests.openai_upstream`), a Gemini
non-streaming body (one event of a Gemini transcript), and streams that stop
at a point and wait until their client has gone away, then go on to their
end.  The proxy (`ProxyServer`, the command's own code, with a real `Tap`
whose sender is a process of its own, as the command's default) sits in
front; plain aiohttp clients call it, none of them asking for usage.

Checked: every client gets exactly what the upstream would have sent it
without the proxy (the OpenAI stream without usage); the upstream was asked
for the usage and never saw the tenant header; a client that goes away after
the OpenAI finish chunk, before the usage chunk, and one that goes away in
the middle of an Anthropic stream, are still billed the provider's usage
(the proxy drains the upstream), closed with their provider's finish reason;
the Tokens and usage rows in Redis are what `streamtally fold` makes of the
whole transcripts.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, Source
from streamtally.core.normalize import read_events
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyServer
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics
from tests.integration.worker import (
    SAMPLES,
    WorkerProcess,
    as_called,
    cli,
    forget_usage,
    tapped_calls,
    wait_for_tokens,
)
from tests.openai_upstream import asked_for_usage, openai_stream

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


def openai_until_finish(data: bytes) -> bytes:
    """The OpenAI stream up to its finish chunk, included (then come the usage and DONE)."""
    end = data.index(b'"finish_reason":"stop"')
    return data[: data.index(b"\n\n", end) + 2]


class Upstream:
    """The provider: replays transcripts in small pieces (module docstring)."""

    def __init__(self) -> None:
        #: Set by the test once a client has gone away: its stream goes on to its end.
        self.resume = {"openai": asyncio.Event(), "anthropic": asyncio.Event()}
        self.runner: web.AppRunner | None = None
        self.asked: list[bool] = []
        self.tenant_headers: list[str] = []

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
        for event in self.resume.values():
            event.set()
        assert self.runner is not None
        await self.runner.cleanup()

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        for start in range(0, len(data), 97):
            await response.write(data[start : start + 97])
            await asyncio.sleep(0)

    async def _stream(
        self, request: web.Request, data: bytes, wait: str | None = None, at: int = 0
    ) -> web.StreamResponse:
        self.tenant_headers += request.headers.getall("X-Tenant", [])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if wait is None:
            await self._write(response, data)
        else:  # up to `at`, then wait for the client to go away, then the rest
            await self._write(response, data[:at])
            await asyncio.wait_for(self.resume[wait].wait(), 60)
            await self._write(response, data[at:])
        await response.write_eof()
        return response

    async def openai(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True
        self.asked.append(asked_for_usage(body))
        data = openai_stream(OPENAI_FILE.read_bytes(), include_usage=asked_for_usage(body))
        if request.headers.get("X-Leave") == "after-finish":
            return await self._stream(request, data, "openai", len(openai_until_finish(data)))
        return await self._stream(request, data)

    async def gemini(self, request: web.Request) -> web.Response:
        return web.Response(body=gemini_body(), content_type="application/json")

    async def anthropic(self, request: web.Request) -> web.StreamResponse:
        data = ANTHROPIC_FILE.read_bytes()
        return await self._stream(request, data, "anthropic", len(anthropic_prefix()))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})


@dataclass
class Seen:
    openai: bytes = b""
    openai_left: bytes = b""
    gemini: bytes = b""
    anthropic: bytes = b""
    models: bytes = b""
    asked: list[bool] = field(default_factory=list)
    tenant_headers: list[str] = field(default_factory=list)
    tap: Any = None
    proxy: Any = None


async def leave_after(client: ClientSession, url: str, want: bytes, **kwargs: Any) -> bytes:
    """Call, read until `want` came, then go away (the connection closed)."""
    seen = b""
    resp = await client.post(url, **kwargs)
    while len(seen) < len(want):
        seen += await asyncio.wait_for(resp.content.readany(), 10)
    resp.close()  # the client goes away mid-stream
    return seen


async def traffic(servers: str, namespace: str, tenants: dict[str, str]) -> Seen:
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    upstream = Upstream()
    seen = Seen()
    up_port = await upstream.start()
    async with Tap(servers, namespace=namespace, sender_process=True) as tap:
        proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap)
        port = await proxy.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        chat = {"model": "gpt-4o-mini", "stream": True, "messages": []}
        try:
            async with ClientSession() as client:
                async with client.post(
                    f"{base}/v1/chat/completions",
                    json=chat,
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
                async with client.get(
                    f"{base}/v1/models", headers={"X-Tenant": tenants["gemini"]}
                ) as resp:
                    seen.models = await resp.read()
                plain = openai_stream(OPENAI_FILE.read_bytes(), include_usage=False)
                seen.openai_left = await leave_after(
                    client,
                    f"{base}/v1/chat/completions",
                    openai_until_finish(plain),
                    json=chat,
                    headers={"X-Tenant": tenants["openai-left"], "X-Leave": "after-finish"},
                )
                seen.anthropic = await leave_after(
                    client,
                    f"{base}/v1/messages",
                    anthropic_prefix(),
                    json={"model": "claude-haiku-4-5", "stream": True, "messages": []},
                    headers={"X-Tenant": tenants["anthropic"]},
                )
                for _ in range(200):  # the proxy notices both clients gone
                    if proxy.stats.clients_gone == 2:
                        break
                    await asyncio.sleep(0.05)
                for event in upstream.resume.values():
                    event.set()  # the upstream goes on; the proxy reads it to its end
                for _ in range(200):
                    if tap.stats.requests == 4:
                        break
                    await asyncio.sleep(0.05)
        finally:
            await proxy.stop()
            await upstream.stop()
    seen.tap = tap.stats
    seen.proxy = proxy.stats
    seen.asked = upstream.asked
    seen.tenant_headers = upstream.tenant_headers
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
    names = ("openai", "openai-left", "gemini", "anthropic")
    tenants = {name: f"tap-{name}-{run}" for name in names}
    namespace = Settings.load().namespace
    try:
        seen = asyncio.run(traffic(bootstrap_servers, namespace, tenants))
        plain = openai_stream(OPENAI_FILE.read_bytes(), include_usage=False)
        assert b'"usage"' not in plain
        assert seen.openai == plain  # what the client would have had without the proxy
        assert seen.openai_left == openai_until_finish(plain)
        assert seen.asked == [True, True]  # the proxy asked the upstream for the usage
        assert seen.tenant_headers == []  # and kept the tenant to itself
        assert seen.gemini == gemini_body()
        assert seen.anthropic == anthropic_prefix()
        assert json.loads(seen.models) == {"data": [{"id": "m"}]}
        assert seen.tap.requests == 4
        assert seen.tap.cancelled == 2
        assert seen.tap.appended == seen.tap.sent  # every record spooled was sent
        assert seen.tap.failed == 0
        assert seen.proxy.usage_asked == 2
        assert seen.proxy.usage_chunks_held == 1  # the other client had gone before it came
        assert (seen.proxy.clients_gone, seen.proxy.drains_cut) == (2, 0)

        gemini_sse = tmp_path / "gemini.sse"
        gemini_sse.write_bytes(b"data: " + gemini_body() + b"\n\n")
        # Both clients that went away are billed the provider's usage, whole: the proxy read
        # their streams to the end; their choices finished before the END said cancelled.
        expected = {
            "openai": folded(Source.OPENAI, OPENAI_FILE),
            "openai-left": folded(Source.OPENAI, OPENAI_FILE),
            "gemini": folded(Source.GEMINI, gemini_sse),
            "anthropic": folded(Source.ANTHROPIC, ANTHROPIC_FILE),
        }
        assert expected["openai"]["usage"]["output_tokens"] > 0

        # Each call is keyed by an id of its own (two calls of one provider id are two
        # requests); the provider's id stays on its Tokens.
        calls = tapped_calls(bootstrap_servers, namespace, tenants.values())
        assert all(len(ids) == 1 for ids in calls.values()), calls
        refs = {name: RequestRef(tenants[name], calls[tenants[name]][0]) for name in expected}
        assert all(ref.request_id.startswith("call-") for ref in refs.values())
        missing = wait_for_tokens(redis_url, refs.values(), timeout=60, worker=worker)
        assert not missing, f"no Tokens for {missing}"
        for name, ref in refs.items():
            got = cli("tokens", "get", ref.request_id, "--tenant", ref.tenant)
            assert got.code == 0, got.err
            assert json.loads(got.out) == as_called(expected[name], ref.request_id), name
            rows = cli("usage", "--tenant", ref.tenant, "--json")
            assert rows.code == 0, rows.err
            [row] = json.loads(rows.out)
            assert row["requests"] == 1
            assert {f: row[f] for f in USAGE_FIELDS} == expected[name]["usage"], name
    finally:
        forget_usage(redis_url, tenants.values())


async def colliding(servers: str, namespace: str, tenant: str) -> list[bytes]:
    """Three calls of one tenant whose provider ids collide (one transcript, one id): the
    first held open upstream while the second runs whole (overlapping), then the third."""
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    upstream = Upstream()
    up_port = await upstream.start()
    got: list[bytes] = []
    async with Tap(servers, namespace=namespace) as tap:
        proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap)
        port = await proxy.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        chat = {"model": "gpt-4o-mini", "stream": True, "messages": []}
        try:
            async with ClientSession() as client:

                async def call(**headers: str) -> bytes:
                    async with client.post(
                        url, json=chat, headers={"X-Tenant": tenant, **headers}
                    ) as resp:
                        return await resp.read()

                held = asyncio.create_task(call(**{"X-Leave": "after-finish"}))
                await asyncio.sleep(0.3)  # the first call waits upstream after its finish
                got.append(await call())  # the second runs whole meanwhile
                upstream.resume["openai"].set()
                got.insert(0, await held)
                got.append(await call())  # the third, after both closed
        finally:
            await proxy.stop()
            await upstream.stop()
    return got


def test_calls_whose_provider_ids_collide_are_billed_each(
    worker: WorkerProcess, bootstrap_servers: str, redis_url: str
) -> None:
    tenant = f"tap-collide-{uuid.uuid4().hex[:10]}"
    namespace = Settings.load().namespace
    try:
        got = asyncio.run(colliding(bootstrap_servers, namespace, tenant))
        plain = openai_stream(OPENAI_FILE.read_bytes(), include_usage=False)
        assert got == [plain, plain, plain]
        [ids] = tapped_calls(bootstrap_servers, namespace, [tenant]).values()
        assert len(ids) == 3 == len(set(ids))
        assert ids == sorted(ids)  # first seen in the order they were made: time-ordered
        refs = [RequestRef(tenant, call_id) for call_id in ids]
        missing = wait_for_tokens(redis_url, refs, timeout=60, worker=worker)
        assert not missing, f"no Tokens for {missing}"
        want = folded(Source.OPENAI, OPENAI_FILE)
        for ref in refs:
            got_tokens = cli("tokens", "get", ref.request_id, "--tenant", tenant)
            assert got_tokens.code == 0, got_tokens.err
            assert json.loads(got_tokens.out) == as_called(want, ref.request_id)
        rows = cli("usage", "--tenant", tenant, "--json")
        assert rows.code == 0, rows.err
        [row] = json.loads(rows.out)
        assert row["requests"] == 3  # three calls, three bills
        assert {f: row[f] for f in USAGE_FIELDS} == {
            f: 3 * value for f, value in want["usage"].items()
        }
    finally:
        forget_usage(redis_url, [tenant])
