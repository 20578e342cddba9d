"""`Tap` (producers/tap.py) with a fake sender: order, ids, the spool, backpressure, ends.

The fake sender records what it is given and resolves each record's future
at once, or holds it until the test lets it go (Kafka slow).  What the tap
sent is then fed to a `RequestProcessor`, the worker's logic, to check how
the worker closes the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from streamtally.billing.pricing import PriceTable
from streamtally.connection import KafkaConnection
from streamtally.core.fold import NO_FINISH
from streamtally.core.models import FinishReason, Source, Tokens
from streamtally.core.normalize import fallback_request_id, fold_stream, read_events
from streamtally.core.sse import SseEvent
from streamtally.processors.requests import Outputs, Position, RequestProcessor
from streamtally.producers import Tap
from streamtally.producers.spool import SpoolLocked, decode_frames
from streamtally.producers.spool_sender import KafkaSender
from streamtally.producers.tap import default_spool_dir
from streamtally.settings import Settings
from streamtally.topics import Topics, encode_key
from streamtally.wire import avro
from streamtally.wire.records import KEEPALIVE_EVENT, EventKind, RawSseEvent

SAMPLES = Path(__file__).resolve().parents[3] / "samples"
TEXT = SAMPLES / "openai" / "text_usage.sse"
TOPICS = Topics.in_namespace()


class FakeSender:
    """Kafka, faked: `records` are the (source, key, value) it acknowledged, in order;
    `attempts` every send.  `hold` keeps the futures unresolved until `release`; `delay`
    acknowledges each that many seconds after its send (in order); `fail` refuses every
    record for good (too large); `down` fails every send as a broker that is away."""

    def __init__(
        self, *, hold: bool = False, fail: bool = False, down: bool = False, delay: float = 0.0
    ) -> None:
        self.hold = hold
        self.fail = fail
        self.down = down
        self.delay = delay
        self.records: list[tuple[Source, str, bytes]] = []
        self.attempts: list[tuple[Source, str, bytes]] = []
        self.pending: list[tuple[asyncio.Future[Any], tuple[Source, str, bytes]]] = []
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def send(self, source: Source, request_id: str, value: bytes) -> asyncio.Future[Any]:
        record = (source, request_id, value)
        self.attempts.append(record)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self.fail:
            future.set_exception(MessageSizeTooLargeError("broker said no"))
        elif self.down:
            future.set_exception(KafkaConnectionError("broker away"))
        elif self.hold or self.delay:
            self.pending.append((future, record))
            if not self.hold:
                loop.call_later(self.delay, self.release, 1)
        else:
            self.records.append(record)
            future.set_result(None)
        return future

    def release(self, count: int | None = None) -> None:
        """Acknowledge the first `count` records held (all by default), in order."""
        count = len(self.pending) if count is None else count
        for future, record in self.pending[:count]:
            if not future.done():
                self.records.append(record)
                future.set_result(None)
        del self.pending[:count]

    def decoded(self) -> list[RawSseEvent]:
        return [avro.decode_raw_sse_event(value) for _, _, value in self.records]


def events_of(path: Path) -> list[SseEvent]:
    return list(read_events(Source.OPENAI, path.open("rb")))


async def settle() -> None:
    """Let the tap's pump hand over what is queued."""
    for _ in range(5):
        await asyncio.sleep(0)


def as_called(want: Tokens, got: Tokens) -> Tokens:
    """`want` (a fold, keyed by the provider's id) as the proxy's call `got` is keyed: by
    its own call id, the provider's id kept beside it."""
    assert got.request_id.startswith("call-"), got.request_id
    return want.model_copy(
        update={"request_id": got.request_id, "provider_request_id": want.request_id}
    )


def worker_tokens(sender: FakeSender) -> tuple[list[Tokens], Outputs]:
    """What the worker's logic makes of the records the tap sent."""
    processor = RequestProcessor(PriceTable.default(), timeout=60.0)
    out = Outputs()
    for offset, (_, key, value) in enumerate(sender.records):
        out.extend(
            processor.handle_sse(
                encode_key(key), value, Position(TOPICS.raw_sse.name, 0, offset, None)
            )
        )
    return [done.tokens for done in out.completed], out


