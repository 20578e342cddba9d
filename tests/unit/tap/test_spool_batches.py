"""Several records at once (`Spool.append_many`, the tap's records of a chunk): one write each.

The tap appends every record one upstream chunk made with one ``write()``
per segment, before the chunk goes on to the client.  The records read back
exactly as if appended one by one, segments still roll at their size, a
failed write leaves only the records before it, and a chunk's records are in
the spool when `TapRequest.feed` returns, or before one of its events waits for
room.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Source
from streamtally.core.sse import SseEvent
from streamtally.producers.spool import Spool, SpoolError, SpoolRecord, encode_frame
from streamtally.producers.tap import Tap
from streamtally.wire import avro

RECORDS = [
    (Source.OPENAI, f"req-{n % 3}", b"v%d" % n * (n + 1), b"sig" if n % 2 else None)
    for n in range(12)
]


def read_all(spool: Spool) -> list[SpoolRecord]:
    out: list[SpoolRecord] = []
    while records := spool.take(1000):
        out.extend(records)
    return out


def count_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the spool's segment writes from now on."""
    sizes: list[int] = []
    real = Spool._write

    def write(self: Spool, data: bytes, key: str) -> None:
        sizes.append(len(data))
        real(self, data, key)

    monkeypatch.setattr(Spool, "_write", write)
    return sizes


async def test_many_records_are_one_write_and_read_back_as_if_appended_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = Spool(tmp_path / "one", memory_bytes=0)
    for record in RECORDS:
        one.append(*record)
    many = Spool(tmp_path / "many", memory_bytes=0)
    writes = count_writes(monkeypatch)
    many.append_many(RECORDS)
    assert len(writes) == 1
    assert (many.appended, many.unsent_records, many.unsent_bytes) == (
        12,
        12,
        one.unsent_bytes,
    )
    mine = [(r.position, r.end, r.source, r.key, r.value, r.auth) for r in read_all(many)]
    theirs = [(r.position, r.end, r.source, r.key, r.value, r.auth) for r in read_all(one)]
    assert mine == theirs
    await one.close()
    await many.close()
    again = Spool(tmp_path / "many")  # and from the files, after a restart
    assert [(r.key, r.value, r.auth) for r in read_all(again)] == [
        (key, value, auth) for _, key, value, auth in RECORDS
    ]
    await again.close()


async def test_a_batch_rolls_segments_at_their_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frame = len(encode_frame(*RECORDS[-1], 0.0))  # the largest of them
    spool = Spool(tmp_path / "s", segment_bytes=3 * frame, memory_bytes=0)
    writes = count_writes(monkeypatch)
    spool.append_many(RECORDS)
    assert all(size <= 3 * frame for size in writes)
    assert 1 < len(writes) == len(spool.segments()) < 12
    assert [(r.key, r.value) for r in read_all(spool)] == [(k, v) for _, k, v, _ in RECORDS]
    await spool.close()


