"""A gateway process that taps through a spool, for tests that kill it (test_tap_spool.py).

    python -m tests.integration.tap_child stream SPOOL_DIR NAMESPACE TENANT RUN SAMPLE N SENDER
    python -m tests.integration.tap_child resume SPOOL_DIR NAMESPACE SENDER

``stream`` taps `N` requests (ids ``RUN-0`` ...) of the SSE transcript `SAMPLE`
(a path under samples/, OpenAI), each begun once the one before has appended
`NEXT_AFTER` events (so that at the first ``END`` some requests are mid-stream and
some not begun, however busy the machine), one event every 3 ms,
with a slow sender (one record in flight at a time, so that the spool holds
records Kafka does not have yet).  It prints ``E <request id> <seq>`` once an
event's append returned, ``END <request id> <seq>`` once the END marker's did.
It runs until killed (it then waits for ever).

``resume`` opens a `Tap` on the same spool, waits until Kafka has everything it
holds, prints ``SENT <records>`` and closes.

`SENDER` is ``inline`` (the tap's sender in its event loop) or ``process`` (a sender
process of its own, `Tap(sender_process=True)`, as the proxy's default).

Kafka is ``KAFKA_BOOTSTRAP_SERVERS``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from streamtally.core.models import Source
from streamtally.core.normalize import read_events
from streamtally.producers import Tap

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
#: Events a request appends before the next one begins.
NEXT_AFTER = 60


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def stream(
    spool: Path, namespace: str, tenant: str, run: str, sample: str, n: int, process: bool
) -> None:
    events = list(read_events(Source.OPENAI, (SAMPLES / sample).open("rb")))
    servers = os.environ["KAFKA_BOOTSTRAP_SERVERS"]

    may_begin = [asyncio.Event() for _ in range(n + 1)]
    may_begin[0].set()

    async def one(tap: Tap, index: int) -> None:
        await may_begin[index].wait()
        rid = f"{run}-{index}"
        async with tap.request(Source.OPENAI, tenant=tenant, request_id=rid) as req:
            for seq, event in enumerate(events):
                await req.event(event)
                say(f"E {rid} {seq}")
                if seq + 1 == NEXT_AFTER:
                    may_begin[index + 1].set()
                await asyncio.sleep(0.003)
        may_begin[index + 1].set()  # (a transcript shorter than NEXT_AFTER)
        say(f"END {rid} {len(events)}")

    async with Tap(
        servers, namespace=namespace, spool_dir=spool, max_in_flight=1, sender_process=process
    ) as tap:
        await asyncio.gather(*(one(tap, index) for index in range(n)))
        say("DONE")
        await asyncio.sleep(3600)  # killed before


async def resume(spool: Path, namespace: str, process: bool) -> None:
    servers = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    async with Tap(servers, namespace=namespace, spool_dir=spool, sender_process=process) as tap:
        if not await tap.spool.wait_sent(120):
            raise SystemExit(f"not sent within 120 s: {tap.spool.unsent_records} records")
        say(f"SENT {tap.stats.sent}")


def main() -> None:
    mode, spool, namespace, *rest = sys.argv[1:]
    if mode == "stream":
        tenant, run, sample, n, sender = rest
        process = sender == "process"
        asyncio.run(stream(Path(spool), namespace, tenant, run, sample, int(n), process))
    else:
        (sender,) = rest
        asyncio.run(resume(Path(spool), namespace, sender == "process"))


if __name__ == "__main__":
    main()
