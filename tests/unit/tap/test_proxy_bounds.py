"""`streamtally proxy`: who pays (the tenant header), its bounds, and no secret in its words.

The proxy on loopback sockets (an aiohttp upstream and raw or aiohttp clients;
the tap's records kept by a fake sender, no Kafka): a tenant header sent
twice, or not at all, is refused before anything is forwarded; a body over
the limit is 413, a slow one 408, a connection that does not send its
headers is closed, calls past the connection limit are 503; every option is
checked (finite, in range); and neither a log line nor an answer quotes the
credentials of a call whose upstream fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from streamtally.cli import main
from streamtally.cli._output import redacted
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyOptions, ProxyServer, describe
from tests.unit.tap.test_tap import SAMPLES, FakeSender

TEXT = SAMPLES / "openai" / "text_usage.sse"
SECRETS = ("sk-live-0123456789abcdef", "sk-ant-api03-secretsecret", "AIzaSyGoogleSecret123")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


@asynccontextmanager
async def proxied(upstream: str, options: ProxyOptions | None = None) -> AsyncIterator[ProxyServer]:
    async with Tap(sender=FakeSender()) as tap:
        proxy = ProxyServer(upstream, tap, options=options)
        proxy.port = await proxy.start("127.0.0.1", 0)  # type: ignore[attr-defined]
        try:
            yield proxy
        finally:
            await proxy.stop()


def base(proxy: ProxyServer) -> str:
    return f"http://127.0.0.1:{proxy.port}"  # type: ignore[attr-defined]


async def stream_text(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(TEXT.read_bytes())
    await response.write_eof()
    return response


async def test_the_tenant_header_once_or_refused() -> None:
    seen: list[str] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Tenant", "-"))
        return await stream_text(request)

    async with serving(upstream) as port, proxied(f"http://127.0.0.1:{port}") as proxy:
        url = base(proxy) + "/v1/chat/completions"
        async with ClientSession() as client:
            twice = [("X-Tenant", "victim"), ("X-Tenant", "attacker")]
            async with client.post(url, data=b"{}", headers=twice) as response:
                assert response.status == 400
                assert "sent 2 times" in await response.text()
            async with client.post(url, data=b"{}") as response:
                assert response.status == 400
                assert "--default-tenant" in await response.text()
            async with client.post(url, data=b"{}", headers={"X-Tenant": "  "}) as response:
                assert response.status == 400
            async with client.post(url, data=b"{}", headers={"X-Tenant": "acme"}) as response:
                assert response.status == 200
    assert seen == ["-"]  # one call forwarded, without the tenant header
    assert proxy.stats.refused == {"tenant_header_repeated": 1, "tenant_header_missing": 2}
    tenants = {r.tenant for r in proxy.tap._sender.decoded()}  # type: ignore[attr-defined]
    assert tenants == {"acme"}


async def test_a_default_tenant_bills_calls_without_the_header() -> None:
    options = ProxyOptions(default_tenant="house")
    async with (
        serving(stream_text) as port,
        proxied(f"http://127.0.0.1:{port}", options) as proxy,
        ClientSession() as client,
    ):
        url = base(proxy) + "/v1/chat/completions"
        async with client.post(url, data=b"{}") as response:
            assert response.status == 200
            await response.read()
        twice = [("X-Tenant", "a"), ("X-Tenant", "b")]
        async with client.post(url, data=b"{}", headers=twice) as response:
            assert response.status == 400  # twice is refused even with a default
    tenants = {r.tenant for r in proxy.tap._sender.decoded()}  # type: ignore[attr-defined]
    assert tenants == {"house"}


async def test_a_body_over_the_limit_is_413_and_never_forwarded() -> None:
    calls: list[int] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        calls.append(len(await request.read()))
        return await stream_text(request)

    options = ProxyOptions(max_request_bytes=1000, default_tenant="t")
    async with serving(upstream) as port, proxied(f"http://127.0.0.1:{port}", options) as proxy:
        url = base(proxy) + "/v1/chat/completions"
        async with ClientSession() as client:
            async with client.post(url, data=b"x" * 1001) as response:
                assert response.status == 413

            # without a length: chunked, found out while reading
            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(20):
                    yield b"y" * 100

            async with client.post(url, data=chunks()) as response:
                assert response.status == 413
            async with client.post(url, data=b"z" * 1000) as response:
                assert response.status == 200
    assert calls == [1000]
    assert proxy.stats.refused == {"too_large": 2}


async def raw_call(port: int, head: bytes, then: bytes = b"", wait: float = 0.0) -> bytes:
    """A raw HTTP exchange: `head`, a pause, `then`; everything the proxy answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    if wait:
        await asyncio.sleep(wait)
    if then:
        writer.write(then)
        await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(200), 5)
    finally:
        writer.close()


