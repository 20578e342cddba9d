"""`RedisStore`: every write and read of streamtally's Redis, as typed async methods.

It wraps one client, of one Redis (`redis.asyncio.Redis`) or of a Redis Cluster
(`redis.asyncio.RedisCluster`), made with or without ``decode_responses``;
registers the scripts once, and takes every key from `streamtally.store.layout`.
Writes: `mark_closing`, `apply_requests` (through the batching
`streamtally.store.RedisBatch`), `count_dead_letters`, each one script call per
shard (one hash slot), sent in one pipeline.  Reads: Tokens, usage rows (the
shards' parts summed), close markers, counts.  No other module talks to Redis
about its data.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import date
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS
from streamtally.errors import LayoutError
from streamtally.store import layout, layout_v2
from streamtally.store.layout import (
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    ROW_FIELDS,
    SHARDS,
    STATS_FIELDS,
    amend_key,
    closed_key,
    closed_pattern,
    closes_key,
    correction_key,
    dead_key,
    guard_key,
    marker_revision,
    parse_row_member,
    parse_tokens_key,
    revision_key,
    row_member,
    rows_key,
    shard_of,
    shard_of_position,
    shard_of_row,
    stats_key,
    tokens_key,
    tokens_pattern,
    tokens_pattern_of_id,
    usage_key,
)
from streamtally.store.rows import day_filter, reply_text, usage_row
from streamtally.store.scripts import (
    AMEND_CLOSE_SCRIPT,
    AMEND_SCRIPT,
    CLOSE_ONCE_SCRIPT,
    CORRECT_ROW_SCRIPT,
    DEAD_LETTER_SCRIPT,
    FLUSH_SCRIPT,
    AmendedRequest,
    FinishedRequest,
    ShardCall,
    amend_call,
    amend_close_calls,
    close_once_calls,
    dead_letter_calls,
    flush_calls,
)

__all__ = ["LayoutError", "RedisClient", "RedisStore"]

#: A client of one Redis or of a Redis Cluster.
RedisClient = aioredis.Redis | RedisCluster


class RedisStore:
    """streamtally's data in one Redis or one Redis Cluster: Tokens, usage rows, markers, counts.

    Not a connection pool of its own: it uses the client it is given, and
    `aclose` closes that client.  `state_ttl_s` is how long Tokens, close
    markers and dead-letter marks are kept after they are written (0: for
    ever); only writes use it.
    """

    def __init__(self, client: RedisClient, *, state_ttl_s: int = 0) -> None:
        if state_ttl_s < 0:
            raise ValueError(f"state_ttl_s must be >= 0 (0: never expire), not {state_ttl_s}")
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._ttl_s = state_ttl_s
        self._flush = client.register_script(FLUSH_SCRIPT)
        self._dead = client.register_script(DEAD_LETTER_SCRIPT)
        self._close_once = client.register_script(CLOSE_ONCE_SCRIPT)
        self._correct_row = client.register_script(CORRECT_ROW_SCRIPT)
        self._amend_close = client.register_script(AMEND_CLOSE_SCRIPT)
        self._amend = client.register_script(AMEND_SCRIPT)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        connect_timeout: float | None = None,
        timeout: float | None = None,
        state_ttl_s: int = 0,
    ) -> RedisStore:
        """A store on a new client of `url` (ValueError when it is not a Redis URL).

        `cluster`: `url` names a node of a Redis Cluster.  `connect_timeout`
        and `timeout` (seconds) bound connecting and each command; None leaves
        redis-py's default (no limit) or the URL's own.
        """
        options: dict[str, float] = {}
        if connect_timeout is not None:
            options["socket_connect_timeout"] = connect_timeout
        if timeout is not None:
            options["socket_timeout"] = timeout
        client: RedisClient = (
            RedisCluster.from_url(url, **options) if cluster else aioredis.from_url(url, **options)
        )
        return cls(client, state_ttl_s=state_ttl_s)

    @property
    def state_ttl_s(self) -> int:
        """How long written Tokens, close markers and dead-letter marks are kept (0: for ever)."""
        return self._ttl_s

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

    async def _run(self, script: Any, calls: Sequence[ShardCall]) -> list[Any]:
        """Each call's reply, in order: one round trip (a pipeline, never a transaction).

        On Redis Cluster the calls go out at once instead, each to the master of
        its shard's slot (redis-py refuses scripts in a cluster pipeline).  Either
        way a failure may leave some calls applied: each script is idempotent, so
        the caller retries the whole batch.
        """
        if len(calls) == 1:
            return [await script(keys=calls[0].keys, args=calls[0].argv)]
        if self._cluster:
            return list(await asyncio.gather(*(script(keys=c.keys, args=c.argv) for c in calls)))
        try:
            return await self._evalsha_pipeline(script, calls)
        except NoScriptError:
            # A Redis without the script: restarted, or its cache flushed (then maybe between
            # two calls).  Each call is idempotent, so the whole pipeline goes again.
            await self._client.script_load(script.script)
            return await self._evalsha_pipeline(script, calls)

    async def _evalsha_pipeline(self, script: Any, calls: Sequence[ShardCall]) -> list[Any]:
        """The calls as EVALSHA of the script's digest in one pipeline.  Not redis-py's
        scripts in a pipeline: those send a SCRIPT EXISTS before each, a round trip more
        on every write."""
        async with self._client.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.evalsha(script.sha, len(call.keys), *call.keys, *call.argv)
            return list(await pipe.execute())

    # ------------------------------------------------------------------ layout

    async def layout_version(self) -> str | None:
        """The data's layout version (``st:layout``); None when it is not set."""
        raw: bytes | str | None = await self._client.get(LAYOUT_KEY)
        return None if raw is None else reply_text(raw)

    async def holds_data(self) -> bool:
        """Whether Redis holds any streamtally data besides the layout keys."""
        older = (layout_v2.CLOSED_KEY, layout_v2.STATS_KEY, layout_v2.ROWS_KEY)
        if await self._client.exists(*older, layout_v2.DEAD_SEEN_KEY):
            return True
        for pattern in (layout_v2.tokens_pattern(), "st:{s*}:*"):
            async for key in self._client.scan_iter(match=pattern, count=1000):
                if not reply_text(key).endswith("}:layout"):
                    return True
        return False

    async def ensure_layout(self) -> None:
        """Claim layout `LAYOUT_VERSION` on an empty Redis; raise `LayoutError` on another one.

        Redis with data of an older layout (no ``st:layout``: version 1; ``"2"``)
        must be migrated first: reading it as version 3 would count replayed
        requests again, so nothing may write before it is migrated.
        """
        version = await self.layout_version()
        if version is None and not await self.holds_data():
            await self._client.set(LAYOUT_KEY, LAYOUT_VERSION, nx=True)
            version = await self.layout_version()
        if version == LAYOUT_VERSION:
            await self._claim_shards()
            return
        if version in (None, layout_v2.VERSION):
            raise LayoutError(
                f"Redis holds streamtally data of layout version {version or 1}; run "
                "`streamtally migrate` once (it needs the billing topic), then start again"
            )
        if version in (MIGRATING, layout_v2.MIGRATING_FROM_1):
            raise LayoutError(
                "a `streamtally migrate` of this Redis is in progress or was interrupted; "
                "run it (again) to the end, then start again"
            )
        raise LayoutError(
            f"Redis holds layout version {version!r}; this streamtally reads and writes "
            f"version {LAYOUT_VERSION} (a newer streamtally wrote it?)"
        )

    async def _claim_shards(self) -> None:
        """Set every shard's layout key to `LAYOUT_VERSION` where it is not set yet."""
        async with self._client.pipeline(transaction=False) as pipe:
            for shard in range(SHARDS):
                pipe.set(guard_key(shard), LAYOUT_VERSION, nx=True)
            await pipe.execute()

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
        refs = list(markers)
        decisions = [(shard_of(ref), closed_key(ref), markers[ref]) for ref in refs]
        calls = close_once_calls(decisions, self._ttl_s)
        conflicts: dict[RequestRef, str] = {}
        for call, flat in zip(calls, await self._run(self._close_once, calls), strict=True):
            for index, marker in zip(flat[::2], flat[1::2], strict=True):
                conflicts[refs[call.indexes[int(index) - 1]]] = reply_text(marker)
        return conflicts

    async def mark_amending(
        self, decisions: Mapping[RequestRef, tuple[str, str]]
    ) -> dict[RequestRef, str]:
        """Record amendments' close decisions (request -> (marker, the superseded
        revision's marker)) before their outputs are sent.

        An amendment's decision replaces the marker of the revision it supersedes and
        nothing else: returns the requests found decided with another marker (another
        owner decided that revision, or a later one), whose outputs must not be written.
        """
        if not decisions:
            return {}
        refs = list(decisions)
        rows = [(shard_of(ref), closed_key(ref), closes_key(ref), *decisions[ref]) for ref in refs]
        calls = amend_close_calls(rows, self._ttl_s)
        conflicts: dict[RequestRef, str] = {}
        for call, flat in zip(calls, await self._run(self._amend_close, calls), strict=True):
            for index, marker in zip(flat[::2], flat[1::2], strict=True):
                conflicts[refs[call.indexes[int(index) - 1]]] = reply_text(marker)
        return conflicts

    async def apply_amendments(self, batch: Sequence[AmendedRequest]) -> list[bool]:
        """Apply amendments, each once (`AMEND_SCRIPT`), in order: True when this call
        applied it, False when that revision (or a later one) was applied before."""
        flags = []
        for amendment in batch:
            keys, argv = amend_call(amendment, self._ttl_s)
            flags.append(bool(await self._amend(keys=keys, args=argv)))
        return flags

    async def keep_amendable(self, states: Mapping[RequestRef, bytes]) -> None:
        """Keep what requests closed at their timeout or over a gap need for an amendment
        (`streamtally.processors.amendable`), for the state TTL.  Idempotent: a replay
        writes the same bytes again."""
        if not states:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for ref, state in states.items():
                pipe.set(amend_key(ref), state, ex=self._ttl_s or None)
            await pipe.execute()

    async def amendable_states(self, refs: Sequence[RequestRef]) -> dict[RequestRef, bytes]:
        """The amendable states kept of `refs` (absent: none kept, or expired)."""
        if not refs:
            return {}
        async with self._client.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.get(amend_key(ref))
            replies = await pipe.execute()
        return {ref: bytes(value) for ref, value in zip(refs, replies, strict=True) if value}

    async def apply_requests(self, batch: Sequence[FinishedRequest]) -> list[bool]:
        """Apply finished requests: one atomic, idempotent script call per shard.

        One flag per request, in order: True when this call applied it, False
        when it had been applied before (its Tokens key existed).  When a
        shard's script refuses (a key of the wrong type), nothing of that
        shard is written; the calls of the other shards may have been applied
        (a retry reports them False).
        """
        if not batch:
            return []
        calls = flush_calls(batch, self._ttl_s)
        flags = [False] * len(batch)
        results = await self._run(self._flush, calls)
        for call, result in zip(calls, results, strict=True):
            if not isinstance(result, list) or len(result) != len(call.indexes):
                raise RuntimeError(
                    f"redis sink script returned {result!r} for {len(call.indexes)} requests"
                )
            for index, flag in zip(call.indexes, result, strict=True):
                flags[index] = int(flag) == 1
        return flags

    async def count_dead_letters(self, positions: Sequence[str]) -> int:
        """Count dead letters once per source position (`position_of`); returns the new ones."""
        if not positions:
            return 0
        marks = [(shard_of_position(p), dead_key(p)) for p in positions]
        calls = dead_letter_calls(marks, self._ttl_s)
        return sum(int(new) for new in await self._run(self._dead, calls))

    async def delete_usage(self, tenants: Iterable[str]) -> int:
        """Delete the usage rows of `tenants` (every shard's part); returns how many rows.

        Tokens and close markers stay: they are the idempotency markers, and
        without them a replay of the raw records would count the requests again.
        """
        wanted = set(tenants)
        deleted: set[tuple[str, str, str]] = set()
        for shard, members in enumerate(await self._row_members()):
            for member in members:
                row = parse_row_member(member)
                if row[1] in wanted:
                    await self._client.delete(usage_key(shard, *row))
                    await self._client.srem(rows_key(shard), member)
                    deleted.add(row)
        return len(deleted)

    async def correct_row(
        self, row: tuple[str, str, str], differences: Mapping[str, int], correction_id: str
    ) -> bool:
        """Add `differences` to the usage row (day, tenant, model), once per `correction_id`.

        `differences` are signed, by field: ``requests``, ``unpriced_requests``, the five
        usage fields and ``cost_pico``, the cost's whole difference in 10**-12 units
        (carried into ``cost_units``); absent fields are 0.  One atomic script on the
        row's correction shard (`shard_of_row`), whose part of the row may go below zero:
        the row is the sum of the parts.  Returns False when the correction had been
        applied before (``streamtally audit --correct`` run again after a failure).
        """
        day, tenant, model = row
        member = row_member(day, tenant, model)
        shard = shard_of_row(member)
        units, pico = divmod(differences.get("cost_pico", 0), 10**12)
        names = ("requests", "unpriced_requests", *USAGE_FIELDS)
        argv = [
            LAYOUT_VERSION,
            str(self._ttl_s),
            member,
            *(str(differences.get(name, 0)) for name in names),
            str(units),
            str(pico),
        ]
        keys = [
            guard_key(shard),
            rows_key(shard),
            usage_key(shard, day, tenant, model),
            correction_key(shard, correction_id),
        ]
        return int(await self._correct_row(keys=keys, args=argv)) == 1

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

    async def _tokens_refs(self, match: str) -> list[RequestRef]:
        refs = []
        async for key in self._client.scan_iter(match=match, count=1000):
            try:
                refs.append(parse_tokens_key(reply_text(key)))
            except ValueError:
                continue  # a key the glob matches that is not a Tokens key
        return refs

    async def tenants_of(self, request_id: str) -> list[str]:
        """The tenants holding Tokens of a request with this id, sorted (by SCAN)."""
        refs = await self._tokens_refs(tokens_pattern_of_id(request_id))
        return sorted({ref.tenant for ref in refs if ref.request_id == request_id})

    async def tokens_count(self) -> int:
        """How many requests' Tokens are stored (by SCAN)."""
        return len(await self._tokens_refs(tokens_pattern()))

    # ------------------------------------------------------------------ usage rows

    async def _row_members(self) -> list[set[bytes | str]]:
        """Each shard's rows set, by shard."""
        async with self._client.pipeline(transaction=False) as pipe:
            for shard in range(SHARDS):
                pipe.smembers(rows_key(shard))
            return list(await pipe.execute())

    async def usage_rows(
        self,
        *,
        tenant: str | None = None,
        day: str | date | None = None,
        first_day: str | date | None = None,
        last_day: str | date | None = None,
    ) -> list[dict[str, Any]]:
        """The usage rows, optionally of one tenant and/or UTC day, sorted by (day, tenant, model).

        `first_day` and `last_day` (both included) keep the rows of a range of
        UTC days; like `day`, they select rows before any is read.

        Each row is ``{"tenant", "model", "day", "requests", "unpriced_requests",
        "input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens",
        "cache_write_tokens", "cost"}`` with `cost` the exact total as a decimal
        string (12 places) and `unpriced_requests` how many of `requests` were
        billed unpriced, cost 0, summed over the shards' parts.  On one Redis
        the parts are read in one MULTI/EXEC, one consistent snapshot; a Redis
        Cluster has no transaction across slots, so there each shard's part is
        read as it is when its node answers.
        """
        wanted_day = day_filter(day)
        # ISO days compare as text in calendar order
        since, until = day_filter(first_day), day_filter(last_day)
        parts: list[tuple[int, tuple[str, str, str]]] = []
        for shard, members in enumerate(await self._row_members()):
            for member in members:
                row = parse_row_member(member)
                if (
                    (tenant is None or row[1] == tenant)
                    and (wanted_day is None or row[0] == wanted_day)
                    and (since is None or row[0] >= since)
                    and (until is None or row[0] <= until)
                ):
                    parts.append((shard, row))
        if not parts:
            return []
        keys = [usage_key(shard, *row) for shard, row in parts]
        async with self._client.pipeline(transaction=not self._cluster) as pipe:
            for key in keys:
                pipe.hmget(key, list(ROW_FIELDS))
            results: list[list[bytes | str | None]] = await pipe.execute()
        by_row: dict[tuple[str, str, str], list[tuple[str, list[bytes | str | None]]]] = {}
        for (_shard, row), key, values in zip(parts, keys, results, strict=True):
            by_row.setdefault(row, []).append((key, values))
        rows = (usage_row(*row, by_row[row]) for row in sorted(by_row))
        return [row for row in rows if row is not None]

    # ------------------------------------------------------------------ markers and counts

    async def closed_markers(
        self, refs: Sequence[RequestRef]
    ) -> dict[RequestRef, tuple[str, bool]]:
        """For each request that closed (or was deciding to): its marker and if it was applied."""
        if not refs:
            return {}
        async with self._client.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.get(closed_key(ref))
                pipe.exists(tokens_key(ref))
            replies = await pipe.execute()
        found: dict[RequestRef, tuple[str, bool]] = {}
        amended: dict[RequestRef, int] = {}
        for ref, marker, exists in zip(refs, replies[::2], replies[1::2], strict=True):
            if marker is not None:
                text = reply_text(marker)
                found[ref] = (text, bool(exists))
                revision = marker_revision(text)
                if revision and exists:
                    amended[ref] = revision
        if amended:  # an amendment's marker: applied once its revision is (a second trip)
            async with self._client.pipeline(transaction=False) as pipe:
                for ref in amended:
                    pipe.get(revision_key(ref))
                applied = await pipe.execute()
            for (ref, wanted), value in zip(amended.items(), applied, strict=True):
                done = value is not None and int(reply_text(value)) >= wanted
                found[ref] = (found[ref][0], done)
        return found

    async def close_history(self, refs: Sequence[RequestRef]) -> dict[RequestRef, list[str]]:
        """For each amended request of `refs`: the close markers of its earlier revisions,
        revision 0 first (absent: never amended, or expired)."""
        if not refs:
            return {}
        async with self._client.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.get(closes_key(ref))
            replies = await pipe.execute()
        return {
            ref: reply_text(value).split("\n")
            for ref, value in zip(refs, replies, strict=True)
            if value
        }

    async def closed_count(self) -> int:
        """How many requests have a close marker (by SCAN)."""
        count = 0
        async for key in self._client.scan_iter(match=closed_pattern(), count=1000):
            if ":closed:" in reply_text(key).split("}", 1)[1][:8]:
                count += 1
        return count

    async def dead_letter_count(self) -> int:
        """How many distinct raw records were dead-lettered (counted once each)."""
        return (await self.stats())["dead_lettered"]

    async def stats(self) -> dict[str, int]:
        """The pipeline's raw-record counts (`STATS_FIELDS`, 0 when never counted)."""
        async with self._client.pipeline(transaction=False) as pipe:
            for shard in range(SHARDS):
                pipe.hgetall(stats_key(shard))
            replies = await pipe.execute()
        out = dict.fromkeys(STATS_FIELDS, 0)
        for raw in replies:
            for name, value in raw.items():
                field = reply_text(name)
                out[field] = out.get(field, 0) + int(value)
        return out
