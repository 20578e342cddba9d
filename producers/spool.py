"""The tap's write-ahead spool: every raw record on local disk before Kafka has it.

    spool = Spool(directory, max_bytes=1 << 30)   # locks the directory, recovers
    await spool.start()                            # the group-commit task
    position = spool.append(Source.OPENAI, request_id, value, auth)
    ...
    await spool.close()                            # fsync, cursor, unlock

Layout.  A directory of its own per writer (``lock`` says which: a second
process opening it gets `SpoolLocked`, naming the directory and the pid that
holds it; a sender process reads it without the lock, below):

    00000000000000000000.seg   segment files, named by the global byte
    00000000000067108903.seg   position of their first record (20 digits)
    cursor                     {"position": N}: Kafka acknowledged every record before N
    lock                       the pid of the process that writes the spool
    rejected/records.seg       records Kafka refused for good (same framing), kept
    rejected/torn-<seg>-<offset>.bin   bytes cut off a torn last segment, kept

A position is a byte offset in the spool's one endless log: a segment named
``P`` holds the bytes from ``P`` on, and the next segment starts where it
ends.  A new segment is begun when the current one would grow past
`segment_bytes` (64 MiB by default; a record larger than that has a segment
of its own).

Records.  Each is framed ``[u32 length][u32 crc32][payload]`` (little
endian; zlib's CRC-32 of the payload) and its payload holds what the sender
needs to produce it: the raw topic kind (the record's `Source`), the key (the
request id), the value (the Avro raw record the tap encoded, stamped with
its capture time), the optional ``st-auth`` header, and the wall-clock time
it was appended (for the age of the oldest unsent record, across restarts).
See `streamtally.producers.spool_frames` for the exact layout.

Durability.  `append` is synchronous and does one ``write()``: when it
returns, the bytes are in the operating system, so a SIGKILLed process loses
nothing it appended.  A background task fsyncs the current segment every
`sync_interval_s` (20 ms by default: group commit; a power loss can lose at
most that much), and `close` fsyncs.  A segment is fsynced before the next
one is begun, so only the last segment can have a torn tail.

The cursor.  The sender acknowledges records in order (`acknowledge`, a
contiguous prefix that Kafka has) and `reject`s one Kafka refuses for good
(it is kept in ``rejected/records.seg`` first).  The cursor file is rewritten
atomically (temporary file, fsync, rename, fsync of the directory) every
`cursor_interval_s` when it moved; segments wholly before it are then
deleted.  After a crash the records between the last cursor written and the
last acknowledgement are sent again: duplicates, which the worker drops (it
keys records by request id and sequence number).

Recovery (on open).  The cursor is read, the segments are listed, and every
record from the cursor on is read and its CRC checked.  A torn or corrupt
tail of the LAST segment (a write cut short by a crash) is cut off, with a
warning naming the byte count, and the bytes cut are kept under
``rejected/``.  Anything else (a bad record in an earlier segment, a missing
segment, a gap between segments) is `SpoolCorrupt`, naming the file and the
offset: the spool refuses to open rather than skip a billable record.

Limits.  `unsent_bytes` are the framed bytes appended and not yet
acknowledged.  `full` is True from ``max_bytes - headroom_bytes`` on (the
proxy refuses new calls then); `at_limit` is True from `max_bytes` on, and
`wait_for_room` waits while it is (the tap awaits it before each event it
appends, so a call in flight is slowed, never dropped).  `append` itself
never refuses: an END marker appended without waiting may go past
`max_bytes` a little.

Reading.  The sender `take`s records in spool order from its read position:
from memory for what was appended by this process while the sender kept up
(at most `memory_bytes` of them held), else from the segment files (after a
restart, or when Kafka fell behind).  After a failure it `rewind`s to the
cursor and sends again from there.

Two processes.  The sender may run in a process of its own
(`streamtally.producers.sender_process`, the proxy's default).  The `Spool`
(the writer, holding the lock) is then told so (`read_elsewhere`: nothing is
kept in memory for it) and still does everything above but reading: it
recovers, appends, rolls, fsyncs, writes the cursor file and deletes the
segments before it; the sender's reports move its cursor (`settled`), so that
`full`, `wait_for_room`, the counts and the age stay its own.  The sender
process reads through a `SpoolReader`: the segment files only, up to the end
the writer published (whole records, already written; a segment begun since
it last looked is found by listing the directory), and it writes nothing but
``rejected/records.seg``.  Both share the cursor's logic (`_Cursor`: take,
acknowledge, reject, rewind) and the reading of segment files (`_Segments`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import fcntl
import json
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from streamtally.core.models import Source
from streamtally.errors import SpoolClosed, SpoolCorrupt, SpoolError, SpoolLocked
from streamtally.producers.spool_frames import (
    FRAME,
    HEAD,
    SpoolRecord,
    decode_frames,
    encode_frame,
    encode_frames,
)

__all__ = [
    "DEFAULT_CURSOR_INTERVAL_S",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SYNC_INTERVAL_S",
    "HEADROOM_FRACTION",
    "Spool",
    "SpoolClosed",
    "SpoolCorrupt",
    "SpoolError",
    "SpoolLocked",
    "SpoolRecord",
    "decode_frames",
    "encode_frame",
    "segment_name",
]

log = logging.getLogger("streamtally.producers.spool")

#: Default limit of unsent bytes (1 GiB).
DEFAULT_MAX_BYTES: Final = 1 << 30
#: Default headroom below `max_bytes` kept for calls in flight: this fraction of it.
HEADROOM_FRACTION: Final = 0.1
#: Default size at which a new segment is begun (64 MiB).
DEFAULT_SEGMENT_BYTES: Final = 64 << 20
#: Default seconds between two fsyncs of the current segment (group commit).
DEFAULT_SYNC_INTERVAL_S: Final = 0.02
#: Default seconds between two writes of the cursor file (when it moved).
DEFAULT_CURSOR_INTERVAL_S: Final = 0.25
#: Default bytes of unsent records held in memory for the sender (beyond: read from disk).
DEFAULT_MEMORY_BYTES: Final = 16 << 20

SEGMENT_SUFFIX: Final = ".seg"
CURSOR_FILE: Final = "cursor"
LOCK_FILE: Final = "lock"
REJECTED_DIR: Final = "rejected"
#: Age checkpoints kept at most (then every other one is dropped: coarser, still bounded).
MAX_CHECKPOINTS: Final = 65_536
#: Seconds between two age checkpoints at least.
CHECKPOINT_S: Final = 0.01
#: Bytes read from a segment at once by `take`.
READ_BYTES: Final = 1 << 20


def segment_name(base: int) -> str:
    """The file name of the segment whose first record is at global position `base`."""
    return f"{base:020d}{SEGMENT_SUFFIX}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock(directory: Path) -> int:
    """The locked lock file's descriptor (`SpoolLocked` naming the pid that holds it)."""
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise SpoolLocked(
            f"the spool directory {directory} is in use by process {holder} "
            "(one process per spool directory: give this one a directory of its own)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


def list_bases(directory: Path) -> list[int]:
    """The bases of the segment files in `directory`, in order."""
    return sorted(
        int(path.name[: -len(SEGMENT_SUFFIX)])
        for path in directory.glob("*" + SEGMENT_SUFFIX)
        if path.name[: -len(SEGMENT_SUFFIX)].isdigit()
    )


class _Segments:
    """The segment files read back, by the writer's own sender or by a sender process."""

    def __init__(self, directory: Path, bases: list[int]) -> None:
        self.directory = directory
        #: Segment bases in order (the writer's own list, which it extends as it rolls).
        self.bases = bases
        self._fds: dict[int, int] = {}

    def read(
        self, position: int, stop: int, limit: int, *, relist: bool = False
    ) -> list[SpoolRecord]:
        """Records from `position` (whole ones before `stop`, at most `limit`, at least one)
        read from their segment file.  `relist`: another process writes the segments, and
        one not known yet (begun since) is looked for in the directory."""
        for attempt in range(2 if relist else 1):
            if attempt:
                self.bases[:] = list_bases(self.directory)
            index = bisect.bisect_right(self.bases, position) - 1
            if index < 0:
                continue
            base = self.bases[index]
            segment_end = self.bases[index + 1] if index + 1 < len(self.bases) else stop
            want = min(stop, segment_end) - position
            fd = self._open(base)
            data = os.pread(fd, min(want, READ_BYTES), position - base)
            if not data:
                continue  # the end of this segment: the next one begins here
            scan = decode_frames(data, position, limit=limit)
            if not scan.records and scan.short and len(data) < want:
                (length,) = struct.unpack_from("<I", data) if len(data) >= 4 else (0,)
                data = os.pread(fd, FRAME.size + length, position - base)  # one large record
                scan = decode_frames(data, position, limit=1)
            if not scan.records:
                raise SpoolCorrupt(
                    f"spool {self.directory}: {segment_name(base)} at byte {position - base}: "
                    f"{scan.problem or 'no record'} (read back after it was written)"
                )
            return scan.records
        raise SpoolCorrupt(f"spool {self.directory}: no segment holds position {position}")

    def _open(self, base: int) -> int:
        fd = self._fds.get(base)
        if fd is None:
            for old in [b for b in self._fds if b < base]:
                os.close(self._fds.pop(old))
            fd = os.open(self.directory / segment_name(base), os.O_RDONLY)
            self._fds[base] = fd
        return fd

    def forget(self, base: int) -> None:
        """The segment at `base` is deleted: close it if it is open."""
        fd = self._fds.pop(base, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


class _Cursor:
    """What a sender moves over a spool's records: the read position, and the cursor over
    what Kafka acknowledged (or refused for good: kept aside first).  The writer's
    `Spool` and a sender process's `SpoolReader` share it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: Records acknowledged (Kafka has them) and rejected since this one was opened.
        self.sent = 0
        self.rejected = 0
        self._cursor = 0  # Kafka has every record before it
        self._end = 0  # the position after the last record
        self._read = 0  # the next record `take` gives
        self._unsent_records = 0
        self._rejected_fd: int | None = None
        self._closed = False
        self._listeners: list[Callable[[], None]] = []
        self._advanced = asyncio.Event()

    @property
    def cursor(self) -> int:
        """Kafka acknowledged every record before this position."""
        return self._cursor

    @property
    def end(self) -> int:
        """The position after the last record appended (for a reader: published)."""
        return self._end

    @property
    def unsent_bytes(self) -> int:
        """Framed bytes appended and not yet acknowledged."""
        return self._end - self._cursor

    @property
    def unsent_records(self) -> int:
        return self._unsent_records

    @property
    def closed(self) -> bool:
        return self._closed

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` when records were added (the sender's wake-up)."""
        self._listeners.append(listener)

    def rewind(self, position: int) -> None:
        """Take again from `position` (at the cursor or after it, not after the read one)."""
        if not self._cursor <= position <= self._read:
            raise ValueError(
                f"rewind to {position}: not between the cursor {self._cursor} and the read "
                f"position {self._read}"
            )
        self._read = position

    def unread(self) -> bool:
        """Records appended and not yet taken."""
        return self._read < self._end

    def acknowledge(self, position: int, records: int) -> None:
        """Kafka has the `records` records from the cursor up to `position` (a record's end)."""
        if not self._cursor < position <= self._read:
            raise ValueError(
                f"acknowledge up to {position}: not after the cursor {self._cursor} and up "
                f"to the read position {self._read}"
            )
        self._cursor = position
        self._unsent_records -= records
        self.sent += records
        self._moved()

    def reject(self, record: SpoolRecord, error: BaseException | str) -> Path:
        """Kafka refused `record` for good: keep it in ``rejected/records.seg`` (fsynced),
        then move the cursor past it (it must be at the cursor).  The file kept."""
        if record.position != self._cursor:
            raise ValueError(f"reject {record.position}: the cursor is at {self._cursor}")
        rejected = self.directory / REJECTED_DIR
        path = rejected / ("records" + SEGMENT_SUFFIX)
        if self._rejected_fd is None:
            rejected.mkdir(exist_ok=True)
            self._rejected_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _fsync_dir(rejected)
        frame = encode_frame(
            record.source, record.key, record.value, record.auth, record.appended_at
        )
        os.write(self._rejected_fd, frame)  # one write, O_APPEND: whole even if two append
        os.fsync(self._rejected_fd)
        log.error(
            "spool %s: Kafka refused a record of request %r (%s, %d bytes) for good: %s; "
            "kept in %s, not sent",
            self.directory,
            record.key,
            record.source.value,
            len(record.value),
            error,
            path,
        )
        self._cursor = record.end
        self._unsent_records -= 1
        self.rejected += 1
        self._moved()
        return path

    def _moved(self) -> None:
        """The cursor moved."""
        self._advanced.set()

    async def wait_sent(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds until every record appended is acknowledged."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._cursor < self._end:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._advanced.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), remaining)
        return True


class SpoolReader(_Cursor):
    """A sender process's view of a spool that another process (the writer, `Spool`)
    appends to (see "Two processes" in the module docstring).

    It reads the segment files only: whole records before the end the writer published
    (`publish`), never past it.  It writes nothing but ``rejected/records.seg``: its
    acknowledgements are reported to the writer (`add_progress_listener`), which writes
    the cursor file and deletes the segments sent.  `written` counts the records the
    writer holds up to `end` (since it opened the spool), `before` those of them before
    `cursor`: what `unsent_records` is made of.
    """

    def __init__(
        self, directory: Path | str, *, cursor: int, end: int, written: int = 0, before: int = 0
    ) -> None:
        if not 0 <= cursor <= end:
            raise ValueError(f"a reader from {cursor} to {end}: not 0 <= cursor <= end")
        super().__init__(Path(directory))
        self._cursor = self._read = cursor
        self._end = end
        self._written = written
        self._unsent_records = written - before
        self._segments = _Segments(self.directory, list_bases(self.directory))
        self._progress: list[Callable[[], None]] = []

    def publish(self, end: int, written: int) -> None:
        """The writer appended up to `end` (whole records, in the operating system), the
        `written`-th record last."""
        if end < self._end:
            raise ValueError(f"publish {end}: before the end published, {self._end}")
        self._unsent_records += written - self._written
        self._end, self._written = end, written
        for listener in self._listeners:
            listener()

    def add_progress_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` when the cursor moved (to report it to the writer)."""
        self._progress.append(listener)

    def _moved(self) -> None:
        super()._moved()
        for listener in self._progress:
            listener()

    def take(self, max_records: int, max_bytes: int = READ_BYTES) -> list[SpoolRecord]:
        """The next records after the read position, in order (at most `max_records`, and
        about `max_bytes`, at least one); [] when all that was published was taken."""
        if self._closed:
            raise SpoolClosed(f"the reader of the spool {self.directory} is closed")
        out: list[SpoolRecord] = []
        taken = 0
        while self._read < self._end and len(out) < max_records and taken < max_bytes:
            records = self._segments.read(
                self._read, self._end, max_records - len(out), relist=True
            )
            out.extend(records)
            taken += records[-1].end - records[0].position
            self._read = records[-1].end
        return out

    def close(self) -> None:
        """Close the files it reads (and its rejected records' file)."""
        self._closed = True
        self._segments.close()
        if self._rejected_fd is not None:
            os.close(self._rejected_fd)
            self._rejected_fd = None
        self._advanced.set()


class Spool(_Cursor):
    """A write-ahead spool of raw records in `directory` (see the module docstring)."""

    def __init__(
        self,
        directory: Path | str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        headroom_bytes: int | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        cursor_interval_s: float = DEFAULT_CURSOR_INTERVAL_S,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if headroom_bytes is None:
            headroom_bytes = int(max_bytes * HEADROOM_FRACTION)
        if not 0 <= headroom_bytes < max_bytes:
            raise ValueError(
                f"headroom_bytes must be >= 0 and below max_bytes ({max_bytes}), "
                f"got {headroom_bytes}"
            )
        if segment_bytes < FRAME.size + HEAD.size:
            raise ValueError(f"segment_bytes must be >= {FRAME.size + HEAD.size}")
        if not sync_interval_s > 0 or not cursor_interval_s > 0:
            raise ValueError("sync_interval_s and cursor_interval_s must be > 0")
        super().__init__(Path(directory))
        self.max_bytes = max_bytes
        self.headroom_bytes = headroom_bytes
        self.segment_bytes = segment_bytes
        self.sync_interval_s = sync_interval_s
        self.cursor_interval_s = cursor_interval_s
        self.memory_bytes = memory_bytes
        #: Records appended by this process (`sent` and `rejected`: see `_Cursor`).
        self.appended = 0
        #: Unsent records found when it was opened.
        self.recovered = 0
        #: Bytes cut off a torn last segment when it was opened.
        self.truncated_bytes = 0

        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = _lock(self.directory)
        #: Segment bases in order, and their paths.
        self._bases: list[int] = []
        self._segments = _Segments(self.directory, self._bases)
        self._fd: int | None = None  # the last segment, open to append
        self._segment_size = 0  # its valid bytes
        self._durable_cursor = -1  # what the cursor file says
        self._synced = 0  # everything before it is fsynced
        #: (position, appended at) of some unsent records, for the age of the oldest.
        self._checkpoints: deque[tuple[int, float]] = deque()
        self._cache: deque[SpoolRecord] = deque()
        self._cache_bytes = 0
        self._caching = True
        #: A sender process reads the segment files (`read_elsewhere`): no cache, no `take`.
        self._elsewhere = False
        self._retired: list[int] = []  # segment descriptors fsynced, to close
        self._dir_dirty = False
        self._room = asyncio.Event()
        self._sync_lock = asyncio.Lock()
        self._sync_task: asyncio.Task[None] | None = None
        try:
            self._recover()
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ state

    @property
    def synced(self) -> int:
        """Every record before this position is fsynced."""
        return self._synced

    @property
    def written(self) -> int:
        """Records it holds or held since it was opened: those found unsent, then appended."""
        return self.recovered + self.appended

    @property
    def full(self) -> bool:
        """No room for new calls: `unsent_bytes` >= `max_bytes` - `headroom_bytes`."""
        return self._end - self._cursor >= self.max_bytes - self.headroom_bytes

    @property
    def at_limit(self) -> bool:
        """No room for more events: `unsent_bytes` >= `max_bytes` (`wait_for_room` waits)."""
        return self._end - self._cursor >= self.max_bytes

    def oldest_unsent_age_s(self, now: float | None = None) -> float:
        """Seconds since the oldest unsent record was appended (0 when all are sent).

        Exact to `CHECKPOINT_S` (an over-estimate, never an under-estimate)."""
        if self._cursor >= self._end or not self._checkpoints:
            return 0.0
        appended = self._checkpoints[0][1]
        return max(0.0, (time.time() if now is None else now) - appended)

    def segments(self) -> list[Path]:
        """The segment files, in order."""
        return [self.directory / segment_name(base) for base in self._bases]

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        directory = self.directory
        for leftover in directory.glob(CURSOR_FILE + ".*.tmp"):
            leftover.unlink()
        cursor = self._read_cursor()
        bases = list_bases(directory)
        if cursor is None:
            cursor = bases[0] if bases else 0
        else:
            self._durable_cursor = cursor
        kept: list[int] = []
        for base in bases:
            path = directory / segment_name(base)
            if base + path.stat().st_size <= cursor:
                path.unlink()  # Kafka has all of it (the cursor file says so)
                continue
            kept.append(base)
        end = cursor
        for index, base in enumerate(kept):
            path = directory / segment_name(base)
            last = index == len(kept) - 1
            if base > end:
                raise SpoolCorrupt(
                    f"spool {directory}: {path.name} starts at {base} but the records before "
                    f"it end at {end}: bytes {end} to {base} are missing; refusing to start "
                    "(move the spool directory aside to start empty)"
                )
            if base < end and index > 0:
                raise SpoolCorrupt(
                    f"spool {directory}: {path.name} starts at {base}, inside the segment "
                    f"before it (which ends at {end}); refusing to start"
                )
            start = end - base  # the cursor's offset in the first segment, else 0
            with path.open("rb") as file:
                file.seek(start)
                data = file.read()
            scan = decode_frames(data, end)
            self._count(scan.records)
            valid_end = end + scan.valid
            if scan.problem is not None:
                offset = start + scan.valid
                if not last:
                    raise SpoolCorrupt(
                        f"spool {directory}: {path} at byte {offset}: {scan.problem}; it is "
                        "not the last segment, so this is not a torn write: refusing to "
                        "start rather than skip a record (inspect the file, or move the "
                        "spool directory aside to start empty)"
                    )
                cut = len(data) - scan.valid
                kept_at = self._keep_torn(base, offset, data[scan.valid :])
                with path.open("r+b") as file:
                    file.truncate(offset)
                    os.fsync(file.fileno())
                self.truncated_bytes += cut
                log.warning(
                    "spool %s: the last segment %s had a torn tail (%s at byte %d): %d bytes "
                    "cut off (kept in %s)",
                    directory,
                    path.name,
                    scan.problem,
                    offset,
                    cut,
                    kept_at,
                )
            end = valid_end
        self._bases[:] = kept
        self.recovered = self._unsent_records
        self._cursor = self._read = cursor
        self._end = self._synced = end
        if kept:
            last_path = directory / segment_name(kept[-1])
            self._fd = os.open(last_path, os.O_WRONLY | os.O_APPEND)
            self._segment_size = end - kept[-1]
        self._caching = cursor == end  # what is on disk is read from disk
        self._room.set()
        if self._unsent_records:
            log.info(
                "spool %s: %d records (%d bytes) not yet sent to Kafka are sent again from "
                "position %d (re-sent records are duplicates the worker drops)",
                directory,
                self._unsent_records,
                end - cursor,
                cursor,
            )

    def _count(self, records: list[SpoolRecord]) -> None:
        for record in records:
            self._unsent_records += 1
            self._checkpoint(record.position, record.appended_at)

    def _read_cursor(self) -> int | None:
        path = self.directory / CURSOR_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            position = json.loads(text)["position"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SpoolCorrupt(
                f"spool {self.directory}: the cursor file {path} is not one ({exc}); "
                "refusing to start"
            ) from exc
        if not isinstance(position, int) or position < 0:
            raise SpoolCorrupt(f"spool {self.directory}: {path} holds {position!r}, not a position")
        return position

    def _keep_torn(self, base: int, offset: int, data: bytes) -> Path:
        rejected = self.directory / REJECTED_DIR
        rejected.mkdir(exist_ok=True)
        target = rejected / f"torn-{base:020d}-{offset}.bin"
        with target.open("wb") as file:
            file.write(data)
            os.fsync(file.fileno())
        _fsync_dir(rejected)
        return target

    # ------------------------------------------------------------------ appending

    def append(self, source: Source, key: str, value: bytes, auth: bytes | None = None) -> int:
        """Frame the record and write it to the current segment (one ``write()``: it is in
        the operating system when this returns); its position.  Never waits, never refuses
        for size (`wait_for_room` is the caller's); `SpoolError` when the disk fails."""
        position = self._end
        self.append_many([(source, key, value, auth)])
        return position

    def append_many(self, records: Sequence[tuple[Source, str, bytes, bytes | None]]) -> None:
        """`append` for several records in order, with one ``write()`` per segment they go
        to (the tap appends every record of one upstream chunk at once).  `SpoolError` when
        the disk fails: the records before the failed write are in (`appended` counts
        them), none after it."""
        if self._closed:
            raise SpoolClosed(f"the spool {self.directory} is closed")
        if not records:
            return
        now = time.time()
        frames = [
            encode_frame(source, key, value, auth, now) for source, key, value, auth in records
        ]
        first, count = 0, len(frames)
        while first < count:
            size = len(frames[first])
            if self._fd is None or (
                self._segment_size > 0 and self._segment_size + size > self.segment_bytes
            ):
                self._roll()
            room = self.segment_bytes - self._segment_size - size
            last = first + 1
            while last < count and len(frames[last]) <= room:
                room -= len(frames[last])
                last += 1
            data = frames[first] if last == first + 1 else b"".join(frames[first:last])
            if self._elsewhere:  # nothing cached: the run's counts at once
                self._write_counted(data, records[first][1], last - first, now)
            else:
                position = self._end
                self._write(data, records[first][1])
                for n in range(first, last):
                    end = position + len(frames[n])
                    self._appended(position, end, now, records[n])
                    position = end
            first = last
        self._notify()

    def append_values(
        self,
        source: Source,
        key: str,
        values: list[bytes],
        auths: list[bytes | None] | None = None,
    ) -> None:
        """`append_many` of `values`, records of one key (with the ``st-auth`` of the same
        place in `auths`, when given; the tap's records of one upstream chunk): framed at
        once (`encode_frames`) and, when a sender process reads the spool and they fit in
        the current segment, written and counted at once; otherwise as `append_many`."""
        if self._closed:
            raise SpoolClosed(f"the spool {self.directory} is closed")
        if not values:
            return
        if self._elsewhere and self._fd is not None:
            now = time.time()
            data = encode_frames(source, key, values, now, auths)
            if self._segment_size + len(data) <= self.segment_bytes:
                self._write_counted(data, key, len(values), now)
                self._notify()
                return
        signed = auths if auths is not None else [None] * len(values)
        if len(signed) != len(values):
            raise ValueError(f"{len(values)} values and {len(signed)} auths")
        self.append_many([(source, key, values[n], signed[n]) for n in range(len(values))])

    def _notify(self) -> None:
        """Tell the listeners that records were appended."""
        for listener in self._listeners:
            listener()

    def _write_counted(self, data: bytes, key: str, records: int, appended_at: float) -> None:
        """`_write` of `data`, `records` frames appended at `appended_at`, then their counts
        (`_counted`): a sender process reads them, so nothing is cached."""
        position = self._end
        self._write(data, key)
        self._counted(position, position + len(data), records, appended_at)

    def _write(self, data: bytes, key: str) -> None:
        """`data` written whole to the current segment, or nothing of it (`SpoolError`)."""
        fd = self._fd
        assert fd is not None
        size = len(data)
        try:
            written = os.write(fd, data)
            while written < size:  # a regular file writes whole, but for a full disk
                written += os.write(fd, data[written:])
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._segment_size)
            raise SpoolError(
                f"spool {self.directory}: a record of request {key!r} could not be written ({exc})"
            ) from exc

    def _appended(
        self,
        position: int,
        end: int,
        appended_at: float,
        fields: tuple[Source, str, bytes, bytes | None],
    ) -> None:
        """The counts, checkpoints and memory cache after the record of `fields` (source,
        key, value, auth) was written from `position` to `end`: its `SpoolRecord` is made
        only to be kept in memory for `take`."""
        self._counted(position, end, 1, appended_at)
        size = end - position
        if not self._caching and not self._cache and not self._elsewhere:
            self._caching = self._read == position
        if self._caching:
            source, key, value, auth = fields
            self._cache.append(SpoolRecord(position, end, source, key, value, auth, appended_at))
            self._cache_bytes += size
            if self._cache_bytes > self.memory_bytes:
                self._caching = False

    def _counted(self, position: int, end: int, records: int, appended_at: float) -> None:
        """The counts after `records` records, all appended at `appended_at`, were written
        from `position` to `end`; one age checkpoint, at the first (the others' time is
        the same)."""
        self._end = end
        self._segment_size += end - position
        self._unsent_records += records
        self.appended += records
        self._checkpoint(position, appended_at)

    def _checkpoint(self, position: int, appended_at: float) -> None:
        checkpoints = self._checkpoints
        if checkpoints and appended_at - checkpoints[-1][1] < CHECKPOINT_S:
            return
        checkpoints.append((position, appended_at))
        if len(checkpoints) > MAX_CHECKPOINTS:
            self._checkpoints = deque(list(checkpoints)[::2])

    def _roll(self) -> None:
        """Begin a new segment at the end (the current one fsynced first: only the last
        segment can ever have a torn tail)."""
        if self._fd is not None:
            os.fsync(self._fd)
            self._synced = self._end
            self._retired.append(self._fd)
            self._fd = None
        base = self._end
        path = self.directory / segment_name(base)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
        self._bases.append(base)
        self._segment_size = 0
        self._dir_dirty = True

    async def wait_for_room(self) -> None:
        """Wait while the spool is `at_limit` (the sender makes room as Kafka
        acknowledges); at once otherwise, or when the spool is closed."""
        while self.at_limit and not self._closed:
            self._room.clear()
            await self._room.wait()

    # ------------------------------------------------------------------ reading

    def take(self, max_records: int, max_bytes: int = READ_BYTES) -> list[SpoolRecord]:
        """The next records after the read position, in order (at most `max_records`, and
        about `max_bytes`, at least one); [] when all were taken."""
        if self._elsewhere:
            raise SpoolError(f"spool {self.directory}: a sender process reads it (not `take`)")
        out: list[SpoolRecord] = []
        cache = self._cache
        taken = 0
        while self._read < self._end and len(out) < max_records and taken < max_bytes:
            if cache and cache[0].position == self._read:
                record = cache.popleft()
                self._cache_bytes -= record.size
            elif cache and cache[0].position < self._read:
                gone = cache.popleft()  # before a read position moved on by disk reads
                self._cache_bytes -= gone.size
                continue
            else:
                stop = cache[0].position if cache else self._end
                records = self._segments.read(self._read, stop, max_records - len(out))
                out.extend(records)
                taken += sum(r.size for r in records)
                self._read = records[-1].end
                continue
            out.append(record)
            taken += record.size
            self._read = record.end
        return out

    # ------------------------------------------------------------------ the cursor

    def read_elsewhere(self) -> None:
        """A sender process reads this spool (a `SpoolReader` on its directory): no record
        is kept in memory for `take` any more, and the cursor moves by `settled`."""
        self._elsewhere = True
        self._caching = False
        self._cache.clear()
        self._cache_bytes = 0

    def settled(self, cursor: int, sent: int, rejected: int) -> None:
        """The sender process reports: Kafka acknowledged `sent` more records and `rejected`
        more were refused for good (kept aside), every record before `cursor` being one of
        those.  The cursor file follows at the next sync."""
        if not self._elsewhere:
            raise SpoolError(f"spool {self.directory}: its own sender moves the cursor")
        if not self._cursor <= cursor <= self._end:
            raise ValueError(
                f"settled up to {cursor}: not between the cursor {self._cursor} and the end "
                f"{self._end}"
            )
        self._cursor = cursor
        self._unsent_records -= sent + rejected
        self.sent += sent
        self.rejected += rejected
        self._moved()

    def _moved(self) -> None:
        checkpoints = self._checkpoints
        while len(checkpoints) > 1 and checkpoints[1][0] <= self._cursor:
            checkpoints.popleft()
        if self._cursor >= self._end:
            checkpoints.clear()
        if not self.at_limit:
            self._room.set()
        super()._moved()

    # ------------------------------------------------------------------ syncing

    async def start(self) -> Spool:
        """Start the group commit (an fsync every `sync_interval_s`)."""
        if self._sync_task is None and not self._closed:
            self._sync_task = asyncio.create_task(self._syncer(), name="streamtally-spool-sync")
        return self

    async def _syncer(self) -> None:
        loop = asyncio.get_running_loop()
        next_cursor = loop.time()
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync(cursor=loop.time() >= next_cursor)
            except OSError as exc:
                log.error("spool %s: fsync failed: %r (retried)", self.directory, exc)
                continue
            if loop.time() >= next_cursor:
                next_cursor = loop.time() + self.cursor_interval_s

    async def sync(self, *, cursor: bool = True) -> None:
        """Fsync what was appended (and, with `cursor`, write the cursor file when it
        moved and delete the segments wholly before it)."""
        async with self._sync_lock:
            fd, target = self._fd, self._end
            if fd is not None and target > self._synced:
                await asyncio.to_thread(os.fsync, fd)
                self._synced = max(self._synced, target)
            if self._dir_dirty:
                self._dir_dirty = False
                await asyncio.to_thread(_fsync_dir, self.directory)
            retired, self._retired = self._retired, []
            for old in retired:
                os.close(old)
            if cursor and self._cursor != self._durable_cursor:
                position = self._cursor
                await asyncio.to_thread(self._write_cursor, position)
                self._durable_cursor = position
                self._delete_sent()

    def _write_cursor(self, position: int) -> None:
        final = self.directory / CURSOR_FILE
        temporary = self.directory / f"{CURSOR_FILE}.{os.getpid()}.tmp"
        with temporary.open("w", encoding="utf-8") as file:
            json.dump({"position": position}, file)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(final)
        _fsync_dir(self.directory)

    def _delete_sent(self) -> None:
        """Delete the segments wholly before the cursor written (never the current one)."""
        bases = self._bases
        while len(bases) > 1 and bases[1] <= self._durable_cursor:
            base = bases.pop(0)
            self._segments.forget(base)
            (self.directory / segment_name(base)).unlink()

    # ------------------------------------------------------------------ closing

    async def close(self) -> None:
        """Stop the group commit, fsync, write the cursor, unlock.  What is unsent stays
        and is sent after the next open."""
        if self._closed:
            return
        task, self._sync_task = self._sync_task, None
        if task is not None:
            async with self._sync_lock:  # never cancelled inside an fsync of its thread
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            await self.sync()
        finally:
            self._closed = True
            self._room.set()
            self._advanced.set()
            self._release()

    def _release(self) -> None:
        for fd in [self._fd, self._rejected_fd, *self._retired]:
            if fd is not None:
                os.close(fd)
        self._fd = self._rejected_fd = None
        self._retired = []
        self._segments.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing it releases the flock
            self._lock_fd = None
