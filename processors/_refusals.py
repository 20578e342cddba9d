"""Refusing records: the edge and the limits, and every dead letter `RequestProcessor` makes.

A message is refused before it reaches a request when it does not decode,
its key is not its request id, or (with a trust file) its signed tenant claim
does not hold (`_examine`, then `take`), or when it would open a request
beyond the limits (`_refused_by_limits`); whatever is refused, here or later,
is dead-lettered with its reason by `_dead`.  What the edge refuses and the
limits themselves are in `processors.limits`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import cast

from streamtally.core.identity import RequestRef
from streamtally.errors import InputError
from streamtally.processors._records import RawRecord, _Raw
from streamtally.processors._state import _ProcessorState
from streamtally.processors.limits import PERMANENT_ERRORS, TOMBSTONE, refused_at_the_edge
from streamtally.processors.outputs import Outputs, Position, Refused
from streamtally.wire.records import DeadLetter
from streamtally.wire.tenant_keys import TenantTrust, UntrustedRecord


class _Refusals(_ProcessorState):
    """Reading a message, and dead-lettering what is refused (a layer of `RequestProcessor`)."""

    #: The worker's trust file: with one, a record bills its tenant only when its
    #: ``st-auth`` header is signed by a key that may claim it (else it is dead-lettered);
    #: None: every producer is trusted (`streamtally.wire.tenant_keys`).
    trust: TenantTrust | None = None

    def _refused_by_limits(self, tenant: str) -> InputError | None:
        limits = self.limits
        if len(self._open) >= limits.open_requests:
            return InputError(
                f"the worker holds {len(self._open)} open requests, the limit "
                f"(STREAMTALLY_MAX_OPEN_REQUESTS={limits.open_requests})"
            )
        if self._open_by_tenant[tenant] >= limits.open_per_tenant:
            return InputError(
                f"tenant {tenant!r} has {self._open_by_tenant[tenant]} open requests, the limit "
                f"(STREAMTALLY_MAX_OPEN_PER_TENANT={limits.open_per_tenant})"
            )
        return None

    def _examine(
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

    def take(
        self,
        examined: RawRecord | Refused,
        key: bytes | None,
        value: bytes | None,
        position: Position,
        out: Outputs,
    ) -> _Raw | None:
        """Count a message in: its record, or None when it was refused (dead-lettered into
        `out`).  `examined` is what `examine_sse` or `examine_engine` made of it."""
        self.counters.received += 1
        if type(examined) is Refused:
            self._refuse(
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
        return _Raw(
            record, position, key, value or b"", RequestRef(record.tenant, record.request_id)
        )

    def _refuse(
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
        self._dead(out, exc, key, value, position, source=source, request_id=request_id)

    def _dead(
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
