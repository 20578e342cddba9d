"""A sender process whose Kafka is faked, for tests/unit/tap/test_sender_process.py.

    python -m tests.unit.tap.sender_child_fake

The real child (`streamtally.producers.sender_process.main`) with `KafkaSender`
replaced: each record "Kafka acknowledges" is appended as a line ``<key>`` to the
file named by ``FAKE_KAFKA_LOG``, ``FAKE_KAFKA_DELAY`` seconds after its send (0:
at once).  ``FAKE_KAFKA_FAIL_START`` makes the start fail as an unreachable broker;
while the file named by ``FAKE_KAFKA_DOWN`` exists, every send fails as in an outage.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaConnectionError

from streamtally.core.models import Source
from streamtally.errors import StackError
from streamtally.producers import sender_process


class FakeKafka:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.log = Path(os.environ["FAKE_KAFKA_LOG"])
        self.delay = float(os.environ.get("FAKE_KAFKA_DELAY", "0"))
        self.down = Path(os.environ.get("FAKE_KAFKA_DOWN", "/nonexistent/down"))

    async def start(self) -> None:
        if os.environ.get("FAKE_KAFKA_FAIL_START"):
            raise StackError("Kafka at nowhere:9092 is not reachable")

    async def stop(self) -> None:
        pass

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self.down.exists():
            future.set_exception(KafkaConnectionError("the broker is away"))
            return future

        def acknowledge() -> None:
            with self.log.open("a", encoding="utf-8") as log:
                log.write(request_id + "\n")
            future.set_result(None)

        if self.delay:
            loop.call_later(self.delay, acknowledge)
        else:
            acknowledge()
        return future


sender_process.KafkaSender = FakeKafka  # type: ignore[misc, assignment]

if __name__ == "__main__":
    sender_process.main()
