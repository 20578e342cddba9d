"""`ensure_topics` returns once the topics it created are served (`wait_served`), and
waits for nothing when it created none."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streamtally.topics import Topics
from streamtally.wire import kafka


@pytest.mark.parametrize("created", [["ns.raw.sse", "ns.tokens"], []])
def test_the_topics_created_are_served_before_ensure_topics_returns(
    monkeypatch: pytest.MonkeyPatch, created: list[str]
) -> None:
    topics = Topics.in_namespace("ns")
    steps: list[Any] = []

    async def ensure_once(conn: Any, wanted: Any, brokers: Any) -> list[str]:
        steps.append("created")
        return created

    async def wait_served(conn: Any, served: list[Any], timeout: float = 0) -> None:
        steps.append(sorted(t.name for t in served))

    monkeypatch.setattr(kafka, "_ensure_once", ensure_once)
    monkeypatch.setattr(kafka, "wait_served", wait_served)
    assert asyncio.run(kafka.ensure_topics("127.0.0.1:9092", topics.all)) == created
    assert steps == (["created", sorted(created)] if created else ["created"])
