"""Events too large for one raw record: sent as part records by the tap, joined by the worker.

The tap (`TapRequest._send`) cuts an SSE event's data over `PART_BYTES` into
slices on UTF-8 character boundaries (`utf8_slices`), sent as `PART_EVENT`
records and a last record under the event's own name; `RequestProcessor`
applies each part (no chunk) and normalises the joined event at the last one,
in sequence order whatever the order of arrival, up to `Limits.event_bytes`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from streamtally.billing.pricing import PriceTable
from streamtally.core.models import FinishReason, Source, Tokens
from streamtally.core.normalize import fold_stream
from streamtally.core.sse import SseEvent
from streamtally.processors.limits import MAX_RECORD_BYTES, Limits
from streamtally.processors.requests import CloseReason, Outputs, Position, RequestProcessor
from streamtally.producers import Tap
from streamtally.producers.tap import utf8_slices
from streamtally.topics import Topics, encode_key
from streamtally.wire import avro
from streamtally.wire.records import PART_BYTES, PART_EVENT, EventKind, RawSseEvent

TOPICS = Topics.in_namespace()


class Sender:
    """Keeps every record the tap sends; Kafka acknowledges at once."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(self, source: Source, request_id: str, value: bytes) -> asyncio.Future[Any]:
        self.records.append((request_id, value))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def decoded(self) -> list[RawSseEvent]:
        return [avro.decode_raw_sse_event(value) for _, value in self.records]


# --------------------------------------------------------------------------- slices

MIXED = ["a", "é", "€", "😀"]  # 1, 2, 3 and 4 UTF-8 bytes


@pytest.mark.parametrize("size", [4, 5, 6, 7, 8, 13, 64])
def test_slices_cut_on_character_boundaries_and_join_to_the_data(size: int) -> None:
    rng = random.Random(size)
    data = "".join(rng.choice(MIXED) for _ in range(500))
    slices = utf8_slices(data, size)
    assert "".join(slices) == data
    assert all(0 < len(s.encode()) <= size for s in slices)
    # each cut is as late as the next character allows: no slice could have taken one more
    for piece, following in itertools.pairwise(slices):
        assert len(piece.encode()) + len(following[0].encode()) > size


def test_slices_at_the_size_exactly() -> None:
    assert utf8_slices("x" * 8, 8) == ["x" * 8]
    assert utf8_slices("x" * 9, 8) == ["x" * 8, "x"]
    assert utf8_slices("", 8) == [""]
    # a 4-byte character straddling the cut goes whole to the next slice
    assert utf8_slices("abcdefg😀", 8) == ["abcdefg", "😀"]
    assert utf8_slices("€€€", 8) == ["€€", "€"]
    with pytest.raises(ValueError, match="size must be >= 4"):
        utf8_slices("abc", 3)


def test_a_lone_surrogate_passes_through_the_slices() -> None:
    data = "x" * 7 + "\ud800" + "y"
    assert "".join(utf8_slices(data, 8)) == data


# --------------------------------------------------------------------------- the tap


def big_body(text_bytes: int, *, request_id: str = "chatcmpl-big") -> str:
    """A non-streaming chat.completion whose content is `text_bytes` of mixed UTF-8."""
    unit = "".join(MIXED) + " "  # 11 bytes
    content = unit * (text_bytes // len(unit.encode()))
    return json.dumps(
        {
            "id": request_id,
            "object": "chat.completion",
            "model": "gpt-4o-mini",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 34567, "total_tokens": 34579},
        },
        ensure_ascii=False,
    )


async def tapped(*events: SseEvent, tenant: str = "acme") -> Sender:
    sender = Sender()
    async with Tap(sender=sender) as tap, tap.request(Source.OPENAI, tenant=tenant) as req:
        for event in events:
            await req.event(event)
    return sender


