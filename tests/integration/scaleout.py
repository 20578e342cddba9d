"""Scale-out run, as a program: `python -m tests.integration.scaleout --requests N`.

Several workers in one consumer group, on the real stack, through a kill/join
schedule while many requests are open.  Like `chaos.py` it runs in its own
process, in a topic namespace of its own (``STREAMTALLY_NAMESPACE``, a fresh
one unless set) and a Redis database of its own (``--db``, emptied first),
and prints one JSON report that `test_scaleout.py` asserts on.

What happens:
1. requests built from our own sample transcripts (`chaos.build_requests`)
   are produced interleaved, many open at once, some records twice
   (`chaos.produce_interleaved`), at a rate that spreads them over `--seconds`;
2. at `--workers-at` of the production (a third or so of the requests
   started, dozens open) three workers start in one group and read the raw
   topics' partitions between them;
3. once the group has settled, while production goes on: a clean leave
   (SIGTERM), a join, a SIGKILL and, while the killed member still holds its
   session, another join: every membership change revokes partitions in the
   middle of open requests (their new owner re-reads from the committed
   offset).  Each change waits for the group to settle from the one before;
   past a share of the production (60, 70, 80 and 90 %), the production is
   held until it has (the open requests stay open; `production_held_s` per
   change says how long), so that on a loaded machine, whose workers take
   long to start, the changes still come amid open requests and, but for
   the join that follows the kill on purpose, in a settled group.  A held
   production shows in the largest billing gap;
4. once every request is in Redis the last workers get SIGTERM, and the run is
   checked as the chaos run is (`chaos.verify`: Tokens equal to the fold, usage
   per tenant exact, one distinct billing event per request, counts reconcile),
   plus: one payload per billing `event_id`.

The pause a rebalance causes is measured twice:
- from the workers' logs: per group generation, from the first member revoking
  its partitions to the last one having its new partitions (the group stops
  reading meanwhile), and per membership change, the time from the change
  until the group has all partitions assigned again;
- from the output: the largest gap between consecutive billing events (Kafka
  timestamps) while records were being produced.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis

from streamtally.ops.worker_process import WorkerProcess
from streamtally.settings import Settings
from streamtally.topics import Topics
from tests.integration.chaos import (
    REPO,
    build_requests,
    produce_interleaved,
    request_ref,
    verify,
    wait_all,
    worker_env,
)
from tests.integration.isolation import db_url

#: This run's Redis database when `--db` is not given (the heavy test passes one it leased).
DEFAULT_DB = 5
#: Seconds the group may take to settle after a membership change (a SIGKILLed
#: member is only given up after its session timeout, 10 s).
SETTLE_TIMEOUT_S = 45.0

_LINE = re.compile(r"^\[(?P<ts>[^\]]+)\] \[(?P<pid>\d+)\] \[\w+\] [\w.]+: (?P<msg>.*)$")
_JOINED = re.compile(r"Joined group '.*' \(generation (?P<generation>\d+)\)")
_REVOKING = "Revoking previously assigned partitions "
_ASSIGNED = "raw partitions assigned: "


# --------------------------------------------------------------------------- the workers' logs


@dataclass(frozen=True, slots=True)
class GroupEvent:
    """One line of a worker's log about its group membership."""

    at: float  # seconds since the epoch
    kind: str  # "revoke" (of a non-empty set), "join" or "assign"
    generation: int = 0  # of a join
    partitions: tuple[tuple[str, int], ...] = ()  # of an assign


def group_events(log: str) -> list[GroupEvent]:
    """The revokes (of partitions it had), joins and assignments a worker logged, in order."""
    events = []
    for line in log.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        at = datetime.fromisoformat(match["ts"]).timestamp()
        msg = match["msg"]
        joined = _JOINED.search(msg)
        if joined is not None:
            events.append(GroupEvent(at, "join", generation=int(joined["generation"])))
        elif msg.startswith(_REVOKING) and not msg.startswith(_REVOKING + "set()"):
            events.append(GroupEvent(at, "revoke"))
        elif msg.startswith(_ASSIGNED):
            parts = ast.literal_eval(msg.removeprefix(_ASSIGNED))
            events.append(GroupEvent(at, "assign", partitions=tuple(map(tuple, parts))))
    return events


