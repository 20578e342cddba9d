"""Proxy memory per open stream: RSS growth of `streamtally proxy` while N streams are open.

For each N, a fresh `streamtally proxy` process (its real `Tap` to Kafka)
sits between the clients and the replaying upstream (`proxy_harness`).
Warm-up first: a few streams go through whole, so that the Kafka client, the
upstream session and the imports are in place.  Then N clients call the
tapped path at once; the upstream sends each stream its first `--events`
events (the request id among them, so the tap is sending, not holding) and
waits.  Once every client has read those bytes, the proxy's RSS is read
again: the growth divided by N is what one open stream costs it (its two
sockets and their buffers, the aiohttp request and response, the tap's
request and SSE decoder).  Then the streams go on to their end; every client
must get the transcript byte for byte, and the tap must have sent every
event.  RSS after the streams ended is shown too (CPython keeps freed
memory for reuse, so it does not fall back to the baseline).

    python -m benchmarks.proxy_memory [--streams 200 1000] [--events 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from benchmarks.proxy_harness import TAPPED_PATH, ProxyProcess, Upstream, sample_events
from streamtally.settings import Settings

__all__ = ["OpenStreams", "main", "measure"]

#: Streams sent through whole before measuring.
WARM_UP = 20


@dataclass(frozen=True, slots=True)
class OpenStreams:
    streams: int
    events_before_hold: int
    rss_before: int
    rss_open: int
    rss_after: int
    bytes_per_open_stream: int
    #: Raw records the tap sent to Kafka (events and END markers), spooled, failed.
    records_sent: int
    records_appended: int
    records_failed: int


async def _call(
    session: ClientSession, url: str, want: bytes, prefix: int, ready: list[int]
) -> bytes:
    """One client: read until it has the first `prefix` bytes (counted in `ready`), then all."""
    got = bytearray()
    counted = False
    async with session.post(url, json={"stream": True}, headers={"X-Tenant": "bench-memory"}) as r:
        async for piece in r.content.iter_any():
            got += piece
            if not counted and len(got) >= prefix:
                ready.append(1)
                counted = True
    if bytes(got) != want:
        raise SystemExit(f"a client got {len(got)} bytes, not the {len(want)} the upstream sent")
    return bytes(got)


def _steady_rss(proxy: ProxyProcess, reads: int = 5) -> int:
    values = []
    for _ in range(reads):
        time.sleep(0.1)
        values.append(proxy.rss)
    return int(statistics.median(values))


async def _measure_one(streams: int, events: int, servers: str, log: Path) -> OpenStreams:
    transcript = sample_events()
    want = b"".join(transcript)
    prefix = len(b"".join(transcript[:events]))
    upstream = Upstream(transcript, hold_after=events)
    up_port = await upstream.start()
    proxy = ProxyProcess(up_port, servers, log)
    url = f"http://127.0.0.1:{proxy.port}{TAPPED_PATH}"
    connector = TCPConnector(limit=0, force_close=True)
    try:
        async with ClientSession(connector=connector, timeout=ClientTimeout(total=300)) as session:
            upstream.go.set()
            for _ in range(WARM_UP):
                await _call(session, url, want, prefix, [])
            upstream.go.clear()
            await asyncio.sleep(1.0)
            rss_before = _steady_rss(proxy)
            ready: list[int] = []
            tasks = [
                asyncio.create_task(_call(session, url, want, prefix, ready))
                for _ in range(streams)
            ]
            deadline = time.monotonic() + 120
            while len(ready) < streams:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {len(ready)} of {streams} streams opened in 120 s")
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the tap hands the first events to Kafka meanwhile
            rss_open = _steady_rss(proxy)
            upstream.go.set()
            await asyncio.gather(*tasks)
            await asyncio.sleep(1.0)
            rss_after = _steady_rss(proxy)
    finally:
        stats = proxy.stop()
        await upstream.stop()
    if stats is None:
        raise SystemExit(f"the proxy printed no tap counts:\n{log.read_text()[-2000:]}")
    return OpenStreams(
        streams=streams,
        events_before_hold=events,
        rss_before=rss_before,
        rss_open=rss_open,
        rss_after=rss_after,
        bytes_per_open_stream=(rss_open - rss_before) // streams,
        records_sent=stats.sent,
        records_appended=stats.appended,
        records_failed=stats.failed,
    )


def measure(streams: list[int], events: int, servers: str | None = None) -> list[OpenStreams]:
    """One fresh proxy per entry of `streams`; Kafka from the settings unless `servers`."""
    servers = servers or Settings.load().bootstrap_servers
    out = []
    with tempfile.TemporaryDirectory(prefix="st-proxy-memory-") as tmp:
        for count in streams:
            out.append(
                asyncio.run(_measure_one(count, events, servers, Path(tmp) / f"{count}.log"))
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--streams", type=int, nargs="+", default=[200, 1000], help="open streams (200 1000)"
    )
    parser.add_argument("--events", type=int, default=5, help="events sent before holding (5)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines")
    args = parser.parse_args()
    events_per_stream = len(sample_events())
    for result in measure(args.streams, args.events):
        expected = (WARM_UP + result.streams) * (events_per_stream + 1)
        if args.json:
            print(json.dumps(asdict(result) | {"records_expected": expected}))
            continue
        print(
            f"{result.streams:,} streams open through the proxy, {result.events_before_hold} "
            f"events each: RSS {result.rss_before / 2**20:.1f} MiB -> "
            f"{result.rss_open / 2**20:.1f} MiB, {result.bytes_per_open_stream:,} bytes per "
            f"open stream; {result.rss_after / 2**20:.1f} MiB once they ended; tap records "
            f"sent {result.records_sent:,} of {expected:,}, spooled {result.records_appended:,}, "
            f"failed {result.records_failed}"
        )


if __name__ == "__main__":
    main()
