"""One audit from start to end: snapshot, billing index, replay, comparisons, report.

As `_split` runs it: `take_plan` (the snapshot and the usage rows), `run_share` for each
share of the raw partitions (one process: share 0/1), `merge_parts`, then `merged_report`
(the usage rows compared once), or with ``--correct`` `correct_audit`: the corrections
planned from the merged discrepancies (`audit_corrections`) and written once, by the
process that merged, whether one process replayed everything or N shares did.

Reads only: a consumer without a group for every topic, an admin request for the
processors' committed offsets, and Redis reads through `RedisStore` (the usage rows,
right after the snapshot, and the close markers of the requests replayed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from streamtally.audit._billing import BillingIndex, find_events, index_billing
from streamtally.audit._corrections import (
    Corrected,
    CorrectionPlan,
    apply_plan,
    audit_id,
    plan_corrections,
)
from streamtally.audit._ledger import Ledger, Scope
from streamtally.audit._range import TimeRange
from streamtally.audit._replay import Replay
from streamtally.audit._report import Report
from streamtally.audit._rerate import Rerating
from streamtally.audit._rows import RowKey
from streamtally.audit._snapshot import take_snapshot
from streamtally.audit._split import (
    Merged,
    Part,
    Plan,
    Share,
    billing_by_partition,
    billing_partition_of,
    merge_parts,
    part_of,
    raw_partition_of,
)
from streamtally.billing.corrections import CorrectionLog
from streamtally.billing.pricing import PriceTable
from streamtally.billing.reading import read_corrections
from streamtally.connection import KafkaConnection
from streamtally.core.identity import RequestRef
from streamtally.core.models import utc_now
from streamtally.errors import InputError
from streamtally.processors.content import content_policy
from streamtally.processors.requests import Limits, RequestProcessor
from streamtally.settings import Settings
from streamtally.store import RedisStore
from streamtally.store.layout import marker_revision
from streamtally.topics import Topics
from streamtally.wire.framing import SINGLE_OBJECT, framing_for
from streamtally.wire.kafka import TopicRecord, read_topic_batches
from streamtally.wire.records import BillingEvent
from streamtally.wire.tenant_keys import TenantTrust

__all__ = [
    "AuditOptions",
    "Progress",
    "ShareRun",
    "audit_corrections",
    "correct_audit",
    "merged_report",
    "replay_processor",
    "run_audit",
    "run_share",
    "take_plan",
]

#: `progress(done, total)`: records read so far of the snapshot's, at most twice a second.
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class AuditOptions:
    window: TimeRange = field(default_factory=TimeRange)
    #: None: every tenant.
    tenants: frozenset[str] | None = None
    #: Raw records per replay step at most (one Redis look-up and one timeout check each):
    #: a step is what one fetch returned, up to this many.
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
    memory grows with the raw bytes of the requests closed at their timeout.  Its content
    policy and chunks setting are the worker's (`STREAMTALLY_CONTENT`, `STREAMTALLY_CHUNKS`)."""
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
    # The chunks the worker writes, made as it makes them (their values dropped): a record
    # whose chunk does not encode is dead-lettered by both, and one the worker writes no
    # chunk of (STREAMTALLY_CHUNKS=off) costs the replay no encoding either.
    processor.content = content_policy(settings)
    processor.chunks_topic = settings.chunks_topic
    return processor


def _frozen() -> float:
    """The replay's wall clock: it never moves (the input's times alone do)."""
    return 0.0


async def take_plan(
    settings: Settings,
    store: RedisStore,
    options: AuditOptions,
    *,
    servers: KafkaConnection | str | None = None,
) -> Plan:
    """The snapshot of an audit of the namespace of `settings`, with the usage rows read
    within it (see `_snapshot`): what every share of it reads."""
    stored_rows: list[dict[str, object]] = []

    async def read_rows() -> None:  # inside the snapshot (see `_snapshot`)
        stored_rows.extend(await store.usage_rows())

    snapshot = await take_snapshot(
        servers or settings.kafka,
        Topics.in_namespace(settings.namespace),
        options.window,
        request_timeout=settings.longest_request_timeout,
        between=read_rows,
    )
    return Plan(snapshot, settings.namespace, options.tenants, tuple(stored_rows))


