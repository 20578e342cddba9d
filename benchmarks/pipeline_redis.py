"""Redis for the pipeline benchmark: when each request's Tokens became readable.

`TokensWatcher` timestamps the first SET of every ``st:{s*}:tokens:bench:bench-<run>-*``
key (the Tokens of tenant ``bench``'s requests ``bench-<run>-*``, keyed by
`RequestRef.text`) through keyspace notifications (`keyspace_flags`: what
``notify-keyspace-events`` needs for it), with `time.perf_counter()` in this
process, like the producer side; `redis_client` connects and reads the
server's version; `check_layout` refuses, before the worker starts, a Redis
the worker would refuse (data of another layout version).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from benchmarks.pipeline_worker import BenchWorkers
from benchmarks.pipeline_workload import Progress
from streamtally.errors import StackError
from streamtally.redact import redact_url
from streamtally.store import LayoutError, RedisStore, parse_tokens_key, tokens_pattern

__all__ = ["TokensWatcher", "as_text", "check_layout", "keyspace_flags", "redis_client"]

#: Give up waiting when no request completed for this long.
_STALL_SECONDS: Final = 90.0


class TokensWatcher:
    """Timestamps the first SET of the Tokens key of every request of `tenant` whose id
    starts with `prefix` (keyspace notifications); `seen` is by request id."""

    def __init__(self, client: aioredis.Redis, db: int, tenant: str, prefix: str) -> None:
        self._client = client
        self._tenant = tenant
        self._channel_prefix = f"__keyspace@{db}__:".encode()
        self.pattern = f"__keyspace@{db}__:{tokens_pattern(tenant, prefix)}"
        self.seen: dict[str, float] = {}
        self._pending: set[str] = set()
        self._all_seen = asyncio.Event()
        self._pubsub: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._pubsub = self._client.pubsub()
        await self._pubsub.psubscribe(self.pattern)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the subscription is confirmed before any SET
            message = await self._pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == "psubscribe":
                break
        else:
            raise StackError("Redis did not confirm the keyspace subscription")
        self._task = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        cut = len(self._channel_prefix)
        async for message in self._pubsub.listen():
            now = time.perf_counter()
            if message["type"] != "pmessage" or message["data"] != b"set":
                continue
            ref = parse_tokens_key(bytes(message["channel"][cut:]))
            if ref.tenant != self._tenant:
                continue  # the pattern matches only its keys; never count another tenant's
            request_id = ref.request_id
            if request_id not in self.seen:
                self.seen[request_id] = now
                self._pending.discard(request_id)
                if not self._pending:
                    self._all_seen.set()

    def expect(self, request_ids: Iterable[str]) -> None:
        self._pending = {r for r in request_ids if r not in self.seen}
        self._all_seen = asyncio.Event()
        if not self._pending:
            self._all_seen.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def wait(
        self,
        worker: BenchWorkers,
        progress: Progress,
        label: str,
        total: int,
        status: Callable[[], str] | None = None,
    ) -> bool:
        """Wait until every expected key was seen; False when the worker stalled."""
        last_pending = self.pending
        last_change = time.monotonic()
        last_report = 0.0
        while not self._all_seen.is_set():
            if self._task is not None and self._task.done():
                self._task.result()  # raises what killed the listener
                raise StackError("the Redis keyspace listener stopped")
            worker.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_seen.wait(), timeout=0.5)
            now = time.monotonic()
            if self.pending != last_pending:
                last_pending, last_change = self.pending, now
            elif now - last_change > _STALL_SECONDS:
                progress(f"  {label}: no request completed for {_STALL_SECONDS:g} s, giving up")
                return False
            if now - last_report >= 2.0:
                last_report = now
                extra = f"; {status()}" if status is not None else ""
                progress(f"  {label}: {total - self.pending:,}/{total:,} requests in Redis{extra}")
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError):
                await self._task
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()


def as_text(value: object) -> str:
    """A Redis reply value as text (bytes decoded as UTF-8)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def keyspace_flags(old: str) -> str:
    """`old` plus K (keyspace events) and $ (string commands)."""
    flags = old
    for flag in "K$":
        if flag not in flags and not (flag == "$" and "A" in flags):
            flags += flag
    return flags


async def redis_client(url: str) -> tuple[aioredis.Redis, int, str | None]:
    """A client of `url`, its database number and the server's version (`StackError`: no answer)."""
    client = aioredis.from_url(url)
    try:
        info = await client.info("server")
    except (RedisError, OSError) as exc:
        await client.aclose()
        raise StackError(
            f"cannot reach Redis at {redact_url(url)}: start it with `streamtally stack up` or "
            "set REDIS_URL"
        ) from exc
    db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
    version = info.get("redis_version")
    return client, db, None if version is None else str(version)


async def check_layout(url: str) -> None:
    """Claim layout 2 on an empty Redis, as the worker does; `StackError` on another layout.

    The benchmark's worker writes to `url` (REDIS_URL): on data of an older
    layout it would refuse to start, so say why before anything is timed.
    """
    store = RedisStore.from_url(url, connect_timeout=5)
    try:
        await store.ensure_layout()
    except LayoutError as exc:
        raise StackError(
            f"the benchmark's worker cannot write to Redis at {redact_url(url)}: {exc} "
            "(or set REDIS_URL to an empty database, e.g. redis://127.0.0.1:6379/15)"
        ) from exc
    except (RedisError, OSError) as exc:
        raise StackError(
            f"cannot reach Redis at {redact_url(url)}: start it with `streamtally stack up` or "
            "set REDIS_URL"
        ) from exc
    finally:
        await store.aclose()
