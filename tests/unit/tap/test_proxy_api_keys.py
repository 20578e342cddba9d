"""`streamtally proxy --api-keys`: the tenant is the one the call's API key maps to.

The map file and the key extraction as pure functions, then the proxy itself on loopback
sockets (an aiohttp upstream and client, the tap's records kept by a fake sender, no
Kafka): a mapped key is billed to its tenant whatever the tenant header claims, and a call
with no key or an unmapped one is refused before anything reaches the upstream.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from streamtally.cli import main
from streamtally.core.models import Source
from streamtally.core.normalize import fold_stream, read_events
from streamtally.errors import InputError
from streamtally.producers import Tap
from streamtally.producers.proxy.api_keys import ApiKeyTenants, api_key_of
from streamtally.producers.proxy.server import ProxyServer
from tests.unit.tap.test_tap import SAMPLES, FakeSender, as_called, worker_tokens

TEXT = SAMPLES / "openai" / "text_usage.sse"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_file(tmp_path: Path, entries: list[dict[str, Any]]) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": entries}), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("headers", "query", "expected"),
    [
        ({"Authorization": "Bearer sk-1"}, {}, "sk-1"),  # OpenAI
        ({"Authorization": "bearer  sk-1 "}, {}, "sk-1"),
        ({"x-api-key": "ant-1"}, {}, "ant-1"),  # Anthropic
        ({"x-goog-api-key": "g-1"}, {}, "g-1"),  # Gemini
        ({}, {"key": "g-2"}, "g-2"),  # Gemini, in the query
        ({"Authorization": "Basic abc"}, {}, None),
        ({"Authorization": "Bearer "}, {}, None),
        ({}, {}, None),
    ],
)
def test_the_key_of_a_call(
    headers: dict[str, str], query: dict[str, str], expected: str | None
) -> None:
    assert api_key_of(headers, query) == expected


def test_the_map_holds_digests_and_maps_a_key_to_its_tenant(tmp_path: Path) -> None:
    keys = ApiKeyTenants.load(
        key_file(
            tmp_path,
            [
                {"sha256": digest("sk-acme"), "tenant": "acme", "name": "acme prod"},
                {"sha256": digest("sk-globex"), "tenant": "globex"},
            ],
        )
    )
    assert keys.tenant_of({"Authorization": "Bearer sk-acme"}, {}) == "acme"
    assert keys.tenant_of({"x-api-key": "sk-globex"}, {}) == "globex"
    assert keys.tenant_of({"Authorization": "Bearer sk-other"}, {}) is None
    assert keys.tenant_of({}, {}) is None
    assert "sk-" not in repr(keys)
    assert digest("sk-acme") not in repr(keys)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("not json", "not JSON"),
        (json.dumps({"keys": []}), "expected"),
        (json.dumps({"keys": [{"sha256": "ABC", "tenant": "a"}]}), "64 lower-case hex"),
        (json.dumps({"keys": [{"sha256": "a" * 64, "tenant": ""}]}), "non-empty"),
        (
            json.dumps({"keys": [{"sha256": "a" * 64, "tenant": "x"}] * 2}),
            "a key listed twice",
        ),
    ],
)
def test_a_bad_map_is_one_clear_error(tmp_path: Path, doc: str, message: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(doc, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        ApiKeyTenants.load(path)
    with pytest.raises(InputError, match="cannot read it"):
        ApiKeyTenants.load(tmp_path / "absent.json")


def test_the_command_refuses_a_bad_map_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    path.write_text("[]", encoding="utf-8")
    code = main(["proxy", "--upstream", "http://127.0.0.1:9", "--api-keys", str(path)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--api-keys" in err


async def test_the_proxy_bills_the_keys_tenant_and_refuses_other_keys(tmp_path: Path) -> None:
    upstream_calls: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        upstream_calls.append(request.headers.get("Authorization", ""))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(TEXT.read_bytes())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up_port = runner.addresses[0][1]
    keys = ApiKeyTenants.load(key_file(tmp_path, [{"sha256": digest("sk-acme"), "tenant": "acme"}]))
    sender = FakeSender()
    try:
        async with Tap(sender=sender) as tap:
            proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap, api_keys=keys)
            port = await proxy.start("127.0.0.1", 0)
            try:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                async with ClientSession() as client:
                    # a mapped key: forwarded byte for byte, billed to acme whatever it claims
                    headers = {"Authorization": "Bearer sk-acme", "X-Tenant": "globex"}
                    async with client.post(url, data=b"{}", headers=headers) as response:
                        assert response.status == 200
                        assert await response.read() == TEXT.read_bytes()
                    for headers in ({"Authorization": "Bearer sk-stolen"}, {"X-Tenant": "acme"}):
                        async with client.post(url, data=b"{}", headers=headers) as response:
                            assert response.status == 403
                            assert "not forwarded" in await response.text()
            finally:
                await proxy.stop()
    finally:
        await runner.cleanup()
    assert upstream_calls == ["Bearer sk-acme"]  # the refused calls never left the proxy
    assert (proxy.forwarded, proxy.tapped, proxy.refused) == (1, 1, 2)
    assert {r.tenant for r in sender.decoded()} == {"acme"}
    (tokens,), _ = worker_tokens(sender)
    want = fold_stream(Source.OPENAI, read_events(Source.OPENAI, TEXT.open("rb")))
    assert tokens == as_called(want, tokens)