def generations(
    histories: dict[str, list[GroupEvent]], kills: dict[str, float] | None = None
) -> dict[int, dict[str, Any]]:
    """Per completed group generation: its members, when the first of them stopped reading
    (revoked the partitions it had), when each got its new partitions, and the pause.

    `kills` (worker name: when it was SIGKILLed) names the generation a kill cut short: a
    member killed while the generation formed may die before it logs its join and its
    partitions (its last lines are lost with it), so the generation's logs hold only a
    share of the partitions; `cut_short_by` says which worker, and `partitions_twice`
    whether any partition was held twice all the same.
    """
    seen: dict[int, dict[str, Any]] = defaultdict(
        lambda: {"members": {}, "stopped": [], "joined": []}
    )
    for name, events in histories.items():
        revoked_at: float | None = None
        for i, event in enumerate(events):
            if event.kind == "revoke":
                revoked_at = event.at
            elif event.kind == "join":
                gen = seen[event.generation]
                gen["joined"].append(event.at)
                if revoked_at is not None:
                    gen["stopped"].append(revoked_at)
                revoked_at = None
                after = events[i + 1] if i + 1 < len(events) else None
                if after is not None and after.kind == "assign":
                    gen["members"][name] = (after.at, after.partitions)
    out = {}
    for number, gen in sorted(seen.items()):
        if not gen["members"] or len(gen["members"]) != len(gen["joined"]):
            continue  # a member never got its partitions: the generation did not complete
        assigned = max(at for at, _ in gen["members"].values())
        stopped = min(gen["stopped"], default=None)
        partitions = sorted(p for _, parts in gen["members"].values() for p in parts)
        out[number] = {
            "members": sorted(gen["members"]),
            "first_join": min(gen["joined"]),
            "assigned": assigned,
            "partitions": partitions,
            "partitions_twice": len(partitions) != len(set(partitions)),
            "pause_s": None if stopped is None else round(assigned - stopped, 2),
        }
    numbers = list(out)
    for i, number in enumerate(numbers):
        gen = out[number]
        # the generation lasted from its first join until the next one's first join
        ended = out[numbers[i + 1]]["first_join"] if i + 1 < len(numbers) else float("inf")
        gen["cut_short_by"] = next(
            (
                name
                for name, at in sorted((kills or {}).items())
                if name not in gen["members"] and gen["first_join"] <= at < ended
            ),
            None,
        )
    return out


# --------------------------------------------------------------------------- the group