async def test_a_failed_write_keeps_the_records_before_it_and_none_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frame = len(encode_frame(*RECORDS[-1], 0.0))
    spool = Spool(tmp_path / "s", segment_bytes=3 * frame, memory_bytes=0)
    real = os.write
    calls = 0

    def write(fd: int, data: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr("streamtally.producers.spool.os.write", write)
    with pytest.raises(SpoolError, match="No space left"):
        spool.append_many(RECORDS)
    kept = spool.appended
    assert 0 < kept < 12
    assert [r.key for r in read_all(spool)] == [key for _, key, _, _ in RECORDS[:kept]]
    monkeypatch.setattr("streamtally.producers.spool.os.write", real)
    spool.append(Source.OPENAI, "after", b"v")  # the spool goes on where it stopped
    await spool.close()
    again = Spool(tmp_path / "s")
    assert [r.key for r in read_all(again)] == [k for _, k, _, _ in RECORDS[:kept]] + ["after"]
    await again.close()


def sse(n: int) -> bytes:
    return b'data: {"id":"chatcmpl-b","choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % n


class Acknowledging:
    """A sender that takes every record at once (what reached it: `records`)."""

    def __init__(self) -> None:
        self.records: list[tuple[Source, str, bytes]] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def send(self, source: Source, request_id: str, value: bytes) -> asyncio.Future[Any]:
        self.records.append((source, request_id, value))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


async def test_a_chunk_of_events_is_one_write_done_before_feed_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = Acknowledging()
    async with Tap(sender=sender, spool_dir=tmp_path / "spool") as tap:
        writes = count_writes(monkeypatch)
        request = tap.request(Source.OPENAI, tenant="acme")
        await request.feed(b"".join(sse(n) for n in range(5)))
        assert len(writes) == 1
        assert tap.spool.appended == 5
        await request.feed(sse(5) + sse(6)[:20])  # one whole event, one cut: one record
        assert len(writes) == 2
        assert tap.spool.appended == 6
        await request.feed(sse(6)[20:])
        assert tap.spool.appended == 7
        assert request._chunk_records is None
        request.end()
    assert [avro.decode_raw_sse_event(v).seq for _, _, v in sender.records] == list(range(8))


class Silent(Acknowledging):
    """A sender that acknowledges nothing (Kafka slow: the spool only fills)."""

    async def send(self, source: Source, request_id: str, value: bytes) -> asyncio.Future[Any]:
        self.records.append((source, request_id, value))
        return asyncio.get_running_loop().create_future()


async def test_a_chunks_records_go_into_the_spool_before_an_event_waits_for_room(
    tmp_path: Path,
) -> None:
    """An event of a chunk that finds the spool at its limit waits for room, and the
    records of that chunk before it do not wait with it, unwritten."""
    async with Tap(sender=Silent(), spool_dir=tmp_path / "spool", spool_bytes=600) as tap:
        request = tap.request(Source.OPENAI, tenant="acme", request_id="r")
        request._chunk_records = []  # as in `feed`
        await request.event(SseEvent("first"))
        assert tap.spool.appended == 0
        while not tap.spool.at_limit:
            tap.spool.append(Source.OPENAI, "other", b"x" * 50)
        appended = tap.spool.appended
        waiting = asyncio.create_task(tap._wait_for_room(request))
        await asyncio.sleep(0.02)
        assert not waiting.done(), "at the limit: it waits"
        assert tap.spool.appended == appended + 1, "the chunk's record is in the spool"
        assert request._chunk_records == []
        waiting.cancel()
        request._chunk_records = None
        await tap.close(timeout=0.1)


async def test_a_spool_read_elsewhere_counts_a_batch_as_one_by_one(tmp_path: Path) -> None:
    """With a sender process reading the files (`read_elsewhere`), a batch's counts are
    taken at once: the same end, sizes, counts and age checkpoints as appended singly, over
    a segment roll."""
    big = [(Source.ANTHROPIC, f"req-{n}", b"x" * 300, None) for n in range(40)]
    one = Spool(tmp_path / "one", segment_bytes=4096)
    one.read_elsewhere()
    for record in big:
        one.append_many([record])
    many = Spool(tmp_path / "many", segment_bytes=4096)
    many.read_elsewhere()
    many.append_many(big)
    assert many.appended == one.appended == 40
    assert (many.end, many.unsent_records, many.unsent_bytes) == (
        one.end,
        one.unsent_records,
        one.unsent_bytes,
    )
    assert len(many.segments()) == len(one.segments()) > 2
    assert [p.stat().st_size for p in many.segments()] == [p.stat().st_size for p in one.segments()]
    later = time.time() + 5
    assert many.oldest_unsent_age_s(later) >= 5  # its age checkpoint was taken
    many.settled(many.end, 40, 0)
    assert many.unsent_records == 0
    assert many.oldest_unsent_age_s(later) == 0.0
    await one.close()
    await many.close()
