"""The corrections topic read as a billing consumer applies it: the audit's, the rebuild's and
``billing export --ledger``'s.

``streamtally audit --correct`` appends `BillingCorrection` records (see
`streamtally.billing.corrections`); the audit judges the bills as corrected and a rebuild
restores them so.  Both read the topic here, into one `CorrectionLog`.  `read_ledger`
reads the billing topic too, into a `BillingLedger` (`streamtally.billing.ledger`: the
bills as they stand, one per request).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from streamtally.billing.corrections import CorrectionLog
from streamtally.billing.ledger import BillingLedger
from streamtally.connection import KafkaConnection
from streamtally.wire.avro import decode_billing_correction, decode_billing_event
from streamtally.wire.kafka import read_decoded, read_decoded_at

__all__ = ["read_corrections", "read_ledger"]


async def read_corrections(
    kafka: KafkaConnection | str,
    topic: str,
    bad: list[tuple[int, int, str]],
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    missing_ok: bool = False,
) -> CorrectionLog:
    """The corrections of `topic` (from `start` to `end`, default all of it) in topic order;
    what does not decode goes to `bad` as (partition, offset, reason).  With `missing_ok`, a
    topic that does not exist (a deployment of before it) holds none."""
    log = CorrectionLog()
    reading = read_decoded(
        kafka, topic, decode_billing_correction, bad, start=start, end=end, missing_ok=missing_ok
    )
    async with contextlib.aclosing(reading) as corrections:
        async for correction in corrections:
            log.add(correction)
    return log


async def read_ledger(
    kafka: KafkaConnection | str,
    *,
    billing_topic: str,
    corrections_topic: str,
    bad_billing: list[tuple[int, int, str]],
    bad_corrections: list[tuple[int, int, str]],
    missing_hint: str,
) -> BillingLedger:
    """The corrections topic (none when it does not exist: a deployment of before it), then
    the billing topic, each from its beginning to its end at the time of the call, into a
    `BillingLedger`; what does not decode goes to `bad_billing` and `bad_corrections`.

    Raises `StackError` when Kafka cannot be reached or the billing topic is missing
    (`missing_hint` then says why it may be, as `read_topic`'s).
    """
    log = await read_corrections(kafka, corrections_topic, bad_corrections, missing_ok=True)
    ledger = BillingLedger(log)
    reading = read_decoded_at(
        kafka, billing_topic, decode_billing_event, bad_billing, missing_hint=missing_hint
    )
    async with contextlib.aclosing(reading) as records:
        async for record in records:
            ledger.add(record.value, record.partition, record.offset)
    return ledger
