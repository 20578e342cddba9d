"""The corrections topic read as a billing consumer applies it: the audit's and the rebuild's.

``streamtally audit --correct`` appends `BillingCorrection` records (see
`streamtally.wire.corrections`); the audit judges the bills as corrected and a rebuild
restores them so.  Both read the topic here, into one `CorrectionLog`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from streamtally.connection import KafkaConnection
from streamtally.wire.avro import decode_billing_correction
from streamtally.wire.corrections import CorrectionLog
from streamtally.wire.kafka import read_decoded

__all__ = ["read_corrections"]


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
