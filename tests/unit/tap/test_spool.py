"""The tap's write-ahead spool (producers/spool.py): framing, recovery, cursor, limits."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from streamtally.core.models import Source
from streamtally.producers.spool import (
    FRAME,
    Spool,
    SpoolCorrupt,
    SpoolLocked,
    SpoolRecord,
    decode_frames,
    encode_frame,
    segment_name,
)

REPO = Path(__file__).resolve().parents[3]


def value(n: int, size: int = 40) -> bytes:
    return (f"record-{n}-".encode() * size)[:size]


def fill(spool: Spool, count: int, *, size: int = 40, key: str = "req") -> list[int]:
    return [
        spool.append(Source.OPENAI, f"{key}-{n}", value(n, size), b"sig" if n % 2 else None)
        for n in range(count)
    ]


def read_all(spool: Spool) -> list[SpoolRecord]:
    out: list[SpoolRecord] = []
    while records := spool.take(1000):
        out.extend(records)
    return out


def frame_size(size: int, key: str = "req-0", auth: bytes | None = None) -> int:
    return len(encode_frame(Source.OPENAI, key, value(0, size), auth, 0.0))


# --------------------------------------------------------------------------- framing


def test_a_frame_is_length_crc_payload_and_decodes_to_its_record() -> None:
    frame = encode_frame(Source.VLLM, "req-é", b"\x00avro\xff", b"signed", 1700000000.5)
    length, crc = FRAME.unpack_from(frame)
    payload = frame[FRAME.size :]
    assert length == len(payload)
    assert crc == zlib.crc32(payload)
    (record,) = decode_frames(frame, 100).records
    assert record == SpoolRecord(
        100, 100 + len(frame), Source.VLLM, "req-é", b"\x00avro\xff", b"signed", 1700000000.5
    )
    unsigned = encode_frame(Source.OPENAI, "k", b"v", None, 1.0)
    assert decode_frames(unsigned, 0).records[0].auth is None


def test_a_frame_has_the_exact_bytes_of_its_format() -> None:
    """The layout on disk, byte for byte: a format change shows here first (a spool written
    by one version is read by the next)."""
    signed = encode_frame(Source.VLLM, "req-é", b"\x00avro\xff", b"signed", 1700000000.5)
    assert signed == bytes.fromhex(
        "29000000" "f52895e1"  # length 41, CRC-32 of the payload
        "01" "01" "04" "00002040fc54d941" "06000000" "06000000"  # version, flags: auth, ...
        "766c6c6d" "7265712dc3a9" "7369676e6564" "006176726fff"  # vllm, req-é, signed, value
    )  # fmt: skip
    unsigned = encode_frame(Source.OPENAI, "k", b"v", None, 1.0)
    assert unsigned == bytes.fromhex(
        "1b000000" "0b6d5d49"
        "01" "00" "06" "000000000000f03f" "01000000" "00000000"  # no auth: flags 0, length 0
        "6f70656e6169" "6b" "76"
    )  # fmt: skip


def test_every_source_reads_back_and_an_unknown_source_name_does_not_decode() -> None:
    for source in Source:
        (record,) = decode_frames(encode_frame(source, "k", b"v", None, 1.0), 0).records
        assert record.source is source
    good = encode_frame(Source.OPENAI, "k", b"v", None, 1.0)
    payload = good[FRAME.size :].replace(b"openai", b"opemai", 1)  # a valid CRC, no source
    scan = decode_frames(FRAME.pack(len(payload), zlib.crc32(payload)) + payload, 0)
    assert scan.records == []
    assert scan.problem == "a record that does not decode (b'opemai' is not a source)"


def test_a_flipped_bit_fails_the_crc() -> None:
    frame = bytearray(encode_frame(Source.OPENAI, "k", b"value", None, 1.0))
    frame[-2] ^= 0x01
    scan = decode_frames(bytes(frame), 0)
    assert scan.records == []
    assert scan.problem == "a CRC mismatch"


async def test_appended_records_read_back_in_order_from_memory_and_from_disk(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s", memory_bytes=500)  # most of them only on disk
    positions = fill(spool, 30)
    assert positions[0] == 0
    records = read_all(spool)
    assert spool.end == spool.unsent_bytes == records[-1].end
    assert spool.unsent_records == 30
    assert [r.position for r in records] == positions
    assert [(r.key, r.value, r.auth) for r in records] == [
        (f"req-{n}", value(n), b"sig" if n % 2 else None) for n in range(30)
    ]
    spool.rewind(positions[10])
    assert [r.key for r in spool.take(3)] == ["req-10", "req-11", "req-12"]
    await spool.close()


# --------------------------------------------------------------------------- durability


async def test_a_reopened_spool_gives_the_unsent_records_and_keeps_its_cursor(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s")
    positions = fill(spool, 5)
    first_three = spool.take(3)
    spool.acknowledge(first_three[-1].end, 3)
    await spool.close()
    assert json.loads((tmp_path / "s" / "cursor").read_text()) == {"position": positions[3]}
    again = Spool(tmp_path / "s")
    assert again.cursor == positions[3]
    assert again.unsent_records == 2
    assert [r.key for r in read_all(again)] == ["req-3", "req-4"]
    assert again.sent == again.appended == 0
    await again.close()


def test_a_sigkilled_process_loses_nothing_it_appended(tmp_path: Path) -> None:
    """append is one write(): the bytes are the OS's when it returns, fsynced or not."""
    script = (
        "import os, signal, sys\n"
        "from streamtally.core.models import Source\n"
        "from streamtally.producers.spool import Spool\n"
        "spool = Spool(sys.argv[1], sync_interval_s=3600)\n"
        "for n in range(500):\n"
        "    spool.append(Source.ANTHROPIC, f'r{n}', b'x' * n)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "STREAMTALLY_NATIVE": "off"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s")], env=env, cwd=REPO, check=False
    )
    assert done.returncode == -signal.SIGKILL
    spool = Spool(tmp_path / "s")
    records = read_all(spool)
    assert [(r.key, len(r.value)) for r in records] == [(f"r{n}", n) for n in range(500)]
    assert spool.truncated_bytes == 0


