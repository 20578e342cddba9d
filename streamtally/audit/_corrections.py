"""``audit --correct``: one append-only correction per discrepancy, and the usage rows set right.

`plan_corrections` (pure) turns the discrepancies of one audit into `BillingCorrection`
records (see `streamtally.billing.corrections` for what a billing consumer does with them)
and `RowFix` differences for Redis; `apply_plan` writes the corrections to the
corrections topic first (``acks=all``, flushed), then adds each row's difference once
(`RedisStore.correct_row`, keyed by the fix's id).  The next audit reads the corrections
topic and judges the bills as corrected (`index_billing`), and the rows as Redis holds
them now: it reports clean.

Ids are deterministic: `audit_id` digests the snapshot (offsets, range, tenants; not
the time it was taken), and each correction's id digests the audit id and the
discrepancy.  Run again over the same snapshot after a failure, the audit writes
corrections with the same ids (a consumer drops the copies by id) and adds no row
difference twice.  Over a later snapshot only what is still wrong is corrected: the
corrections already written make their discrepancies disappear.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Protocol

from streamtally.audit._compare import Discrepancy, Kind
from streamtally.audit._rows import RowKey
from streamtally.connection import KafkaConnection
from streamtally.core.identity import RequestRef
from streamtally.core.money import PICO, cost_parts
from streamtally.store import RedisStore
from streamtally.topics import Topic, output_key
from streamtally.wire.avro import encode_billing_correction
from streamtally.wire.framing import SINGLE_OBJECT, Framing
from streamtally.wire.kafka import ensure_topics, idempotent_producer
from streamtally.wire.records import BillingCorrection, BillingEvent

__all__ = [
    "Corrected",
    "CorrectionPlan",
    "Replayed",
    "RowFix",
    "apply_plan",
    "audit_id",
    "plan_corrections",
]


def _digest(*parts: object) -> str:
    text = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def audit_id(snapshot: Mapping[str, Any]) -> str:
    """32 hex digits naming what an audit read (`Snapshot.to_json`, without ``taken_at``)."""
    return _digest({k: v for k, v in snapshot.items() if k != "taken_at"})


class Replayed(Protocol):
    """What the corrections take from the replay: a `Ledger` (one process), or a split
    audit's `Merged` bills with the merge's usage row values (`_run.audit_corrections`)."""

    @property
    def row_expected(self) -> Mapping[RowKey, Mapping[str, Any]]:
        """The replay's values of the usage rows found differing."""
        ...

    def expected_bill(self, event_id: str) -> BillingEvent | None:
        """The replay's billing event of `event_id` (a request whose billing differs)."""
        ...


def _pico(cost: str | None) -> int:
    units, pico = cost_parts(Decimal(cost or "0"))
    return units * PICO + pico


@dataclass(frozen=True, slots=True)
class RowFix:
    """The difference to add to one usage row (signed, by field; the cost in 10**-12 units)."""

    row: RowKey
    differences: dict[str, int]
    fix_id: str

    @property
    def day_tenant_model(self) -> tuple[str, str, str]:
        tenant, model, day = self.row
        return day, tenant, model


@dataclass(frozen=True, slots=True)
class CorrectionPlan:
    """What ``--correct`` writes: the correction records, and the row differences."""

    corrections: tuple[BillingCorrection, ...] = ()
    row_fixes: tuple[RowFix, ...] = ()


@dataclass(slots=True)
class Corrected:
    """What ``--correct`` did (the report's ``corrections``)."""

    topic: str
    written: int = 0
    rows_fixed: int = 0
    #: Row differences found applied already (a run over the same snapshot, again).
    rows_applied_before: int = 0
    audit_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "audit_id": self.audit_id,
            "written": self.written,
            "rows_fixed": self.rows_fixed,
            "rows_applied_before": self.rows_applied_before,
        }


