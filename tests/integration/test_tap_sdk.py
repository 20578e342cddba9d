"""The official SDKs (`openai`, `anthropic`, `google-genai`) through `streamtally proxy`.

A small aiohttp upstream replays our own transcripts (`samples/`): the
transcript a call gets is named by its ``X-Sample`` header (the SDKs send
extra headers as they are), streamed in small pieces for a streaming call,
or, for a non-streaming call, as the body the provider returns for it
(`tests.bodies`, assembled from the same transcript).  Each SDK's async
client has its ``base_url`` at the proxy (`ProxyServer`, the command's own
code, with a real `Tap` to the real Kafka), and each call names its own
tenant (``X-Tenant``).

Checked:

- what each SDK parsed is exactly what the upstream sent: its events (or
  its response object), dumped with the fields the JSON set, equal the
  transcript's events (or the body); a raw read with httpx (the SDKs' own
  HTTP client) gets the transcript's bytes, byte for byte;
- a client that breaks off mid-stream (Anthropic, `close()` on the stream)
  ends its request `cancelled`, with what it had;
- the worker's Tokens and usage row of every call equal `streamtally fold`
  of the same transcript (or of the body, as one event).
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
from aiohttp import web

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, Source
from streamtally.core.normalize import read_events
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyOptions, ProxyServer
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics
from tests.bodies import body_of
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

SOURCES = {
    "openai": Source.OPENAI,
    "openai-responses": Source.OPENAI_RESPONSES,
    "anthropic": Source.ANTHROPIC,
    "gemini": Source.GEMINI,
}
#: SSE blocks of the cut transcript the upstream sends before it waits (and the client leaves).
BEFORE_LEAVING = 8
CUT_SAMPLE = "anthropic/long_text_bench.sse"
#: Streaming calls read raw with httpx, one per source.
RAW_READS = (
    "openai/parallel_tool_calls_cached.sse",
    "openai-responses/text_cached.sse",
    "anthropic/thinking_then_text.sse",
    "gemini/long_text_bench.sse",
)


def source_of_sample(sample: str) -> Source:
    return SOURCES[sample.split("/", 1)[0]]


def blocks(sample: str) -> list[bytes]:
    """The transcript's SSE blocks, each with its blank line."""
    data = (SAMPLES / sample).read_bytes()
    return [block + b"\n\n" for block in data.split(b"\n\n") if block.strip()]


def cut_prefix() -> bytes:
    return b"".join(blocks(CUT_SAMPLE)[:BEFORE_LEAVING])


def sent_unasked(sample: str) -> bytes:
    """What the upstream sends a call that did not ask for usage (the SDKs' default)."""
    data = (SAMPLES / sample).read_bytes()
    if source_of_sample(sample) is Source.OPENAI:
        return openai_stream(data, include_usage=False)
    return data


def transcript_events(sample: str, data: bytes | None = None) -> list[dict[str, Any]]:
    """The JSON objects of the transcript's events (`[DONE]` and Anthropic pings aside).

    What the SDKs yield: openai stops at `[DONE]`, anthropic skips `ping`.
    """
    source = source_of_sample(sample)
    raw = (SAMPLES / sample).read_bytes() if data is None else data
    return [
        json.loads(event.data)
        for event in read_events(source, io.BytesIO(raw))
        if event.data.startswith("{") and event.event != "ping"
    ]


