"""Quiet is not the end while the call is alive (issue 24): keep-alives on the real stack.

A local aiohttp upstream streams an OpenAI transcript (with its usage, as the
proxy asks for it: `tests.openai_upstream`), but after its first
`THINK_AFTER` events it goes silent for `SILENCE_S`, twice the worker's
request timeout, as a reasoning model may, then sends the rest.  Two calls
of their own tenants go through at once, each through a `ProxyServer` with a
real `Tap` of its own (its spool in the test's directory) in front of that
upstream, while their clients stay connected:

- the kept call's tap sends keep-alives every `KEEPALIVE_S`: it is closed
  once, by its END, and billed exactly the fold of the transcript (its Tokens,
  one billing event, finished ``stop``, no timeout error, no dead letter);
- the control call's tap sends none (``keepalive_s=None``): the same silence
  closes it as timed out (revision 0, ``error``), which shows the silence is
  long enough to matter; what came after amends it (revision 1, the fold):
  two bills where the kept call has one.

A worker of a topic namespace and Redis database of its own (`own_worker`)
times requests out after `REQUEST_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web

from streamtally.core.identity import RequestRef
from streamtally.ops.worker_process import WorkerProcess
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyOptions, ProxyServer
from streamtally.settings import Settings
from streamtally.store import RedisStore
from tests.integration.worker import (
    SAMPLES,
    Endpoints,
    as_called,
    cli,
    own_worker,
    raw_sse_of,
    tapped_calls,
    wait_for_tokens,
)
from tests.openai_upstream import asked_for_usage, openai_blocks, openai_stream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TRANSCRIPT = SAMPLES / "openai" / "text_usage.sse"
#: The worker's request timeout, the tap's keep-alive interval, the upstream's silence.
REQUEST_TIMEOUT_S = 3.0
KEEPALIVE_S = 1.0
SILENCE_S = 2 * REQUEST_TIMEOUT_S
#: Events the upstream sends before it goes silent.
THINK_AFTER = 2


@pytest.fixture
def scene(stack_endpoints: Endpoints, tmp_path: Path) -> Iterator[tuple[Settings, WorkerProcess]]:
    """A worker of a namespace and Redis database of its own, with a short request timeout."""
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="tapka",
        log=tmp_path / "worker.log",
        request_timeout=REQUEST_TIMEOUT_S,
    ) as (settings, worker):
        yield settings, worker


class Upstream:
    """Streams the transcript (with usage when asked), silent for `SILENCE_S` after the
    first `THINK_AFTER` events; `silences` are the silences it kept, in seconds."""

    def __init__(self, transcript: bytes) -> None:
        self.blocks = openai_blocks(transcript)
        self.silences: list[float] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        asked = asked_for_usage(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        for i, block in enumerate(self.blocks[asked]):
            if i == THINK_AFTER:
                began = loop.time()
                await asyncio.sleep(SILENCE_S)
                self.silences.append(loop.time() - began)
            await response.write(block)
        await response.write_eof()
        return response


async def calls(
    settings: Settings, spool: Path, kept: str, control: str
) -> tuple[list[bytes], list[float], list[Any]]:
    """One call of tenant `kept` through a tap with keep-alives and one of `control` through
    a tap without, at once; their bodies, the upstream's silences and the taps' stats."""
    upstream = Upstream(TRANSCRIPT.read_bytes())
    port = await upstream.start()
    try:
        async with (
            Tap(
                settings.bootstrap_servers,
                namespace=settings.namespace,
                spool_dir=spool / "kept",
                keepalive_s=KEEPALIVE_S,
            ) as with_keepalives,
            Tap(
                settings.bootstrap_servers,
                namespace=settings.namespace,
                spool_dir=spool / "control",
                keepalive_s=None,
            ) as without,
        ):
            proxies = [
                ProxyServer(f"http://127.0.0.1:{port}", tap, options=ProxyOptions())
                for tap in (with_keepalives, without)
            ]
            try:
                ports = [await proxy.start("127.0.0.1", 0) for proxy in proxies]
                chat = {"model": "gpt-4o-mini", "stream": True, "messages": []}
                async with ClientSession(timeout=ClientTimeout(total=60)) as client:

                    async def call(proxy_port: int, tenant: str) -> bytes:
                        url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
                        async with client.post(url, json=chat, headers={"X-Tenant": tenant}) as r:
                            assert r.status == 200, await r.text()
                            return await r.read()  # connected throughout the silence

                    bodies = await asyncio.gather(call(ports[0], kept), call(ports[1], control))
            finally:
                for proxy in proxies:
                    await proxy.stop()
            stats = [with_keepalives.stats, without.stats]
    finally:
        await upstream.stop()
    return list(bodies), upstream.silences, stats


async def stored_tokens(url: str, refs: list[RequestRef]) -> list[dict[str, Any]]:
    store = RedisStore.from_url(url)
    try:
        texts = await store.tokens_texts(refs)
    finally:
        await store.aclose()
    return [json.loads(text) if text is not None else {} for text in texts]


def test_a_call_silent_for_twice_the_timeout_is_closed_once_by_its_end(
    scene: tuple[Settings, WorkerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, worker = scene
    run = uuid.uuid4().hex[:8]
    kept, control = f"tapka-{run}-kept", f"tapka-{run}-control"
    bodies, silences, (kept_stats, control_stats) = asyncio.run(
        calls(settings, tmp_path / "spool", kept, control)
    )
    print(
        f"\nupstream silent {min(silences):.2f} s (the worker's timeout {REQUEST_TIMEOUT_S:g} s); "
        f"keep-alives sent: {kept_stats.keepalives} (every {KEEPALIVE_S:g} s), control: "
        f"{control_stats.keepalives}"
    )
    plain = openai_stream(TRANSCRIPT.read_bytes(), include_usage=False)
    assert bodies == [plain, plain]  # both clients got their whole stream
    assert len(silences) == 2
    assert min(silences) >= SILENCE_S
    # The kept call's tap sent a keep-alive about every second of the silence; the other none.
    assert kept_stats.keepalives >= SILENCE_S / KEEPALIVE_S - 2, kept_stats
    assert control_stats.keepalives == 0
    assert kept_stats.failed == control_stats.failed == 0

    found = tapped_calls(settings.bootstrap_servers, settings.namespace, [kept, control])
    assert {tenant: len(ids) for tenant, ids in found.items()} == {kept: 1, control: 1}
    refs = [RequestRef(tenant, ids[0]) for tenant, ids in found.items()]
    missing = wait_for_tokens(settings.redis_url, refs, timeout=60, worker=worker)
    assert not missing, worker.describe()

    # The raw records: the keep-alives in the kept call's sequence, between its events.
    records = raw_sse_of(settings.bootstrap_servers, settings.namespace, [kept, control])
    by_tenant = {
        tenant: sorted(
            {r.seq: r for r in records if r.tenant == tenant}.values(), key=lambda r: r.seq
        )
        for tenant in (kept, control)
    }
    alive = [r.seq for r in by_tenant[kept] if r.is_keepalive]
    assert alive == list(range(THINK_AFTER, THINK_AFTER + len(alive)))
    assert len(alive) == kept_stats.keepalives
    assert [r.seq for r in by_tenant[kept]] == list(range(len(by_tenant[kept])))
    assert not any(r.is_keepalive for r in by_tenant[control])

    # Billed exactly the fold of the transcript, closed by its END: no timeout.
    done = cli("fold", "--source", "openai", str(TRANSCRIPT))
    assert done.code == 0, done.err
    folded: dict[str, Any] = json.loads(done.out)
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", settings.namespace)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    events = billing_events(3)
    for _ in range(40):  # the amendment's Tokens reach Redis right after its bill reaches Kafka
        kept_tokens, control_tokens = asyncio.run(stored_tokens(settings.redis_url, refs))
        if control_tokens.get("error") is None:
            break
        time.sleep(0.25)
    assert kept_tokens == as_called(folded, refs[0].request_id)
    assert kept_tokens.get("error") is None
    kept_events = [e for e in events if e["tenant"] == kept]
    assert len(kept_events) == 1  # one billing event: closed once
    (event,) = kept_events
    assert event["request_id"] == refs[0].request_id
    assert (event["finish_reason"], event["revision"]) == (folded["finish_reason"], 0)
    assert event["finish_reason"] == "stop"
    assert {name: event[name] for name in folded["usage"]} == folded["usage"]
    # The control: the same silence closed it as timed out; the rest amended it.
    control_events = sorted(
        (e for e in events if e["tenant"] == control), key=lambda e: e["revision"]
    )
    assert [(e["finish_reason"], e["revision"]) for e in control_events] == [
        ("error", 0),
        ("stop", 1),
    ]
    assert control_tokens == as_called(folded, refs[1].request_id)
    # Dead letters: none of either call.
    letters = cli("deadletter", "--json")
    assert letters.code == 0, letters.err
    dead = [json.loads(line) for line in letters.out.decode().splitlines()]
    assert dead == []
    worker.check()  # still running


def billing_events(count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """`billing export --json` of the namespace once it holds `count` events."""
    deadline = time.monotonic() + timeout
    while True:
        export = cli("billing", "export", "--json")
        assert export.code == 0, export.err
        events = [json.loads(line) for line in export.out.decode().splitlines()]
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.5)
