"""No credential of a proxied call shows anywhere: `streamtally proxy` run as a process.

The real command (a subprocess, its real `Tap` to the session's Kafka, in a
topic namespace of its own) in front of a local upstream that answers by the
``X-Mode`` header: a good stream, a malformed HTTP reply, a stream that
breaks off, a stream whose client goes away; then the calls the proxy
refuses (the tenant header twice, a body too large), and last a call after
the upstream has gone (unreachable).  Every call carries an OpenAI bearer
key, an Anthropic ``x-api-key``, a Gemini ``x-goog-api-key`` and a ``key=``
parameter.  None of them may appear in the proxy's output (every log line,
its last summary), in any answer, or in any record of the raw topics; the
output must show that each error path was taken.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from streamtally.topics import Topics
from streamtally.wire.kafka import read_topic
from tests.integration.worker import SAMPLES

pytestmark = pytest.mark.integration

SECRETS = ("sk-proj-Zq0123456789secret", "sk-ant-api03-Xy98765secret", "AIzaSyG00gleSecret42")
TEXT = (SAMPLES / "anthropic" / "text_end_turn.sse").read_bytes()


class Upstream:
    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        mode = request.headers.get("X-Mode", "good")
        if mode == "garbage":
            assert request.transport is not None
            request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n{")
            request.transport.close()
            return web.Response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if mode == "break":
            await response.write(TEXT[:300])
            assert request.transport is not None
            request.transport.close()
            return response
        if mode == "slow":  # its client goes away meanwhile
            await response.write(TEXT[:300])
            await asyncio.sleep(0.5)
            await response.write(TEXT[300:])
        else:
            await response.write(TEXT)
        await response.write_eof()
        return response


def start_proxy(
    upstream: str, namespace: str, bootstrap: str, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    out = log.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "streamtally.cli", "proxy",
            "--upstream", upstream, "--listen", "127.0.0.1:0",
            "--bootstrap-servers", bootstrap, "--max-request-bytes", "10000",
            "--drain-seconds", "1", "--metrics", "127.0.0.1:0",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "STREAMTALLY_NAMESPACE": namespace, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    for _ in range(600):
        found = re.search(rb"listening on 127\.0\.0\.1:(\d+)", log.read_bytes())
        if found:
            return proc, int(found.group(1))
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"the proxy did not start: {log.read_text()}")


async def calls(port: int, up: Upstream) -> list[str]:
    url = f"http://127.0.0.1:{port}/v1/messages?key={SECRETS[2]}"
    headers = {
        "Authorization": f"Bearer {SECRETS[0]}",
        "x-api-key": SECRETS[1],
        "x-goog-api-key": SECRETS[2],
        "X-Tenant": "acme",
    }
    answers: list[str] = []
    async with ClientSession() as client:
        for mode in ("good", "garbage", "break"):
            try:
                async with client.post(url, data=b"{}", headers=headers | {"X-Mode": mode}) as r:
                    answers.append(f"{r.status} {dict(r.headers)} {await r.text()}")
            except Exception as exc:  # noqa: BLE001 - the broken stream breaks the client off
                answers.append(repr(exc))
        resp = await client.post(url, data=b"{}", headers=headers | {"X-Mode": "slow"})
        answers.append(str(await resp.content.readany()))
        resp.close()  # a client that goes away
        twice = [*headers.items(), ("X-Tenant", "other")]
        async with client.post(url, data=b"{}", headers=twice) as r:
            answers.append(f"{r.status} {await r.text()}")
        async with client.post(url, data=b"x" * 20000, headers=headers) as r:
            answers.append(f"{r.status} {await r.text()}")
        unmetered = f"http://127.0.0.1:{port}/v1/files/file-{SECRETS[0]}?key={SECRETS[2]}"
        async with client.get(unmetered, headers=headers) as r:
            answers.append(f"{r.status} {await r.text()}")
        await up.stop()  # the upstream is gone: the next call cannot reach it
        async with client.post(url, data=b"{}", headers=headers) as r:
            answers.append(f"{r.status} {await r.text()}")
    return answers


async def raw_values(bootstrap: str, namespace: str) -> list[bytes]:
    topics = Topics.in_namespace(namespace)
    found: list[bytes] = []
    for topic in (topics.raw_sse.name, topics.raw_engine.name):
        async for record in read_topic(bootstrap, topic, missing_ok=True):
            found.append(record.value or b"")
            found.extend(value for _, value in record.headers)
    return found


def test_no_credential_shows_in_output_answers_or_records(
    bootstrap_servers: str, tmp_path: Path
) -> None:
    namespace = f"secrets-{uuid.uuid4().hex[:10]}"
    log = tmp_path / "proxy.log"

    async def run() -> tuple[list[str], int]:
        up = Upstream()
        up_port = await up.start()
        proc, port = await asyncio.to_thread(
            start_proxy, f"http://127.0.0.1:{up_port}", namespace, bootstrap_servers, log
        )
        try:
            answers = await calls(port, up)
            await asyncio.sleep(2)  # the drain of the client that went away (1 s)
            found = re.search(r"metrics on (http://\S+/metrics)", log.read_text())
            assert found, log.read_text()
            async with ClientSession() as client, client.get(found.group(1)) as r:
                answers.append(await r.text())  # searched for secrets too
        finally:
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 60)
        return answers, code

    answers, code = asyncio.run(run())
    output = log.read_text()
    assert code == 0, output
    records = asyncio.run(raw_values(bootstrap_servers, namespace))
    assert len(records) > 10, "the good calls were teed"
    # every error path was taken
    assert "upstream call POST /v1/messages failed" in output  # garbage, unreachable
    assert "the upstream broke off" in output
    assert any(a.startswith("400 ") for a in answers)
    assert any(a.startswith("413 ") for a in answers)
    assert sum(a.startswith("502 ") for a in answers) == 2, answers
    assert "1 clients gone, 0 of them cut" in output, output
    metrics = answers[-1]
    assert 'streamtally_proxy_calls_refused_total{reason="too_large"} 1.0' in metrics
    assert 'streamtally_proxy_calls_unmetered_total{path="/v1/files/{id}"} 1.0' in metrics
    assert "streamtally_proxy_clients_gone_total 1.0" in metrics
    assert "streamtally_tap_records_sent_total" in metrics
    assert "streamtally_proxy_background_repeats_total 0.0" in metrics
    for secret in SECRETS:
        assert secret not in output
        assert not any(secret in a for a in answers), answers
        assert not any(secret.encode() in value for value in records)
