"""Closing requests: their records applied in order, their close, their billing event.

A keep-alive record (`KEEPALIVE_EVENT`: the tap's call is still in flight) is applied
like any record (it takes its sequence number, counts as applied, is in the provenance
digest and moves the request's last time) and makes no chunk: the fold and the bill are
what they would be without it.

A request closes at its END marker, by timeout, over a gap or at a limit
(`CloseReason`: its record count, or an event sent in parts past
`Limits.event_bytes`); its outputs (Tokens, billing event, last chunks) are
encoded as they are made.  The close cannot fail on its price: a cost the
billing record cannot carry is billed as unpriced (`_bill`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from streamtally.core.content import capped_chunk
from streamtally.core.fold import NO_FINISH
from streamtally.core.identity import RequestRef, epoch_micros
from streamtally.core.models import Chunk, Source, Tokens
from streamtally.core.sse import SseEvent
from streamtally.errors import InputError
from streamtally.processors._records import _Open, _Raw
from streamtally.processors._refusals import _Refusals
from streamtally.processors.amendable import Amendable
from streamtally.processors.limits import CHUNK_CONTENT_BYTES, PERMANENT_ERRORS
from streamtally.processors.outputs import Closed, CloseReason, Completed, Outputs
from streamtally.wire import avro
from streamtally.wire.billing import bill
from streamtally.wire.records import (
    PART_EVENT,
    BillingEvent,
    EventKind,
    Provenance,
    RawSseEvent,
    UsageSource,
)

#: The processor's logger, named after the module it is known by.
log = logging.getLogger("streamtally.processors.requests")


class _Closing(_Refusals):
    """Applying, closing and billing requests (a layer of `RequestProcessor`)."""

    def _apply(
        self, out: Outputs, ref: RequestRef, state: _Open, raw: _Raw, *, closing: bool = False
    ) -> None:
        """Apply the next record of a request; an END closes it unless it is `closing` already."""
        record, position = raw.record, raw.position
        # A record an amended request had already (`_Open.uncounted`): applied again, not
        # counted or written again.
        fresh = not state.uncounted or record.seq not in state.uncounted
        if not fresh:
            state.uncounted.discard(record.seq)
        state.next_seq = record.seq + 1
        state.last_time = record.received_at
        if record.kind is EventKind.END:
            if fresh:
                state.records += 1
                self.counters.applied += 1
            state.applied(raw)
            if not closing:
                if record.cancelled:  # the client went away: unfinished choices `cancelled`
                    state.fold.cancel()
                self._finish(out, ref, state, CloseReason.END)
            return
        if record.is_keepalive:  # the call is in flight: applied, nothing to fold
            state.records += 1
            self.counters.applied += 1
            state.applied(raw)
            return
        event: Any
        if isinstance(record, RawSseEvent):
            if record.event == PART_EVENT:
                self._part(out, ref, state, raw, closing=closing, fresh=fresh)
                return
            data = record.data
            if state.parts:  # the last record of an event sent in parts: the event, joined
                size = state.part_bytes + len(data.encode("utf-8", "surrogatepass"))
                if size > self.limits.event_bytes:
                    self._too_big(out, ref, state, raw, size, closing=closing)
                    return
                state.parts.append(data)
                data = "".join(state.parts)
                state.parts = []
                state.part_bytes = 0
            event = SseEvent(data, record.event, record.sse_id)
        else:
            event = record.payload
        try:
            chunks = state.normalizer.feed(event, record.received_at)
            values: list[bytes] | None
            if self._chunks_as_is:  # full content, chunks topic on: the chunks themselves
                shown = [capped_chunk(chunk, CHUNK_CONTENT_BYTES) for chunk in chunks]
                values = [avro.encode_chunk(chunk) for chunk in shown]
            else:
                shown, values = self._written(chunks)
        except PERMANENT_ERRORS as exc:
            self._dead(
                out,
                exc,
                raw.key,
                raw.value,
                position,
                source=state.source,
                request_id=ref.request_id,
            )
            return
        if fresh:
            state.records += 1
            self.counters.applied += 1
        state.applied(raw)
        for chunk in chunks:
            state.fold.add(chunk)
        if values is not None and fresh:
            out.chunks.extend(shown)
            out.chunk_values.extend(values)
            out.chunk_refs.extend([ref] * len(shown))

    def _part(
        self,
        out: Outputs,
        ref: RequestRef,
        state: _Open,
        raw: _Raw,
        *,
        closing: bool,
        fresh: bool = True,
    ) -> None:
        """A part record (`PART_EVENT`): its data kept for the event it is a part of.

        Applied (counted, in the provenance) with no chunk of its own; the part that
        takes the event past `Limits.event_bytes` is dead-lettered instead and closes the
        request at its record limit (`_too_big`).
        """
        data = raw.record.data if isinstance(raw.record, RawSseEvent) else ""
        size = state.part_bytes + len(data.encode("utf-8", "surrogatepass"))
        if size > self.limits.event_bytes:
            self._too_big(out, ref, state, raw, size, closing=closing)
            return
        state.parts.append(data)
        state.part_bytes = size
        if fresh:
            state.records += 1
            self.counters.applied += 1
        state.applied(raw)

    def _too_big(
        self, out: Outputs, ref: RequestRef, state: _Open, raw: _Raw, size: int, *, closing: bool
    ) -> None:
        """An event sent in parts grew past `Limits.event_bytes`: the record that took it
        there is dead-lettered, the parts so far are dropped, and the request closes with
        what it had, as at its record limit (deterministic: a replay closes it here again).
        """
        limit = self.limits.event_bytes
        reason = (
            f"an event of request {ref} sent in parts has {size} bytes with this record, "
            f"over the limit (STREAMTALLY_MAX_EVENT_BYTES={limit})"
        )
        self._dead(
            out,
            InputError(reason),
            raw.key,
            raw.value,
            raw.position,
            source=state.source,
            request_id=ref.request_id,
        )
        state.parts = []
        state.part_bytes = 0
        if not closing:
            state.limit_reason = (
                f"request closed at its event limit: an event sent in parts over {limit} bytes"
            )
            self._finish(out, ref, state, CloseReason.LIMIT)

    def _written(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[bytes] | None]:
        """The chunks as written (the content policy applied, each capped at
        `CHUNK_CONTENT_BYTES` of content: `capped_chunk`) and their Avro values (None:
        the chunks topic is off, nothing encoded).  Raises what encoding them can (the
        record's poison).  Under ``full`` they are the chunks themselves: no copy.
        """
        if not self.chunks_topic:
            return chunks, None
        policy = self.content
        shown = chunks if policy.keeps_content else [policy.chunk(c) for c in chunks]
        shown = [capped_chunk(chunk, CHUNK_CONTENT_BYTES) for chunk in shown]
        return shown, [avro.encode_chunk(chunk) for chunk in shown]

    def _finish(self, out: Outputs, ref: RequestRef, state: _Open, reason: CloseReason) -> None:
        """Close a request: at its END, by timeout, or over a gap (see `CloseReason`)."""
        del self._open[ref]
        self._release(state.tenant)
        message = NO_FINISH
        if reason is CloseReason.GAP:
            first_missing = state.next_seq
            for seq in sorted(state.waiting):
                self._apply(out, ref, state, state.waiting.pop(seq), closing=True)
            state.fold.fail(
                f"raw events missing from seq {first_missing}: closed after "
                f"{self.timeout_of(state.source):g}s without them"
            )
        elif reason is CloseReason.TIMEOUT:
            message = (
                "request timed out: no end-of-stream marker within "
                f"{self.timeout_of(state.source):g}s"
            )
        elif reason is CloseReason.LIMIT:
            message = state.limit_reason or (
                f"request closed at its record limit ({self.limits.records_per_request} records)"
            )
        if state.parts:  # an event whose last record never came: not billed, and said so
            state.fold.fail(
                f"an event sent in parts ended without its last record "
                f"({len(state.parts)} parts, {state.part_bytes} bytes)"
            )
            state.parts = []
            state.part_bytes = 0
        for seq in sorted(state.waiting):  # after the END marker: too late to belong
            waiting = state.waiting.pop(seq)
            late = InputError(f"event seq {seq} of request {ref} after its end marker")
            self._dead(
                out,
                late,
                waiting.key,
                waiting.value,
                waiting.position,
                source=state.source,
                request_id=ref.request_id,
            )
        closed = Closed(state.max_offset, reason, False, epoch_micros(state.latest), state.revision)
        self._close(out, ref, state, message, closed)

    def _close(
        self, out: Outputs, ref: RequestRef, state: _Open, reason: str, closed: Closed
    ) -> None:
        when = state.last_time
        chunks = state.normalizer.end(when, fallback_request_id=ref.request_id)
        shown, values = self._written(chunks)
        for chunk in chunks:
            state.fold.add(chunk)
        state.fold.provider_request_id = state.normalizer.provider_request_id
        tokens = state.fold.result(ended=True, reason=reason)
        # Stored (Redis, the tokens topic) under the content policy; billed from the fold.
        policy = self.content
        stored = tokens if policy.keeps_content else policy.tokens(tokens)
        tokens_value = avro.encode_tokens(stored)
        billing, billing_value = self._bill(
            tokens, state.tenant, when, _provenance(state), state.revision
        )
        done = Closed(closed.offset, closed.reason, True, closed.last_received, closed.revision)
        self._remember(ref, done)
        self.counters.requests_completed += 1
        if state.revision:
            self.counters.requests_amended += 1
        amendable: bytes | None = None
        if closed.amendable:  # later records may still come: kept for them
            topic, partition = state.topic_partition
            kept = Amendable(
                state.revision,
                closed.offset,
                topic,
                partition,
                not Source(state.source).is_sse,
                billing,
                tuple(state.kept),
                done.marker(),
            )
            self._keep_amendable(ref, kept)
            amendable = kept.encode()
        else:
            self._drop_amendable(ref)
        if values is not None:
            out.chunks.extend(shown)
            out.chunk_values.extend(values)
            out.chunk_refs.extend([ref] * len(shown))
        out.completed.append(
            Completed(
                stored,
                billing,
                closed,
                state.records,
                state.duplicates,
                tokens_value=tokens_value,
                billing_value=billing_value,
                amendable=amendable,
                supersedes=state.previous,
                supersedes_marker=state.previous_marker,
            )
        )

    def _bill(
        self,
        tokens: Tokens,
        tenant: str,
        when: datetime,
        provenance: Provenance | None = None,
        revision: int = 0,
    ) -> tuple[BillingEvent, bytes]:
        """The request's billing event and its Avro value; never fails on the price.

        An unknown model, or a cost the billing record cannot carry (beyond
        decimal(38,12)), is billed as unpriced: ``priced=False``, cost 0,
        counted, and logged for an operator to re-rate.  Should pricing fail
        otherwise, the request is billed by a table without a single price:
        unpriced too.
        """
        try:
            billing = bill(tokens, tenant, when, self.prices, provenance, revision=revision)
            value = avro.encode_billing_event(billing)
        except PERMANENT_ERRORS as exc:
            log.warning(
                "request %s (tenant %s, model %s) billed at 0 as unpriced: %s",
                ascii(tokens.request_id),
                ascii(tenant),
                ascii(tokens.model),
                exc,
            )
            billing = bill(tokens, tenant, when, self._no_prices, provenance, revision=revision)
            value = avro.encode_billing_event(billing)
        if not billing.priced:  # counted once, whichever way it was billed
            self.counters.unpriced += 1
        return billing, value


def _provenance(state: _Open) -> Provenance:
    """What the request's billing event was folded from, and where its usage came from.

    MISSING when no chunk of the stream carried usage (the fold's usage is None: its
    Tokens says 0), or ABORTED when, moreover, its END marker said cancelled (the client
    went away, the upstream was aborted before its usage); else ENGINE_COUNTED or
    PROVIDER_REPORTED after the adapter's `counted` at the last usage
    (`Normalizer.usage_counted`).
    """
    if state.fold.usage is None:
        usage_source = UsageSource.ABORTED if state.fold.cancelled else UsageSource.MISSING
    elif state.normalizer.usage_counted:
        usage_source = UsageSource.ENGINE_COUNTED
    else:
        usage_source = UsageSource.PROVIDER_REPORTED
    topic, partition = state.topic_partition
    return Provenance(
        raw_topic=topic,
        raw_partition=partition,
        first_offset=state.first_offset,
        last_offset=state.last_offset,
        raw_sha256=state.digest.hexdigest(),
        usage_source=usage_source,
    )
