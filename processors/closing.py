"""Closing a request and billing it: its Tokens, its billing event, its last chunks.

One part of `RequestProcessor` (`processors.requests`).  A request closes at its
END marker, by timeout (`close_quiet`), over a gap or at a limit
(`CloseReason`: its record count, or an event sent in parts past
`Limits.event_bytes`); `Closer.finish` applies what it can still apply, ends its
fold, and encodes its outputs (Tokens, billing event, last chunks) as they are
made.  The close cannot fail on its price: a cost the billing record cannot
carry is billed as unpriced (`bill`).  A request closed at its timeout or over a
gap keeps an `Amendable` state for the records that may still come.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from datetime import datetime

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.content import FULL, ContentPolicy
from streamtally.core.fold import NO_FINISH
from streamtally.core.identity import RequestRef, epoch_micros
from streamtally.core.models import Source, Tokens
from streamtally.errors import InputError
from streamtally.processors._records import _Open
from streamtally.processors.amendable import Amendable
from streamtally.processors.clock import InputClock
from streamtally.processors.folding import RecordFolder
from streamtally.processors.limits import PERMANENT_ERRORS, Limits
from streamtally.processors.outputs import Closed, CloseReason, Completed, Counters, Outputs
from streamtally.processors.refusals import Refusals
from streamtally.processors.table import RequestTable
from streamtally.wire import avro
from streamtally.wire.records import BillingEvent, Provenance, UsageSource

__all__ = ["Closer"]

#: The processor's logger, named after the module it is known by.
log = logging.getLogger("streamtally.processors.requests")


class Closer:
    """Closes requests and bills them; see the module docstring."""

    def __init__(
        self,
        table: RequestTable,
        folder: RecordFolder,
        refusals: Refusals,
        prices: PriceTable,
        *,
        timeout: float,
        timeouts: Mapping[str, float] | None,
        limits: Limits,
        counters: Counters,
        input_clock: InputClock,
    ) -> None:
        self.table = table
        self.folder = folder
        self.refusals = refusals
        self.prices = prices
        #: The same table without a single price (same versions and dates): what an
        #: unpriceable request is billed by.
        self.no_prices = prices.without_prices()
        #: Seconds a request may stay quiet before it closes (`timeout_of`): `timeouts` by
        #: source name (``STREAMTALLY_REQUEST_TIMEOUTS``), else `timeout`.
        self.timeout = timeout
        self.timeouts: dict[str, float] = dict(timeouts or {})
        self.limits = limits
        self.counters = counters
        self.input_clock = input_clock
        #: What of the Tokens is stored (`RequestProcessor.content`); billed from the fold.
        self.content: ContentPolicy = FULL

    def timeout_of(self, source: str) -> float:
        """Seconds a request of `source` (its name: ``anthropic``) may stay quiet."""
        return self.timeouts.get(source, self.timeout)

    def close_quiet(self, live: Callable[[Hashable, int], bool] | None) -> Outputs:
        """Close every request that has been quiet for longer than its timeout (its
        source's, `timeout_of`), its partition's input clock read first (`live`: whether
        a partition is caught up, `RequestProcessor.live`)."""
        out = Outputs()
        clock = self.input_clock
        clock.tick(live)
        timeout = self.timeout
        timeouts = self.timeouts
        quiet = []
        for ref, state in self.table.open.items():
            now = clock.now(state.topic_partition)
            limit = timeouts.get(state.source, timeout) if timeouts else timeout
            if now is not None and now - state.last_input > limit:
                quiet.append(ref)
        for ref in quiet:
            state = self.table.open[ref]
            reason = CloseReason.GAP if state.waiting else CloseReason.TIMEOUT
            self.finish(out, ref, state, reason)
            self.counters.requests_timed_out += 1
        return out

    def finish(self, out: Outputs, ref: RequestRef, state: _Open, reason: CloseReason) -> None:
        """Close a request: at its END, by timeout, or over a gap (see `CloseReason`)."""
        self.table.release(ref, state)
        message = NO_FINISH
        if reason is CloseReason.GAP:
            first_missing = state.next_seq
            for seq in sorted(state.waiting):
                self.folder.fold(out, ref, state, state.waiting.pop(seq), closing=True)
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
            self.refusals.dead(
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
        shown, values = self.folder.written(chunks)
        for chunk in chunks:
            state.fold.add(chunk)
        state.fold.provider_request_id = state.normalizer.provider_request_id
        if state.fold.model is None:
            # No chunk named it (cut after a first event with no content, as OpenAI's role
            # chunk): the model the events named, so the bill is that model's, not unknown.
            state.fold.model = state.normalizer.model
        tokens = state.fold.result(ended=True, reason=reason)
        # Stored (Redis, the tokens topic) under the content policy; billed from the fold.
        policy = self.content
        stored = tokens if policy.keeps_content else policy.tokens(tokens)
        tokens_value = avro.encode_tokens(stored)
        billing, billing_value = self.bill(
            tokens, state.tenant, when, _provenance(state), state.revision
        )
        done = Closed(closed.offset, closed.reason, True, closed.last_received, closed.revision)
        table = self.table
        table.remember(ref, done)
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
            table.keep_amendable(ref, kept)
            amendable = kept.encode()
        else:
            table.drop_amendable(ref)
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

    def bill(
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
            billing = bill(tokens, tenant, when, self.no_prices, provenance, revision=revision)
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