async def test_slow_headers_and_bodies_are_cut() -> None:
    options = ProxyOptions(header_timeout_s=0.3, body_timeout_s=0.3, default_tenant="t")
    async with serving(stream_text) as port, proxied(f"http://127.0.0.1:{port}", options) as proxy:
        # headers that never end: the connection is closed, nothing answered
        got = await raw_call(proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # type: ignore[attr-defined]
        assert got == b""
        # a body that does not come: 408
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
            b"Connection: close\r\n\r\nabc"
        )
        got = await raw_call(proxy.port, head)  # type: ignore[attr-defined]
        assert got.startswith(b"HTTP/1.1 408"), got[:60]
    assert proxy.stats.refused == {"body_timeout": 1}


async def test_calls_past_the_connection_limit_are_503() -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return await stream_text(request)

    options = ProxyOptions(max_connections=2, default_tenant="t")
    async with serving(slow) as port, proxied(f"http://127.0.0.1:{port}", options) as proxy:
        url = base(proxy) + "/v1/chat/completions"
        async with ClientSession() as client:

            async def call() -> int:
                async with client.post(url, data=b"{}") as response:
                    await response.read()
                    if response.status == 503:
                        assert response.headers["Retry-After"] == "1"
                    return response.status

            first = [asyncio.create_task(call()) for _ in range(2)]
            for _ in range(100):
                if proxy._active == 2:
                    break
                await asyncio.sleep(0.01)
            assert await call() == 503
            release.set()
            assert sorted(await asyncio.gather(*first)) == [200, 200]
            assert await call() == 200  # room again
    assert proxy.stats.refused == {"busy": 1}


@pytest.mark.parametrize(
    "option",
    [
        {"drain_s": math.nan},
        {"drain_s": math.inf},
        {"drain_s": -1.0},
        {"header_timeout_s": 0.0},
        {"body_timeout_s": math.nan},
        {"max_request_bytes": 0},
        {"max_connections": 0},
        {"tenant_header": " "},
        {"default_tenant": ""},
    ],
)
def test_options_are_checked(option: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="--"):
        ProxyOptions(**option)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "argv",
    [
        ["--budget-ms", "nan"],
        ["--budget-ms", "inf"],
        ["--budget-ms", "-1"],
        ["--drain-seconds", "nan"],
        ["--keepalive-seconds", "nan"],
        ["--keepalive-seconds", "-1"],
        ["--keepalive-seconds", "0.01"],
        ["--keepalive-seconds", "100000"],
        ["--header-timeout", "0"],
        ["--max-connections", "0"],
        ["--max-request-bytes", "-5"],
    ],
)
def test_the_command_refuses_bad_options_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["proxy", "--upstream", "http://127.0.0.1:9", *argv])
    except SystemExit as exited:  # argparse's own check of the option's type
        code = int(str(exited.code))
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert argv[0] in err or "finite" in err or "whole number" in err or "seconds" in err