async def test_an_event_over_the_part_size_is_sent_as_parts() -> None:
    body = big_body(3 * PART_BYTES + 1000)
    sender = await tapped(SseEvent(body, "message", "ev-7"))
    records = sender.decoded()
    *events, end = records
    assert end.kind is EventKind.END
    assert len(events) == 4
    assert [r.seq for r in records] == list(range(5))
    assert [r.event for r in events] == [PART_EVENT] * 3 + ["message"]
    assert [r.sse_id for r in events] == [None] * 3 + ["ev-7"]
    assert "".join(r.data for r in events) == body
    assert all(len(r.data.encode()) <= PART_BYTES for r in events)
    assert all(len(value) < MAX_RECORD_BYTES // 4 for _, value in sender.records)
    assert {key for key, _ in sender.records} == {"chatcmpl-big"}


async def test_an_event_of_the_part_size_is_one_record() -> None:
    body = big_body(PART_BYTES - 400)
    body += " " * (PART_BYTES - len(body.encode()))  # JSON whitespace up to the byte
    assert len(body.encode()) == PART_BYTES
    records = (await tapped(SseEvent(body))).decoded()
    assert [r.event for r in records] == ["message", "message"]
    assert records[0].data == body
    records = (await tapped(SseEvent(body + " "))).decoded()
    assert [r.event for r in records[:-1]] == [PART_EVENT, "message"]
    assert records[1].data == " "


async def test_a_tap_at_its_spool_limit_waits_then_spools_every_part_of_an_event(
    tmp_path: Path,
) -> None:
    acks: list[asyncio.Future[Any]] = []

    class Slow(Sender):
        async def send(self, source: Source, request_id: str, value: bytes) -> Any:
            self.records.append((request_id, value))
            acks.append(asyncio.get_running_loop().create_future())
            return acks[-1]

    sender = Slow()
    tap = Tap(sender=sender, spool_dir=tmp_path / "spool", spool_bytes=2 * PART_BYTES)
    await tap.start()
    req = tap.request(Source.OPENAI, tenant="acme", request_id="r-1")
    await req.event(SseEvent("x" * (2 * PART_BYTES + 1)))  # 3 records: past the limit
    waiting = asyncio.create_task(req.event(SseEvent("y" * (PART_BYTES + 1))))
    await asyncio.sleep(0.05)
    assert not waiting.done(), "no room: the event waits, whole"
    assert tap.stats.appended == 3
    for ack in acks:
        ack.set_result(None)  # Kafka takes the first event
    await asyncio.wait_for(waiting, 1)
    req.end()
    assert tap.stats.appended == 6
    await asyncio.sleep(0.05)
    for ack in acks[3:]:
        ack.set_result(None)
    await tap.close(timeout=1)
    records = sender.decoded()
    assert [r.seq for r in records] == list(range(6)), "no gap: nothing dropped"
    assert records[-1].kind is EventKind.END
    assert tap.stats.sent == 6


# --------------------------------------------------------------------------- the worker


def worker(
    records: list[tuple[str, bytes]],
    *,
    order: list[int] | None = None,
    limits: Limits | None = None,
    processor: RequestProcessor | None = None,
) -> tuple[Outputs, RequestProcessor]:
    processor = processor or RequestProcessor(PriceTable.default(), timeout=60.0, limits=limits)
    out = Outputs()
    for offset in order if order is not None else range(len(records)):
        key, value = records[offset]
        processor.handle_sse(
            encode_key(key), value, Position(TOPICS.raw_sse.name, 0, offset, None), out
        )
    return out, processor


def sha256_of(values: list[bytes]) -> str:
    return hashlib.sha256(b"".join(len(v).to_bytes(8, "big") + v for v in values)).hexdigest()


def expected(body: str) -> Tokens:
    return fold_stream(Source.OPENAI, [SseEvent(body)])


async def test_the_worker_joins_the_parts_into_the_event() -> None:
    body = big_body(2 * PART_BYTES + 7)
    sender = await tapped(SseEvent(body))
    assert len(sender.records) == 4  # three records of the event, the END
    out, processor = worker(sender.records)
    (done,) = out.completed
    assert done.tokens == expected(body)
    assert done.tokens.usage.output_tokens == 34567
    assert done.records == 4
    assert processor.counters.applied == 4
    assert len(out.chunks) == 1  # the parts make no chunk of their own
    assert not out.dead_letters
    # provenance: over the records as sent
    assert done.billing.raw_sha256 == sha256_of([value for _, value in sender.records])
    assert (done.billing.first_offset, done.billing.last_offset) == (0, 3)


async def test_parts_out_of_order_and_repeated_give_the_same_bill() -> None:
    body = big_body(4 * PART_BYTES)
    sender = await tapped(SseEvent(body))
    records = sender.records
    assert len(records) == 6
    ordered, _ = worker(records)
    # the END and the parts in reverse order, then every part record again
    resent = records + records[:4]
    order = [5, 4, 3, 2, 1, 0, 6, 7, 8, 9]
    out, processor = worker(resent, order=order)
    (done,) = out.completed
    (want,) = ordered.completed
    assert done.tokens == want.tokens == expected(body)
    assert done.billing.raw_sha256 == want.billing.raw_sha256
    assert done.duplicates == 0  # the repeats come after the close: replays or late
    assert processor.counters.applied == 6
    # duplicates before the close are dropped as such
    out, processor = worker(records[:2] + records[:2] + records[2:], order=None)
    (done,) = out.completed
    assert done.tokens == want.tokens
    assert done.duplicates == 2
    assert processor.counters.duplicates == 2
    assert done.billing.raw_sha256 == want.billing.raw_sha256


async def test_an_event_over_the_limit_closes_its_request_deterministically() -> None:
    body = big_body(3 * PART_BYTES)
    small = SseEvent(
        json.dumps({"id": "chatcmpl-big", "object": "chat.completion.chunk", "choices": []})
    )
    sender = await tapped(small, SseEvent(body))
    assert [r.event for r in sender.decoded()] == ["message"] + [PART_EVENT] * 3 + [
        "message",
        "message",
    ]
    limits = Limits(event_bytes=PART_BYTES + 10)
    out, processor = worker(sender.records, limits=limits)
    (done,) = out.completed
    assert done.closed.reason is CloseReason.LIMIT
    assert done.closed.offset == 2  # at the second part, which takes the event past
    assert done.tokens.finish_reason is FinishReason.ERROR
    assert "event limit" in (done.tokens.error or "")
    assert done.tokens.usage.output_tokens == 0
    first, *late = out.dead_letters
    two = sum(len(r.data.encode()) for r in sender.decoded()[1:3])
    assert f"has {two} bytes with this record" in first.reason
    assert "STREAMTALLY_MAX_EVENT_BYTES" in first.reason
    assert first.offset == 2
    assert [d.offset for d in late] == [3, 4, 5]
    assert all("already closed" in d.reason for d in late)
    assert processor.counters.applied == 2
    # a replay from the start closes it at the same record, with the same bill
    again, _ = worker(sender.records, limits=limits)
    assert again.completed[0].billing == done.billing
    assert [d.reason for d in again.dead_letters] == [d.reason for d in out.dead_letters]
    # the joined size counts the last record too
    out, _ = worker(sender.records, limits=Limits(event_bytes=3 * PART_BYTES + 10))
    (done,) = out.completed
    assert done.closed.reason is CloseReason.LIMIT
    assert out.dead_letters[0].offset == 4
    # within the limit: billed in full
    out, _ = worker(sender.records, limits=Limits(event_bytes=len(body.encode())))
    assert out.completed[0].tokens.usage.output_tokens == 34567
    assert not out.dead_letters


async def test_a_keepalive_between_the_parts_of_an_event_leaves_the_event_whole() -> None:
    """The tap never puts one there (an event's records are appended in one step), but a
    keep-alive is no part: the worker keeps the event's parts for its last record."""
    body = big_body(2 * PART_BYTES + 7)
    sender = await tapped(SseEvent(body))
    records = [avro.decode_raw_sse_event(value) for _, value in sender.records]
    alive = RawSseEvent.keepalive(
        request_id=records[0].request_id,
        seq=1,
        source=Source.OPENAI,
        tenant="acme",
        received_at=records[0].received_at,
    )
    records.insert(1, alive)
    renumbered = [
        (r.request_id, avro.encode_raw_sse_event(dataclasses.replace(r, seq=i)))
        for i, r in enumerate(records)
    ]
    out, _ = worker(renumbered)
    (done,) = out.completed
    assert out.dead_letters == []
    assert done.tokens == expected(body)
    assert done.records == 5


def test_parts_without_their_last_record_are_not_billed_silently() -> None:
    at = datetime(2026, 3, 1, tzinfo=UTC)

    def value(seq: int, event: str, data: str) -> bytes:
        return avro.encode_raw_sse_event(
            RawSseEvent(
                request_id="r-1",
                seq=seq,
                source=Source.OPENAI,
                tenant="acme",
                received_at=at,
                event=event,
                data=data,
            )
        )

    chunk = json.dumps(
        {
            "id": "r-1",
            "object": "chat.completion.chunk",
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
        }
    )
    end = avro.encode_raw_sse_event(
        RawSseEvent.end(
            request_id="r-1", seq=3, source=Source.OPENAI, tenant="acme", received_at=at
        )
    )
    records = [
        ("r-1", value(0, "message", chunk)),
        ("r-1", value(1, PART_EVENT, '{"id": "r-1", ')),
        ("r-1", value(2, PART_EVENT, '"choices"')),
        ("r-1", end),
    ]
    out, _ = worker(records)
    (done,) = out.completed
    assert done.tokens.text == "hi"
    assert "ended without its last record (2 parts, 23 bytes)" in (done.tokens.error or "")


async def test_the_chunk_of_a_joined_event_is_capped_to_fit_its_topic() -> None:
    """A 6 MB body makes one chunk: its text is cut to CHUNK_CONTENT_BYTES (whole characters)
    so that it fits the chunks topic; the Tokens and the usage are the whole body's."""
    from streamtally.processors.limits import CHUNK_CONTENT_BYTES

    body = big_body(6_000_000)
    sender = await tapped(SseEvent(body))
    out, _ = worker(sender.records)
    (chunk,) = out.chunks
    (value,) = out.chunk_values
    want = expected(body)
    full = json.loads(body)["choices"][0]["message"]["content"]
    assert CHUNK_CONTENT_BYTES - 4 < len(chunk.text_delta.encode()) <= CHUNK_CONTENT_BYTES
    assert full.startswith(chunk.text_delta)
    assert len(value) < (8 << 20) - 1024  # the chunks topic's max.message.bytes
    assert TOPICS.chunks.max_message_bytes == 8 << 20
    (done,) = out.completed
    assert done.tokens == want
    assert done.tokens.usage.output_tokens == 34567


def test_the_audit_replays_parts_to_the_workers_bill() -> None:
    """The audit replays the raw records through the same processor: it bills an event sent
    in parts exactly as the worker did, provenance included."""
    from streamtally.wire.kafka import TopicRecord
    from tests.unit.audit.test_audit_replay import replay

    body = big_body(2 * PART_BYTES + 99)
    sender = asyncio.run(tapped(SseEvent(body)))
    out, _ = worker(sender.records)
    (done,) = out.completed
    appended = int(datetime(2026, 11, 23, 12, tzinfo=UTC).timestamp() * 1000)
    records = [
        TopicRecord(TOPICS.raw_sse.name, 0, offset, key.encode(), value, appended)
        for offset, (key, value) in enumerate(sender.records)
    ]
    outcomes, _ = replay(records[:2], records[2:])
    (bill,) = outcomes.bills
    assert bill.usage == done.billing.usage
    assert bill.usage.output_tokens == 34567
    assert (bill.raw_sha256, bill.first_offset, bill.last_offset) == (
        done.billing.raw_sha256,
        done.billing.first_offset,
        done.billing.last_offset,
    )
    assert bill.event_id == done.billing.event_id
    assert (outcomes.partials, outcomes.dead) == ([], [])