async def test_events_go_out_in_order_under_the_provider_id_then_end() -> None:
    sender = FakeSender()
    async with Tap(sender=sender) as tap, tap.request(Source.OPENAI, tenant="acme") as req:
        for event in events_of(TEXT):
            await req.event(event)
        await settle()
        assert sender.records, "events are sent as they come, before the end"
    assert sender.started
    assert sender.stopped
    records = sender.decoded()
    expected = fold_stream(Source.OPENAI, events_of(TEXT))
    assert {r.request_id for r in records} == {expected.request_id}
    assert [r.seq for r in records] == list(range(len(records)))
    assert [r.kind for r in records] == [EventKind.EVENT] * (len(records) - 1) + [EventKind.END]
    assert not records[-1].cancelled
    assert all(r.tenant == "acme" and r.received_at.tzinfo is not None for r in records)
    assert tap.stats.sent == len(records)
    assert tap.stats.requests == 1
    (tokens,), _ = worker_tokens(sender)
    assert tokens == expected


async def test_feeding_bytes_in_small_pieces_sends_the_same_events() -> None:
    data = TEXT.read_bytes()
    sender = FakeSender()
    async with Tap(sender=sender) as tap, tap.request(Source.OPENAI, tenant="acme") as req:
        for start in range(0, len(data), 7):
            await req.feed(data[start : start + 7])
    (tokens,), _ = worker_tokens(sender)
    assert tokens == fold_stream(Source.OPENAI, events_of(TEXT))


