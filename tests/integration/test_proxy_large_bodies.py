"""Large non-streaming bodies through `streamtally proxy` on the real stack (issue 22, item 4).

A local aiohttp upstream answers a chat completion with a 6 MB body (text of
1- to 4-byte UTF-8 characters, logprobs-sized) and an Anthropic message with a
3 MB one.  The proxy (`ProxyServer` with a real `Tap`) sits in front; a worker
of this module, in a topic namespace of its own (its raw topics created with
their declared ``max.message.bytes``), bills them:

- the 6 MB body is teed whole, in part records, and billed exactly as
  `streamtally fold` bills the body (Tokens and usage row);
- the 3 MB body, through a proxy whose ``max_body_bytes`` is lowered to 1 MiB,
  is billed with the usage, id and model found in its edges; the proxy counts it.

Every client gets the upstream's bytes unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyOptions, ProxyServer
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics, read_topic
from streamtally.wire.records import PART_EVENT
from tests.integration.worker import (
    Endpoints,
    WorkerProcess,
    as_called,
    cli,
    forget_usage,
    tapped_calls,
    wait_for_tokens,
)

pytestmark = pytest.mark.integration

RUN = uuid.uuid4().hex[:10]
UNIT = "a é € 😀 "  # 1, 2, 3 and 4 bytes a character


def openai_body() -> bytes:
    text = UNIT * (6_000_000 // len(UNIT.encode()))
    return json.dumps(
        {
            "id": f"chatcmpl-big-{RUN}",
            "object": "chat.completion",
            "created": 1772366400,
            "model": "gpt-4o-mini",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 1234,
                "completion_tokens": 1_500_000,
                "total_tokens": 1_501_234,
                "prompt_tokens_details": {"cached_tokens": 1024},
            },
        },
        ensure_ascii=False,
    ).encode()


def anthropic_body() -> bytes:
    text = UNIT * (3_000_000 // len(UNIT.encode()))
    return json.dumps(
        {
            "id": f"msg_big_{RUN}",
            "type": "message",
            "role": "assistant",
            "model": "claude-haiku-4-5",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            "usage": {
                "input_tokens": 321,
                "cache_read_input_tokens": 100,
                "cache_creation_input_tokens": 50,
                "output_tokens": 750_000,
            },
        },
        ensure_ascii=False,
    ).encode()


class Upstream:
    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.bodies = {"openai": openai_body(), "anthropic": anthropic_body()}

    async def start(self) -> int:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/v1/chat/completions", self.answer("openai"))
        app.router.add_post("/v1/messages", self.answer("anthropic"))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(self.runner.addresses[0][1])

    def answer(self, name: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            body = self.bodies[name]
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(body)
            await response.prepare(request)
            for start in range(0, len(body), 65536):
                await response.write(body[start : start + 65536])
            await response.write_eof()
            return response

        return handler

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture(scope="module")
def scene(
    stack_endpoints: Endpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, WorkerProcess]]:
    namespace = f"bodies-{RUN}"
    env = stack_endpoints.env() | {"STREAMTALLY_NAMESPACE": namespace}
    asyncio.run(
        ensure_topics(stack_endpoints.bootstrap_servers, Topics.in_namespace(namespace).all)
    )
    worker = WorkerProcess(tmp_path_factory.mktemp("bodies") / "worker.log", env).start()
    try:
        worker.wait_until_ready(60)
        yield namespace, worker
    finally:
        worker.stop(timeout=30)


async def traffic(servers: str, namespace: str, tenants: dict[str, str]) -> dict[str, Any]:
    upstream = Upstream()
    seen: dict[str, Any] = {}
    up_port = await upstream.start()
    async with Tap(servers, namespace=namespace) as tap:
        whole = ProxyServer(f"http://127.0.0.1:{up_port}", tap)
        lowered = ProxyServer(
            f"http://127.0.0.1:{up_port}", tap, options=ProxyOptions(max_body_bytes=1 << 20)
        )
        port = await whole.start("127.0.0.1", 0)
        low_port = await lowered.start("127.0.0.1", 0)
        try:
            async with ClientSession() as client:
                async with client.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": [], "logprobs": True},
                    headers={"X-Tenant": tenants["openai"]},
                ) as resp:
                    assert resp.status == 200
                    seen["openai"] = await resp.read()
                async with client.post(
                    f"http://127.0.0.1:{low_port}/v1/messages",
                    json={"model": "claude-haiku-4-5", "messages": [], "max_tokens": 750000},
                    headers={"X-Tenant": tenants["anthropic"]},
                ) as resp:
                    assert resp.status == 200
                    seen["anthropic"] = await resp.read()
        finally:
            await whole.stop()
            await lowered.stop()
            await upstream.stop()
        seen["oversize"] = (whole.oversize, lowered.oversize)
    seen["tap"] = tap.stats
    seen["bodies"] = upstream.bodies
    return seen


async def raw_events_of(servers: str, topic: str, request_id: str) -> list[str]:
    events = []
    from streamtally.wire import avro

    reading = read_topic(servers, topic)
    async with contextlib.aclosing(reading) as records:
        async for record in records:
            if record.key == request_id.encode() and record.value is not None:
                events.append(avro.decode_raw_sse_event(record.value).event)
    return events


def folded(path: Path, source: str) -> dict[str, Any]:
    done = cli("fold", "--source", source, str(path))
    assert done.code == 0, done.err
    return dict(json.loads(done.out))


def test_a_6_mb_body_is_billed_whole_and_one_past_the_limit_by_its_usage(
    scene: tuple[str, WorkerProcess], bootstrap_servers: str, redis_url: str, tmp_path: Path
) -> None:
    namespace, worker = scene
    tenants = {name: f"bodies-{name}-{RUN}" for name in ("openai", "anthropic")}
    try:
        seen = asyncio.run(traffic(bootstrap_servers, namespace, tenants))
        bodies = seen["bodies"]
        assert len(bodies["openai"]) > 6_000_000
        assert seen["openai"] == bodies["openai"]
        assert seen["anthropic"] == bodies["anthropic"]
        assert seen["oversize"] == (0, 1)
        assert seen["tap"].failed == 0
        assert seen["tap"].appended == seen["tap"].sent  # every record spooled was sent

        openai_sse = tmp_path / "openai.sse"
        openai_sse.write_bytes(b"data: " + bodies["openai"] + b"\n\n")
        anthropic_sse = tmp_path / "anthropic.sse"
        anthropic_sse.write_bytes(b"data: " + bodies["anthropic"] + b"\n\n")
        want_openai = folded(openai_sse, "openai")
        want_anthropic = folded(anthropic_sse, "anthropic")
        calls = tapped_calls(bootstrap_servers, namespace, tenants.values())
        refs = {name: RequestRef(tenants[name], calls[tenants[name]][0]) for name in tenants}
        missing = wait_for_tokens(redis_url, refs.values(), timeout=90, worker=worker)
        assert not missing, f"no Tokens for {missing}\n{worker.describe()}"

        got = cli("tokens", "get", refs["openai"].request_id, "--tenant", tenants["openai"])
        assert got.code == 0, got.err
        # the whole body, text and all
        assert json.loads(got.out) == as_called(want_openai, refs["openai"].request_id)
        got = cli("tokens", "get", refs["anthropic"].request_id, "--tenant", tenants["anthropic"])
        assert got.code == 0, got.err
        tokens = json.loads(got.out)
        assert tokens["usage"] == want_anthropic["usage"]
        assert tokens["usage"]["output_tokens"] == 750_000
        assert (tokens["provider_request_id"], tokens["model"]) == (
            want_anthropic["request_id"],
            want_anthropic["model"],
        )
        assert tokens["finish_reason"] == want_anthropic["finish_reason"] == "length"
        assert tokens["text"] == ""  # its content is not kept
        for name, want in (("openai", want_openai), ("anthropic", want_anthropic)):
            rows = cli("usage", "--tenant", tenants[name], "--json")
            assert rows.code == 0, rows.err
            [row] = json.loads(rows.out)
            assert row["requests"] == 1
            assert {f: row[f] for f in USAGE_FIELDS} == want["usage"], name

        raw = f"{namespace}.raw.sse"
        events = asyncio.run(raw_events_of(bootstrap_servers, raw, refs["openai"].request_id))
        assert events[:-2] == [PART_EVENT] * (len(events) - 2)
        assert len(events) >= 13  # 6 MB in 512 KiB parts, the last record, the END
        events = asyncio.run(raw_events_of(bootstrap_servers, raw, refs["anthropic"].request_id))
        assert events == ["message", "message"]  # the synthetic body, the END
    finally:
        forget_usage(redis_url, tenants.values())
