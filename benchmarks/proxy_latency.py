"""What the proxy adds per chunk, and what it carries: latency p50/p99, streams/s, events/s.

One `streamtally proxy` process (its real `Tap` to Kafka) in front of the
replaying upstream (`proxy_harness`: `samples/openai/long_text_bench.sse`,
195 events, one write per event), three ways to reach the upstream:
``direct`` (no proxy), ``plain`` (through the proxy on an untapped path) and
``tapped`` (through the proxy on `/v1/chat/completions`, every event teed to
Kafka).

- Latency: the upstream paces its events (`--pace-ms`) and notes when it
  wrote each; the client notes when the event's last byte arrived (both in
  this process, one clock).  `--latency-streams` streams,
  `--latency-concurrency` at a time (1: the cost of one chunk, no queueing
  behind other streams; more: the cost under that load).  The proxy's cost
  is the difference with ``direct``.
- Throughput: `--concurrency` clients call at full speed until
  `--throughput-streams` streams are done; streams/s and events/s per mode,
  and the CPU per event of the proxy and of its sender process (over the
  phase and, for the sender, until it has caught up: it may still be sending
  when the last client is served).  On a machine shared with the clients, the
  upstream and the broker, CPU per event is the steadier figure.  So is the
  whole machine's CPU per event (every process, over the phase and the
  sender's catching up), with the benchmark's own share and the rest (the
  broker, mostly): where the cores are full, the ratio of plain to tapped in
  it bounds the ratio in streams/s, and the ratio of the proxy's own CPU is
  what a proxy whose sender and broker have cores of their own would see.

The tap's counts (records appended to its spool, sent to Kafka, failed) are
the proxy's own, printed when it stops.

    python -m benchmarks.proxy_latency [--latency-streams 40] [--latency-concurrency 1]
                                       [--throughput-streams 400] [--concurrency 20]
                                       [--pace-ms 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from benchmarks.proxy_harness import (
    PLAIN_PATH,
    TAPPED_PATH,
    ProxyProcess,
    ProxyStats,
    Upstream,
    machine_cpu_seconds,
    sample_events,
)
from streamtally.settings import Settings

__all__ = ["Latency", "ProxyFigures", "Throughput", "main", "measure"]

MODES: Final = ("direct", "plain", "tapped")
#: The sender has caught up once it used less than `_IDLE_CPU_S` in `_SETTLE_S`.
_SETTLE_S: Final = 0.3
_IDLE_CPU_S: Final = 0.02


@dataclass(frozen=True, slots=True)
class Latency:
    mode: str
    events: int
    p50_us: float
    p99_us: float


@dataclass(frozen=True, slots=True)
class Throughput:
    mode: str
    streams: int
    seconds: float
    streams_per_second: float
    events_per_second: float
    #: CPU per event (µs) of the proxy over the phase, and of its sender process over the
    #: phase and until it caught up.
    proxy_cpu_us: float = 0.0
    sender_cpu_us: float = 0.0
    #: CPU per event (µs) of this process (the clients and the upstream) over the phase;
    #: of the whole machine over the phase and the sender's catching up; and what the
    #: machine used beyond these three processes (the broker, mostly).
    bench_cpu_us: float = 0.0
    machine_cpu_us: float = 0.0
    rest_cpu_us: float = 0.0
    #: Seconds the sender took after the last client was served to catch up.
    sender_behind_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ProxyFigures:
    latency: list[Latency]
    throughput: list[Throughput]
    #: What the tap of the proxy did over the whole run.
    tap: ProxyStats
    #: Records the tapped streams should have given it (events and END markers).
    tap_records_expected: int


def _percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))])


async def _read(
    session: ClientSession,
    url: str,
    want: bytes,
    on_event: Callable[[int], None] | None,
    number: int = -1,
) -> None:
    """One client: the whole stream; `on_event(i)` when event i's last byte has arrived."""
    got = bytearray()
    done = 0
    headers = {"X-Tenant": "bench-proxy", "X-Stream": str(number)}
    async with session.post(url, json={"stream": True}, headers=headers) as r:
        async for piece in r.content.iter_any():
            got += piece
            if on_event is not None:
                complete = got.count(b"\n\n")
                while done < complete:
                    on_event(done)
                    done += 1
    if bytes(got) != want:
        raise SystemExit(f"a client got {len(got)} bytes, not the {len(want)} the upstream sent")


