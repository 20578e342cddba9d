"""Kafka for the pipeline benchmark: offsets, the worker group's lag and members.

`KafkaProbe` holds one admin client and one consumer (no group) for the
whole run: end offsets before and after a phase, whether the worker has
caught up (its group's committed offsets), how many members its group has,
and how many records of a range carry the run's keys (`read_topic`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from benchmarks.pipeline_worker import BenchWorkers
from benchmarks.pipeline_workload import Names, Progress
from streamtally.connection import KafkaConnection, client_options
from streamtally.wire.kafka import read_topic

__all__ = ["KafkaProbe"]


class KafkaProbe:
    """Offsets, lag and the worker group's members, from one admin client and one consumer."""

    def __init__(self, servers: KafkaConnection | str, names: Names) -> None:
        self.servers = servers
        self.names = names
        options = client_options(servers)
        self.admin = AIOKafkaAdminClient(**options, request_timeout_ms=15000)
        self.consumer = AIOKafkaConsumer(**options, enable_auto_commit=False)

    async def start(self) -> None:
        await self.admin.start()
        await self.consumer.start()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.consumer.stop()
        with contextlib.suppress(Exception):
            await self.admin.close()

    async def end_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return dict(await self.consumer.end_offsets(tps))

    async def lag(self) -> int:
        """Raw messages the worker group has not committed yet."""
        tps = self.names.partitions(*self.names.topics.raw)
        ends = await self.end_offsets(tps)
        begins = dict(await self.consumer.beginning_offsets(tps))
        committed = await self.admin.list_consumer_group_offsets(self.names.group, partitions=tps)
        lag = 0
        for tp in tps:
            meta = committed.get(tp)
            done = meta.offset if meta is not None and meta.offset >= 0 else begins[tp]
            lag += max(0, ends[tp] - done)
        return lag

    async def group_members(self) -> int | None:
        try:
            response = await self.admin.describe_consumer_groups([self.names.group])
            return len(response[0].groups[0][5])
        except (KafkaError, IndexError, AttributeError, TypeError):  # diagnostics only
            return None

    async def wait_caught_up(self, worker: BenchWorkers, progress: Progress, timeout: float) -> int:
        """Wait until the worker group has committed every raw message; the lag left."""
        deadline = time.monotonic() + timeout
        last_report = 0.0
        while True:
            worker.check()
            lag = await self.lag()
            now = time.monotonic()
            if lag == 0 or now >= deadline:
                return lag
            if now - last_report >= 2.0:
                last_report = now
                progress(f"  waiting for the worker to catch up: {lag:,} raw messages behind")
            await asyncio.sleep(0.5)

    async def count_keys(
        self, topic: str, start: dict[Any, int], end: dict[Any, int], keys: set[bytes]
    ) -> tuple[int, int]:
        """Records in `[start, end)` of `topic` with a key in `keys`, and distinct such keys."""
        found = 0
        distinct: set[bytes] = set()
        reading = read_topic(
            self.servers,
            topic,
            start={tp.partition: offset for tp, offset in start.items() if tp.topic == topic},
            end={tp.partition: offset for tp, offset in end.items() if tp.topic == topic},
        )
        async with contextlib.aclosing(reading) as records:
            async for record in records:
                if record.key in keys:
                    found += 1
                    distinct.add(record.key)
        return found, len(distinct)