async def test_a_torn_tail_of_the_last_segment_is_cut_off_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    fill(spool, 3)
    end = spool.end
    await spool.close()
    segment = tmp_path / "s" / segment_name(0)
    torn = encode_frame(Source.OPENAI, "req-3", value(3), None, 1.0)[:25]
    with segment.open("ab") as file:
        file.write(torn)
    with caplog.at_level(logging.WARNING, "streamtally.producers.spool"):
        again = Spool(tmp_path / "s")
    assert again.end == end
    assert segment.stat().st_size == end
    assert again.truncated_bytes == 25
    assert "25 bytes cut off" in caplog.text
    (kept,) = (tmp_path / "s" / "rejected").glob("torn-*.bin")
    assert kept.read_bytes() == torn, "the bytes cut are kept for an operator"
    assert [r.key for r in read_all(again)] == ["req-0", "req-1", "req-2"]
    again.append(Source.OPENAI, "req-3", value(3))
    assert [r.key for r in read_all(again)] == ["req-3"]
    await again.close()


async def test_a_corrupt_record_in_the_last_segment_ends_it(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    positions = fill(spool, 3)
    await spool.close()
    segment = tmp_path / "s" / segment_name(0)
    data = bytearray(segment.read_bytes())
    data[positions[2] + FRAME.size + 3] ^= 0xFF  # in the last record's payload
    segment.write_bytes(bytes(data))
    again = Spool(tmp_path / "s")
    assert again.end == positions[2]
    assert [r.key for r in read_all(again)] == ["req-0", "req-1"]
    await again.close()


async def test_corruption_before_the_last_segment_refuses_to_open(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=4 * frame_size(40, auth=b"sig"))
    positions = fill(spool, 10)
    assert len(spool.segments()) > 2
    await spool.close()
    first = tmp_path / "s" / segment_name(0)
    data = bytearray(first.read_bytes())
    data[positions[1] + FRAME.size + 10] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(SpoolCorrupt, match=rf"{first} at byte {positions[1]}: a CRC mismatch"):
        Spool(tmp_path / "s")
    with pytest.raises(SpoolCorrupt):  # not SpoolLocked: a refused open leaves no lock
        Spool(tmp_path / "s")


async def test_a_missing_segment_refuses_to_open(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=3 * frame_size(40, auth=b"sig"))
    fill(spool, 10)
    middle = spool.segments()[1]
    await spool.close()
    middle.unlink()
    with pytest.raises(SpoolCorrupt, match="are missing"):
        Spool(tmp_path / "s")


async def test_the_cursor_file_is_replaced_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path / "s")
    positions = fill(spool, 4)
    records = spool.take(10)
    spool.acknowledge(records[0].end, 1)
    await spool.sync()
    cursor = tmp_path / "s" / "cursor"
    assert json.loads(cursor.read_text()) == {"position": positions[1]}

    def crash(self: Path, target: Path) -> Path:
        raise OSError("power lost before the rename")

    monkeypatch.setattr(Path, "replace", crash)
    spool.acknowledge(records[2].end, 2)
    with pytest.raises(OSError, match="power lost"):
        await spool.sync()
    assert json.loads(cursor.read_text()) == {"position": positions[1]}, "the old one, whole"
    assert list((tmp_path / "s").glob("cursor.*.tmp")), "only the temporary file was written"
    monkeypatch.undo()
    spool._release()  # the process dies here
    again = Spool(tmp_path / "s")
    assert not list((tmp_path / "s").glob("cursor.*.tmp"))
    assert [r.key for r in read_all(again)] == ["req-1", "req-2", "req-3"], "sent again"
    await again.close()