@dataclass(slots=True)
class ShareRun:
    """What `run_share` found: the part, and the records it read (billing included)."""

    part: Part
    meter_done: int = 0


def _refuse_undecodable(billing: int, corrections: int) -> None:
    if billing or corrections:
        raise InputError(
            f"{billing} billing and {corrections} correction records in range "
            "do not decode (see `streamtally audit --json`, snapshot): an audit cannot correct "
            "bills it cannot read; run it without --correct and repair those first"
        )


async def run_share(
    settings: Settings,
    store: RedisStore,
    plan: Plan,
    share: Share,
    *,
    rerate: Rerating | None = None,
    servers: KafkaConnection | str | None = None,
    progress: Progress | None = None,
    refuse_bad: bool = False,
    batch_size: int = 2000,
    partition_read: Callable[[str, int, int], None] | None = None,
) -> ShareRun:
    """Replay the raw partitions of `share` of `plan` and check their requests' bills
    (see `_split`); `refuse_bad`: `InputError` when a billing or correction record in range
    does not decode (``--correct`` cannot correct what it cannot read)."""
    plan.check_namespace(settings.namespace)
    servers = servers or settings.kafka
    snapshot = plan.snapshot
    topics = Topics.in_namespace(settings.namespace)
    prices = PriceTable.load_or_default(settings.prices_path)
    raw = {
        name: {p: r if share.owns(p) else (r[1], r[1]) for p, r in ranges.items()}
        for name, ranges in snapshot.raw.items()
    }
    raw_partitions = max((len(ranges) for ranges in snapshot.raw.values()), default=1) or 1
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
    scope = Scope(snapshot.window, plan.tenants)
    # The billing partitions of this share's numbers (see `_split`), else all of them.
    by_partition = share.count > 1 and billing_by_partition(snapshot)
    billing = {
        p: r if not by_partition or share.owns(p) else (r[1], r[1])
        for p, r in snapshot.billing.items()
    }
    raw_records = sum(end - start for ranges in raw.values() for start, end in ranges.values())
    billing_records = sum(end - start for start, end in billing.values())
    meter = _Meter(raw_records + billing_records, progress)
    index = BillingIndex()

    def by_content(event: BillingEvent) -> bool:
        return scope.accepts(event) and share.owns(raw_partition_of(event, raw_partitions))

    def standing(event: BillingEvent) -> bool:  # a corrected bill, on no partition
        return scope.accepts(event) and share.owns(billing_partition_of(event, len(billing)))

    if billing_records or len(corrections):
        await index_billing(
            servers,
            snapshot.billing_topic,
            billing,
            by_content if share.count > 1 and not by_partition else scope.accepts,
            index,
            corrections=corrections,
            progress=meter,
            standing=standing if by_partition else None,
        )
    if share.index:  # corrections (and, read whole, billing records) undecodable: share 0's
        bad_corrections = []
        if not by_partition:
            index.bad = []
    if refuse_bad:
        _refuse_undecodable(len(index.bad), len(bad_corrections))
    ledger = Ledger(index, scope, rerating=rerate)
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
        tenants=plan.tenants,
        lookup=lookup,
        committed=snapshot.committed,
        outcomes=ledger,
    )
    for name, ranges in raw.items():
        if not any(end > start for start, end in ranges.values()):
            continue
        start = {p: r[0] for p, r in ranges.items()}
        end = {p: r[1] for p, r in ranges.items()}
        reading = read_topic_batches(servers, name, start=start, end=end, max_records=batch_size)
        told: set[int] = set()
        async with contextlib.aclosing(reading) as batches:
            async for batch in batches:
                await replay.feed(batch)
                meter(len(batch))
                if partition_read is not None:
                    _partitions_read(batch, name, ranges, partition_read, told)
        if partition_read is not None:
            _partitions_read(None, name, ranges, partition_read, told)
    replay.finish()
    wanted = ledger.close_index()
    found: dict[int, list[BillingEvent]] = {}
    if wanted:
        found = await find_events(
            servers,
            snapshot.billing_topic,
            billing,
            wanted,
            corrections=corrections,
        )
        ledger.resolve(found)
    stats, counters = replay.stats, replay.processor.counters
    raw_counts = Counter(
        read=stats.read,
        outside_range=stats.outside,
        other_tenants=stats.other_tenants,
        straddling=stats.straddling,
        applied=counters.applied,
        duplicates=counters.duplicates,
        dead_lettered=counters.dead_lettered,
        replays=counters.replayed,
    )
    part = part_of(share, plan.digest(), raw_counts, index=index, ledger=ledger, found=found)
    part.corrections_read, part.bills_corrected = corrections.records, len(corrections)
    part.corrections_bad = bad_corrections
    return ShareRun(part, meter.done)