@pytest.mark.parametrize(
    ("argv", "keepalive_s"), [([], 30.0), (["--keepalive-seconds", "0"], None)]
)
def test_the_command_gives_its_tap_the_keepalive_interval(
    argv: list[str], keepalive_s: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamtally.cli import proxy

    given: dict[str, object] = {}

    class Stop(Exception):
        pass

    def tap(*args: object, **kwargs: object) -> Tap:
        given.update(kwargs)
        raise Stop

    async def topics(*args: object) -> None:
        return None

    monkeypatch.setattr(proxy, "Tap", tap)
    monkeypatch.setattr(proxy, "ensure_topics", topics)
    with pytest.raises(Stop):
        main(["proxy", "--upstream", "http://127.0.0.1:9", *argv])
    assert given["keepalive_s"] == keepalive_s


def test_describe_hides_what_an_http_client_quotes() -> None:
    exc = RuntimeError(
        "bad reply to POST http://up/v1beta/models/g:generateContent?key=AIzaSyGoogleSecret123 "
        "headers={'Authorization': 'Bearer sk-live-0123456789abcdef', "
        "'x-api-key': 'sk-ant-api03-secretsecret'}"
    )
    text = describe(exc)
    assert text.startswith("RuntimeError: bad reply")
    for secret in SECRETS:
        assert secret not in text
    assert redacted("Authorization: Bearer sk-live-0123456789abcdef") == "Authorization: ***"


async def test_no_secret_in_a_log_line_or_an_answer_when_the_upstream_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n{")
        request.transport.close()
        return web.Response()

    headers = {
        "Authorization": f"Bearer {SECRETS[0]}",
        "x-api-key": SECRETS[1],
        "x-goog-api-key": SECRETS[2],
        "X-Tenant": "t",
    }
    answers: list[str] = []
    caplog.set_level(logging.DEBUG)
    async with serving(garbage) as port:
        for upstream in (f"http://127.0.0.1:{port}", "http://127.0.0.1:1"):
            async with proxied(upstream) as proxy, ClientSession() as client:
                url = base(proxy) + f"/v1beta/models/g:generateContent?key={SECRETS[2]}"
                async with client.post(url, data=b"{}", headers=headers) as response:
                    answers.append(f"{response.status} {await response.text()}")
    assert [a[:3] for a in answers] == ["502", "502"]
    logged = "\n".join(redacted(r.getMessage()) for r in caplog.records)
    assert "upstream call POST" in logged
    for secret in SECRETS:
        assert not any(secret in a for a in answers), answers
        assert secret not in logged
    assert "127.0.0.1" not in " ".join(answers)  # the upstream's address is not echoed


def test_unmetered_paths_are_labelled_without_ids_and_bounded() -> None:
    from collections import Counter

    from streamtally.producers.proxy.server import MAX_UNMETERED_LABELS, unmetered_label

    seen: Counter[str] = Counter()
    assert unmetered_label("/v1/files/file-abc123/content", seen) == "/v1/files/{id}/content"
    assert unmetered_label("/v1/models", seen) == "/v1/models"
    assert unmetered_label("/v1/x/" + "a" * 30, seen) == "/v1/x/{id}"
    for n in range(MAX_UNMETERED_LABELS):
        seen[f"/p{chr(97 + n % 26)}/{'q' * (n // 26)}"] += 1
    assert len(seen) == MAX_UNMETERED_LABELS
    assert unmetered_label("/brand/new", seen) == "other"
    assert unmetered_label("/pa/", seen) == "/pa/"  # one it keeps already


def test_api_versions_are_not_ids() -> None:
    from collections import Counter

    from streamtally.producers.proxy.server import unmetered_label

    seen: Counter[str] = Counter()
    assert unmetered_label("/v1beta/models/gemini-2.5-pro", seen) == "/v1beta/models/{id}"
    assert unmetered_label("/v2/x", seen) == "/v2/x"


async def test_one_tenants_burst_leaves_room_for_the_others() -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return await stream_text(request)

    options = ProxyOptions(max_calls_per_tenant=2)
    async with (
        serving(slow) as port,
        proxied(f"http://127.0.0.1:{port}", options) as proxy,
        ClientSession() as client,
    ):
        url = base(proxy) + "/v1/chat/completions"

        async def call(tenant: str) -> tuple[int, str]:
            async with client.post(url, data=b"{}", headers={"X-Tenant": tenant}) as response:
                await response.read()
                return response.status, response.headers.get("Retry-After", "")

        burst = [asyncio.create_task(call("noisy")) for _ in range(2)]
        for _ in range(100):
            if proxy.in_flight == 2:
                break
            await asyncio.sleep(0.01)
        assert await call("noisy") == (429, "1")  # its third call, while two are in flight
        quiet = asyncio.create_task(call("quiet"))  # another tenant is not refused
        for _ in range(100):
            if proxy.in_flight == 3:
                break
            await asyncio.sleep(0.01)
        assert proxy.in_flight == 3
        release.set()
        assert [status for status, _ in await asyncio.gather(*burst, quiet)] == [200] * 3
        assert (await call("noisy"))[0] == 200  # room again
    assert proxy.stats.refused == {"tenant_busy": 1}
    assert proxy._by_tenant == {}


async def test_a_full_spool_refuses_new_calls_before_forwarding_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    """Kafka holds every record (unacknowledged): the spool fills; a new metered call is
    refused with 503 before it reaches the upstream, /ready says so, an unmetered call still
    passes, and every record already accepted stays in the spool to be sent."""
    from streamtally.producers.proxy.metrics import ProxyCollector, metrics_app

    calls: list[str] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        calls.append(request.path)
        return await stream_text(request)

    sender = FakeSender(hold=True)
    body = TEXT.read_bytes()
    async with (
        serving(upstream) as port,
        Tap(
            sender=sender,
            spool_dir=tmp_path / "spool",
            spool_bytes=10 * len(body),
            spool_headroom_bytes=5 * len(body),  # room for the calls in flight to finish
        ) as tap,
    ):
        proxy = ProxyServer(f"http://127.0.0.1:{port}", tap, options=ProxyOptions())
        proxy_port = await proxy.start("127.0.0.1", 0)
        collector = ProxyCollector(lambda: proxy.stats, lambda: tap.stats, lambda: 0)
        runner = web.AppRunner(metrics_app(collector, lambda: tap.full))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        metrics_port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        statuses = []
        try:
            async with ClientSession() as client:
                for _ in range(12):
                    async with client.post(url, data=b"{}", headers={"X-Tenant": "t"}) as r:
                        await r.read()
                        statuses.append((r.status, r.headers.get("Retry-After")))
                async with client.get(
                    f"http://127.0.0.1:{proxy_port}/v1/models", headers={"X-Tenant": "t"}
                ) as r:
                    assert r.status == 200  # unmetered: nothing to spool, forwarded
                async with client.get(f"http://127.0.0.1:{metrics_port}/ready") as r:
                    assert r.status == 503
                    assert "spool is full" in (await r.json())["reason"]
                async with client.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                    text = await r.text()
        finally:
            await proxy.stop()
            await runner.cleanup()
        accepted = [s for s in statuses if s[0] == 200]
        refused = [s for s in statuses if s[0] == 503]
        assert accepted, statuses
        assert refused, statuses
        assert statuses == accepted + refused  # once full, every new call is refused
        assert set(refused) == {(503, "5")}
        assert calls.count("/v1/chat/completions") == len(accepted)  # refused: not forwarded
        assert proxy.stats.refused["spool_full"] == len(refused)
        assert tap.stats.spool_bytes >= 5 * len(body)
        assert f"streamtally_tap_spool_bytes {float(tap.stats.spool_bytes)}" in text
        assert "streamtally_tap_spool_oldest_unsent_seconds" in text
        assert "streamtally_tap_keepalives_total 0.0" in text
        assert "streamtally_tap_sender_restarts_total 0.0" in text
        assert 'streamtally_proxy_calls_refused_total{reason="spool_full"}' in text
        appended = tap.stats.appended
        sender.hold = False
        sender.release(len(sender.pending))  # Kafka is back: everything accepted is sent
        assert await tap.spool.wait_sent(10)
    assert len(sender.records) == appended
