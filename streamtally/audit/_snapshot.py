"""The snapshot an audit reads: offsets taken once, at start, so the audit always ends.

In this order, so that each later read covers what the earlier ones imply:

1. the processors' committed offsets (their consumer group, read with an admin request,
   never joined): a request closed below them has its outputs durable;
2. the billing topic's end offsets: every event of those requests is below them; with
   them the corrections topic's (``audit --correct`` writes it);
3. the usage rows, read from Redis by the caller (`take_snapshot`'s `between`): every
   request in them was applied before, so its raw records are below the raw end offsets
   taken next (read after those, a request whose records all came after the snapshot
   could be in a row the replay cannot explain);
4. the raw topics' end offsets, and where `--since` / `--until` start and stop reading
   (`offsets_for_times` on the records' Kafka time, which the raw topics set to the
   broker's append time: a record received at t is appended after t - `SKEW_S`, and
   read up to `LATE_APPEND_S` past `--until`, a producer's backlog).

When a raw partition is read from its first retained record (the rest deleted by
retention), the audit cannot see requests from before it: the range's start is moved to
that record's time plus the request timeout (`Snapshot.window`; the longest one, when
``STREAMTALLY_REQUEST_TIMEOUTS`` sets some per source).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError

from streamtally.audit._range import TimeRange
from streamtally.connection import KafkaConnection, as_connection, client_options
from streamtally.errors import InputError, StackError
from streamtally.processors.clock import SKEW_S
from streamtally.topics import Topics

__all__ = ["BILLING_SLACK_S", "LATE_APPEND_S", "Snapshot", "take_snapshot"]

#: How long after `--until` a record received before it may still be appended (read that far).
LATE_APPEND_S: Final = 3600.0
#: How long before its event time a billing event may have been appended (clock skew).
BILLING_SLACK_S: Final = 3600.0

Ranges = dict[int, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the audit reads: offsets `[start, end)` per partition, taken at `taken_at`."""

    taken_at: datetime
    #: The receive times audited: `--since` / `--until`, the start moved past retention.
    window: TimeRange
    #: Raw topic name -> partition -> [start, end).
    raw: dict[str, Ranges]
    billing_topic: str
    billing: Ranges
    group: str
    #: (raw topic, partition) -> the processors' committed offset (absent: none yet).
    committed: dict[tuple[str, int], int]
    corrections_topic: str = ""
    #: The corrections topic from its start (empty: the topic does not exist yet).
    corrections: Ranges = field(default_factory=dict)

    def raw_records(self) -> int:
        return sum(end - start for ranges in self.raw.values() for start, end in ranges.values())

    def billing_records(self) -> int:
        return sum(end - start for start, end in self.billing.values())

    def to_json(self) -> dict[str, Any]:
        def spans(ranges: Ranges) -> dict[str, dict[str, int]]:
            return {str(p): {"start": s, "end": e} for p, (s, e) in sorted(ranges.items())}

        return {
            "taken_at": self.taken_at.isoformat(),
            **self.window.to_json(),
            "topics": {
                **{name: spans(ranges) for name, ranges in self.raw.items()},
                self.billing_topic: spans(self.billing),
                **({self.corrections_topic: spans(self.corrections)} if self.corrections else {}),
            },
            "processors_group": self.group,
            "processors_committed": {
                name: {str(p): self.committed.get((name, p)) for p in sorted(ranges)}
                for name, ranges in self.raw.items()
            },
        }


def _ms(moment: datetime, shift_s: float) -> int:
    return int((moment.timestamp() + shift_s) * 1000)


async def _committed(servers: KafkaConnection, group: str) -> dict[tuple[str, int], int]:
    admin = AIOKafkaAdminClient(**client_options(servers), request_timeout_ms=15000)
    try:
        await admin.start()
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {(tp.topic, tp.partition): m.offset for tp, m in offsets.items() if m.offset >= 0}


class _Offsets:
    """Offset look-ups of one consumer without a group (assigned, never subscribed)."""

    def __init__(self, consumer: AIOKafkaConsumer, servers: KafkaConnection, cluster: Any) -> None:
        self._consumer = consumer
        self._servers = servers
        self._cluster = cluster

    async def partitions(self, topic: str) -> list[TopicPartition]:
        found = self._cluster.partitions_for_topic(topic)
        if not found:
            raise StackError(
                f"topic {topic} does not exist on {self._servers}: nothing was written there "
                "yet (`streamtally worker` creates the topics), or it is the wrong Kafka or "
                "namespace (STREAMTALLY_NAMESPACE)"
            )
        return [TopicPartition(topic, p) for p in sorted(found)]

    async def bounds(self, tps: list[TopicPartition]) -> tuple[dict[Any, int], dict[Any, int]]:
        ends: dict[Any, int] = await self._consumer.end_offsets(tps)
        begins: dict[Any, int] = await self._consumer.beginning_offsets(tps)
        return begins, ends

    async def at(
        self, tps: Iterable[TopicPartition], ms: int, ends: dict[Any, int]
    ) -> dict[Any, int]:
        """The first offset of each partition whose Kafka time is >= `ms` (its end if none)."""
        wanted = {tp: max(ms, 0) for tp in tps}
        if not wanted:
            return {}
        found = await self._consumer.offsets_for_times(wanted)
        return {tp: ends[tp] if found.get(tp) is None else found[tp].offset for tp in wanted}

    async def first_time(self, tp: TopicPartition, offset: int) -> float | None:
        """The Kafka time (seconds) of the record at `offset` of `tp`."""
        self._consumer.assign([tp])
        self._consumer.seek(tp, offset)
        batch = await self._consumer.getmany(tp, timeout_ms=5000, max_records=1)
        records = batch.get(tp) or []
        return records[0].timestamp / 1000 if records else None