@dataclass
class Group:
    """The run's workers: who is meant to be in the group, and what happened to them."""

    directory: Path
    env: dict[str, str]
    partitions: list[tuple[str, int]]
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    members: set[str] = field(default_factory=set)
    changes: list[dict[str, Any]] = field(default_factory=list)
    leaving: list[asyncio.Task[tuple[str, int | None, float]]] = field(default_factory=list)
    settle_timeouts: list[str] = field(default_factory=list)
    done: float = 0.0  # fraction of the records produced
    #: Clear while the production is held (`until`), so that a change meets open requests.
    producing: asyncio.Event = field(default_factory=asyncio.Event)
    held_s: float = 0.0  # how long the production was held before the next change

    def __post_init__(self) -> None:
        self.producing.set()

    def note(self, kind: str, name: str, settled: bool) -> None:
        self.changes.append(
            {
                "kind": kind,
                "worker": name,
                "at": time.time(),
                "produced": self.done,
                "group_settled_before": settled,
                "production_held_s": round(self.held_s, 2),
            }
        )
        self.held_s = 0.0
        print(f"{kind} {name} at {self.done:.0%} produced", file=sys.stderr)

    def join(self, name: str) -> None:
        settled, log = self.settled(), self.directory / f"{name}.log"
        self.workers[name] = WorkerProcess(log, self.env, cwd=REPO, new_session=False).start()
        self.members.add(name)
        self.note("join", name, settled)

    def leave(self, name: str, *, note: bool = True) -> None:
        """SIGTERM: a clean leave, awaited in the background (its exit status is reported)."""
        settled = self.settled()
        self.workers[name].proc.terminate()
        self.members.discard(name)
        if note:
            self.note("sigterm", name, settled)
        self.leaving.append(asyncio.create_task(self._stopped(name)))

    def kill(self, name: str) -> None:
        settled = self.settled()
        self.workers[name].kill()
        self.members.discard(name)
        self.note("sigkill", name, settled)

    async def _stopped(self, name: str) -> tuple[str, int | None, float]:
        code, took = await asyncio.to_thread(self.workers[name].stop, 30.0)
        return name, code, round(took, 2)

    def settled(self) -> bool:
        """Whether every member holds partitions of one generation, all of them between them."""
        held: list[tuple[str, int]] = []
        numbers = set()
        for name in self.members:
            events = group_events(self.workers[name].log_text())
            assigns = [i for i, e in enumerate(events) if e.kind == "assign"]
            if not assigns or assigns[-1] == 0 or events[assigns[-1] - 1].kind != "join":
                return False
            if any(e.kind == "revoke" for e in events[assigns[-1] :]):
                return False
            numbers.add(events[assigns[-1] - 1].generation)
            held.extend(events[assigns[-1]].partitions)
        return len(numbers) == 1 and sorted(held) == self.partitions

    async def settle(self, what: str) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not self.settled():
            if time.monotonic() > deadline:
                self.settle_timeouts.append(what)
                return
            await asyncio.sleep(0.2)

    async def until(
        self, earliest: float, latest: float, after: float, *, settled: bool = True
    ) -> None:
        """Wait until `earliest` of the records are produced, `after` seconds have passed since
        the last change and (if `settled`) the group has settled.  Once `latest` are
        produced the production is held meanwhile (its open requests stay open), so that
        on a slow machine too, whose workers take long to start, every change meets open
        requests and a settled group; held past `SETTLE_TIMEOUT_S`, the change comes
        anyway and the wait is a settle timeout.  The caller makes its change at once: the
        production resumes when the caller next waits."""
        held_since: float | None = None
        while True:
            quiet = time.time() - self.changes[-1]["at"] if self.changes else after
            if self.done >= earliest and quiet >= after and (not settled or self.settled()):
                break
            if self.done >= latest:
                if held_since is None:
                    held_since = time.monotonic()
                    self.producing.clear()
                elif time.monotonic() - held_since > SETTLE_TIMEOUT_S:
                    self.settle_timeouts.append(f"held at {latest:.0%} produced")
                    break
            await asyncio.sleep(0.1)
        if held_since is not None:
            self.held_s = time.monotonic() - held_since
        self.producing.set()

    def stop_all(self) -> None:
        for worker in self.workers.values():
            if worker.running:
                worker.kill()


async def schedule(group: Group, workers_at: float, gap: float, kill_join_after: float) -> None:
    """Start three workers, then leave, join, kill and join while records are produced.

    Each change waits for the group to settle from the previous one (so that its pause
    is its own); past a share of the production, the production is held until it has
    (`Group.until`), so that all of them meet open requests.
    """
    await group.until(workers_at, workers_at, 0.0, settled=False)
    for name in ("w1", "w2", "w3"):
        group.join(name)
    await group.until(workers_at, 0.6, gap)
    group.leave("w2")
    await group.until(workers_at, 0.7, gap)
    group.join("w4")
    await group.until(workers_at, 0.8, gap)
    group.kill("w1")
    # w1 is still a member until its session times out: the join waits for that
    await group.until(workers_at, 0.9, kill_join_after, settled=False)
    group.join("w5")
    await group.settle("after the last change")