# --------------------------------------------------------------------------- segments


async def test_segments_roll_at_their_size_and_are_deleted_once_sent(tmp_path: Path) -> None:
    size = frame_size(40, "req-0")
    spool = Spool(tmp_path / "s", segment_bytes=3 * size + 10)
    positions = fill(spool, 8)  # 3, 3, 2 a segment (the odd ones a little larger)
    names = [path.name for path in spool.segments()]
    assert names == [
        segment_name(positions[0]),
        segment_name(positions[3]),
        segment_name(positions[6]),
    ]
    assert sorted(p.name for p in (tmp_path / "s").glob("*.seg")) == names
    records = spool.take(100)
    spool.acknowledge(records[4].end, 5)  # all of the first segment, part of the second
    await spool.sync()
    assert [path.name for path in spool.segments()] == names[1:]
    assert not (tmp_path / "s" / names[0]).exists()
    spool.acknowledge(records[-1].end, 3)
    await spool.sync()
    assert [path.name for path in spool.segments()] == names[2:], "never the current one"
    await spool.close()
    again = Spool(tmp_path / "s")
    assert not list((tmp_path / "s").glob("*.seg")), "wholly sent: deleted on open"
    assert again.unsent_bytes == 0
    assert again.append(Source.OPENAI, "next", b"v") == records[-1].end
    assert [path.name for path in again.segments()] == [segment_name(records[-1].end)]
    await again.close()


async def test_a_record_larger_than_a_segment_has_one_of_its_own(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=100, memory_bytes=0)
    spool.append(Source.OPENAI, "small", b"s")
    spool.append(Source.OPENAI, "big", b"B" * 3_000_000)  # more than one disk read too
    spool.append(Source.OPENAI, "small2", b"s")
    assert len(spool.segments()) == 3
    assert [(r.key, len(r.value)) for r in read_all(spool)] == [
        ("small", 1),
        ("big", 3_000_000),
        ("small2", 1),
    ]
    await spool.close()


# --------------------------------------------------------------------------- the lock


async def test_two_spools_never_share_a_directory(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    with pytest.raises(SpoolLocked, match=rf"{tmp_path / 's'} is in use by process {os.getpid()}"):
        Spool(tmp_path / "s")
    await spool.close()
    await Spool(tmp_path / "s").close()


def test_the_lock_names_the_other_process(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from streamtally.producers.spool import Spool\n"
        "spool = Spool(sys.argv[1])\n"
        "print('open', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "STREAMTALLY_NATIVE": "off"}
    other = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "s")],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None
        assert other.stdout.readline() == "open\n"
        with pytest.raises(SpoolLocked, match=rf"in use by process {other.pid}\b"):
            Spool(tmp_path / "s")
    finally:
        other.kill()
        other.wait()
    Spool(tmp_path / "s")._release()  # a killed holder leaves no lock behind


