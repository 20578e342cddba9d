"""One upstream chunk's SSE events as one run: `TapRequest._send_chunk`.

When a chunk's events need nothing of their own (the request id known, room
in the spool, no event cut into parts), the tap writes their records with one
call (`RawSseWriter.values`), frames and signs them as one by one, and appends
them framed at once (`encode_frames`, `Spool.append_values`).  The spool must
hold the very records the event-by-event path appends: same values, same
order, same numbering, same signatures, whatever the chunking and framing;
and the other cases must still go event by event.
"""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Source
from streamtally.core.sse import SseEvent
from streamtally.producers.spool import Spool, SpoolClosed, decode_frames
from streamtally.producers.spool_frames import encode_frame, encode_frames
from streamtally.producers.tap import Tap, TapRequest
from streamtally.wire import avro
from streamtally.wire.framing import Framing
from streamtally.wire.records import PART_BYTES
from streamtally.wire.tenant_keys import ProducerKey
from tests.unit.tap.test_tap import FakeSender

REPO = Path(__file__).resolve().parents[3]
#: Every event's receive time (the tap's clock): the two paths' records compare whole.
MOMENT = datetime(2026, 11, 28, 12, 0, 0, 123456, tzinfo=UTC)
SAMPLES = sorted((REPO / "samples" / "openai").glob("*.sse")) + sorted(
    (REPO / "samples" / "anthropic").glob("*.sse")
)


