"""One audit from start to end: snapshot, billing index, replay, comparisons, report.

Reads only: a consumer without a group for every topic, an admin request for the
processors' committed offsets, and Redis reads through `RedisStore` (the usage rows,
right after the snapshot, and the close markers of the requests replayed).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from streamtally.connection import KafkaConnection
from streamtally.core.identity import RequestRef
from streamtally.core.models import utc_now
from streamtally.core.pricing import PriceTable
from streamtally.errors import InputError
from streamtally.ops.audit._billing import BillingIndex, find_events, index_billing
from streamtally.ops.audit._corrections import Corrected, apply_plan, audit_id, plan_corrections
from streamtally.ops.audit._ledger import Ledger, Scope
from streamtally.ops.audit._range import TimeRange
from streamtally.ops.audit._replay import Replay
from streamtally.ops.audit._report import Report
from streamtally.ops.audit._rerate import Rerating
from streamtally.ops.audit._snapshot import Snapshot, take_snapshot
from streamtally.ops.corrections import read_corrections
from streamtally.processors.requests import Limits, RequestProcessor
from streamtally.settings import Settings
from streamtally.store import RedisStore
from streamtally.store.layout import marker_revision
from streamtally.topics import Topics
from streamtally.wire.corrections import CorrectionLog
from streamtally.wire.framing import SINGLE_OBJECT, framing_for
from streamtally.wire.kafka import TopicRecord, read_topic
from streamtally.wire.tenant_keys import TenantTrust

__all__ = ["AuditOptions", "Progress", "replay_processor", "run_audit"]

#: `progress(done, total)`: records read so far of the snapshot's, at most twice a second.
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class AuditOptions:
    window: TimeRange = field(default_factory=TimeRange)
    #: None: every tenant.
    tenants: frozenset[str] | None = None
    #: Raw records per replay step (one Redis look-up and one timeout check each).
    batch_size: int = 2000
    #: ``--prices``: re-rate the period at these prices too (see `_rerate`), named so.
    rerate: PriceTable | None = None
    rerate_name: str = ""
    #: ``--correct``: write a correction per discrepancy and set the usage rows right.
    correct: bool = False
    #: Told (raw topic, partition, records read) as each raw partition is read to its end
    #: (``--progress-lines``); a partition with nothing in range is not read.
    partition_read: Callable[[str, int, int], None] | None = None


def _partitions_read(
    batch: list[TopicRecord] | None,
    topic: str,
    ranges: dict[int, tuple[int, int]],
    tell: Callable[[str, int, int], None],
    told: set[int],
) -> None:
    """`tell` each partition of `batch` whose last record in range it holds; without a
    batch (the topic read), each partition with records in range not told yet."""
    ends = (
        [(r.partition, r.offset + 1) for r in batch]
        if batch is not None
        else [(p, end) for p, (start, end) in sorted(ranges.items()) if end > start]
    )
    for partition, reached in ends:
        start, end = ranges[partition]
        if reached >= end and partition not in told:
            told.add(partition)
            tell(topic, partition, end - start)


class _Meter:
    def __init__(self, total: int, progress: Progress | None) -> None:
        self.done, self.total = 0, total
        self._progress = progress
        self._next = time.monotonic() + 0.5  # nothing to say in the first half second

    def __call__(self, n: int) -> None:
        self.done += n
        if self._progress is not None and time.monotonic() >= self._next:
            self._next = time.monotonic() + 0.5
            self._progress(self.done, self.total)


def replay_processor(settings: Settings, prices: PriceTable) -> RequestProcessor:
    """The worker's processor as the replay runs it: the worker's request timeouts (its
    default and its sources'), its record and size limits, no limit on open requests, and a
    clock that never moves (the input's times alone close quiet requests).  It keeps every
    timed-out request's amendable state (the worker keeps the latest in memory and all in
    Redis; the replay has no Redis to ask), so each late record amends as in the worker:
    memory grows with the raw bytes of the requests closed at their timeout."""
    processor = RequestProcessor(
        prices,
        timeout=settings.request_timeout,
        timeouts=settings.request_timeouts,
        clock=_frozen,
        limits=Limits(
            records_per_request=settings.max_records_per_request,
            open_requests=sys.maxsize,
            open_per_tenant=sys.maxsize,
            text_bytes=settings.max_text_bytes,
            event_bytes=settings.max_event_bytes,
        ),
    )
    processor.amendable_memory_bytes = sys.maxsize
    return processor


def _frozen() -> float:
    """The replay's wall clock: it never moves (the input's times alone do)."""
    return 0.0


async def _batches(
    records: AsyncIterator[TopicRecord], size: int
) -> AsyncIterator[list[TopicRecord]]:
    batch: list[TopicRecord] = []
    async for record in records:
        batch.append(record)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


async def run_audit(
    settings: Settings,
    store: RedisStore,
    options: AuditOptions,
    *,
    servers: KafkaConnection | str | None = None,
    progress: Progress | None = None,
) -> Report:
    """Audit the namespace of `settings` (see `streamtally.ops.audit`)."""
    servers = servers or settings.kafka
    topics = Topics.in_namespace(settings.namespace)
    prices = PriceTable.load_or_default(settings.prices_path)
    stored_rows: list[dict[str, object]] = []

    async def read_rows() -> None:  # inside the snapshot (see `_snapshot`)
        stored_rows.extend(await store.usage_rows())

    snapshot = await take_snapshot(
        servers,
        topics,
        options.window,
        request_timeout=settings.longest_request_timeout,
        between=read_rows,
    )
    bad_corrections: list[tuple[int, int, str]] = []
    corrections = CorrectionLog()
    if any(end > start for start, end in snapshot.corrections.values()):
        corrections = await read_corrections(
            servers,
            snapshot.corrections_topic,
            bad_corrections,
            start={p: r[0] for p, r in snapshot.corrections.items()},
            end={p: r[1] for p, r in snapshot.corrections.items()},
        )
    scope = Scope(snapshot.window, options.tenants)
    meter = _Meter(snapshot.raw_records() + snapshot.billing_records(), progress)
    index = BillingIndex()
    if snapshot.billing_records() or len(corrections):
        await index_billing(
            servers,
            snapshot.billing_topic,
            snapshot.billing,
            scope.accepts,
            index,
            corrections=corrections,
            progress=meter,
        )
    if options.correct and (index.bad or bad_corrections):
        raise InputError(
            f"{len(index.bad)} billing and {len(bad_corrections)} correction records in range "
            "do not decode (see `streamtally audit --json`, snapshot): an audit cannot correct "
            "bills it cannot read; run it without --correct and repair those first"
        )
    rerating = None if options.rerate is None else Rerating(options.rerate, options.rerate_name)
    ledger = Ledger(index, scope, rerating=rerating)
    processor = replay_processor(settings, prices)
    if settings.tenant_keys_path is not None:  # refuse what the worker refused
        processor.trust = TenantTrust.load(settings.tenant_keys_path)

    async def lookup(refs: list[RequestRef]) -> dict[RequestRef, tuple[str, bool]]:
        """The close markers of `refs`; an amended request's with its history before it,
        one marker per line (revision 0 first: `_replay._marker`)."""
        found = await store.closed_markers(refs)
        amended = [ref for ref, (marker, _) in found.items() if marker_revision(marker)]
        history = await store.close_history(amended)
        for ref, earlier in history.items():
            marker, applied = found[ref]
            found[ref] = ("\n".join([*earlier, marker]), applied)
        return found

    replay = Replay(
        processor,
        sse_topic=topics.raw_sse.name,
        window=snapshot.window,
        tenants=options.tenants,
        lookup=lookup,
        committed=snapshot.committed,
        outcomes=ledger,
    )
    for name, ranges in snapshot.raw.items():
        if not any(end > start for start, end in ranges.values()):
            continue
        start = {p: r[0] for p, r in ranges.items()}
        end = {p: r[1] for p, r in ranges.items()}
        reading = read_topic(servers, name, start=start, end=end)
        told: set[int] = set()
        async with contextlib.aclosing(reading) as records:
            async for batch in _batches(records, options.batch_size):
                await replay.feed(batch)
                meter(len(batch))
                if options.partition_read is not None:
                    _partitions_read(batch, name, ranges, options.partition_read, told)
        if options.partition_read is not None:
            _partitions_read(None, name, ranges, options.partition_read, told)
    replay.finish()
    wanted = ledger.close_index()
    if wanted:
        ledger.resolve(
            await find_events(
                servers,
                snapshot.billing_topic,
                snapshot.billing,
                wanted,
                corrections=corrections,
            )
        )
    rows, skipped = ledger.compare_rows(stored_rows)
    if progress is not None:
        progress(meter.done, meter.total)
    discrepancies = sorted(ledger.discrepancies + rows.discrepancies, key=lambda d: d.sort_key())
    corrected = None
    if options.correct:
        corrected = Corrected(topics.corrections.name, audit_id=audit_id(snapshot.to_json()))
        plan = plan_corrections(
            discrepancies,
            ledger,
            audit=corrected.audit_id,
            billing_before={p: end for p, (_, end) in snapshot.billing.items()},
            currency=prices.currency,
            now=utc_now(),
        )
        # Written in the framing of STREAMTALLY_AVRO_FRAMING (its schema registered first).
        framing = framing_for(settings, (topics.corrections,)) if plan.corrections else None
        await apply_plan(
            plan,
            servers=servers,
            topic=topics.corrections,
            store=store,
            done=corrected,
            framing=framing or SINGLE_OBJECT,
        )
    json_snapshot = _snapshot_json(snapshot, replay, index, ledger, options)
    json_snapshot["correction_records"] = {
        "read": corrections.records,
        "bills_corrected": len(corrections),
        "billing_records_superseded": index.superseded,
        "undecodable": [{"partition": p, "offset": o, "reason": r} for p, o, r in bad_corrections],
    }
    return Report(
        requests=ledger.counts,
        rows=rows,
        rows_skipped=skipped,
        discrepancies=tuple(discrepancies),
        totals=ledger.totals(),
        snapshot=json_snapshot,
        rerating=None if rerating is None else rerating.to_json(),
        corrections=None if corrected is None else corrected.to_json(),
        aborted=ledger.aborted.to_json(),
    )


def _snapshot_json(
    snapshot: Snapshot,
    replay: Replay,
    index: BillingIndex,
    ledger: Ledger,
    options: AuditOptions,
) -> dict[str, object]:
    stats, counters = replay.stats, replay.processor.counters
    return {
        **snapshot.to_json(),
        "tenants": None if options.tenants is None else sorted(options.tenants),
        "raw_records": {
            "read": stats.read,
            "outside_range": stats.outside,
            "other_tenants": stats.other_tenants,
            "straddling": stats.straddling,
            "applied": counters.applied,
            "duplicates": counters.duplicates,
            "dead_lettered": counters.dead_lettered,
            "replays": counters.replayed,
        },
        "billing_records": {
            "in_scope": index.records,
            "undecodable": [
                {"partition": p, "offset": o, "reason": r} for p, o, r in index.bad[:100]
            ],
        },
        "partial": dict(sorted(ledger.partial_reasons.items())),
    }
