"""Shared fixtures of the integration tests: where the stack's Redis and Kafka are.

Both come from the environment / stack config (`streamtally.stack.config`):
``REDIS_URL`` and ``KAFKA_BOOTSTRAP_SERVERS`` when set, else the local stack
that `streamtally stack up` runs.  `redis_client` skips the test when Redis
does not answer (fails instead on CI, where the stack must be up).

Tests share that Redis with whoever else uses it: write only keys of your own
(unique request ids and tenants) and delete them afterwards; never FLUSHDB.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamtally.stack.config import bootstrap_servers as _bootstrap_servers
from streamtally.stack.config import redis_url as _redis_url


@pytest.fixture(scope="session")
def redis_url() -> str:
    """``$REDIS_URL``, else the local stack's Redis URL."""
    return _redis_url()


@pytest.fixture(scope="session")
def bootstrap_servers() -> str:
    """``$KAFKA_BOOTSTRAP_SERVERS``, else the local stack's broker."""
    return _bootstrap_servers()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of `redis_url` that answered PING; skips (fails on CI) if Redis is down."""
    client = aioredis.from_url(redis_url, socket_connect_timeout=3)
    try:
        await client.ping()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        await client.aclose()
        message = f"Redis at {redis_url} does not answer ({exc}); run `streamtally stack up`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield client
    finally:
        await client.aclose()