async def test_the_events_of_one_chunk_carry_the_time_the_chunk_arrived(
    tmp_path: Path,
) -> None:
    """One clock reading per chunk fed, not per event: the events arrived together."""
    readings: list[datetime] = []

    def clock() -> datetime:
        readings.append(datetime(2026, 3, 1, tzinfo=UTC) + timedelta(seconds=len(readings)))
        return readings[-1]

    data = TEXT.read_bytes()
    events = events_of(TEXT)
    cut = data.index(b"\n\n", len(data) // 2) + 2  # two chunks, each of whole events
    sender = FakeSender()
    tap = Tap(sender=sender, spool_dir=tmp_path / "spool", clock=clock)
    async with tap, tap.request(Source.OPENAI, tenant="acme", request_id="gw-1") as req:
        await req.feed(data[:cut])
        await req.feed(data[cut:])
    records = [r for r in sender.decoded() if r.kind is EventKind.EVENT]
    assert len(records) == len(events) > 4
    first = data[:cut].count(b"\n\n")
    assert {r.received_at for r in records[:first]} == {readings[0]}
    assert {r.received_at for r in records[first:]} == {readings[1]}
    assert [(r.event, r.data, r.sse_id) for r in records] == [
        (e.event, e.data, e.id) for e in events
    ]


async def test_a_stream_without_an_id_gets_the_fallback_of_produce() -> None:
    data = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
    sender = FakeSender()
    async with Tap(sender=sender) as tap, tap.request(Source.OPENAI, tenant="acme") as req:
        await req.feed(data)
    assert {r.request_id for r in sender.decoded()} == {fallback_request_id(data)}


async def test_a_given_request_id_keys_every_record() -> None:
    sender = FakeSender()
    tap = Tap(sender=sender)
    async with tap, tap.request(Source.OPENAI, tenant="acme", request_id="gw-1") as req:
        await req.event(events_of(TEXT)[0])
        assert req.request_id == "gw-1"
    assert {key for _, key, _ in sender.records} == {"gw-1"}


async def test_cancellation_mid_stream_ends_the_request_cancelled() -> None:
    sender = FakeSender()
    events = events_of(TEXT)
    streaming = asyncio.Event()

    async def gateway(tap: Tap) -> None:
        async with tap.request(Source.OPENAI, tenant="acme") as req:
            for event in events[:2]:
                await req.event(event)
            streaming.set()
            await asyncio.sleep(3600)  # the client goes away while we wait upstream

    async with Tap(sender=sender) as tap:
        task = asyncio.create_task(gateway(tap))
        await streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    records = sender.decoded()
    assert [r.kind for r in records] == [EventKind.EVENT, EventKind.EVENT, EventKind.END]
    assert records[-1].cancelled
    assert records[-1].event == "cancelled"
    assert tap.stats.cancelled == 1
    (tokens,), _ = worker_tokens(sender)
    assert tokens.finish_reason is FinishReason.CANCELLED
    assert tokens.finish_reason_raw is None
    assert tokens.error is None
    assert tokens.text == fold_stream(Source.OPENAI, events[:2]).text


async def test_an_exception_ends_the_request_cancelled_and_propagates() -> None:
    sender = FakeSender()

    async def gateway() -> None:
        tap = Tap(sender=sender)
        async with tap, tap.request(Source.OPENAI, tenant="acme") as req:
            await req.event(events_of(TEXT)[0])
            raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await gateway()
    assert sender.decoded()[-1].cancelled


async def test_a_request_that_finished_before_the_cancel_keeps_its_finish() -> None:
    sender = FakeSender()

    async def gateway() -> None:
        tap = Tap(sender=sender)
        async with tap, tap.request(Source.OPENAI, tenant="acme") as req:
            for event in events_of(TEXT):
                await req.event(event)
            raise RuntimeError("after the last event")

    with pytest.raises(RuntimeError):
        await gateway()
    (tokens,), _ = worker_tokens(sender)
    assert tokens == fold_stream(Source.OPENAI, events_of(TEXT))


async def test_a_request_with_no_event_sends_nothing() -> None:
    sender = FakeSender()
    async with Tap(sender=sender) as tap, tap.request(Source.OPENAI, tenant="acme"):
        pass
    assert sender.records == []
    assert tap.stats.requests == 0


async def test_kafka_slow_nothing_is_dropped_and_the_worker_bills_every_request(
    tmp_path: Path,
) -> None:
    """The issue's small case: Kafka acking in 40 ms, 20 streams at once.  The old tap
    (a 20-record buffer, 5 ms budget) lost 16 of 20 usage events; through the spool
    every record arrives once and the worker bills all 20 requests as their fold."""
    events = events_of(TEXT)
    sender = FakeSender(delay=0.04)
    tap = Tap(sender=sender, spool_dir=tmp_path / "spool", max_in_flight=20)

    async def stream(n: int) -> None:
        async with tap.request(Source.OPENAI, tenant="acme", request_id=f"r{n}") as req:
            for event in events:
                await req.event(event)

    async with tap:
        await asyncio.gather(*(stream(n) for n in range(20)))
    keys = [(r.request_id, r.seq) for r in sender.decoded()]
    assert len(keys) == len(set(keys)) == 20 * (len(events) + 1)
    assert tap.stats.sent == tap.stats.appended == len(keys)
    assert tap.stats.failed == 0
    assert tap.stats.spool_bytes == 0
    assert tap.spool.unsent_records == 0
    tokens, _ = worker_tokens(sender)
    want = fold_stream(Source.OPENAI, events)
    assert sorted(t.request_id for t in tokens) == sorted(f"r{n}" for n in range(20))
    assert {t.model_copy(update={"request_id": want.request_id}) for t in tokens} == {want}


async def test_backpressure_a_full_spool_slows_an_event_never_drops_it(tmp_path: Path) -> None:
    sender = FakeSender(hold=True)  # Kafka acknowledges nothing
    events = events_of(TEXT)
    tap = Tap(sender=sender, spool_dir=tmp_path / "spool", spool_bytes=600)
    await tap.start()
    async with tap.request(Source.OPENAI, tenant="acme") as req:
        await req.event(events[0])
        await req.event(events[1])
        await settle()
        assert tap.full, "past the headroom: a proxy refuses new calls"
        while tap.spool.unsent_bytes < 600:
            await req.event(events[2])
        waiting = asyncio.create_task(req.event(events[3]))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "at the limit an event waits for room"
        sender.release()  # Kafka catches up
        await asyncio.wait_for(waiting, 1)
        sender.hold = False
    sender.release()
    await tap.close(timeout=1)
    records = sender.decoded()
    seqs = [r.seq for r in records]
    assert sorted(set(seqs)) == list(range(len(records))), "no gap: nothing dropped"
    assert records[-1].kind is EventKind.END
    assert tap.stats.sent == len(records)
    assert not tap.full


async def test_records_kafka_refuses_for_good_are_counted_failed_and_kept(tmp_path: Path) -> None:
    sender = FakeSender(fail=True)
    tap = Tap(sender=sender, spool_dir=tmp_path / "spool")
    async with tap, tap.request(Source.OPENAI, tenant="acme") as req:
        await req.event(events_of(TEXT)[0])
    assert tap.stats.failed == 2
    assert tap.stats.sent == 0
    assert tap.stats.spool_bytes == 0
    kept = decode_frames((tmp_path / "spool" / "rejected" / "records.seg").read_bytes(), 0)
    assert [avro.decode_raw_sse_event(r.value).seq for r in kept.records] == [0, 1]


async def test_records_the_disk_refuses_are_counted_failed_and_logged_never_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk: an event alone and the events of a chunk alike are counted failed and
    logged with their request, the caller goes on; what comes after the disk is back is
    spooled and sent (the worker sees the gap)."""
    sender = FakeSender()
    events = events_of(TEXT)
    real = os.write

    def full(fd: int, data: Any) -> int:
        raise OSError(28, "No space left on device")

    tap = Tap(sender=sender, spool_dir=tmp_path / "spool")
    async with tap, tap.request(Source.OPENAI, tenant="acme", request_id="gw-1") as req:
        await req.event(events[0])
        monkeypatch.setattr("streamtally.producers.spool.os.write", full)
        await req.event(events[1])  # one record
        assert tap.stats.failed == 1
        await req.feed(b"".join(b"data: %s\n\n" % e.data.encode() for e in events[2:4]))
        assert tap.stats.failed == 3, "both records of the chunk"
        monkeypatch.setattr("streamtally.producers.spool.os.write", real)
        await req.event(events[4])
    assert [(r.seq, r.kind) for r in sender.decoded()] == [
        (0, EventKind.EVENT),
        (4, EventKind.EVENT),
        (5, EventKind.END),
    ]
    assert tap.stats.failed == 3
    lost = [r.getMessage() for r in caplog.records if "could not be spooled" in r.getMessage()]
    assert len(lost) == 2
    assert all("gw-1 (openai, tenant acme)" in m and "No space left" in m for m in lost)
    assert lost[0].startswith("tap: 1 records")
    assert lost[1].startswith("tap: 2 records")


async def test_kafka_down_the_records_wait_in_the_spool_with_their_capture_time(
    tmp_path: Path,
) -> None:
    """A broker down (every send fails, retriably) then back: records are sent again until
    Kafka takes them, each once in the end, stamped with the time the tap saw it."""
    sender = FakeSender(down=True)
    times = iter(datetime(2026, 3, 1, tzinfo=UTC) + timedelta(seconds=i) for i in range(100))
    tap = Tap(sender=sender, spool_dir=tmp_path / "spool", clock=lambda: next(times))
    async with tap:
        async with tap.request(Source.OPENAI, tenant="acme", request_id="r1") as req:
            for event in events_of(TEXT)[:3]:
                await req.event(event)
        await asyncio.sleep(0.3)
        assert tap.stats.sent == 0
        assert tap.stats.spool_bytes > 0
        assert tap.stats.oldest_unsent_age_s >= 0.25
        assert len(sender.attempts) > 4, "sent again and again"
        sender.down = False
        assert await tap.spool.wait_sent(3)
    records = sender.decoded()
    assert [(r.seq, r.received_at.second) for r in records] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert tap.stats.sent == 4
    assert tap.stats.failed == 0


async def test_a_tap_restarted_on_its_spool_sends_what_the_last_one_left(tmp_path: Path) -> None:
    held = FakeSender(hold=True)
    first = Tap(sender=held, spool_dir=tmp_path / "spool")
    await first.start()
    async with first.request(Source.OPENAI, tenant="acme", request_id="r1") as req:
        for event in events_of(TEXT)[:2]:
            await req.event(event)
    await first.close(timeout=0.1)
    assert first.stats.sent == 0
    sender = FakeSender()
    async with Tap(sender=sender, spool_dir=tmp_path / "spool") as second:
        assert await second.spool.wait_sent(2)
    assert [(r.request_id, r.seq) for r in sender.decoded()] == [("r1", 0), ("r1", 1), ("r1", 2)]
    assert second.stats.sent == 3
    assert second.stats.appended == 0


async def test_two_taps_cannot_share_a_spool_directory(tmp_path: Path) -> None:
    async with Tap(sender=FakeSender(), spool_dir=tmp_path / "spool"):
        with pytest.raises(SpoolLocked, match=rf"{tmp_path / 'spool'}.*process {os.getpid()}"):
            await Tap(sender=FakeSender(), spool_dir=tmp_path / "spool").start()


async def test_a_tap_spools_in_its_default_directory(tmp_path: Path) -> None:
    assert default_spool_dir("ns-1", Settings(state_dir_setting=tmp_path)) == (
        tmp_path / "spool" / "ns-1"
    )
    async with Tap(sender=FakeSender(), namespace="ns-1") as tap:  # the tests' default
        assert tap.spool.directory == tap.spool_dir
        assert tap.spool_dir.name == "ns-1"
        assert (tap.spool_dir / "lock").exists()


def test_the_fold_of_a_cancelled_request() -> None:
    from streamtally.core.fold import Fold
    from streamtally.core.normalize import Normalizer

    normalizer = Normalizer(Source.OPENAI, "r1")
    acc = Fold("r1", Source.OPENAI)
    when = datetime(2026, 3, 1, tzinfo=UTC)
    for i, event in enumerate(events_of(TEXT)[:2]):
        for chunk in normalizer.feed(event, when + timedelta(seconds=i)):
            acc.add(chunk)
    assert acc.result().finish_reason is FinishReason.ERROR
    assert acc.result().error == NO_FINISH
    acc.cancel()
    cancelled = acc.result()
    assert cancelled.finish_reason is FinishReason.CANCELLED
    assert cancelled.error is None


async def test_an_engine_request_cancelled_mid_stream_closes_cancelled_with_its_usage() -> None:
    """An engine stream has a cancel marker too (RawEngineOutput version 3): the worker
    closes the request `cancelled` with what the engine reported so far, not `error`."""
    sender = FakeSender()
    lines = [
        json.loads(line)
        for line in (SAMPLES / "vllm" / "delta_stop_cached.jsonl").read_bytes().splitlines()
        if line.strip()
    ]
    assert len(lines) > 2
    streaming = asyncio.Event()

    async def gateway(tap: Tap) -> None:
        async with tap.request(Source.VLLM, tenant="acme", request_id="eng-1", model="m") as req:
            for line in lines[:2]:
                await req.event(line)
            streaming.set()
            await asyncio.sleep(3600)  # the client goes away

    async with Tap(sender=sender) as tap:
        task = asyncio.create_task(gateway(tap))
        await streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    records = [avro.decode_raw_engine_output(value) for _, _, value in sender.records]
    assert [(r.kind, r.cancelled) for r in records] == [
        (EventKind.EVENT, False),
        (EventKind.EVENT, False),
        (EventKind.END, True),
    ]
    assert tap.stats.cancelled == 1
    processor = RequestProcessor(PriceTable.default(), timeout=60.0)
    out = Outputs()
    for offset, (_, key, value) in enumerate(sender.records):
        processor.handle_engine(
            encode_key(key), value, Position(TOPICS.raw_engine.name, 0, offset, None), out
        )
    (done,) = out.completed
    assert done.tokens.finish_reason is FinishReason.CANCELLED
    assert done.tokens.error is None
    # the usage seen so far: what the two outputs the engine sent carry, not zero
    plain = RequestProcessor(PriceTable.default(), timeout=60.0)
    ended = Outputs()
    for offset, (_, key, value) in enumerate(sender.records[:2]):
        plain.handle_engine(
            encode_key(key), value, Position(TOPICS.raw_engine.name, 0, offset, None), ended
        )
    plain_end = avro.encode_raw_engine_output(dataclasses.replace(records[-1], cancelled=False))
    plain.handle_engine(
        encode_key("eng-1"), plain_end, Position(TOPICS.raw_engine.name, 0, 2, None), ended
    )
    (uncancelled,) = ended.completed
    assert done.tokens.usage == uncancelled.tokens.usage
    assert done.tokens.text == uncancelled.tokens.text
    assert done.billing.finish_reason is FinishReason.CANCELLED


async def test_a_tap_connects_with_the_secured_kafka_settings() -> None:
    """The tap (and so `streamtally proxy`) takes the settings' `KafkaConnection`: a secured
    Kafka's SASL and TLS reach its producer, the password never its repr."""
    secured = KafkaConnection(
        servers="kafka.example:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="streamtally-producer",
        sasl_password="not-in-any-repr",
    )
    tap = Tap(secured)
    sender = tap._sender
    assert isinstance(sender, KafkaSender)
    assert sender._producer.kafka == secured
    assert "not-in-any-repr" not in repr(sender._producer.kafka)


async def test_a_request_with_a_given_id_may_number_its_events_itself() -> None:
    events = events_of(TEXT)
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        req = tap.request(Source.OPENAI, tenant="acme", request_id="resp_given")
        await req.event(events[0], seq=0)
        await req.event(events[2], seq=2)
        await req.event(events[1], seq=1)
        req.end()
        unnamed = tap.request(Source.OPENAI, tenant="acme")
        with pytest.raises(ValueError, match="request id given up front"):
            await unnamed.event(events[0], seq=0)
        with pytest.raises(ValueError, match="seq must be >= 0"):
            await tap.request(Source.OPENAI, tenant="acme", request_id="r").event(events[0], seq=-1)
        left = tap.request(Source.OPENAI, tenant="acme", request_id="resp_left")
        await left.event(events[5], seq=5)
        left.suspend()  # no END: the response goes on elsewhere
        left.end()  # nothing more
    records = sender.decoded()
    assert [(r.request_id, r.seq, r.kind) for r in records] == [
        ("resp_given", 0, EventKind.EVENT),
        ("resp_given", 2, EventKind.EVENT),
        ("resp_given", 1, EventKind.EVENT),
        ("resp_given", 3, EventKind.END),  # after the highest number sent
        ("resp_left", 5, EventKind.EVENT),
    ]


# --------------------------------------------------------------------------- keep-alives


def later(seconds: float) -> float:
    """`time.monotonic` as it will be `seconds` from now (what `Tap.keep_alive` is told)."""
    return time.monotonic() + seconds


async def test_a_quiet_request_in_flight_gets_keepalives_in_its_own_sequence() -> None:
    events = events_of(TEXT)
    sender = FakeSender()
    async with Tap(sender=sender, keepalive_s=30.0) as tap:
        async with tap.request(Source.OPENAI, tenant="acme", request_id="call-1") as req:
            for event in events[:2]:
                await req.event(event)
            assert tap.keep_alive(later(20)) == 0  # not quiet for keepalive_s yet
            assert tap.keep_alive(later(31)) == 1  # quiet: one keep-alive
            assert tap.keep_alive(later(31)) == 0  # ... which is a record: quiet again from it
            assert tap.keep_alive(later(62)) == 1
            for event in events[2:]:
                await req.event(event)
            assert tap.keep_alive(later(20)) == 0  # its events count as records too
        assert tap.keep_alive(later(3600)) == 0  # ended: none after its END
        assert tap.stats.keepalives == 2
    records = sender.decoded()
    assert [r.seq for r in records] == list(range(len(events) + 3))
    kept = [i for i, r in enumerate(records) if r.is_keepalive]
    assert kept == [2, 3]
    assert all((records[i].event, records[i].data) == (KEEPALIVE_EVENT, "") for i in kept)
    assert records[-1].kind is EventKind.END
    assert tap.stats.appended == len(records)
    # The worker bills the same as without them; it counts them as applied records.
    (tokens,), out = worker_tokens(sender)
    assert tokens == as_called(fold_stream(Source.OPENAI, events), tokens.model_copy())
    (done,) = out.completed
    assert done.records == len(records)
    assert out.dead_letters == []


async def test_no_keepalive_before_the_first_record_after_the_end_or_when_off() -> None:
    events = events_of(TEXT)
    sender = FakeSender()
    async with Tap(sender=sender, keepalive_s=30.0) as tap:
        unnamed = tap.request(Source.OPENAI, tenant="acme")  # its id awaited: nothing sent
        idle = tap.request(Source.OPENAI, tenant="acme", request_id="idle")  # no record yet
        numbered = tap.request(Source.OPENAI, tenant="acme", request_id="resp_1")
        await numbered.event(events[0], seq=0)  # numbered by its caller
        suspended = tap.request(Source.OPENAI, tenant="acme", request_id="left")
        await suspended.event(events[0])
        suspended.suspend()
        ended = tap.request(Source.OPENAI, tenant="acme", request_id="ended")
        await ended.event(events[0])
        ended.end()
        assert unnamed.request_id is None
        assert tap.keep_alive(later(3600)) == 0
        idle.end()
        unnamed.end()
    assert not any(r.is_keepalive for r in sender.decoded())
    sender = FakeSender()
    tap = Tap(sender=sender, keepalive_s=None)
    async with tap, tap.request(Source.OPENAI, tenant="acme", request_id="off") as req:
        await req.event(events[0])
        assert tap.keep_alive(later(3600)) == 0
    assert not any(r.is_keepalive for r in sender.decoded())


async def test_the_tap_sends_keepalives_on_its_own_while_the_call_is_silent() -> None:
    events = events_of(TEXT)
    sender = FakeSender()
    async with Tap(sender=sender, keepalive_s=0.05) as tap:
        async with tap.request(Source.OPENAI, tenant="acme", request_id="call-thinking") as req:
            await req.event(events[0])
            began = time.monotonic()
            await asyncio.sleep(0.4)  # the upstream thinks
            thought = time.monotonic() - began
            for event in events[1:]:
                await req.event(event)
        quiet = tap.stats.keepalives
        await asyncio.sleep(0.2)
        assert tap.stats.keepalives == quiet  # none after its END
    records = sender.decoded()
    kept = [r.seq for r in records if r.is_keepalive]
    # one every 0.05 s (ticks of 0.0125 s), never sooner
    assert 3 <= len(kept) <= thought / 0.05, (kept, thought)
    assert kept == list(range(1, 1 + len(kept)))  # between its first and its second event
    assert [r.seq for r in records] == list(range(len(records)))
    (tokens,), _ = worker_tokens(sender)
    assert tokens == as_called(fold_stream(Source.OPENAI, events), tokens.model_copy())


async def test_an_engine_request_gets_keepalives_without_a_payload() -> None:
    lines = [
        json.loads(line)
        for line in (SAMPLES / "vllm" / "delta_stop_cached.jsonl").read_bytes().splitlines()
        if line.strip()
    ]
    sender = FakeSender()
    tap = Tap(sender=sender)
    async with tap, tap.request(Source.VLLM, tenant="acme", request_id="eng-k", model="m") as req:
        await req.event(lines[0])
        assert tap.keep_alive(later(31)) == 1
        for line in lines[1:]:
            await req.event(line)
    records = [avro.decode_raw_engine_output(value) for _, _, value in sender.records]
    assert [r.seq for r in records] == list(range(len(lines) + 2))
    assert [r.is_keepalive for r in records] == [False, True] + [False] * len(lines)
    assert (records[1].payload, records[1].model) == (None, "m")

    def bill_of(values: list[bytes]) -> Any:
        processor = RequestProcessor(PriceTable.default(), timeout=60.0)
        out = Outputs()
        for offset, value in enumerate(values):
            processor.handle_engine(
                encode_key("eng-k"), value, Position(TOPICS.raw_engine.name, 0, offset, None), out
            )
        assert out.dead_letters == []
        (done,) = out.completed
        return done

    kept = bill_of([value for _, _, value in sender.records])
    without = [r for r in records if not r.is_keepalive]
    plain = bill_of(
        [
            avro.encode_raw_engine_output(dataclasses.replace(r, seq=i))
            for i, r in enumerate(without)
        ]
    )
    assert kept.tokens == plain.tokens
    assert (kept.records, plain.records) == (len(records), len(without))


async def test_a_request_dropped_without_its_end_is_not_kept_alive() -> None:
    sender = FakeSender()
    async with Tap(sender=sender) as tap:
        req = tap.request(Source.OPENAI, tenant="acme", request_id="forgotten")
        await req.event(events_of(TEXT)[0])
        del req
        gc.collect()
        assert tap.keep_alive(later(3600)) == 0  # the worker times it out


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_keepalive_seconds_must_be_a_positive_number(bad: float) -> None:
    with pytest.raises(ValueError, match="keepalive_s"):
        Tap(sender=FakeSender(), keepalive_s=bad)
