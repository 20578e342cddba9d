"""Sinks: concurrent writers (the two agents and the timer) never resend each other's batch."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from processors.requests import Outputs
from processors.sinks import KafkaSink, Sinks
from streamtally.models import Chunk, Source


class SlowProducer:
    """Records every send; each send and each ack yields to the event loop."""

    def __init__(self) -> None:
        self.sent: list[bytes | None] = []

    async def send(self, topic: str, key: bytes | None, value: bytes, *_: Any) -> Any:
        await asyncio.sleep(0)
        self.sent.append(key)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.001, future.set_result, None)
        return future


def _outputs(request_id: str, n: int) -> Outputs:
    when = datetime(2026, 1, 1, tzinfo=UTC)
    chunks = [
        Chunk(request_id=request_id, seq=i, source=Source.OPENAI, text_delta="x", event_time=when)
        for i in range(n)
    ]
    return Outputs(chunks=chunks)


async def test_concurrent_writes_send_every_output_exactly_once() -> None:
    producer = SlowProducer()
    sinks = Sinks(KafkaSink(producer))
    await asyncio.gather(
        sinks.write(_outputs("a", 50)),
        sinks.write(_outputs("b", 30)),
        sinks.write(_outputs("c", 7)),
    )
    assert sorted(producer.sent) == sorted([b"a"] * 50 + [b"b"] * 30 + [b"c"] * 7)


async def test_a_failed_flush_keeps_its_batch_for_the_retry() -> None:
    class FlakyProducer(SlowProducer):
        calls = 0

        async def send(self, topic: str, key: bytes | None, value: bytes, *_: Any) -> Any:
            self.calls += 1
            if self.calls == 3:
                raise OSError("broker went away")
            return await super().send(topic, key, value)

    producer = FlakyProducer()
    await Sinks(KafkaSink(producer)).write(_outputs("r", 5))
    # the first two sends happened before the failure; the retry resends the whole batch
    assert producer.sent.count(b"r") == 2 + 5
