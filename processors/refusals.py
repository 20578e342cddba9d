"""The refusal rules: the edge, the limits, and every dead letter `RequestProcessor` makes.

One part of `RequestProcessor` (`processors.requests`).  A message is refused
before it reaches a request when it does not decode, its key is not its request
id, or (with a trust file) its signed tenant claim does not hold (`examine`, then
`admit`), or when it would open a request beyond the limits
(`refused_by_limits`); whatever is refused, here or later, is dead-lettered with
its reason by `dead`, under the content policy.  What the edge refuses and the
limits themselves are in `processors.limits`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import cast

from streamtally.core.content import FULL, ContentPolicy
from streamtally.errors import InputError
from streamtally.processors._records import RawRecord, _Raw, raw_of
from streamtally.processors.clock import InputClock
from streamtally.processors.limits import (
    PERMANENT_ERRORS,
    TOMBSTONE,
    Limits,
    refused_at_the_edge,
)
from streamtally.processors.outputs import Counters, Outputs, Position, Refused
from streamtally.processors.table import RequestTable
from streamtally.wire.records import DeadLetter
from streamtally.wire.tenant_keys import TenantTrust, UntrustedRecord

__all__ = ["Refusals"]


class Refusals:
    """Reading a message at the edge, the limits, and dead-lettering what is refused."""

    def __init__(
        self, table: RequestTable, limits: Limits, counters: Counters, input_clock: InputClock
    ) -> None:
        self.table = table
        self.limits = limits
        self.counters = counters
        self.input_clock = input_clock
        #: The worker's trust file: with one, a record bills its tenant only when its
        #: ``st-auth`` header is signed by a key that may claim it (else it is
        #: dead-lettered); None: every producer is trusted (`streamtally.wire.tenant_keys`).
        self.trust: TenantTrust | None = None
        #: What of a dead letter's value and reason is kept (`RequestProcessor.content`).
        self.content: ContentPolicy = FULL

    def examine(
        self,
        decode: Callable[[bytes], RawRecord],
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> RawRecord | Refused:
        """The record a message holds, or why it is refused: decoded and checked at the edge.

        Pure (it reads only the trust file): the worker examines a batch ahead of applying
        it, while the batch before is being written.
        """
        refused = refused_at_the_edge(key, value)
        if refused is not None or value is None:  # dead-lettered, so the counts reconcile
            return Refused(refused or TOMBSTONE)
        try:
            record = decode(value)
        except PERMANENT_ERRORS as exc:
            return Refused(exc)
        if key != record.request_id.encode():
            reason = InputError(
                f"message key {key!r} is not the record's request id {record.request_id!r}"
            )
            return Refused(reason, record.source.value, record.request_id)
        trust = self.trust
        if trust is not None:
            untrusted = trust.refusal(
                headers,
                tenant=record.tenant,
                request_id=record.request_id,
                seq=record.seq,
                value=value,
            )
            if untrusted is not None:
                return Refused(untrusted, record.source.value, record.request_id)
        return record

    def admit(
        self,
        examined: RawRecord | Refused,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
    ) -> _Raw | None:
        """Count a message in: its record, or None when it was refused (dead-lettered into
        `out`).  `examined` is what `examine` made of it."""
        self.counters.received += 1
        if type(examined) is Refused:
            self.refuse(
                out,
                examined.reason,
                key,
                value or b"",
                position,
                source=examined.source,
                request_id=examined.request_id,
            )
            return None
        record = cast(RawRecord, examined)
        return raw_of(record, position, key, value or b"", record.tenant)

    def refused_by_limits(self, tenant: str) -> InputError | None:
        """Why one more request of `tenant` may not open (None: it may)."""
        limits = self.limits
        table = self.table
        held = len(table.open)
        if held >= limits.open_requests:
            return InputError(
                f"the worker holds {held} open requests, the limit "
                f"(STREAMTALLY_MAX_OPEN_REQUESTS={limits.open_requests})"
            )
        of_tenant = table.open_by_tenant[tenant]
        if of_tenant >= limits.open_per_tenant:
            return InputError(
                f"tenant {tenant!r} has {of_tenant} open requests, the limit "
                f"(STREAMTALLY_MAX_OPEN_PER_TENANT={limits.open_per_tenant})"
            )
        return None

    def refuse(
        self,
        out: Outputs,
        exc: Exception,
        key: bytes | None,
        value: bytes,
        position: Position,
        *,
        source: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Dead-letter a record refused before it reached a request; it still moves its
        partition's offset (what "caught up" is judged by), without a time."""
        self.input_clock.saw((position.topic, position.partition), position.offset)
        self.dead(out, exc, key, value, position, source=source, request_id=request_id)

    def dead(
        self,
        out: Outputs,
        exc: Exception,
        key: bytes | None,
        value: bytes,
        position: Position,
        *,
        source: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Dead-letter a record into `out` with the reason `exc`, counted."""
        self.counters.dead_lettered += 1
        # The record's own Kafka time, not the wall clock: a replay dead-letters
        # the same record into the same bytes.
        when = (
            datetime.fromtimestamp(position.timestamp, UTC)
            if position.timestamp is not None
            else datetime(1970, 1, 1, tzinfo=UTC)
        )
        reason = str(exc)
        policy = self.content
        if not policy.keeps_content:
            # The value is the raw event, prompt or output: its marker only.  A reason that
            # may quote the event (decoding, validation) has its quoted values replaced too;
            # the processor's own refusals (exactly InputError) and the trust checks name
            # requests, tenants and keys only, and stay as they are.
            value = policy.data(value)
            if type(exc) is not InputError and not isinstance(exc, UntrustedRecord):
                reason = policy.reason(reason)
        out.dead_letters.append(
            DeadLetter(
                topic=position.topic,
                partition=position.partition,
                offset=position.offset,
                key=key,
                value=value,
                reason=reason,
                error_type=type(exc).__name__,
                source=source,
                request_id=request_id,
                dead_lettered_at=when,
            )
        )