async def _latency(
    session: ClientSession,
    upstream: Upstream,
    *,
    url: str,
    mode: str,
    streams: int,
    concurrency: int,
    want: bytes,
) -> Latency:
    written: dict[tuple[int, int], int] = {}
    delays: list[int] = []
    upstream.on_write = lambda stream, index: written.__setitem__(
        (stream, index), time.perf_counter_ns()
    )
    gate = asyncio.Semaphore(concurrency)

    async def one(number: int) -> None:
        async with gate:
            arrived: dict[int, int] = {}

            def on_event(index: int) -> None:
                arrived[index] = time.perf_counter_ns()

            await _read(session, url, want, on_event, number)
            delays.extend(arrived[i] - written[number, i] for i in arrived)

    await asyncio.gather(*(one(number) for number in range(streams)))
    written.clear()
    upstream.on_write = None
    return Latency(
        mode, len(delays), _percentile(delays, 0.5) / 1e3, _percentile(delays, 0.99) / 1e3
    )


async def _sender_settled(proxy: ProxyProcess, timeout: float = 60.0) -> tuple[float, float]:
    """Wait until the sender process stops using CPU (it has sent what was spooled); its
    CPU seconds then, and the seconds waited for it."""
    start = time.perf_counter()
    last = proxy.cpu()[1]
    while time.perf_counter() - start < timeout:
        await asyncio.sleep(_SETTLE_S)
        now = proxy.cpu()[1]
        if now - last < _IDLE_CPU_S:
            return now, max(0.0, time.perf_counter() - start - _SETTLE_S)
        last = now
    return last, time.perf_counter() - start


async def _throughput(
    session: ClientSession,
    url: str,
    *,
    mode: str,
    streams: int,
    concurrency: int,
    want: bytes,
    proxy: ProxyProcess,
) -> Throughput:
    left = streams

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await _read(session, url, want, None)

    proxy_before, sender_before = proxy.cpu()
    machine_before, bench_before = machine_cpu_seconds(), time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    proxy_cpu = proxy.cpu()[0] - proxy_before
    bench_cpu = time.process_time() - bench_before
    sender_after, behind = await _sender_settled(proxy)
    sender_cpu = sender_after - sender_before
    machine_cpu = machine_cpu_seconds() - machine_before
    events = streams * want.count(b"\n\n")

    def per_event(cpu_seconds: float) -> float:
        return round(1e6 * cpu_seconds / events, 2)

    return Throughput(
        mode,
        streams,
        seconds,
        streams / seconds,
        events / seconds,
        proxy_cpu_us=per_event(proxy_cpu),
        sender_cpu_us=per_event(sender_cpu),
        sender_behind_s=round(behind, 2),
        bench_cpu_us=per_event(bench_cpu),
        machine_cpu_us=per_event(machine_cpu),
        rest_cpu_us=per_event(max(0.0, machine_cpu - proxy_cpu - sender_cpu - bench_cpu)),
    )


