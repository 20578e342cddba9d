"""`streamtally proxy` on loopback sockets (an aiohttp upstream and client, the tap's records
kept by a fake sender, no Kafka): the Accept-Encoding it sends upstream, a br response
forwarded as sent and teed decoded, an upstream that ignores Accept-Encoding counted, and
calls to paths it does not meter forwarded and counted, or refused with --unmetered reject.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import brotli
import pytest
from aiohttp import ClientSession, web

from streamtally.cli import main
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyOptions, ProxyServer
from tests.unit.tap.test_tap import FakeSender, worker_tokens

BODY = json.dumps(
    {
        "id": "chatcmpl-br1",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"content": "brotli ✓"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43},
    }
).encode()


@dataclass
class Upstream:
    #: The Accept-Encoding of each call that reached the upstream, by path.
    offers: dict[str, str | None] = field(default_factory=dict)
    #: The Content-Encoding the chat endpoint answers with.
    encoding: str = "br"

    async def chat(self, request: web.Request) -> web.Response:
        self.offers[request.path] = request.headers.get("Accept-Encoding")
        data = brotli.compress(BODY) if self.encoding == "br" else BODY
        return web.Response(
            body=data,
            headers={"Content-Type": "application/json", "Content-Encoding": self.encoding},
        )

    async def other(self, request: web.Request) -> web.Response:
        self.offers[request.path] = request.headers.get("Accept-Encoding")
        return web.json_response({"data": []})


@dataclass
class Running:
    base: str
    upstream: Upstream
    proxy: ProxyServer
    sender: FakeSender


async def _running(unmetered: str) -> AsyncIterator[Running]:
    upstream = Upstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream.chat)
    app.router.add_route("*", "/{tail:.*}", upstream.other)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up_port = runner.addresses[0][1]
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        options = ProxyOptions(default_tenant="acme", unmetered=unmetered)
        proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap, options=options)
        port = await proxy.start("127.0.0.1", 0)
        try:
            yield Running(f"http://127.0.0.1:{port}", upstream, proxy, sender)
        finally:
            await proxy.stop()
            await runner.cleanup()


@pytest.fixture
async def forwarding() -> AsyncIterator[Running]:
    async for running in _running("forward"):
        yield running


@pytest.fixture
async def rejecting() -> AsyncIterator[Running]:
    async for running in _running("reject"):
        yield running


async def test_a_br_answer_is_forwarded_as_sent_and_billed_decoded(forwarding: Running) -> None:
    async with (
        ClientSession(auto_decompress=False) as client,
        client.post(
            f"{forwarding.base}/v1/chat/completions",
            json={"model": "gpt-4o-mini", "messages": []},
            headers={"X-Tenant": "acme", "Accept-Encoding": "br, compress"},
        ) as resp,
    ):
        assert resp.headers["Content-Encoding"] == "br"
        assert await resp.read() == brotli.compress(BODY)
    assert forwarding.upstream.offers["/v1/chat/completions"] == "br"
    (tokens,), _ = worker_tokens(forwarding.sender)
    assert tokens.provider_request_id == "chatcmpl-br1"
    assert tokens.text == "brotli ✓"
    assert tokens.usage.input_tokens == 40


async def test_an_upstream_ignoring_accept_encoding_is_counted(forwarding: Running) -> None:
    forwarding.upstream.encoding = "exi"
    async with (
        ClientSession(auto_decompress=False) as client,
        client.post(
            f"{forwarding.base}/v1/chat/completions",
            json={},
            headers={"X-Tenant": "acme"},
            skip_auto_headers=("Accept-Encoding",),  # no offer: any coding
        ) as resp,
    ):
        assert await resp.read() == BODY  # forwarded all the same
    assert forwarding.upstream.offers["/v1/chat/completions"] == "identity"
    assert forwarding.proxy.tees.stats.undecodable == {"/v1/chat/completions": 1}
    assert forwarding.sender.records == []


async def test_an_unmetered_call_is_forwarded_unchanged_and_counted(forwarding: Running) -> None:
    async with ClientSession() as client:
        for path in ("/v1/models", "/v1/files/file-AbC123dEf456gHi789", "/v1/models"):
            async with client.get(
                f"{forwarding.base}{path}", headers={"Accept-Encoding": "compress"}
            ) as resp:
                assert resp.status == 200
                assert await resp.json() == {"data": []}
    assert forwarding.upstream.offers["/v1/models"] == "compress"  # not metered: as sent
    assert forwarding.proxy.stats.unmetered == {"/v1/models": 2, "/v1/files/{id}": 1}
    assert forwarding.proxy.forwarded == 3
    assert forwarding.sender.records == []


async def test_an_unmetered_call_is_refused_with_reject(rejecting: Running) -> None:
    async with ClientSession() as client:
        async with client.get(f"{rejecting.base}/v1/models") as resp:
            assert resp.status == 403
            text = await resp.text()
        assert "GET /v1/models is not metered" in text
        assert "--unmetered reject" in text
        async with client.post(
            f"{rejecting.base}/v1/chat/completions", json={}, headers={"X-Tenant": "acme"}
        ) as resp:
            assert resp.status == 200  # a metered call goes through
            await resp.read()
    assert "/v1/models" not in rejecting.upstream.offers  # never forwarded
    assert rejecting.proxy.stats.unmetered == {"/v1/models": 1}
    assert rejecting.proxy.stats.refused == {"unmetered": 1}
    assert rejecting.proxy.forwarded == 1


def test_the_option_takes_forward_or_reject(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["proxy", "--upstream", "http://127.0.0.1:1", "--unmetered", "drop"])
    assert "invalid choice: 'drop'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--unmetered must be one of forward, reject"):
        ProxyOptions(unmetered="drop")