async def take_snapshot(
    kafka: KafkaConnection | str,
    topics: Topics,
    wanted: TimeRange,
    *,
    request_timeout: float,
    between: Callable[[], Awaitable[None]] | None = None,
) -> Snapshot:
    """The offsets to read (see the module docstring); `StackError` when Kafka fails.

    `between` is awaited after the billing topic's end offsets are taken and before the
    raw topics' are: where the usage rows must be read.
    """
    group = topics.processors_group
    servers = as_connection(kafka)  # printed as its servers, credentials hidden
    consumer = AIOKafkaConsumer(
        **client_options(servers),
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        request_timeout_ms=15000,
    )
    try:
        committed = await _committed(servers, group)
        await consumer.start()
        # As `read_topic` does: `consumer.topics()` fetches this metadata but keeps the names.
        cluster = await consumer._client.fetch_all_metadata()
        # The consumer tracks no topic yet: an offset request for one it does not know asks
        # for its metadata and then sleeps the retry backoff (100 ms) before it asks again,
        # once per topic.  Tracking the snapshot's topics (those that exist: tracking one
        # that does not could create it) takes one metadata request for all of them.
        await consumer._client.set_topics(
            [t.name for t in (topics.billing, topics.corrections, *topics.raw)
             if cluster.partitions_for_topic(t.name)]
        )  # fmt: skip
        offsets = _Offsets(consumer, servers, cluster)
        billing_tps = await offsets.partitions(topics.billing.name)
        billing_begins, billing_ends = await offsets.bounds(billing_tps)
        corrections: Ranges = {}
        if cluster.partitions_for_topic(topics.corrections.name):
            correction_tps = await offsets.partitions(topics.corrections.name)
            begins, ends = await offsets.bounds(correction_tps)
            corrections = {tp.partition: (begins[tp], ends[tp]) for tp in correction_tps}
        if between is not None:
            await between()
        taken_at = datetime.now(UTC)
        raw: dict[str, Ranges] = {}
        retained_from: float | None = None
        for topic in topics.raw:
            tps = await offsets.partitions(topic.name)
            begins, ends = await offsets.bounds(tps)
            starts = dict(begins)
            if wanted.since is not None:
                starts = await offsets.at(tps, _ms(wanted.since, -SKEW_S), ends)
            stops = dict(ends)
            if wanted.until is not None:
                stops = await offsets.at(tps, _ms(wanted.until, LATE_APPEND_S), ends)
            raw[topic.name] = {}
            for tp in tps:
                start = min(max(starts[tp], begins[tp]), ends[tp])
                raw[topic.name][tp.partition] = (start, max(start, min(stops[tp], ends[tp])))
                if 0 < begins[tp] == start < ends[tp]:  # records before it were deleted
                    first = await offsets.first_time(tp, start)
                    if first is not None:
                        retained_from = (
                            first if retained_from is None else max(retained_from, first)
                        )
        window = _window(wanted, retained_from, request_timeout)
        billing_starts = dict(billing_begins)
        if window.since is not None:
            billing_starts = await offsets.at(
                billing_tps, _ms(window.since, -BILLING_SLACK_S), billing_ends
            )
        billing = {
            tp.partition: (max(billing_starts[tp], billing_begins[tp]), billing_ends[tp])
            for tp in billing_tps
        }
    except KafkaConnectionError as exc:
        raise StackError(
            f"cannot reach Kafka at {servers.unreachable()}: start the local stack with "
            "`streamtally stack up`, or pass --bootstrap-servers / set KAFKA_BOOTSTRAP_SERVERS"
        ) from exc
    except KafkaError as exc:
        raise StackError(
            f"taking the audit's snapshot of Kafka at {servers} failed: {exc}"
        ) from exc
    finally:
        await consumer.stop()
    return Snapshot(
        taken_at,
        window,
        raw,
        topics.billing.name,
        billing,
        group,
        committed,
        topics.corrections.name,
        corrections,
    )


def _window(wanted: TimeRange, retained_from: float | None, request_timeout: float) -> TimeRange:
    """`wanted`, its start moved to what the raw topics still hold in full."""
    if retained_from is None:
        return wanted
    held = datetime.fromtimestamp(retained_from, UTC) + timedelta(seconds=request_timeout)
    if wanted.since is not None and wanted.since >= held:
        return wanted
    if wanted.until is not None and held >= wanted.until:
        raise InputError(
            f"the raw topics hold records from {held.isoformat()} on only (retention): "
            "nothing before --until can be audited"
        )
    return TimeRange(held, wanted.until)
