"""What the proxy benchmarks share: a replaying upstream, a `streamtally proxy` process, its RSS.

The proxy runs as the real command (`streamtally proxy`, a separate process
with its own `Tap` to Kafka), so its memory is its own and its CPU is not the
benchmark's.  The upstream and the clients run in the benchmark's process,
on one event loop: the upstream replays one of our long transcripts
(`samples/openai/long_text_bench.sse`, 195 events), one write per event, and
can hold every stream after its first events until told to go on.  A call on
`/v1/chat/completions` is tapped by the proxy; the same stream on
`/v1/plain/stream` is forwarded only (an untapped path).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from aiohttp import web

from streamtally.settings import project_root

__all__ = [
    "PLAIN_PATH",
    "TAPPED_PATH",
    "ProxyProcess",
    "ProxyStats",
    "Upstream",
    "machine_cpu_seconds",
    "rss_bytes",
    "sample_events",
]

TAPPED_PATH: Final = "/v1/chat/completions"
PLAIN_PATH: Final = "/v1/plain/stream"
SAMPLE: Final = "openai/long_text_bench.sse"
_LISTENING: Final = re.compile(rb"proxy: listening on [^\s:]+:(\d+)")
_STATS: Final = re.compile(
    rb"appended to the spool (\d+)(?: \(\d+ keep-alives\))?, sent (\d+), failed (\d+)",
    re.MULTILINE,
)


def sample_events(name: str = SAMPLE) -> list[bytes]:
    """The transcript's SSE events, each with its blank line (one upstream write each)."""
    root = project_root()
    if root is None:
        raise SystemExit("run from a clone: the benchmark replays samples/")
    data = (root / "samples" / name).read_bytes()
    return [block + b"\n\n" for block in data.split(b"\n\n") if block.strip()]


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux: /proc/PID/status, VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process `pid` has used (Linux: /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine, every core and process (Linux: the ``cpu``
    line of /proc/stat: user, nice, system, irq and softirq time; not idle, I/O wait or
    time stolen by a hypervisor)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The pids of process `pid`'s children (Linux: /proc/PID/task/*/children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            out.extend(int(child) for child in (task / "children").read_text().split())
    return out


@dataclass
class Upstream:
    """The provider: each POST streams `events`; `hold_after` events, then waits for `go`."""

    events: list[bytes]
    #: Events sent before a stream waits for `go` (None: never waits).
    hold_after: int | None = None
    #: Seconds between two events (0: as fast as the socket takes them).
    pace_s: float = 0.0
    #: Called with (stream number, event number) right after each write: latency probes.
    on_write: Callable[[int, int], None] | None = None
    go: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    streams: int = 0
    _runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._stream)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        self.go.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        number = int(request.headers.get("X-Stream", self.streams))  # the client's, if it says
        self.streams += 1
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index, event in enumerate(self.events):
            if index == self.hold_after:
                self.held += 1
                await self.go.wait()
            await response.write(event)
            if self.on_write is not None:
                self.on_write(number, index)
            if self.pace_s:
                await asyncio.sleep(self.pace_s)
        await response.write_eof()
        return response


@dataclass
class ProxyStats:
    appended: int
    sent: int
    failed: int


#: The topic namespace (and so the spool directory) of the benchmarks' proxy, unless
#: STREAMTALLY_NAMESPACE names one: a run sends hundreds of thousands of records, which a
#: worker of the default namespace (a demo's, a test's) would otherwise have to read.
PROXY_NAMESPACE: Final = "streamtally-bench-proxy"


def _namespace() -> str:
    return os.environ.get("STREAMTALLY_NAMESPACE") or PROXY_NAMESPACE


class ProxyProcess:
    """``streamtally proxy`` in front of `upstream`, on a free port, until `stop`: in the
    topic namespace `PROXY_NAMESPACE` unless STREAMTALLY_NAMESPACE names one."""

    def __init__(self, upstream_port: int, bootstrap_servers: str, log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "streamtally.cli", "proxy",
                "--upstream", f"http://127.0.0.1:{upstream_port}",
                "--listen", "127.0.0.1:0",
                "--bootstrap-servers", bootstrap_servers,
                # The clients name no tenant; the replaying upstream sends its usage
                # whatever it is asked, so the proxy is told not to ask (and not to strip).
                "--default-tenant", "bench",
                "--no-usage-request",
            ],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "STREAMTALLY_NAMESPACE": _namespace()},
        )  # fmt: skip
        self.port = self._wait_listening(60.0)

    def _wait_listening(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = _LISTENING.search(self.log.read_bytes())
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise SystemExit(f"streamtally proxy did not start:\n{self.log.read_text()[-2000:]}")

    @property
    def rss(self) -> int:
        """The proxy's RSS with its sender process's (its children's), if any."""
        return rss_bytes(self.proc.pid) + sum(rss_bytes(pid) for pid in children(self.proc.pid))

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the proxy, and of its sender process (0 when inline)."""
        sender = 0.0
        for pid in children(self.proc.pid):
            with contextlib.suppress(FileNotFoundError):
                sender += cpu_seconds(pid)
        return cpu_seconds(self.proc.pid), sender

    def stop(self) -> ProxyStats | None:
        """SIGTERM, wait for the exit; the tap's counts from its last line."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        found = _STATS.search(self.log.read_bytes())
        if found is None:
            return None
        return ProxyStats(*(int(group) for group in found.groups()))