class Upstream:
    """The provider: replays the transcript named by ``X-Sample``."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.calls = 0

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        self.leave.set()
        assert self.runner is not None
        await self.runner.cleanup()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        sample = request.headers["X-Sample"]
        body = await request.json()
        streaming = request.path.endswith(":streamGenerateContent") or body.get("stream") is True
        if not streaming:
            return web.json_response(body_of(source_of_sample(sample), SAMPLES / sample))
        cut = request.headers.get("X-Cut")
        data = b"".join(blocks(sample)[: int(cut)]) if cut else (SAMPLES / sample).read_bytes()
        if source_of_sample(sample) is Source.OPENAI:  # usage only when asked, as OpenAI does
            data = openai_stream(data, include_usage=asked_for_usage(body))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(data), 97):
            await response.write(data[start : start + 97])
            await asyncio.sleep(0)
        if cut:
            await asyncio.wait_for(self.leave.wait(), 60)  # the client leaves meanwhile
        else:
            await response.write_eof()
        return response


@dataclass
class Call:
    """One SDK call: what it asked for, what the SDK parsed, and what fold expects of it."""

    name: str
    sample: str
    streaming: bool
    tenant: str = ""
    #: The SDK's events (streaming) or its response object, dumped as the JSON set them.
    parsed: list[dict[str, Any]] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        return {"X-Sample": self.sample, "X-Tenant": self.tenant}

    def want_parsed(self) -> list[dict[str, Any]]:
        if self.streaming:
            return transcript_events(self.sample, sent_unasked(self.sample))
        return [body_of(source_of_sample(self.sample), SAMPLES / self.sample)]


def dump(model: Any) -> dict[str, Any]:
    """An SDK object as the JSON it was parsed from.

    google-genai adds two fields of its own, never on the wire: the HTTP
    response's headers and (non-streaming) the automatic function calling history.
    """
    out: dict[str, Any] = model.model_dump(
        mode="json",
        exclude_unset=True,
        by_alias=True,
        exclude={"sdk_http_response", "automatic_function_calling_history"},
    )
    return out


CALLS = [
    Call("openai-chat-stream", "openai/parallel_tool_calls_cached.sse", streaming=True),
    Call("openai-chat-body", "openai/reasoning_cache_hit.sse", streaming=False),
    Call("openai-responses-stream", "openai-responses/reasoning_parallel_calls.sse", True),
    Call("openai-responses-body", "openai-responses/text_cached.sse", streaming=False),
    Call("anthropic-stream", "anthropic/thinking_then_text.sse", streaming=True),
    Call("anthropic-body", "anthropic/parallel_tool_use_cache.sse", streaming=False),
    Call("gemini-stream", "gemini/long_text_bench.sse", streaming=True),
    Call("gemini-body", "gemini/text_stop.sse", streaming=False),
]


# Each SDK is imported where it is called: importing all three costs about 2 CPU-s, which
# every test process of a parallel run would pay at collection for the one that runs them.


async def openai_calls(base: str, calls: dict[str, Call]) -> None:
    import openai

    client = openai.AsyncOpenAI(api_key="sk-test", base_url=f"{base}/v1", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    try:
        call = calls["openai-chat-stream"]
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, stream=True, extra_headers=call.headers()
        )
        call.parsed = [dump(chunk) async for chunk in stream]
        call = calls["openai-chat-body"]
        completion = await client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, extra_headers=call.headers()
        )
        call.parsed = [dump(completion)]
        call = calls["openai-responses-stream"]
        events = await client.responses.create(
            model="gpt-5", input="hi", stream=True, extra_headers=call.headers()
        )
        call.parsed = [dump(event) async for event in events]
        call = calls["openai-responses-body"]
        response = await client.responses.create(
            model="gpt-4.1", input="hi", extra_headers=call.headers()
        )
        call.parsed = [dump(response)]
    finally:
        await client.close()


async def anthropic_calls(base: str, calls: dict[str, Call], cut: Call) -> None:
    import anthropic

    client = anthropic.AsyncAnthropic(api_key="sk-ant-test", base_url=base, max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    try:
        call = calls["anthropic-stream"]
        stream = await client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=256,
            messages=messages,
            stream=True,
            extra_headers=call.headers(),
        )
        call.parsed = [dump(event) async for event in stream]
        call = calls["anthropic-body"]
        message = await client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=256,
            messages=messages,
            extra_headers=call.headers(),
        )
        call.parsed = [dump(message)]
        # Breaks off mid-stream: the upstream has sent BEFORE_LEAVING blocks and waits.
        want = len(transcript_events(CUT_SAMPLE, cut_prefix()))
        stream = await client.messages.create(
            model="claude-haiku-4-5",
            max_tokens=256,
            messages=messages,
            stream=True,
            extra_headers=cut.headers() | {"X-Cut": str(BEFORE_LEAVING)},
        )
        async for event in stream:
            cut.parsed.append(dump(event))
            if len(cut.parsed) == want:
                break
        await stream.close()
    finally:
        await client.close()


async def gemini_calls(base: str, calls: dict[str, Call]) -> None:
    from google import genai
    from google.genai import types as genai_types

    def config(call: Call) -> genai_types.GenerateContentConfig:
        return genai_types.GenerateContentConfig(
            http_options=genai_types.HttpOptions(headers=call.headers())
        )

    client = genai.Client(api_key="g-test", http_options=genai_types.HttpOptions(base_url=base))
    try:
        call = calls["gemini-stream"]
        chunks = await client.aio.models.generate_content_stream(
            model="gemini-2.5-flash-lite", contents="hi", config=config(call)
        )
        call.parsed = [dump(chunk) async for chunk in chunks]
        call = calls["gemini-body"]
        response = await client.aio.models.generate_content(
            model="gemini-2.5-flash-lite", contents="hi", config=config(call)
        )
        call.parsed = [dump(response)]
    finally:
        await client.aio.aclose()


async def raw_reads(base: str, tenants: dict[str, str]) -> dict[str, bytes]:
    """Each streaming transcript read through the proxy with httpx, bytes as they come."""
    paths = {
        Source.OPENAI: "/v1/chat/completions",
        Source.OPENAI_RESPONSES: "/v1/responses",
        Source.ANTHROPIC: "/v1/messages",
        Source.GEMINI: "/v1beta/models/gemini-2.5-flash-lite:streamGenerateContent?alt=sse",
    }
    got: dict[str, bytes] = {}
    async with httpx2.AsyncClient(timeout=30) as client:
        for sample in RAW_READS:
            headers = {"X-Sample": sample, "X-Tenant": tenants[sample]}
            url = base + paths[source_of_sample(sample)]
            async with client.stream("POST", url, json={"stream": True}, headers=headers) as resp:
                assert resp.status_code == 200
                got[sample] = b"".join([piece async for piece in resp.aiter_raw()])
    return got


@dataclass
class Seen:
    raw: dict[str, bytes]
    tap: Any
    upstream_calls: int
    proxy: Any


async def traffic(
    servers: str, namespace: str, calls: dict[str, Call], cut: Call, raw_tenants: dict[str, str]
) -> Seen:
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    upstream = Upstream()
    up_port = await upstream.start()
    total = len(calls) + 1 + len(RAW_READS)
    async with Tap(servers, namespace=namespace) as tap:
        # The cut call's upstream stays silent after its client left: drained 1 s, then cut.
        proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap, options=ProxyOptions(drain_s=1))
        port = await proxy.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            await openai_calls(base, calls)
            await anthropic_calls(base, calls, cut)
            await gemini_calls(base, calls)
            raw = await raw_reads(base, raw_tenants)
            for _ in range(200):  # the proxy notices the cut client and ends its request
                if tap.stats.requests == total:
                    break
                await asyncio.sleep(0.05)
        finally:
            await proxy.stop()
            await upstream.stop()
    return Seen(raw, tap.stats, upstream.calls, proxy.stats)


def folded(source: Source, path: Path) -> dict[str, Any]:
    """What `streamtally fold` prints for the transcript."""
    done = cli("fold", "--source", source.value, str(path))
    assert done.code == 0, done.err
    return dict(json.loads(done.out))


def test_sdk_clients_get_the_upstream_unchanged_and_the_pipeline_counts_their_calls(
    worker: WorkerProcess, bootstrap_servers: str, redis_url: str, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:10]
    calls = {
        call.name: Call(call.name, call.sample, call.streaming, f"sdk-{call.name}-{run}")
        for call in CALLS
    }
    cut = Call("anthropic-cut", CUT_SAMPLE, streaming=True, tenant=f"sdk-anthropic-cut-{run}")
    raw_tenants = {
        sample: f"sdk-raw-{source_of_sample(sample).value}-{run}" for sample in RAW_READS
    }
    tenants = [c.tenant for c in calls.values()] + [cut.tenant, *raw_tenants.values()]
    namespace = Settings.load().namespace
    try:
        seen = asyncio.run(traffic(bootstrap_servers, namespace, calls, cut, raw_tenants))

        # What each SDK parsed is what the upstream sent.
        for call in calls.values():
            assert call.parsed == call.want_parsed(), call.name
        assert cut.parsed == transcript_events(CUT_SAMPLE, cut_prefix())
        for sample in RAW_READS:
            assert seen.raw[sample] == sent_unasked(sample), sample
        assert seen.upstream_calls == len(calls) + 1 + len(RAW_READS)
        assert seen.tap.requests == len(calls) + 1 + len(RAW_READS)
        assert seen.tap.cancelled == 1
        assert (seen.proxy.clients_gone, seen.proxy.drains_cut) == (1, 1)
        assert seen.proxy.usage_asked == 2  # the SDK's default streamed chat, the raw read
        assert seen.proxy.usage_chunks_held == 2
        assert seen.tap.appended == seen.tap.sent  # every record spooled was sent
        assert seen.tap.failed == 0

        # The pipeline's Tokens and usage of every call are the fold of what was sent.
        expected: dict[str, dict[str, Any]] = {}
        for call in calls.values():
            source = source_of_sample(call.sample)
            path = SAMPLES / call.sample
            if not call.streaming:
                path = tmp_path / f"{call.name}.sse"
                body = json.dumps(body_of(source, SAMPLES / call.sample))
                path.write_text(f"data: {body}\n\n")
            expected[call.tenant] = folded(source, path)
        for sample, tenant in raw_tenants.items():
            expected[tenant] = folded(source_of_sample(sample), SAMPLES / sample)
        cut_file = tmp_path / "anthropic-cut.sse"
        cut_file.write_bytes(cut_prefix())
        assert folded(Source.ANTHROPIC, cut_file)["finish_reason"] == "error"
        expected[cut.tenant] = folded(Source.ANTHROPIC, cut_file) | {
            "finish_reason": "cancelled",
            "finish_reason_raw": None,
            "error": None,
        }
        assert expected[cut.tenant]["usage"]["input_tokens"] > 0  # message_start's count

        # Each call is keyed by an id of its own; the provider's id stays on its Tokens.
        calls = tapped_calls(bootstrap_servers, namespace, tenants)
        assert all(len(ids) == 1 for ids in calls.values()), calls
        refs = {tenant: RequestRef(tenant, calls[tenant][0]) for tenant in expected}
        missing = wait_for_tokens(redis_url, refs.values(), timeout=60, worker=worker)
        assert not missing, f"no Tokens for {missing}"
        for tenant in tenants:
            _check_tenant(refs[tenant], as_called(expected[tenant], refs[tenant].request_id))
    finally:
        forget_usage(redis_url, tenants)


def _check_tenant(ref: RequestRef, want: dict[str, Any]) -> None:
    got = cli("tokens", "get", ref.request_id, "--tenant", ref.tenant)
    assert got.code == 0, got.err
    assert json.loads(got.out) == want, ref.tenant
    rows = cli("usage", "--tenant", ref.tenant, "--json")
    assert rows.code == 0, rows.err
    [row] = json.loads(rows.out)
    assert row["requests"] == 1
    assert {f: row[f] for f in USAGE_FIELDS} == want["usage"], ref.tenant