def merged_report(
    plan: Plan,
    merged: Merged,
    *,
    rerate: Rerating | None = None,
    corrections: dict[str, Any] | None = None,
    rows_ledger: Ledger | None = None,
) -> Report:
    """The report of the audit of `plan` whose parts `merged` adds up: the usage rows
    compared once, here; `rerate` (empty) names the ``--prices`` table, the one the parts
    were re-rated at, and is given exactly when they were (`InputError` otherwise: a merge
    never drops a re-rating its parts carry)."""
    if rerate is None and merged.prices:
        raise InputError(
            "the parts were re-rated (run with --prices): give merge the same --prices FILE, "
            "so the report carries their re-rating"
        )
    if rerate is not None and merged.prices != rerate.prices.digest():
        raise InputError(
            f"--prices {rerate.name}: "
            + (
                "the parts were not re-rated: run each share with --prices FILE"
                if not merged.prices
                else "the parts were re-rated at other prices: give the table they were run with"
            )
        )
    scope = Scope(plan.snapshot.window, plan.tenants)
    ledger = rows_ledger if rows_ledger is not None else Ledger(BillingIndex(), scope)
    ledger.add_sums(merged.rows, merged.totals, merged.unsure)
    rows, skipped = ledger.compare_rows(plan.rows)
    discrepancies = sorted(merged.discrepancies + rows.discrepancies, key=lambda d: d.sort_key())
    raw = merged.raw_records
    snapshot: dict[str, Any] = {
        **plan.snapshot.to_json(),
        "tenants": None if plan.tenants is None else sorted(plan.tenants),
        "raw_records": {
            name: raw[name]
            for name in (
                "read",
                "outside_range",
                "other_tenants",
                "straddling",
                "applied",
                "duplicates",
                "dead_lettered",
                "replays",
            )
        },
        "billing_records": {
            "in_scope": merged.billing_in_scope,
            "undecodable": [
                {"partition": p, "offset": o, "reason": r}
                for p, o, r in sorted(merged.billing_bad)[:100]
            ],
        },
        "partial": dict(sorted(merged.partial_reasons.items())),
        "correction_records": {
            "read": merged.corrections_read,
            "bills_corrected": merged.bills_corrected,
            "billing_records_superseded": merged.billing_superseded,
            "undecodable": [
                {"partition": p, "offset": o, "reason": r}
                for p, o, r in sorted(merged.corrections_bad)
            ],
        },
    }
    rerating = None
    if rerate is not None:
        rerating = Rerating(rerate.prices, rerate.name, dict(merged.rerating or {})).to_json()
    return Report(
        requests=merged.counts,
        rows=rows,
        rows_skipped=skipped,
        discrepancies=tuple(discrepancies),
        totals=ledger.totals(),
        snapshot=snapshot,
        rerating=rerating,
        corrections=corrections,
        aborted=merged.aborted.to_json(),
    )


