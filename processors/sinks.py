"""Where a batch's outputs go: Kafka topics and Redis, behind one small interface.

A sink takes outputs with `add` and makes them durable with `flush`
(quix-streams style).  The worker flushes every sink before faust commits the
offsets of the batch, so a crash replays at most one batch; replays are
harmless because the Redis writes are idempotent per request and every
Kafka output of a request is byte-identical when recomputed.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from processors.redis_sink import RedisSink
from processors.requests import Outputs
from streamtally import avro
from topics import BILLING, CHUNKS, DEADLETTER, TOKENS, encode_key

__all__ = ["KafkaSink", "RedisOutputs", "Sink", "Sinks"]


class Sink(Protocol):
    def add(self, outputs: Outputs) -> None: ...

    async def flush(self) -> None: ...


class KafkaSink:
    """Chunks, completed Tokens, billing events and dead letters onto their topics."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self._pending: list[tuple[str, bytes | None, bytes]] = []

    def add(self, outputs: Outputs) -> None:
        pending = self._pending
        for chunk in outputs.chunks:
            pending.append((CHUNKS.name, encode_key(chunk.request_id), avro.encode_chunk(chunk)))
        for done in outputs.completed:
            key = encode_key(done.tokens.request_id)
            pending.append((TOKENS.name, key, avro.encode_tokens(done.tokens)))
            pending.append((BILLING.name, key, avro.encode_billing_event(done.billing)))
        for letter in outputs.dead_letters:
            pending.append((DEADLETTER.name, letter.key, avro.encode_dead_letter(letter)))

    async def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        futures = [
            await self._producer.send(topic, key, value, None, None, None)
            for topic, key, value in pending
        ]
        await asyncio.gather(*futures)


class RedisOutputs:
    """Completed requests into Redis: Tokens and usage rows, idempotently."""

    def __init__(self, sink: RedisSink) -> None:
        self._sink = sink

    def add(self, outputs: Outputs) -> None:
        for done in outputs.completed:
            self._sink.add(done.tokens, done.billing)

    async def flush(self) -> None:
        await self._sink.flush()


class Sinks:
    """Several sinks fed together; Kafka outputs are flushed before Redis."""

    def __init__(self, *sinks: Sink) -> None:
        self._sinks = sinks

    async def write(self, outputs: Outputs) -> None:
        if not outputs:
            return
        for sink in self._sinks:
            sink.add(outputs)
        for sink in self._sinks:
            await sink.flush()
