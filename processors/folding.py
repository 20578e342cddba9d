"""Folding a request's next record: its events normalised, folded, and its chunks written.

One part of `RequestProcessor` (`processors.requests`).  `RecordFolder.fold`
takes the next record of an open request (in sequence order: the sequencer,
`processors.sequencing`, holds the others back) into its `Normalizer` and
`Fold`, encodes its chunks as written under the content policy, and counts it
into the request's provenance.  It says when the record closes the request (its
END marker, or an event in parts past `Limits.event_bytes`); the close itself is
`processors.closing`'s.

A keep-alive record (`KEEPALIVE_EVENT`: the tap's call is still in flight) is applied
like any record (it takes its sequence number, counts as applied, is in the provenance
digest and moves the request's last time) and makes no chunk: the fold and the bill are
what they would be without it.  Part records (`PART_EVENT`) are kept until the last
record of their event, which is their sum.
"""

from __future__ import annotations

from typing import Any

from streamtally.core.content import FULL, ContentPolicy, capped_chunk
from streamtally.core.identity import RequestRef
from streamtally.core.models import Chunk
from streamtally.core.sse import SseEvent, _new, _set_data, _set_event, _set_id
from streamtally.errors import InputError
from streamtally.processors._records import _Open, _Raw
from streamtally.processors.limits import CHUNK_CONTENT_BYTES, PERMANENT_ERRORS, Limits
from streamtally.processors.outputs import CloseReason, Counters, Outputs
from streamtally.processors.refusals import Refusals
from streamtally.wire import avro
from streamtally.wire.records import PART_EVENT, EventKind, RawSseEvent

__all__ = ["RecordFolder"]


class RecordFolder:
    """Applies a request's next record to its fold; see the module docstring."""

    def __init__(self, refusals: Refusals, limits: Limits, counters: Counters) -> None:
        self.refusals = refusals
        self.limits = limits
        self.counters = counters
        self._content: ContentPolicy = FULL
        self._chunks_topic = True
        #: Full content and the chunks topic on: chunks are written as folded (the hot path).
        self._chunks_as_is = True

    @property
    def content(self) -> ContentPolicy:
        """What of the chunks is written (`RequestProcessor.content`)."""
        return self._content

    @content.setter
    def content(self, policy: ContentPolicy) -> None:
        self._content = policy
        self._chunks_as_is = policy.keeps_content and self._chunks_topic

    @property
    def chunks_topic(self) -> bool:
        """False: chunks are folded but not written (`RequestProcessor.chunks_topic`)."""
        return self._chunks_topic

    @chunks_topic.setter
    def chunks_topic(self, on: bool) -> None:
        self._chunks_topic = on
        self._chunks_as_is = self._content.keeps_content and on

    def fold(
        self, out: Outputs, ref: RequestRef, state: _Open, raw: _Raw, *, closing: bool = False
    ) -> CloseReason | None:
        """Apply the next record of a request; returns why it closes the request now (its
        END, or an event in parts over the limit), None when it does not or the request
        is `closing` already."""
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
            if closing:
                return None
            if record.cancelled:  # the client went away: unfinished choices `cancelled`
                state.fold.cancel()
            return CloseReason.END
        if record.is_keepalive:  # the call is in flight: applied, nothing to fold
            state.records += 1
            self.counters.applied += 1
            state.applied(raw)
            return None
        event: Any
        if isinstance(record, RawSseEvent):
            if record.event == PART_EVENT:
                return self._part(out, ref, state, raw, closing=closing, fresh=fresh)
            data = record.data
            if state.parts:  # the last record of an event sent in parts: the event, joined
                size = state.part_bytes + len(data.encode("utf-8", "surrogatepass"))
                if size > self.limits.event_bytes:
                    return self._too_big(out, ref, state, raw, size, closing=closing)
                state.parts.append(data)
                data = "".join(state.parts)
                state.parts = []
                state.part_bytes = 0
            # `SseEvent(data, record.event, record.sse_id)`, made as `core.sse`'s decoder
            # makes it, with its setters (the dataclass's `__init__` is interpreted).
            event = _new(SseEvent)
            _set_data(event, data)
            _set_event(event, record.event)
            _set_id(event, record.sse_id)
        else:
            event = record.payload
        try:
            chunks = state.normalizer.feed(event, record.received_at)
            values: list[bytes] | None
            if self._chunks_as_is:  # full content, chunks topic on: the chunks themselves
                shown = [capped_chunk(chunk, CHUNK_CONTENT_BYTES) for chunk in chunks]
                values = [avro.encode_chunk(chunk) for chunk in shown]
            else:
                shown, values = self.written(chunks)
        except PERMANENT_ERRORS as exc:
            self.refusals.dead(
                out,
                exc,
                raw.key,
                raw.value,
                position,
                source=state.source,
                request_id=ref.request_id,
            )
            return None
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
        return None

    def _part(
        self,
        out: Outputs,
        ref: RequestRef,
        state: _Open,
        raw: _Raw,
        *,
        closing: bool,
        fresh: bool = True,
    ) -> CloseReason | None:
        """A part record (`PART_EVENT`): its data kept for the event it is a part of.

        Applied (counted, in the provenance) with no chunk of its own; the part that
        takes the event past `Limits.event_bytes` is dead-lettered instead and closes the
        request at its record limit (`_too_big`).
        """
        data = raw.record.data if isinstance(raw.record, RawSseEvent) else ""
        size = state.part_bytes + len(data.encode("utf-8", "surrogatepass"))
        if size > self.limits.event_bytes:
            return self._too_big(out, ref, state, raw, size, closing=closing)
        state.parts.append(data)
        state.part_bytes = size
        if fresh:
            state.records += 1
            self.counters.applied += 1
        state.applied(raw)
        return None

    def _too_big(
        self, out: Outputs, ref: RequestRef, state: _Open, raw: _Raw, size: int, *, closing: bool
    ) -> CloseReason | None:
        """An event sent in parts grew past `Limits.event_bytes`: the record that took it
        there is dead-lettered, the parts so far are dropped, and the request closes with
        what it had, as at its record limit (deterministic: a replay closes it here again).
        """
        limit = self.limits.event_bytes
        reason = (
            f"an event of request {ref} sent in parts has {size} bytes with this record, "
            f"over the limit (STREAMTALLY_MAX_EVENT_BYTES={limit})"
        )
        self.refusals.dead(
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
        if closing:
            return None
        state.limit_reason = (
            f"request closed at its event limit: an event sent in parts over {limit} bytes"
        )
        return CloseReason.LIMIT

    def written(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[bytes] | None]:
        """The chunks as written (the content policy applied, each capped at
        `CHUNK_CONTENT_BYTES` of content: `capped_chunk`) and their Avro values (None:
        the chunks topic is off, nothing encoded).  Raises what encoding them can (the
        record's poison).  Under ``full`` they are the chunks themselves: no copy.
        """
        if not self._chunks_topic:
            return chunks, None
        policy = self._content
        shown = chunks if policy.keeps_content else [policy.chunk(c) for c in chunks]
        shown = [capped_chunk(chunk, CHUNK_CONTENT_BYTES) for chunk in shown]
        return shown, [avro.encode_chunk(chunk) for chunk in shown]