# --------------------------------------------------------------------------- what the topics say


async def _records(topic: str) -> list[Any]:
    from streamtally.wire.kafka import read_topic

    servers = Settings.load().bootstrap_servers
    async with contextlib.aclosing(read_topic(servers, topic)) as records:
        return [r async for r in records if r.value is not None]


async def measure(
    topics: Topics, changes: list[dict[str, Any]], window: tuple[float, float]
) -> dict[str, Any]:
    """Open requests at each change, and the billing topic: payloads per event id, and the
    largest gap between two billing events within `window` (seconds since the epoch)."""
    from streamtally.wire import avro

    spans: dict[bytes | None, list[float]] = {}
    for topic in topics.raw:
        for record in await _records(topic.name):
            at = record.timestamp_ms / 1000
            first, last = spans.setdefault(record.key, [at, at])
            spans[record.key] = [min(first, at), max(last, at)]
    for change in changes:
        change["request_ids_open"] = sum(a < change["at"] < b for a, b in spans.values())
    payloads: dict[str, set[bytes]] = defaultdict(set)
    times: list[float] = []
    for record in await _records(topics.billing.name):
        payloads[avro.decode_billing_event(record.value).event_id].add(record.value)
        times.append(record.timestamp_ms / 1000)
    inside = sorted(t for t in times if window[0] <= t <= window[1])
    gaps = [(b - a, a) for a, b in pairwise(inside)]
    widest, at = max(gaps, default=(0.0, window[0]))
    return {
        "billing_event_ids": len(payloads),
        "event_ids_with_two_payloads": sorted(e for e, v in payloads.items() if len(v) > 1),
        "max_output_gap_s": round(widest, 2),
        "max_output_gap_at": at,
    }


async def diagnose(topics: Topics, refs: list[Any], url: str) -> dict[str, Any]:
    """Why these requests never reached Redis: where their records are, the offset the group
    committed on those partitions (past a request's first record: skipped), their close marker."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from streamtally.core.identity import RequestRef
    from streamtally.store import RedisStore
    from streamtally.wire import avro
    from streamtally.wire.records import RawEngineOutput, RawSseEvent

    decoders: dict[str, Callable[[bytes], RawSseEvent | RawEngineOutput]] = {
        topics.raw_sse.name: avro.decode_raw_sse_event,
        topics.raw_engine.name: avro.decode_raw_engine_output,
    }
    wanted = set(refs)
    ids = {ref.request_id.encode() for ref in refs}
    where: dict[RequestRef, tuple[str, int, list[int]]] = {}
    for name, decode in decoders.items():
        for record in await _records(name):
            if record.key in ids:
                raw = decode(record.value)
                ref = RequestRef(raw.tenant, raw.request_id)
                if ref in wanted:
                    where.setdefault(ref, (name, record.partition, []))[2].append(record.offset)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=Settings.load().bootstrap_servers,
        group_id=topics.processors_group,
        enable_auto_commit=False,
    )
    await consumer.start()
    try:  # reads the group's offsets only: the consumer subscribes to nothing
        committed = {
            (name, part): await consumer.committed(TopicPartition(name, part))
            for name, part in {(n, p) for n, p, _ in where.values()}
        }
    finally:
        await consumer.stop()
    store = RedisStore.from_url(url)
    try:
        markers = await store.closed_markers(refs)
    finally:
        await store.aclose()
    return {
        ref.text: {
            "partition": f"{name}/{part}",
            "offsets": [min(offsets), max(offsets)],
            "committed": committed[(name, part)],
            "committed_past_its_first_record": (committed[(name, part)] or 0) > min(offsets),
            "close_marker": markers.get(ref),
        }
        for ref, (name, part, offsets) in where.items()
    }


# --------------------------------------------------------------------------- the database


#: Holds the id of the run using the database (not a streamtally key: workers ignore it).
CLAIM_KEY = "scaleout:run"
#: A run lasts a few minutes at most; a claim left by a killed run expires.
CLAIM_TTL_S = 300


class DatabaseInUse(Exception):
    """Another run (or the workers of one) uses the database: its numbers would mix with ours."""


async def claim_db(url: str, run_id: str) -> None:
    """Empty the run's database and mark it as this run's; `DatabaseInUse` if another run
    holds it or another client (say, a worker left running by a killed run) is connected."""
    client = aioredis.from_url(url, single_connection_client=True)
    try:
        me = await client.client_id()
        db = str(urlsplit(url).path.lstrip("/") or "0")
        others = [
            c["addr"] for c in await client.client_list() if c["db"] == db and int(c["id"]) != me
        ]
        holder = await client.get(CLAIM_KEY)
        if holder is not None or others:
            raise DatabaseInUse(
                f"Redis database {db} is in use (run {holder!r}, clients {others}): "
                "stop them or pass another --db"
            )
        await client.flushdb()  # this run's own database
        await client.set(CLAIM_KEY, run_id, ex=CLAIM_TTL_S)
    finally:
        await client.aclose()


async def still_claimed(url: str, run_id: str) -> bool:
    """Whether the database is still this run's (nobody emptied or took it meanwhile)."""
    client = aioredis.from_url(url)
    try:
        holder = await client.get(CLAIM_KEY)
    finally:
        await client.aclose()
    return holder in (run_id, run_id.encode())


