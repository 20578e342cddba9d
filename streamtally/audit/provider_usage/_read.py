"""The bills that stand as of an audit's snapshot, for the provider comparison.

The audit's report names the offsets it read (`Report.snapshot`, ``topics``): the billing
topic from an hour before ``--since`` (or its beginning) to its end at the snapshot, and the
corrections topic from its beginning to its end then.  The same ranges are read again here
into a `BillingLedger` (the one rule, `streamtally.billing.ledger`), the billing records of
other tenants skipped, and settled: one bill per request, the highest revision, as
corrected.  Corrections the audit itself writes (``--correct``) come after the snapshot
and are not in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from streamtally.billing.ledger import BillingLedger
from streamtally.billing.reading import read_corrections
from streamtally.connection import KafkaConnection
from streamtally.wire.avro import decode_billing_event
from streamtally.wire.kafka import read_decoded_at
from streamtally.wire.records import BillingEvent

__all__ = ["snapshot_ranges", "standing_bills"]


def snapshot_ranges(snapshot: Mapping[str, Any], topic: str) -> dict[int, tuple[int, int]]:
    """The [start, end) offsets per partition the snapshot JSON names for `topic` (none:
    the topic was not read)."""
    spans = snapshot.get("topics", {}).get(topic, {})
    return {int(p): (int(s["start"]), int(s["end"])) for p, s in spans.items()}


async def standing_bills(
    servers: KafkaConnection | str,
    snapshot: Mapping[str, Any],
    *,
    billing_topic: str,
    corrections_topic: str,
    tenants: frozenset[str],
    bad: list[tuple[int, int, str]],
) -> list[BillingEvent]:
    """The standing bills of `tenants` in the snapshot's ranges; undecodable billing and
    correction records go to `bad` as (partition, offset, reason)."""
    corrections = snapshot_ranges(snapshot, corrections_topic)
    log = None
    if any(end > start for start, end in corrections.values()):
        log = await read_corrections(
            servers,
            corrections_topic,
            bad,
            start={p: r[0] for p, r in corrections.items()},
            end={p: r[1] for p, r in corrections.items()},
        )
    ledger = BillingLedger(log)
    billing = snapshot_ranges(snapshot, billing_topic)
    if any(end > start for start, end in billing.values()):
        reading = read_decoded_at(
            servers,
            billing_topic,
            decode_billing_event,
            bad,
            start={p: r[0] for p, r in billing.items()},
            end={p: r[1] for p, r in billing.items()},
        )
        async with contextlib.aclosing(reading) as records:
            async for record in records:
                if record.value.tenant in tenants:
                    ledger.add(record.value, record.partition, record.offset)
    return [bill for bill in ledger.bills() if bill.tenant in tenants]
