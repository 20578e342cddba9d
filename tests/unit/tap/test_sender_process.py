"""The spool's sender in a process of its own (producers/sender_process.py): the reader's
view of a spool another process writes, the writer's cursor moved by reports, and the
supervision of the child (its Kafka faked: `tests.unit.tap.sender_child_fake`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from streamtally.core.models import Source
from streamtally.errors import StackError
from streamtally.producers import Tap
from streamtally.producers.sender_process import SenderConfig, SenderProcess
from streamtally.producers.spool import (
    CURSOR_FILE,
    REJECTED_DIR,
    Spool,
    SpoolError,
    SpoolReader,
    decode_frames,
)
from tests.unit.tap.test_tap import FakeSender

REPO = Path(__file__).resolve().parents[3]
FAKE = "tests.unit.tap.sender_child_fake"


def append(spool: Spool, count: int, *, start: int = 0, size: int = 60) -> list[str]:
    keys = [f"req-{n:05d}" for n in range(start, start + count)]
    for key in keys:
        spool.append(Source.OPENAI, key, key.encode() * (size // len(key)), None)
    return keys


async def until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def alive(pid: int) -> bool:
    """Process `pid` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.fixture
def kafka_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the faked Kafka of the child appends each acknowledged key to."""
    path = tmp_path / "kafka.log"
    path.touch()
    monkeypatch.setenv("FAKE_KAFKA_LOG", str(path))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return path


def logged(path: Path) -> list[str]:
    return path.read_text().split()


def config(max_in_flight: int | None = None) -> SenderConfig:
    return SenderConfig("nowhere:9092", "ns", 5, None, max_in_flight)


# --------------------------------------------------------------------------- the reader


async def test_a_reader_takes_only_what_the_writer_published_across_segments(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=400)
    spool.read_elsewhere()
    reader = SpoolReader(tmp_path / "s", cursor=0, end=0)
    assert reader.take(100) == []
    keys = append(spool, 5)
    assert reader.take(100) == [], "nothing is read past the end published"
    reader.publish(spool.end, spool.written)
    assert reader.unsent_records == 5
    assert [r.key for r in reader.take(100)] == keys
    more = append(spool, 40, start=5)  # several new segments, begun after the reader listed
    assert len(spool.segments()) > 3
    reader.publish(spool.end, spool.written)
    taken = []
    while records := reader.take(7):
        taken.extend(records)
    assert [r.key for r in taken] == more
    assert not reader.unread()
    reader.acknowledge(taken[-1].end, 45)
    assert (reader.cursor, reader.unsent_records, reader.sent) == (spool.end, 0, 45)
    reader.close()
    await spool.close()


async def test_a_reader_opened_from_a_cursor_counts_the_records_after_it(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.read_elsewhere()
    append(spool, 10)
    first = SpoolReader(tmp_path / "s", cursor=0, end=spool.end, written=10)
    records = first.take(100)
    spool.settled(records[3].end, 4, 0)  # reported by a sender process that then died
    second = SpoolReader(
        tmp_path / "s",
        cursor=spool.cursor,
        end=spool.end,
        written=spool.written,
        before=spool.written - spool.unsent_records,
    )
    assert second.unsent_records == 6
    assert [r.key for r in second.take(100)] == [r.key for r in records[4:]]
    first.close()
    second.close()
    await spool.close()


async def test_a_reader_keeps_a_refused_record_aside_and_reports_its_progress(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s")
    spool.read_elsewhere()
    append(spool, 3)
    reader = SpoolReader(tmp_path / "s", cursor=0, end=spool.end, written=3)
    moved: list[int] = []
    reader.add_progress_listener(lambda: moved.append(reader.cursor))
    first, second, _ = reader.take(10)
    reader.acknowledge(first.end, 1)
    path = reader.reject(second, "too large")
    assert moved == [first.end, second.end]
    assert path == tmp_path / "s" / REJECTED_DIR / "records.seg"
    assert [r.key for r in decode_frames(path.read_bytes(), 0).records] == [second.key]
    assert (reader.sent, reader.rejected, reader.unsent_records) == (1, 1, 1)
    reader.close()
    await spool.close()


# --------------------------------------------------------------------------- the writer


async def test_the_writer_moves_its_cursor_by_reports_and_writes_the_cursor_file(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=400, max_bytes=2000, headroom_bytes=100)
    spool.read_elsewhere()
    append(spool, 30)
    with pytest.raises(SpoolError, match="sender process"):
        spool.take(1)
    assert spool.full
    waiting = asyncio.create_task(spool.wait_for_room())
    await asyncio.sleep(0.01)
    assert not waiting.done(), "the spool is at its limit"
    reader = SpoolReader(tmp_path / "s", cursor=0, end=spool.end, written=30)
    records = reader.take(100)
    with pytest.raises(ValueError, match="not between"):
        spool.settled(spool.end + 1, 30, 0)
    spool.settled(records[24].end, 24, 1)
    await asyncio.wait_for(waiting, 1)
    assert (spool.cursor, spool.sent, spool.rejected) == (records[24].end, 24, 1)
    assert spool.unsent_records == 5
    assert not spool.full
    segments = len(spool.segments())
    await spool.sync()
    cursor = json.loads((tmp_path / "s" / CURSOR_FILE).read_text())["position"]
    assert cursor == records[24].end
    assert len(spool.segments()) < segments, "segments wholly before the cursor deleted"
    assert reader.take(100) == [], "the reader goes on from where it was"
    reader.close()
    await spool.close()


async def test_a_tap_with_its_own_sender_cannot_move_it_to_a_process() -> None:
    with pytest.raises(ValueError, match="sender_process"):
        Tap(sender=FakeSender(), sender_process=True)


# --------------------------------------------------------------------------- the process


async def test_the_sender_process_sends_everything_in_order(
    tmp_path: Path, kafka_log: Path
) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=2000)
    await spool.start()
    before = append(spool, 20)  # appended before it starts: sent first
    process = await SenderProcess(spool, config(), module=FAKE).start()
    keys = before + append(spool, 300, start=20)
    assert await process.drain(20)
    assert logged(kafka_log) == keys
    assert (spool.sent, spool.unsent_records, spool.unsent_bytes) == (320, 0, 0)
    child = process.pid
    assert child is not None
    await process.stop(5)
    assert not alive(child)
    await spool.close()
    cursor = json.loads((tmp_path / "s" / CURSOR_FILE).read_text())["position"]
    assert cursor == spool.end


async def test_a_killed_sender_process_is_started_again_from_the_cursor(
    tmp_path: Path, kafka_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_KAFKA_DELAY", "0.002")
    spool = Spool(tmp_path / "s")
    await spool.start()
    process = await SenderProcess(spool, config(max_in_flight=1), module=FAKE).start()
    keys = append(spool, 400)
    await until(lambda: spool.sent >= 50)
    first = process.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    keys += append(spool, 100, start=400)  # appended while it is away
    await until(lambda: process.pid not in (None, first))
    assert await process.drain(30)
    got = logged(kafka_log)
    assert set(got) == set(keys), "nothing lost"
    assert list(dict.fromkeys(got)) == keys, "in order (re-sent ones are duplicates)"
    # Sent again: what was in flight, and what Kafka acknowledged since the last report
    # (every 5 ms: a few records).
    assert len(got) - len(keys) <= 20
    assert process.restarts == 1
    assert spool.sent == len(keys)
    await process.stop(5)
    await spool.close()


async def test_kafka_away_the_records_wait_in_the_spool_and_go_when_it_is_back(
    tmp_path: Path, kafka_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    down = tmp_path / "down"
    down.touch()
    monkeypatch.setenv("FAKE_KAFKA_DOWN", str(down))
    spool = Spool(tmp_path / "s")
    await spool.start()
    process = SenderProcess(spool, config(), module=FAKE)
    await process.start()
    keys = append(spool, 200)
    await asyncio.sleep(1.0)  # a few tries fail meanwhile
    assert logged(kafka_log) == []
    assert spool.unsent_records == 200
    assert spool.oldest_unsent_age_s() >= 0.9
    down.unlink()  # the broker is back
    assert await process.drain(20)
    assert list(dict.fromkeys(logged(kafka_log))) == keys
    assert (spool.sent, spool.unsent_bytes, spool.oldest_unsent_age_s()) == (200, 0, 0.0)
    assert process.restarts == 0, "an outage is not a dead process"
    await process.stop(5)
    await spool.close()


async def test_a_sender_process_that_cannot_reach_kafka_fails_the_start(
    tmp_path: Path, kafka_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_KAFKA_FAIL_START", "1")
    spool = Spool(tmp_path / "s")
    with pytest.raises(StackError, match="could not start: Kafka at nowhere:9092"):
        await SenderProcess(spool, config(), module=FAKE).start()
    await spool.close()


WRITER = """
import asyncio, sys
from streamtally.core.models import Source
from streamtally.producers.sender_process import SenderConfig, SenderProcess
from streamtally.producers.spool import Spool

async def main():
    spool = Spool(sys.argv[1])
    await spool.start()
    process = await SenderProcess(
        spool, SenderConfig("nowhere:9092", "ns", 5), module=sys.argv[2]
    ).start()
    spool.append(Source.OPENAI, "k", b"v", None)
    assert await process.drain(10)
    print(process.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_the_sender_process_exits_when_its_writer_is_sigkilled(
    tmp_path: Path, kafka_log: Path
) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "s"), FAKE],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    child = int(writer.stdout.readline())
    assert alive(child)
    writer.kill()
    writer.wait(10)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "no sender outlives its writer"
    assert logged(kafka_log) == ["k"]