async def _run(args: argparse.Namespace, servers: str, log: Path) -> ProxyFigures:
    transcript = sample_events()
    want = b"".join(transcript)
    upstream = Upstream(transcript)
    up_port = await upstream.start()
    proxy = ProxyProcess(up_port, servers, log)
    urls = {
        "direct": f"http://127.0.0.1:{up_port}{TAPPED_PATH}",
        "plain": f"http://127.0.0.1:{proxy.port}{PLAIN_PATH}",
        "tapped": f"http://127.0.0.1:{proxy.port}{TAPPED_PATH}",
    }
    latency: list[Latency] = []
    throughput: list[Throughput] = []
    connector = TCPConnector(limit=0)
    try:
        async with ClientSession(connector=connector, timeout=ClientTimeout(total=600)) as session:
            for mode in MODES:  # warm-up: connections, the tap's first records
                await _read(session, urls[mode], want, None)
            upstream.pace_s = args.pace_ms / 1000
            for mode in MODES:
                latency.append(
                    await _latency(
                        session,
                        upstream,
                        url=urls[mode],
                        mode=mode,
                        streams=args.latency_streams,
                        concurrency=args.latency_concurrency,
                        want=want,
                    )
                )
            upstream.pace_s = 0.0
            for mode in MODES:
                throughput.append(
                    await _throughput(
                        session,
                        urls[mode],
                        mode=mode,
                        streams=args.throughput_streams,
                        concurrency=args.concurrency,
                        want=want,
                        proxy=proxy,
                    )
                )
    finally:
        stats = proxy.stop()
        await upstream.stop()
    if stats is None:
        raise SystemExit(f"the proxy printed no tap counts:\n{log.read_text()[-2000:]}")
    tapped_streams = 1 + args.latency_streams + args.throughput_streams
    return ProxyFigures(latency, throughput, stats, tapped_streams * (len(transcript) + 1))


def measure(args: argparse.Namespace, servers: str | None = None) -> ProxyFigures:
    servers = servers or Settings.load().bootstrap_servers
    with tempfile.TemporaryDirectory(prefix="st-proxy-latency-") as tmp:
        return asyncio.run(_run(args, servers, Path(tmp) / "proxy.log"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-streams", type=int, default=40, help="paced streams (40)")
    parser.add_argument("--throughput-streams", type=int, default=400, help="full speed (400)")
    parser.add_argument(
        "--latency-concurrency", type=int, default=1, help="paced streams at once (1)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=20, help="full-speed clients at once (20)"
    )
    parser.add_argument("--pace-ms", type=float, default=2.0, help="between paced events (2)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = measure(args)
    if args.json:
        print(json.dumps(asdict(figures)))
        return
    direct = {f.mode: f for f in figures.latency}["direct"]
    for lat in figures.latency:
        print(
            f"latency {lat.mode:>6}: p50 {lat.p50_us:,.0f} µs, p99 {lat.p99_us:,.0f} µs "
            f"({lat.events:,} events; added vs direct: p50 {lat.p50_us - direct.p50_us:+,.0f} µs,"
            f" p99 {lat.p99_us - direct.p99_us:+,.0f} µs)"
        )
    for run in figures.throughput:
        print(
            f"throughput {run.mode:>6}: {run.streams_per_second:,.0f} streams/s, "
            f"{run.events_per_second:,.0f} events/s "
            f"({run.streams} streams in {run.seconds:.2f} s); "
            f"CPU per event: proxy {run.proxy_cpu_us:.1f} µs, sender {run.sender_cpu_us:.1f} µs"
            + (f" (caught up {run.sender_behind_s:.1f} s later)" if run.sender_behind_s else "")
            + f", benchmark {run.bench_cpu_us:.1f} µs, rest {run.rest_cpu_us:.1f} µs;"
            f" machine {run.machine_cpu_us:.1f} µs"
        )
    runs = {run.mode: run for run in figures.throughput}
    plain, tapped = runs["plain"], runs["tapped"]
    if plain.streams_per_second and tapped.machine_cpu_us:
        print(
            f"tapped/plain: {tapped.streams_per_second / plain.streams_per_second:.2f} in "
            f"streams/s; {plain.machine_cpu_us / tapped.machine_cpu_us:.2f} in the machine's "
            f"CPU per event (the bound where the cores are full); "
            f"{plain.proxy_cpu_us / tapped.proxy_cpu_us:.2f} in the proxy's own"
        )
    tap = figures.tap
    print(
        f"tap: records sent {tap.sent:,} of {figures.tap_records_expected:,}, "
        f"appended to the spool {tap.appended:,}, failed {tap.failed:,}"
    )


if __name__ == "__main__":
    main()