def _bill(
    d: Discrepancy,
    *,
    ledger: Replayed,
    audit: str,
    before: Mapping[int, int],
    currency: str,
    now: datetime,
) -> BillingCorrection:
    if d.event_id is None or d.request_id is None:
        raise ValueError(f"a {d.kind.value} discrepancy names no billing event")
    corrected: BillingEvent | None = None
    superseded: str | None = d.event_id
    if d.kind is Kind.UNEXPECTED_BILLING:
        pass  # withdrawn: no bill stands
    else:
        corrected = ledger.expected_bill(d.event_id)
        if corrected is None:
            raise ValueError(f"no replayed bill for the {d.kind.value} of {d.event_id}")
        if d.kind is Kind.MISSING_BILLING or d.kind is Kind.UNBILLED_AMENDMENT:
            superseded = None  # billed by the correction (an amendment names what it supersedes)
    usage = corrected.usage_counts() if corrected is not None else {}
    return BillingCorrection(
        correction_id=_digest(audit, d.kind.value, d.event_id, d.field, d.found),
        audit_id=audit,
        reason=d.kind.value,
        field=d.field,
        tenant=d.tenant,
        request_id=d.request_id,
        model=d.model,
        expected=None if d.expected is None else json.dumps(d.expected),
        found=None if d.found is None else json.dumps(d.found),
        superseded_event_id=superseded,
        billing_before=dict(before),
        corrected=corrected,
        input_tokens=usage.get("input_tokens", 0),
        output_tokens=usage.get("output_tokens", 0),
        reasoning_tokens=usage.get("reasoning_tokens", 0),
        cached_tokens=usage.get("cached_tokens", 0),
        cache_write_tokens=usage.get("cache_write_tokens", 0),
        requests=0 if corrected is None else 1,
        cost=Decimal(0) if corrected is None else corrected.cost,
        currency=currency if corrected is None else corrected.currency,
        created_at=now,
    )


def _row(
    d: Discrepancy, *, values: Mapping[str, Any], audit: str, currency: str, now: datetime
) -> BillingCorrection:
    if d.day is None:
        raise ValueError("a usage row discrepancy names its day")
    return BillingCorrection(
        correction_id=_digest(audit, d.kind.value, d.tenant, d.model, d.day, d.field, d.found),
        audit_id=audit,
        reason=d.kind.value,
        field=d.field,
        tenant=d.tenant,
        model=d.model,
        day=d.day,
        expected=None if d.expected is None else json.dumps(d.expected),
        found=None if d.found is None else json.dumps(d.found),
        input_tokens=int(values["input_tokens"]),
        output_tokens=int(values["output_tokens"]),
        reasoning_tokens=int(values["reasoning_tokens"]),
        cached_tokens=int(values["cached_tokens"]),
        cache_write_tokens=int(values["cache_write_tokens"]),
        requests=int(values["requests"]),
        cost=Decimal(values["cost"]),
        currency=currency,
        created_at=now,
    )


def plan_corrections(
    discrepancies: Sequence[Discrepancy],
    ledger: Replayed,
    *,
    audit: str,
    billing_before: Mapping[int, int],
    currency: str,
    now: datetime,
) -> CorrectionPlan:
    """One correction per discrepancy, and one `RowFix` per usage row that differs."""
    corrections: list[BillingCorrection] = []
    fixes: dict[RowKey, dict[str, int]] = {}
    for d in discrepancies:
        if d.kind is not Kind.USAGE_ROW_MISMATCH:
            corrections.append(
                _bill(
                    d,
                    ledger=ledger,
                    audit=audit,
                    before=billing_before,
                    currency=currency,
                    now=now,
                )
            )
            continue
        key: RowKey = (d.tenant, d.model or "", d.day or "")
        corrections.append(
            _row(d, values=ledger.row_expected[key], audit=audit, currency=currency, now=now)
        )
        if d.field is None:
            raise ValueError("a usage row discrepancy names its field")
        differences = fixes.setdefault(key, {})
        if d.field == "cost":
            differences["cost_pico"] = _pico(d.expected) - _pico(d.found)
        else:
            differences[d.field] = int(d.expected or 0) - int(d.found or 0)
    row_fixes = tuple(
        RowFix(key, differences, _digest(audit, "row", key))
        for key, differences in sorted(fixes.items())
    )
    return CorrectionPlan(tuple(corrections), row_fixes)


def _key(correction: BillingCorrection) -> bytes:
    if correction.request_id is not None:
        return output_key(RequestRef(correction.tenant, correction.request_id))
    return json.dumps(
        [correction.day, correction.tenant, correction.model], ensure_ascii=False
    ).encode("utf-8")


async def apply_plan(
    plan: CorrectionPlan,
    *,
    servers: KafkaConnection | str,
    topic: Topic,
    store: RedisStore,
    done: Corrected,
    framing: Framing = SINGLE_OBJECT,
) -> None:
    """Write the corrections (all acknowledged), then add the row differences (each once).

    The corrections topic is created first when it does not exist yet (a worker of before
    it creates none).
    """
    if plan.corrections:
        await ensure_topics(servers, (topic,))
        producer = idempotent_producer(servers)
        await producer.start()
        try:
            sent = [
                await producer.send(
                    topic.name, framing.frame(encode_billing_correction(c)), key=_key(c)
                )
                for c in plan.corrections
            ]
            for future in sent:
                await future
        finally:
            await producer.stop()
        done.written = len(plan.corrections)
    for fix in plan.row_fixes:
        if await store.correct_row(fix.day_tenant_model, fix.differences, fix.fix_id):
            done.rows_fixed += 1
        else:
            done.rows_applied_before += 1