async def run_audit(
    settings: Settings,
    store: RedisStore,
    options: AuditOptions,
    *,
    servers: KafkaConnection | str | None = None,
    progress: Progress | None = None,
) -> Report:
    """Audit the namespace of `settings` (see `streamtally.audit`) in this process:
    share 0/1 of its snapshot, merged alone (`_split`)."""
    servers = servers or settings.kafka
    plan = await take_plan(settings, store, options, servers=servers)
    rerating = None if options.rerate is None else Rerating(options.rerate, options.rerate_name)
    done = await run_share(
        settings,
        store,
        plan,
        Share(),
        rerate=rerating,
        servers=servers,
        progress=progress,
        refuse_bad=options.correct,
        batch_size=options.batch_size,
        partition_read=options.partition_read,
    )
    merged = merge_parts([done.part])
    if progress is not None:
        progress(done.meter_done, plan.snapshot.raw_records() + plan.snapshot.billing_records())
    if not options.correct:
        return merged_report(plan, merged, rerate=rerating)
    return await correct_audit(settings, store, plan, merged, rerate=rerating, servers=servers)


@dataclass(frozen=True, slots=True)
class _MergedReplay:
    """The replay as ``--correct`` needs it (`_corrections.Replayed`): the merged bills, and
    the usage row values the merge's comparison found differing."""

    merged: Merged
    row_expected: dict[RowKey, dict[str, Any]]

    def expected_bill(self, event_id: str) -> BillingEvent | None:
        return self.merged.expected_bill(event_id)


def audit_corrections(
    plan: Plan,
    merged: Merged,
    *,
    currency: str,
    now: datetime,
    rerate: Rerating | None = None,
) -> tuple[Report, CorrectionPlan]:
    """The report of `merged` (`merged_report`) and what ``--correct`` writes for it: one
    correction per discrepancy, one difference per usage row (pure; `correct_audit` writes
    them).  From the merged discrepancies: one process's and N shares' are the same."""
    rows_ledger = Ledger(BillingIndex(), Scope(plan.snapshot.window, plan.tenants))
    report = merged_report(plan, merged, rerate=rerate, rows_ledger=rows_ledger)
    correction_plan = plan_corrections(
        report.discrepancies,
        _MergedReplay(merged, rows_ledger.row_expected),
        audit=audit_id(plan.snapshot.to_json()),
        billing_before={p: end for p, (_, end) in plan.snapshot.billing.items()},
        currency=currency,
        now=now,
    )
    return report, correction_plan


async def correct_audit(
    settings: Settings,
    store: RedisStore,
    plan: Plan,
    merged: Merged,
    *,
    rerate: Rerating | None = None,
    servers: KafkaConnection | str | None = None,
) -> Report:
    """``--correct`` after the merge: the report of `merged`, its corrections written to the
    corrections topic and its usage row differences added to Redis (`audit_corrections`,
    `apply_plan`), once.  `InputError` when a billing or correction record in range did not
    decode (nothing is written then)."""
    plan.check_namespace(settings.namespace)
    _refuse_undecodable(len(merged.billing_bad), len(merged.corrections_bad))
    servers = servers or settings.kafka
    topics = Topics.in_namespace(settings.namespace)
    prices = PriceTable.load_or_default(settings.prices_path)
    report, correction_plan = audit_corrections(
        plan, merged, currency=prices.currency, now=utc_now(), rerate=rerate
    )
    corrected = Corrected(topics.corrections.name, audit_id=audit_id(plan.snapshot.to_json()))
    # Written in the framing of STREAMTALLY_AVRO_FRAMING (its schema registered first).
    framing = framing_for(settings, (topics.corrections,)) if correction_plan.corrections else None
    await apply_plan(
        correction_plan,
        servers=servers,
        topic=topics.corrections,
        store=store,
        done=corrected,
        framing=framing or SINGLE_OBJECT,
    )
    return dataclasses.replace(report, corrections=corrected.to_json())