def release_db(url: str, run_id: str) -> None:
    """Drop this run's claim (its data stays, for a look afterwards)."""
    client = redis.Redis.from_url(url)
    try:
        if client.get(CLAIM_KEY) == run_id.encode():
            client.delete(CLAIM_KEY)
    finally:
        client.close()


# --------------------------------------------------------------------------- the run


async def run(
    count: int,
    seconds: float,
    workers_at: float,
    gap: float,
    kill_join_after: float,
    seed: int,
) -> dict[str, Any]:
    """The whole run in the database `REDIS_URL` names, claimed for it meanwhile."""
    url = Settings.load().redis_url
    run_id = uuid.uuid4().hex[:8]
    await claim_db(url, run_id)
    try:
        return await _run(run_id, count, seconds, workers_at, gap, kill_join_after, seed)
    finally:
        release_db(url, run_id)


async def _run(
    run_id: str,
    count: int,
    seconds: float,
    workers_at: float,
    gap: float,
    kill_join_after: float,
    seed: int,
) -> dict[str, Any]:
    from streamtally.producers import raw_records
    from streamtally.store import RedisStore
    from streamtally.wire.kafka import ensure_topics

    settings = Settings.load()
    url, namespace = settings.redis_url, settings.namespace
    topics = Topics.in_namespace(namespace)
    await ensure_topics(settings.bootstrap_servers, topics.all)
    requests = build_requests(run_id, count, prefix="scaleout")
    records = sum(
        len(raw_records(r["source"], r["file"].read_bytes(), tenant=r["tenant"])[1])
        for r in requests
    )
    partitions = sorted((t.name, p) for t in topics.raw for p in range(t.partitions))
    directory = REPO / ".stack" / "logs" / f"scaleout-{run_id}"
    group = Group(directory, worker_env(namespace, url, timeout=300), partitions)

    def progress(done: float) -> None:
        group.done = done

    # SIGTERM or Ctrl-C: cancelled, so that the workers are stopped too (not left running)
    main_task = asyncio.current_task()
    assert main_task is not None
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, main_task.cancel)
    started = time.time()
    producing = asyncio.create_task(
        produce_interleaved(
            requests, random.Random(seed), records / seconds, progress, running=group.producing
        )
    )
    changing = asyncio.create_task(schedule(group, workers_at, gap, kill_join_after))
    try:
        messages, duplicates = await producing
        produced = time.time()
        await changing
        store = RedisStore.from_url(url)
        try:
            waiting = await wait_all(store, [request_ref(r) for r in requests], timeout=60)
        finally:
            await store.aclose()
        finished = time.time()
        for name in sorted(group.members):
            group.leave(name, note=False)
        stops = await asyncio.gather(*group.leaving)
    finally:
        changing.cancel()
        group.stop_all()
    kills = {c["worker"]: c["at"] for c in group.changes if c["kind"] == "sigkill"}
    gens = generations(
        {name: group_events(w.log_text()) for name, w in group.workers.items()}, kills
    )
    for change in group.changes:
        # what it led to: the first generation whose members all joined after it
        after = [n for n, g in gens.items() if g["first_join"] > change["at"]]
        gen = gens[after[0]] if after else None
        change["generation"] = after[0] if after else None
        change["pause_s"] = gen["pause_s"] if gen else None
        change["until_assigned_s"] = round(gen["assigned"] - change["at"], 2) if gen else None
    report = await verify(requests, url)
    report["redis_db_claimed_throughout"] = await still_claimed(url, run_id)
    report["stuck"] = await diagnose(topics, waiting[:20], url) if waiting else {}
    # the output while records were produced, from when the first three had their partitions
    formed = next((g["assigned"] for g in gens.values() if len(g["members"]) == 3), started)
    measured = await measure(topics, group.changes, (formed, produced))
    measured["max_output_gap_at_s"] = round(measured.pop("max_output_gap_at") - started, 1)
    report.update(measured)
    pauses = [g["pause_s"] for g in gens.values() if g["pause_s"] is not None]
    report.update(
        requests=count,
        raw_messages_sent=messages,
        duplicates_sent=duplicates,
        changes=[
            {**c, "at": round(c["at"] - started, 2), "produced": round(c["produced"], 2)}
            for c in group.changes
        ],
        generations={
            n: {
                "members": g["members"],
                "every_partition_once": g["partitions"] == partitions,
                "partitions_twice": g["partitions_twice"],
                "cut_short_by": g["cut_short_by"],
                "pause_s": g["pause_s"],
            }
            for n, g in gens.items()
        },
        max_rebalance_pause_s=max(pauses, default=None),
        settle_timeouts=group.settle_timeouts,
        worker_error_lines=[
            f"{name}: {line}"
            for name, worker in sorted(group.workers.items())
            for line in worker.log_text().splitlines()
            if "Traceback" in line or "[ERROR]" in line
        ][:10],
        # Records of batches fetched before a revoke and dropped after it (the fence at work).
        fenced_records=sum(
            int(m.group(1))
            for worker in group.workers.values()
            for m in re.finditer(r"fenced (\d+) records of partitions revoked", worker.log_text())
        ),
        clean_stops=[{"worker": n, "exit_code": c, "seconds": s} for n, c, s in stops],
        never_finished=[ref.text for ref in waiting[:5]],
        never_finished_count=len(waiting),
        seconds_producing=round(produced - started, 1),
        seconds_until_all_in_redis=round(finished - started, 1),
        seconds_total=round(time.time() - started, 1),
        worker_logs=str(directory),
        redis_db=urlsplit(url).path.lstrip("/"),
        namespace=namespace,
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=36.0, help="time to produce them in")
    parser.add_argument("--workers-at", type=float, default=0.3, help="fraction produced")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between changes")
    parser.add_argument("--kill-join-after", type=float, default=3.0)
    parser.add_argument("--db", type=int, default=DEFAULT_DB, help="this run's Redis database")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    os.environ["REDIS_URL"] = db_url(Settings.load().redis_url, args.db)
    os.environ.setdefault("STREAMTALLY_NAMESPACE", f"scaleout-{uuid.uuid4().hex[:8]}")
    try:
        report = asyncio.run(
            run(
                args.requests,
                args.seconds,
                args.workers_at,
                args.gap,
                args.kill_join_after,
                args.seed,
            )
        )
    except DatabaseInUse as exc:
        sys.exit(f"scaleout: {exc}")
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
