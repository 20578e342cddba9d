"""Outages are only delay (issue 23): 1,000 streams through the proxy while Kafka is paused.

A local aiohttp upstream streams one of our OpenAI transcripts (with its
usage, as the proxy asks for it: `tests.openai_upstream`) to 1,000 streaming
calls of ten tenants (no semaphore; connection limits off).
`ProxyServer` with a real `Tap` (its spool in the test's directory, its own
topic namespace, its sender in a process of its own as the proxy's default)
sits in front.  A tenth of the calls *think*: after their
first events the upstream waits, a few seconds, as a reasoning model may.
They go first; once they all wait and Kafka has every record so far, the
other 900 calls are released at once and, as they stream, the broker is paused
for `PAUSE_S` seconds (SIGSTOP of the fault stack's Kafka processes, found by
their pid files; SIGCONT after; `fault_stack`, tests/integration/heavy/conftest.py),
so that records pile up in the spool while the clients keep being served; the thinking
calls go on during the pause.  A worker of the namespace, with a request timeout well
below the pause, bills them.

The thinking calls are what makes a timeout likely: their first records
reached the worker before the pause, their next ones wait in the spool, and
only their capture times tell the worker that they were quiet for less than
the request timeout (a tap that stamped records when it sent them makes the
worker close them as timed out).

Checked:

- every client got its whole stream, as the upstream sends it unasked for usage;
- the proxy went on serving during the pause (clients finished while the
  broker was stopped), and the spool held records when it came back;
- the tap failed nothing and its spool is empty at the end;
- every call is billed exactly the fold of its transcript: its Tokens, each
  tenant's usage row (100 calls, 100 times the transcript's usage), one
  billing event per call, finished ``stop``; none closed as timed out or
  ``error`` because its records waited in the spool (the worker's clock runs
  on the records' capture time); no dead letters in the namespace.

The broker is resumed by a helper process of its own session that sends
SIGCONT after the pause whatever becomes of the test, and again by the test
itself (``finally``), which then waits until the broker serves again: other
tests share it.  Containers mode (`tests.integration.conftest`) does not hand
out its Kafka container, so the test is skipped there; CI runs the local stack.
An external Kafka (``KAFKA_BOOTSTRAP_SERVERS``) is paused only when it is the
local stack's of ``STREAMTALLY_STATE_DIR`` (or of this clone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS
from streamtally.ops.worker_process import WorkerProcess
from streamtally.producers import Tap
from streamtally.producers.proxy.server import ProxyOptions, ProxyServer
from streamtally.settings import Settings
from streamtally.stack import ServiceState, kafka
from streamtally.stack.config import StackConfig
from streamtally.store import RedisStore
from tests.integration.worker import (
    SAMPLES,
    Endpoints,
    StackMode,
    as_called,
    cli,
    own_worker,
    tapped_calls,
    wait_for_tokens,
)
from tests.openai_upstream import asked_for_usage, openai_blocks, openai_stream

pytestmark = [pytest.mark.integration, pytest.mark.fault_stack, pytest.mark.timeout(300)]

#: 32 events: 1,000 calls stream 32,000 records, still streaming when the broker is paused
#: and done well within the pause even on a loaded machine (a transcript of 195 events took
#: the proxy 20 s alone and up to 46 s beside the parallel integration tier: all calls
#: progress together, so then none ended during the pause).
TRANSCRIPT = SAMPLES / "openai" / "reasoning_outside_completion.sse"
CALLS = 1000
TENANTS = 10
#: Seconds the broker stays paused, and the worker's request timeout (well below it: the
#: records of the pause wait ~20 s in the spool; a thinking call's own quiet, which is up to
#: the machine before the pause, stays below it by a margin, asserted).
PAUSE_S = 20.0
REQUEST_TIMEOUT_S = 12.0
#: Calls that think: a tenth, released first (ten of each tenant), stream `THINK_AFTER`
#: events, then wait until `THINK_S` after the broker was paused.  Their first events are
#: in Kafka before the pause; their next ones come during it (after a wait below the
#: request timeout, asserted) and wait in the spool until the broker is back, far longer
#: than the timeout.  The wait before the pause is the machine's (every thinking call must
#: wait, and Kafka take what came before: up to 6 s beside a loaded parallel run, and up
#: to 25 s on a slower day while the other calls were released with them, hence first),
#: so the wait after it is short.
THINKING_EVERY = 10
THINK_AFTER = 3
THINK_S = 1.0


@dataclass(frozen=True, slots=True)
class Broker:
    """The local stack's Kafka processes, to pause and resume."""

    pids: tuple[int, ...]
    servers: str

    def pause_for(self, seconds: float) -> subprocess.Popen[bytes]:
        """SIGSTOP every broker now and SIGCONT them after `seconds`, from a process of
        its own session: the broker is resumed even if this process dies meanwhile."""
        pids = " ".join(str(pid) for pid in self.pids)
        script = f"kill -STOP {pids} && sleep {seconds:g}; kill -CONT {pids}"
        return subprocess.Popen(["sh", "-c", script], start_new_session=True)

    def resume(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not kafka.broker_answers(self.servers):
            if time.monotonic() > deadline:
                raise AssertionError(f"Kafka at {self.servers} does not answer after its pause")
            time.sleep(0.5)


def _unavailable(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def broker(stack_endpoints: Endpoints) -> Iterator[Broker]:
    """The brokers of the local stack behind `stack_endpoints` (the fault stack); resumed
    after the test."""
    if stack_endpoints.mode is StackMode.CONTAINERS:
        pytest.skip(
            "pauses the broker: the containers mode does not expose its Kafka container "
            "(CI runs the local stack, where the broker's processes are paused)"
        )
    cfg = StackConfig.from_settings(Settings.load())
    servers = stack_endpoints.bootstrap_servers
    if servers not in (cfg.local_bootstrap_servers(), cfg.all_bootstrap_servers()):
        _unavailable(
            f"pauses the broker: Kafka at {servers} is not the local stack of "
            f"{cfg.state_dir} ({cfg.local_bootstrap_servers()}); set STREAMTALLY_STATE_DIR"
        )
    nodes = kafka.statuses(cfg)
    if any(node.state is not ServiceState.RUNNING or node.pid is None for node in nodes):
        _unavailable(f"pauses the broker: the local stack's Kafka does not run: {nodes}")
    handle = Broker(tuple(node.pid for node in nodes if node.pid is not None), servers)
    try:
        yield handle
    finally:
        handle.resume()
        handle.wait_serving()


@pytest.fixture
def scene(stack_endpoints: Endpoints, tmp_path: Path) -> Iterator[tuple[Settings, WorkerProcess]]:
    """A worker of a namespace and Redis database of its own, timing out requests early."""
    with own_worker(
        stack_endpoints.bootstrap_servers,
        stack_endpoints.redis_url,
        prefix="tapout",
        log=tmp_path / "worker.log",
        request_timeout=REQUEST_TIMEOUT_S,
    ) as (settings, worker):
        yield settings, worker


class Upstream:
    """The provider: streams the transcript event by event, with its usage when asked;
    a call with ``X-Think`` waits after its first `THINK_AFTER` events until `go_on`."""

    def __init__(self, transcript: bytes) -> None:
        self.streams = openai_blocks(transcript)
        self.asked: Counter[bool] = Counter()
        self.runner: web.AppRunner | None = None
        self.go_on = asyncio.Event()
        #: Loop times at which each thinking call began to wait, and went on.
        self.waited: list[tuple[float, float]] = []

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        asked = asked_for_usage(await request.json())
        self.asked[asked] += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        for i, block in enumerate(self.streams[asked]):
            if i == THINK_AFTER and "X-Think" in request.headers:
                thinking = loop.time()
                await self.go_on.wait()
                self.waited.append((thinking, loop.time()))
            await response.write(block)
            await asyncio.sleep(0)
        await response.write_eof()
        return response


@dataclass
class Traffic:
    """What the clients got, when, and what the tap and the proxy said."""

    warm: bytes = b""
    bodies: list[bytes] = field(default_factory=list)
    #: Seconds since the release at which each call ended, the broker was paused, resumed.
    ended: list[float] = field(default_factory=list)
    paused_at: float = 0.0
    resumed_at: float = 0.0
    #: The exit status of the process that paused the broker (0: it was paused, resumed).
    pause_status: int | None = None
    sent_at_pause: int = 0
    sent_at_resume: int = 0
    appended_at_pause: int = 0
    appended_at_resume: int = 0
    spool_bytes_at_resume: int = 0
    #: Seconds from the resume until Kafka had every record.
    drained_after_s: float = 0.0
    tap: Any = None
    proxy: Any = None
    asked: Counter[bool] = field(default_factory=Counter)
    #: (began to wait, went on) of each thinking call, seconds since the release.
    waited: list[tuple[float, float]] = field(default_factory=list)


async def traffic(
    settings: Settings, spool_dir: Path, broker: Broker, tenants: list[str], warm: str
) -> Traffic:
    """One call of tenant `warm`, then `CALLS` calls of `tenants` at once; the broker
    paused for `PAUSE_S` once the thinking calls wait and Kafka has their first events."""
    upstream = Upstream(TRANSCRIPT.read_bytes())
    up_port = await upstream.start()
    seen = Traffic()
    loop = asyncio.get_running_loop()
    async with Tap(
        settings.bootstrap_servers,
        namespace=settings.namespace,
        spool_dir=spool_dir,
        sender_process=True,  # as `streamtally proxy` runs it
    ) as tap:
        proxy = ProxyServer(f"http://127.0.0.1:{up_port}", tap, options=ProxyOptions())
        port = await proxy.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        chat = {"model": "gpt-4o-mini", "stream": True, "messages": []}
        try:
            async with ClientSession(
                connector=TCPConnector(limit=0), timeout=ClientTimeout(total=240)
            ) as client:
                start = loop.time()
                prefix = b"".join(upstream.streams[False][:THINK_AFTER])
                thinking: list[bool] = []

                async def call(tenant: str, think: bool = False) -> tuple[bytes, float]:
                    headers = {"X-Tenant": tenant, **({"X-Think": "1"} if think else {})}
                    async with client.post(url, json=chat, headers=headers) as resp:
                        assert resp.status == 200, await resp.text()
                        body = b""
                        if think:  # what came before the upstream waits
                            while len(body) < len(prefix):
                                body += await resp.content.readany()
                            thinking.append(True)
                        body += await resp.read()
                    return body, loop.time() - start

                # One call first, until Kafka has its records: the producer knows the
                # partitions' leaders of the new topics before the release.
                seen.warm, *_ = await call(warm)
                deadline = loop.time() + 60
                while tap.stats.sent < tap.stats.appended or not tap.stats.sent:
                    assert loop.time() < deadline, (
                        f"Kafka does not take the first call: {tap.stats}"
                    )
                    await asyncio.sleep(0.05)
                start = loop.time()
                # The thinking calls first: their quiet before the pause is the time they
                # take to reach their wait and Kafka to take their first events, not the
                # time the other 900 take to get going on a loaded machine (up to 25 s
                # beside the parallel integration tier, more than the request timeout).
                thinkers = CALLS // THINKING_EVERY
                first = asyncio.gather(
                    *(call(tenants[i % TENANTS], think=True) for i in range(thinkers))
                )
                rest: asyncio.Future[list[tuple[bytes, float]]] | None = None
                try:
                    # Pause once every thinking call waits and Kafka has all it was sent:
                    # the thinking calls are open in the worker, their first events read.
                    deadline = loop.time() + 60
                    while len(thinking) < thinkers:
                        assert loop.time() < deadline, f"{len(thinking)} calls think"
                        await asyncio.sleep(0.005)
                    appended = tap.stats.appended
                    while tap.stats.sent < appended:
                        assert loop.time() < deadline, f"Kafka took only {tap.stats.sent} records"
                        await asyncio.sleep(0.005)
                    # Then the other calls, released at once; the pause comes as they stream.
                    rest = asyncio.gather(
                        *(call(tenants[i % TENANTS]) for i in range(thinkers, CALLS))
                    )
                    await asyncio.sleep(0.2)  # their first events on their way
                    assert not rest.done(), "every call ended before the pause"
                    pause = broker.pause_for(PAUSE_S)
                    try:
                        seen.paused_at = loop.time() - start
                        seen.sent_at_pause = tap.stats.sent
                        seen.appended_at_pause = tap.stats.appended
                        while pause.poll() is None:
                            if loop.time() - start > seen.paused_at + THINK_S:
                                upstream.go_on.set()
                            await asyncio.sleep(0.05)
                    finally:
                        broker.resume()
                        if pause.poll() is None:  # (the test failed): the helper is not needed
                            with contextlib.suppress(ProcessLookupError):
                                os.killpg(pause.pid, signal.SIGKILL)
                            pause.wait()
                    seen.resumed_at = loop.time() - start
                    seen.pause_status = pause.returncode
                    seen.sent_at_resume = tap.stats.sent
                    seen.appended_at_resume = tap.stats.appended
                    seen.spool_bytes_at_resume = tap.stats.spool_bytes
                    results = [*await first, *await rest]
                except BaseException:
                    for calls in (first, rest):
                        if calls is not None:
                            calls.cancel()
                            with contextlib.suppress(BaseException):
                                await calls
                    raise
            for body, ended in results:
                seen.bodies.append(body)
                seen.ended.append(ended)
            deadline = loop.time() + 120
            while tap.stats.spool_bytes:
                assert loop.time() < deadline, f"spool not drained: {tap.stats}"
                await asyncio.sleep(0.05)
            seen.drained_after_s = loop.time() - start - seen.resumed_at
        finally:
            upstream.go_on.set()
            await proxy.stop()
            await upstream.stop()
    seen.tap = tap.stats
    seen.proxy = proxy.stats
    seen.asked = upstream.asked
    seen.waited = [(a - start, b - start) for a, b in upstream.waited]
    return seen


def test_a_broker_paused_20s_under_1000_streams_only_delays_their_bills(
    broker: Broker,
    scene: tuple[Settings, WorkerProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings, worker = scene
    run = uuid.uuid4().hex[:8]
    tenants = [f"tapout-{run}-{i}" for i in range(TENANTS)]
    warm = f"tapout-{run}-warm"
    began = time.monotonic()
    try:
        seen = asyncio.run(traffic(settings, tmp_path / "spool", broker, tenants, warm))
    finally:
        broker.resume()
    broker.wait_serving()
    longest_wait = max(on - waiting for waiting, on in seen.waited)
    during = sum(seen.paused_at < ended < seen.resumed_at for ended in seen.ended)
    print(
        f"\n{CALLS} streams: broker paused at {seen.paused_at:.1f} s for {PAUSE_S:g} s "
        f"({seen.sent_at_pause} records in Kafka, {seen.appended_at_pause} spooled then; "
        f"{seen.sent_at_resume} and {seen.appended_at_resume} at the resume, "
        f"{seen.spool_bytes_at_resume} bytes unsent); {during} calls ended during the pause, "
        f"the last at {max(seen.ended):.1f} s; thinking calls waited up to {longest_wait:.1f} s; "
        f"Kafka had every record {seen.drained_after_s:.1f} s after the resume "
        f"({seen.tap.appended} records, {seen.tap.sent} sent); broker serving "
        f"{time.monotonic() - began:.1f} s after the traffic began"
    )

    # Every client got its whole stream, as the upstream sends it to a client not asking
    # for usage; the proxy asked the upstream for it every time.
    plain = openai_stream(TRANSCRIPT.read_bytes(), include_usage=False)
    assert b'"usage"' not in plain
    assert [i for i, body in enumerate(seen.bodies) if body != plain] == []
    assert len(seen.bodies) == CALLS
    assert seen.warm == plain
    assert seen.asked == Counter({True: CALLS + 1})

    # The broker was stopped for PAUSE_S; the proxy kept serving; records piled up in the spool.
    assert seen.pause_status == 0
    assert seen.resumed_at - seen.paused_at >= PAUSE_S
    # Served during the pause: calls ended in it or, on a machine so loaded that the 1,000
    # calls all progress together and end after it, records spooled in it (each forwarded
    # to its client right after its append) more than one per call.
    served = seen.appended_at_resume - seen.appended_at_pause
    assert during > 0 or served > CALLS, (seen.paused_at, seen.resumed_at, max(seen.ended), served)
    # The thinking calls went on during the pause, after a wait the worker must not take for
    # a timeout (capture times), shorter than it by a margin for this machine's load.
    assert len(seen.waited) == CALLS // THINKING_EVERY
    assert all(seen.paused_at < on < seen.resumed_at for _, on in seen.waited), seen.waited
    assert longest_wait < REQUEST_TIMEOUT_S - 1.5, longest_wait
    assert seen.appended_at_resume > seen.appended_at_pause
    assert seen.spool_bytes_at_resume > 0
    # Nothing failed or was refused, and Kafka has everything.
    assert seen.tap.failed == 0
    assert seen.tap.spool_bytes == 0
    assert (seen.tap.requests, seen.tap.cancelled) == (CALLS + 1, 0)
    assert sum(seen.proxy.refused.values()) == 0
    assert seen.proxy.tapped == CALLS + 1

    # Every call billed the fold of its transcript; none timed out.
    done = cli("fold", "--source", "openai", str(TRANSCRIPT))
    assert done.code == 0, done.err
    folded: dict[str, Any] = json.loads(done.out)
    assert folded["usage"]["output_tokens"] > 0
    calls = tapped_calls(settings.bootstrap_servers, settings.namespace, tenants)
    assert {tenant: len(set(ids)) for tenant, ids in calls.items()} == dict.fromkeys(
        tenants, CALLS // TENANTS
    )
    refs = [RequestRef(tenant, call_id) for tenant, ids in calls.items() for call_id in ids]
    missing = wait_for_tokens(settings.redis_url, refs, timeout=90)
    assert not missing, (len(missing), sorted(missing)[:3], worker.describe())
    billed = time.monotonic()
    stored, rows = asyncio.run(_tokens_and_usage(settings.redis_url, refs, tenants))
    errors = Counter(tokens.get("error") for tokens in stored)
    assert errors == Counter({None: len(refs)}), errors
    wrong = [
        ref
        for ref, tokens in zip(refs, stored, strict=True)
        if tokens != as_called(folded, ref.request_id)
    ]
    assert wrong == [], (len(wrong), wrong[:3])
    each = CALLS // TENANTS
    want = {"requests": each, **{f: (folded["usage"][f] or 0) * each for f in USAGE_FIELDS}}
    assert rows == dict.fromkeys(tenants, want)

    # The billing topic and the dead letters of the namespace.
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", settings.namespace)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    # (The namespace's events are this test's: the warm-up call's, then the 1,000.)
    events = _billing_events(CALLS + 1)
    assert Counter(e["finish_reason"] for e in events) == Counter(
        {folded["finish_reason"]: CALLS + 1}
    )
    mine = [e for e in events if e["tenant"] in tenants]
    assert Counter(e["tenant"] for e in mine) == Counter(dict.fromkeys(tenants, CALLS // TENANTS))
    assert {(e["tenant"], e["request_id"]) for e in mine} == {
        (r.tenant, r.request_id) for r in refs
    }
    letters = cli("deadletter", "--json")
    assert letters.code == 0, letters.err
    assert letters.out == b""
    worker.check()  # still running
    print(f"all Tokens {billed - began:.1f} s after the traffic began")


async def _tokens_and_usage(
    url: str, refs: list[RequestRef], tenants: list[str]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    store = RedisStore.from_url(url)
    try:
        texts = await store.tokens_texts(refs)
        stored = [json.loads(text) if text is not None else {} for text in texts]
        rows: dict[str, dict[str, int]] = {}
        for tenant in tenants:
            total = Counter[str]()
            for row in await store.usage_rows(tenant=tenant):
                total["requests"] += row["requests"]
                for name in USAGE_FIELDS:
                    total[name] += row[name] or 0
            rows[tenant] = dict(total)
    finally:
        await store.aclose()
    return stored, rows


def _billing_events(count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """`billing export --json` of the namespace once it holds `count` events."""
    deadline = time.monotonic() + timeout
    while True:
        export = cli("billing", "export", "--json")
        assert export.code == 0, export.err
        events = [json.loads(line) for line in export.out.decode().splitlines()]
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(1.0)
