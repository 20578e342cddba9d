"""`RedisStore`: every write and read of streamtally's Redis, as typed async methods.

It wraps one `redis.asyncio.Redis` client (made with or without
``decode_responses``), registers the scripts once, and takes every key from
`streamtally.store.layout`.  Writes: `mark_closing`, `apply_requests` (through
the batching `streamtally.store.RedisSink`), `count_dead_letters`.  Reads:
Tokens, usage rows, close markers, counts.  No other module talks to Redis
about its data.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import date
from typing import Any

import redis.asyncio as aioredis

from streamtally.core.identity import RequestRef
from streamtally.errors import StreamtallyError
from streamtally.store import layout
from streamtally.store.layout import (
    CLOSED_KEY,
    DEAD_SEEN_KEY,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    ROW_FIELDS,
    ROWS_KEY,
    STATS_FIELDS,
    STATS_KEY,
    closed_field,
    parse_row_member,
    parse_tokens_key,
    tokens_key,
    tokens_pattern,
    tokens_pattern_of_id,
    usage_key,
)
from streamtally.store.rows import day_filter, reply_text, usage_row
from streamtally.store.scripts import (
    CLOSE_ONCE_SCRIPT,
    DEAD_LETTER_SCRIPT,
    FLUSH_SCRIPT,
    FinishedRequest,
    close_once_call,
    dead_letter_call,
    flush_call,
)

__all__ = ["LayoutError", "RedisStore"]


class LayoutError(StreamtallyError):
    """Redis holds data of another layout version: migrate it (the message says how)."""


class RedisStore:
    """streamtally's data in one Redis: Tokens, usage rows, close markers and counts.

    Not a connection pool of its own: it uses the client it is given, and
    `aclose` closes that client.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._flush = client.register_script(FLUSH_SCRIPT)
        self._dead = client.register_script(DEAD_LETTER_SCRIPT)
        self._close_once = client.register_script(CLOSE_ONCE_SCRIPT)

    @classmethod
    def from_url(
        cls, url: str, *, connect_timeout: float | None = None, timeout: float | None = None
    ) -> RedisStore:
        """A store on a new client of `url` (ValueError when it is not a Redis URL).

        `connect_timeout` and `timeout` (seconds) bound connecting and each
        command; None leaves redis-py's default (no limit) or the URL's own.
        """
        options: dict[str, float] = {}
        if connect_timeout is not None:
            options["socket_connect_timeout"] = connect_timeout
        if timeout is not None:
            options["socket_timeout"] = timeout
        return cls(aioredis.from_url(url, **options))

    async def ping(self, timeout: float = 1.0) -> None:
        """Whether Redis answers now: returns, or raises (a `RedisError`, `OSError`, timeout)."""
        await asyncio.wait_for(self._client.ping(), timeout)

    async def aclose(self) -> None:
        """Close the client."""
        await self._client.aclose()

    @staticmethod
    def position_of(topic: str, partition: int, offset: int) -> str:
        """How `count_dead_letters` names a raw record: ``topic:partition:offset``."""
        return layout.position_of(topic, partition, offset)

    # ------------------------------------------------------------------ layout

    async def layout_version(self) -> str | None:
        """The data's layout version (``st:layout``); None when it is not set."""
        raw: bytes | str | None = await self._client.get(LAYOUT_KEY)
        return None if raw is None else reply_text(raw)

    async def holds_data(self) -> bool:
        """Whether Redis holds any streamtally data besides ``st:layout``."""
        if await self._client.exists(CLOSED_KEY, STATS_KEY, ROWS_KEY, DEAD_SEEN_KEY):
            return True
        async for _ in self._client.scan_iter(match=tokens_pattern(), count=1000):
            return True
        return False

    async def ensure_layout(self) -> None:
        """Claim layout `LAYOUT_VERSION` on an empty Redis; raise `LayoutError` on another one.

        Redis with data but no ``st:layout`` was written by a version before 2
        (Tokens keyed by request id alone): reading it as version 2 would count
        replayed requests again, so nothing may write before it is migrated.
        """
        version = await self.layout_version()
        if version is None and not await self.holds_data():
            await self._client.set(LAYOUT_KEY, LAYOUT_VERSION, nx=True)
            version = await self.layout_version()
        if version == LAYOUT_VERSION:
            return
        if version is None:
            raise LayoutError(
                "Redis holds streamtally data of layout version 1 (requests keyed by id "
                "alone); run `streamtally migrate` once (it needs the billing topic), then "
                "start again"
            )
        if version == MIGRATING:
            raise LayoutError(
                "a `streamtally migrate` of this Redis is in progress or was interrupted; "
                "run it (again) to the end, then start again"
            )
        raise LayoutError(
            f"Redis holds layout version {version!r}; this streamtally reads and writes "
            f"version {LAYOUT_VERSION} (a newer streamtally wrote it?)"
        )

    # ------------------------------------------------------------------ writes

    async def mark_closing(self, markers: Mapping[RequestRef, str]) -> dict[RequestRef, str]:
        """Record close decisions (request -> "offset reason") before their outputs are sent.

        Write-once: a decision already there is never overwritten.  Returns the
        requests decided before with another marker (and that marker): their
        outputs must not be written (another owner of the partition decided;
        the one decision stands), so a request never gets two different bills.
        A replay that finds a decision but no Tokens closes the request again
        at the same offset for the same reason, so its outputs do not change.
        """
        if not markers:
            return {}
        by_field = {closed_field(ref): ref for ref in markers}
        keys, args = close_once_call({closed_field(ref): m for ref, m in markers.items()})
        flat = await self._close_once(keys=keys, args=args)
        texts = [reply_text(item) for item in flat]
        return {by_field[f]: m for f, m in zip(texts[::2], texts[1::2], strict=True)}

    async def apply_requests(self, batch: Sequence[FinishedRequest]) -> list[bool]:
        """Apply finished requests in ONE atomic, idempotent script call.

        One flag per request, in order: True when this call applied it, False
        when it had been applied before (its Tokens key existed).  When the
        script refuses (a key of the wrong type), nothing is written.
        """
        if not batch:
            return []
        keys, argv = flush_call(batch)
        result = await self._flush(keys=keys, args=argv)
        if not isinstance(result, list) or len(result) != len(batch):
            raise RuntimeError(f"redis sink script returned {result!r} for {len(batch)} requests")
        return [int(flag) == 1 for flag in result]

    async def count_dead_letters(self, positions: Sequence[str]) -> int:
        """Count dead letters once per source position (`position_of`); returns the new ones."""
        if not positions:
            return 0
        keys, args = dead_letter_call(positions)
        return int(await self._dead(keys=keys, args=args))

    async def delete_usage(self, tenants: Iterable[str]) -> int:
        """Delete the usage rows of `tenants` and their index members; returns how many.

        Tokens and close markers stay: they are the idempotency markers, and
        without them a replay of the raw records would count the requests again.
        """
        wanted = set(tenants)
        deleted = 0
        for member in await self._client.smembers(ROWS_KEY):
            day, tenant, model = parse_row_member(member)
            if tenant in wanted:
                await self._client.delete(usage_key(day, tenant, model))
                await self._client.srem(ROWS_KEY, member)
                deleted += 1
        return deleted

    # ------------------------------------------------------------------ Tokens

    async def tokens_text(self, ref: RequestRef) -> str | None:
        """The stored Tokens JSON text of `ref`, exactly as written; None if absent."""
        raw: bytes | str | None = await self._client.get(tokens_key(ref))
        return None if raw is None else reply_text(raw)

    async def tokens(self, ref: RequestRef) -> dict[str, Any] | None:
        """The stored Tokens of `ref` as a JSON dict; None if absent (or still streaming)."""
        stored = await self.tokens_text(ref)
        if stored is None:
            return None
        parsed = json.loads(stored)
        if not isinstance(parsed, dict):
            raise ValueError(f"{tokens_key(ref)} does not hold a JSON object")
        return parsed

    async def tokens_texts(self, refs: Sequence[RequestRef]) -> list[str | None]:
        """`tokens_text` of each request, in order, in one round trip."""
        if not refs:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.get(tokens_key(ref))
            replies: list[bytes | str | None] = await pipe.execute()
        return [None if raw is None else reply_text(raw) for raw in replies]

    async def has_tokens(self, ref: RequestRef) -> bool:
        """Whether the Tokens of `ref` are stored (the request is counted)."""
        return bool(await self._client.exists(tokens_key(ref)))

    async def missing_tokens(self, refs: Sequence[RequestRef]) -> list[RequestRef]:
        """The requests of `refs` (in order) whose Tokens are not stored; one round trip."""
        if not refs:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.exists(tokens_key(ref))
            found = await pipe.execute()
        return [r for r, exists in zip(refs, found, strict=True) if not exists]

    async def tenants_of(self, request_id: str) -> list[str]:
        """The tenants holding Tokens of a request with this id, sorted (by SCAN)."""
        tenants = set()
        match = tokens_pattern_of_id(request_id)  # Redis filters; each key is parsed to be sure
        async for key in self._client.scan_iter(match=match, count=1000):
            try:
                ref = parse_tokens_key(reply_text(key))
            except ValueError:
                continue
            if ref.request_id == request_id:
                tenants.add(ref.tenant)
        return sorted(tenants)

    async def tokens_count(self) -> int:
        """How many requests' Tokens are stored (by SCAN)."""
        count = 0
        async for _ in self._client.scan_iter(match=tokens_pattern(), count=1000):
            count += 1
        return count

    # ------------------------------------------------------------------ usage rows

    async def usage_rows(
        self, *, tenant: str | None = None, day: str | date | None = None
    ) -> list[dict[str, Any]]:
        """The usage rows, optionally of one tenant and/or UTC day, sorted by (day, tenant, model).

        Each row is ``{"tenant", "model", "day", "requests", "unpriced_requests",
        "input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens",
        "cache_write_tokens", "cost"}`` with `cost` the exact total as a decimal
        string (12 places) and `unpriced_requests` how many of `requests` were
        billed unpriced, cost 0 (0 for a row written before the field existed).
        The hashes are read in one MULTI/EXEC, so the rows are one consistent
        snapshot of the rows listed in the index.
        """
        wanted_day = day_filter(day)
        members: set[bytes | str] = await self._client.smembers(ROWS_KEY)
        rows: list[tuple[str, str, str]] = []
        for member in members:
            row_day, row_tenant, row_model = parse_row_member(member)
            if (tenant is None or row_tenant == tenant) and (
                wanted_day is None or row_day == wanted_day
            ):
                rows.append((row_day, row_tenant, row_model))
        rows.sort()
        if not rows:
            return []
        async with self._client.pipeline(transaction=True) as pipe:
            for row in rows:
                pipe.hmget(usage_key(*row), list(ROW_FIELDS))
            results: list[list[bytes | str | None]] = await pipe.execute()
        out: list[dict[str, Any]] = []
        for row, values in zip(rows, results, strict=True):
            decoded = usage_row(*row, values)
            if decoded is not None:
                out.append(decoded)
        return out

    # ------------------------------------------------------------------ markers and counts

    async def closed_markers(
        self, refs: Sequence[RequestRef]
    ) -> dict[RequestRef, tuple[str, bool]]:
        """For each request that closed (or was deciding to): its marker and if it was applied."""
        if not refs:
            return {}
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hmget(CLOSED_KEY, [closed_field(ref) for ref in refs])
            for ref in refs:
                pipe.exists(tokens_key(ref))
            replies = await pipe.execute()
        markers, applied = replies[0], replies[1:]
        found: dict[RequestRef, tuple[str, bool]] = {}
        for ref, marker, exists in zip(refs, markers, applied, strict=True):
            if marker is not None:
                found[ref] = (reply_text(marker), bool(exists))
        return found

    async def closed_count(self) -> int:
        """How many requests have a close marker."""
        return int(await self._client.hlen(CLOSED_KEY))

    async def dead_letter_count(self) -> int:
        """How many distinct raw records were dead-lettered (positions seen)."""
        return int(await self._client.scard(DEAD_SEEN_KEY))

    async def stats(self) -> dict[str, int]:
        """The pipeline's raw-record counts (`STATS_FIELDS`, 0 when never counted)."""
        raw = await self._client.hgetall(STATS_KEY)
        out = dict.fromkeys(STATS_FIELDS, 0)
        for name, value in raw.items():
            out[reply_text(name)] = int(value)
        return out