def chunkings(body: bytes, seed: int) -> list[list[bytes]]:
    """`body` whole, a byte at a time up to 300 bytes then whole, per event, and random."""
    rng = random.Random(seed)
    events = [part + b"\n\n" for part in body.split(b"\n\n") if part]
    cuts = sorted(rng.sample(range(1, len(body)), min(40, len(body) - 1)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    return [[body], [body[i : i + 1] for i in range(300)] + [body[300:]], events, pieces]


async def spooled(
    tmp_path: Path, name: str, source: Source, chunks: list[bytes], **options: Any
) -> list[tuple[Source, str, bytes, bytes | None]]:
    """What a tap's spool holds after `chunks` were fed as one request (and its END).  The
    spool is the proxy's kind, read by a sender process (`read_elsewhere`: records framed
    and counted at once); no sender runs here."""
    tap = Tap(sender=FakeSender(), keepalive_s=None, clock=lambda: MOMENT, **options)
    spool = Spool(tmp_path / name)
    spool.read_elsewhere()
    tap._spool = spool
    async with tap.request(source, tenant="acme") as request:
        for chunk in chunks:
            await request.feed(chunk)
    data = b"".join(path.read_bytes() for path in spool.segments())
    await spool.close()
    return [(r.source, r.key, r.value, r.auth) for r in decode_frames(data, 0).records]


def count_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The records of each chunk run (`Tap._append_values`) from now on."""
    runs: list[int] = []
    real = Tap._append_values

    def counted(
        self: Tap, request: TapRequest, request_id: str, values: list[bytes], auths: Any = None
    ) -> None:
        runs.append(len(values))
        real(self, request, request_id, values, auths)

    monkeypatch.setattr(Tap, "_append_values", counted)
    return runs


def event_by_event(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TapRequest, "_whole_chunk", lambda self, events: False)


def confluent() -> Framing:
    """The Confluent framing, the RawSseEvent's writer schema under id 7."""
    fingerprint = avro.raw_sse_writer("r", Source.OPENAI, "t").value(0, 0, "m", "d", None)[2:10]
    return Framing({fingerprint: b"\x00\x00\x00\x00\x07"})


OPTIONS = {
    "plain": {},
    "signed": {"key": ProducerKey("k1", b"s" * 32)},
    "confluent": {"framing": confluent()},
}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
async def test_a_chunk_as_one_run_spools_the_records_event_by_event_does(
    path: Path, options: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = Source(path.parent.name)
    body = path.read_bytes()
    runs = count_runs(monkeypatch)
    for n, chunks in enumerate(chunkings(body, seed=len(body))):
        fast = await spooled(tmp_path, f"fast-{n}", source, chunks, **OPTIONS[options])
        with monkeypatch.context() as slow_path:
            event_by_event(slow_path)
            slow = await spooled(tmp_path, f"slow-{n}", source, chunks, **OPTIONS[options])
        assert fast == slow
        assert len(fast) > 1
        assert all((auth is not None) == (options == "signed") for *_, auth in fast)
        assert all(v[:1] == (b"\x00" if options == "confluent" else b"\xc3") for *_, v, _ in fast)
    assert sum(runs) > 0  # the run was taken: the comparison is not of one path with itself


async def test_large_and_early_events_and_a_framing_failure_go_event_by_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = count_runs(monkeypatch)
    first = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    big = "x" * (PART_BYTES + 1)
    large = b'data: {"id":"chatcmpl-2","choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
    parts = await spooled(tmp_path, "large", Source.OPENAI, [first, large % big.encode()])
    # The first chunk came before its request id was known (held, then sent); the
    # second's event is cut into parts: both went event by event.
    assert runs == []
    assert len(parts) > 3  # the first event, the large one's parts, its last slice, END
    await spooled(tmp_path, "after", Source.OPENAI, [first, first, first])
    assert runs == [1, 1]  # a chunk once the id is known, and nothing else in the way
    # A framing that knows no schema: the run fails, each event is counted failed one by
    # one (none spooled), and the numbering goes on as event by event.
    runs.clear()
    unknown = await spooled(tmp_path, "unknown", Source.OPENAI, [first, first], framing=Framing({}))
    assert runs == []
    assert unknown == []


async def test_a_run_whose_records_cannot_be_written_fails_as_event_by_event_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock without a time zone: no record can be written.  Each is counted failed and
    none is spooled, nothing is raised to the caller, whichever path the chunk takes."""
    first = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    seen: dict[str, tuple[int, int]] = {}
    for name in ("run", "event by event"):
        with monkeypatch.context() as patch:
            if name != "run":
                event_by_event(patch)
            tap = Tap(sender=FakeSender(), keepalive_s=None, clock=lambda: datetime(2026, 1, 1))  # noqa: DTZ001
            spool = Spool(tmp_path / name.replace(" ", "-"))
            spool.read_elsewhere()
            tap._spool = spool
            request = await tap.request(Source.OPENAI, tenant="acme").__aenter__()
            for _ in range(3):
                await request.feed(first)
            request.suspend()  # no END (its record would fail alike, raised by `end`)
            seen[name] = (tap.stats.failed, spool.appended)
            await spool.close()
    assert seen["run"] == seen["event by event"] == (3, 0)


def test_encode_frames_is_encode_frame_of_each_value_joined() -> None:
    values = [b"", b"\x00avro", "é".encode() * 40]
    auths = [b"sig-0", b"", b"sig-2" * 9]
    for key in ("req-1", "req-é", ""):
        joined = b"".join(encode_frame(Source.GEMINI, key, v, None, 1700000000.25) for v in values)
        assert encode_frames(Source.GEMINI, key, values, 1700000000.25) == joined
        signed = b"".join(
            encode_frame(Source.GEMINI, key, v, a, 1700000000.25)
            for v, a in zip(values, auths, strict=True)
        )
        assert encode_frames(Source.GEMINI, key, values, 1700000000.25, auths) == signed
    assert encode_frames(Source.GEMINI, "k", [], 1.0) == b""
    with pytest.raises(ValueError, match="3 values and 2 auths"):
        encode_frames(Source.GEMINI, "k", values, 1.0, auths[:2])


def test_raw_sse_writer_values_is_value_of_each_event() -> None:
    writer = avro.raw_sse_writer("req-1", Source.ANTHROPIC, "acme")
    events = [SseEvent("a"), SseEvent("b", "content_block_delta", "7"), SseEvent("", "ping")]
    micros = 1_700_000_000_123_456
    assert writer.values(126, micros, events) == [
        writer.value(126 + n, micros, e.event, e.data, e.id) for n, e in enumerate(events)
    ]
    with pytest.raises(ValueError, match="seq must be >= 0"):
        writer.values(-1, micros, events)


@pytest.mark.parametrize("signed", [False, True])
async def test_append_values_reads_back_as_append_many_over_a_segment_roll(
    signed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1700000000.5)
    values = [b"v%d" % n * 40 for n in range(30)]
    auths = [b"a%d" % n for n in range(30)] if signed else None
    many = Spool(tmp_path / "many", segment_bytes=2048)
    many.read_elsewhere()
    runs = Spool(tmp_path / "runs", segment_bytes=2048)
    runs.read_elsewhere()
    for start in range(0, 30, 4):
        chunk = values[start : start + 4]
        signs = None if auths is None else auths[start : start + 4]
        records = [(Source.OPENAI, "req-9", v, None if signs is None else signs[n])
                   for n, v in enumerate(chunk)]  # fmt: skip
        many.append_many(records)
        runs.append_values(Source.OPENAI, "req-9", chunk, signs)
    assert len(runs.segments()) == len(many.segments()) > 2
    for a, b in zip(runs.segments(), many.segments(), strict=True):
        assert a.name == b.name
        assert a.read_bytes() == b.read_bytes()
    assert (runs.end, runs.appended, runs.unsent_records) == (many.end, 30, 30)
    runs.append_values(Source.OPENAI, "req-9", [])
    assert runs.appended == 30
    await many.close()
    await runs.close()
    with pytest.raises(SpoolClosed):
        runs.append_values(Source.OPENAI, "req-9", [b"late"])


async def test_append_values_in_a_spool_read_in_process_keeps_its_records_for_take(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s")
    spool.append_values(Source.OPENAI, "req-1", [b"a", b"b"])
    spool.append_values(Source.OPENAI, "req-2", [b"c"], [b"signed"])
    taken = spool.take(10)
    assert [(r.key, r.value, r.auth) for r in taken] == [
        ("req-1", b"a", None),
        ("req-1", b"b", None),
        ("req-2", b"c", b"signed"),
    ]
    await spool.close()