# --------------------------------------------------------------------------- limits


async def test_full_past_the_headroom_and_wait_for_room_at_the_limit(tmp_path: Path) -> None:
    size = frame_size(40, "req-0")
    spool = Spool(tmp_path / "s", max_bytes=10 * size, headroom_bytes=3 * size)
    assert spool.headroom_bytes == 3 * size
    fill(spool, 6)
    assert not spool.full
    spool.append(Source.OPENAI, "req-0", value(0))
    assert spool.full, "7 of 10: new calls are refused"
    assert not spool.at_limit
    await asyncio.wait_for(spool.wait_for_room(), 0.1)  # below the limit: at once
    while spool.unsent_bytes < spool.max_bytes:
        spool.append(Source.OPENAI, "req-0", value(0))
    assert spool.at_limit
    waiter = asyncio.create_task(spool.wait_for_room())
    await asyncio.sleep(0.02)
    assert not waiter.done()
    records = spool.take(2)
    spool.acknowledge(records[0].end, 1)
    spool.acknowledge(records[1].end, 1)
    await asyncio.wait_for(waiter, 1)
    assert spool.unsent_bytes < spool.max_bytes
    assert not spool.at_limit
    await spool.close()


def test_the_default_headroom_is_a_tenth(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", max_bytes=1000)
    assert spool.headroom_bytes == 100
    spool.append(Source.OPENAI, "k", b"v" * 800)
    assert not spool.full
    spool.append(Source.OPENAI, "k", b"v" * 100)
    assert spool.full
    spool._release()
    with pytest.raises(ValueError, match="headroom_bytes"):
        Spool(tmp_path / "t", max_bytes=1000, headroom_bytes=1000)


async def test_the_age_of_the_oldest_unsent_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    assert spool.oldest_unsent_age_s() == 0.0
    spool.append(Source.OPENAI, "a", b"1")
    await asyncio.sleep(0.1)
    spool.append(Source.OPENAI, "b", b"2")
    now = time.time()
    assert 0.1 <= spool.oldest_unsent_age_s(now) < 0.2
    first = spool.take(1)[0]
    spool.acknowledge(first.end, 1)
    assert spool.oldest_unsent_age_s(now) < 0.02
    await spool.close()
    again = Spool(tmp_path / "s")  # the append time is in the record
    assert again.oldest_unsent_age_s(now) < 0.02
    assert again.oldest_unsent_age_s(now + 5) >= 5
    rest = again.take(1)[0]
    again.acknowledge(rest.end, 1)
    assert again.oldest_unsent_age_s() == 0.0
    await again.close()


async def test_a_rejected_record_is_kept_before_the_cursor_moves_past_it(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    fill(spool, 2)
    first, second = spool.take(2)
    with pytest.raises(ValueError, match="cursor"):
        spool.reject(second, "not at the cursor")
    kept = spool.reject(first, "too large")
    assert spool.cursor == first.end
    assert spool.rejected == 1
    assert decode_frames(kept.read_bytes(), 0).records[0].value == first.value
    await spool.close()


async def test_the_group_commit_fsyncs_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    spool = await Spool(tmp_path / "s", sync_interval_s=0.01).start()
    spool.append(Source.OPENAI, "k", b"v")
    assert spool.synced == 0, "append does not wait for the disk"
    assert synced == []
    for _ in range(100):
        await asyncio.sleep(0.01)
        if spool.synced == spool.end:
            break
    assert spool.synced == spool.end
    assert synced
    await spool.close()


def test_bad_frame_length_in_the_header_is_not_read_as_a_record() -> None:
    bogus = struct.pack("<II", 1 << 31, 0) + b"x" * 20
    scan = decode_frames(bogus, 0)
    assert scan.records == []
    assert scan.problem is not None
    assert "frame length" in scan.problem
