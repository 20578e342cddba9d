"""The Kafka side of a migration: request id -> tenants, read from the billing topic.

Version 1 kept no tenant in Redis; every billed request's `BillingEvent`
names it, so `read_billing` reads the billing topic to its end into a
`Billing` map that `plan` places each version-1 request id by.  Only the tenants
are read, never summed: the revisions of an amended bill and the corrections of
``audit --correct`` name the same request and tenant, so the map is the same
whichever bill stands (`streamtally.billing.ledger`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from streamtally.connection import KafkaConnection
from streamtally.wire.avro import decode_billing_event
from streamtally.wire.kafka import read_decoded


@dataclass(slots=True)
class Billing(Mapping[str, tuple[str, ...]]):
    """Request id -> the tenants the billing topic names for it, as read by `read_billing`.

    Kept lean: one tenant per id (the usual case) is a plain string.
    """

    #: Billing records read and decoded.
    events: int = 0
    #: Billing records that did not decode (or were tombstones): their ids are unknown.
    undecodable: int = 0
    _one: dict[str, str] = field(default_factory=dict)
    _several: dict[str, set[str]] = field(default_factory=dict)

    def add(self, request_id: str, tenant: str) -> None:
        """Record that `request_id` was billed to `tenant`."""
        several = self._several.get(request_id)
        if several is not None:
            several.add(tenant)
            return
        known = self._one.setdefault(request_id, tenant)
        if known != tenant:
            del self._one[request_id]
            self._several[request_id] = {known, tenant}

    def __getitem__(self, request_id: str) -> tuple[str, ...]:
        one = self._one.get(request_id)
        if one is not None:
            return (one,)
        return tuple(sorted(self._several[request_id]))

    def __iter__(self) -> Iterator[str]:
        yield from self._one
        yield from self._several

    def __len__(self) -> int:
        return len(self._one) + len(self._several)


async def read_billing(servers: KafkaConnection | str, topic: str) -> Billing:
    """The tenants of every request id on the billing `topic`, from its beginning to its end.

    Raises `StackError` when Kafka cannot be reached or the topic is missing.
    """
    billing = Billing()
    bad: list[tuple[int, int, str]] = []
    reading = read_decoded(servers, topic, decode_billing_event, bad)
    async with contextlib.aclosing(reading) as events:
        async for event in events:
            billing.events += 1
            billing.add(event.request_id, event.tenant)
    billing.undecodable = len(bad)
    return billing
