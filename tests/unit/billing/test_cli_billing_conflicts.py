"""`billing export` reports two different billing events for one request, never hides one.

Before, every record whose event_id had been seen was dropped as a replay, so
a billing consumer using the export never learned of a conflict.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from decimal import Decimal

from streamtally.billing.events import event_id
from streamtally.cli.billing import Export, collect
from streamtally.core.models import FinishReason, Source
from streamtally.wire.kafka import Decoded
from streamtally.wire.records import BillingEvent


def _event(finish: FinishReason, cost: str, tenant: str = "acme") -> BillingEvent:
    return BillingEvent(
        event_id=event_id(tenant, "r-1"),
        request_id="r-1",
        tenant=tenant,
        model="gpt-4o",
        source=Source.OPENAI,
        finish_reason=finish,
        input_tokens=10,
        output_tokens=5,
        cost=Decimal(cost).quantize(Decimal("1e-12")),
        currency="USD",
        price_table_version="v",
        event_time=datetime(2026, 11, 24, tzinfo=UTC),
    )


def read(*events: BillingEvent) -> list[Decoded[BillingEvent]]:
    """The events as read from partition 0, at offsets 0, 1, ..."""
    return [Decoded(0, offset, event) for offset, event in enumerate(events)]


def test_a_byte_identical_replay_is_dropped_and_counted() -> None:
    export = Export()
    stop = _event(FinishReason.STOP, "0.001")
    collect(read(stop, dataclasses.replace(stop)), export, keep_replays=False)
    assert export.events == [stop]
    assert export.replays == 1
    assert export.conflicts == []


def test_two_different_events_for_one_request_are_a_conflict_and_both_stay() -> None:
    export = Export()
    stop, error = _event(FinishReason.STOP, "0.001"), _event(FinishReason.ERROR, "0.0004")
    collect(read(stop, stop, error), export, keep_replays=False)
    assert export.events == [stop, error]
    assert export.replays == 1
    assert export.conflicts == [(stop, error)]


def test_two_tenants_reusing_one_request_id_are_two_requests_not_a_conflict() -> None:
    export = Export()
    acme, globex = _event(FinishReason.STOP, "0.001"), _event(FinishReason.STOP, "0.002", "globex")
    collect(read(acme, globex), export, keep_replays=False)
    assert export.events == [acme, globex]
    assert export.conflicts == []
    assert export.replays == 0
