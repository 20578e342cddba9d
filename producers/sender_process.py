"""The spool's sender in a process of its own: Kafka out of the process that serves.

    process = SenderProcess(spool, SenderConfig(servers, namespace, linger_ms=5, key=None))
    await process.start()      # spawns ``python -m streamtally.producers.sender_child``
    ...
    await process.drain(30)    # Kafka has everything appended (or the timeout passed)
    await process.stop()

The writer (the proxy, or any `Tap` made with ``sender_process=True``) only
appends to its `Spool`; a child process runs the very `SpoolSender` of the
in-process tap over a `SpoolReader` of the same directory, with the same
`KafkaSender` (the idempotent producer; the same order, outages retried for
ever, refusals kept in ``rejected/``).  So the Kafka client's work (batching,
compression, acknowledgements, its event-loop callbacks) no longer shares the
event loop, nor the interpreter, with the client streams.

Who does what on the directory:

- the writer holds the lock, recovers the spool when it opens it (a torn
  tail cut), appends, rolls segments, fsyncs (group commit), writes the
  cursor file and deletes the segments wholly before it;
- the sender process reads the segment files, never past the end the writer
  published, writes only ``rejected/records.seg`` (a record Kafka refused
  for good, fsynced before the cursor moves past it), and reports how far
  Kafka has acknowledged.

The two talk through two pipes (the child's stdin and stdout):

- writer to sender: first one JSON line, the configuration (the Kafka
  connection with its credentials and the producer key, so that they are in
  no command line; where to start: the writer's cursor, end and record
  counts), then ``E <end> <written>`` lines: the records appended up to
  `end` (whole records, already in the operating system), at most one line
  per turn of the writer's event loop, written without blocking (a full pipe
  is tried again 10 ms later; a later line supersedes it);
- sender to writer: ``R`` once its Kafka client started (``X <message>``
  and an exit when it could not), then ``A <cursor> <sent> <rejected>``
  every `REPORT_S` at most while the cursor moves: Kafka has every record
  before `cursor`, and `sent` more records were acknowledged and `rejected`
  more refused since the last report.  The writer applies it
  (`Spool.settled`): backpressure, ``tap.stats``, the proxy's metrics and
  its last line all read the writer's spool, as with a sender in process.

Crash safety.  The writer SIGKILLed: the child sees the end of its stdin
(or, should a forked process keep the pipe open, its parent pid change,
looked at every second), stops its producer (at most `STOP_S`) and exits;
no sender outlives its writer.  What it sent after the last cursor the
writer wrote is sent again by the next writer's sender: duplicates, which
the worker drops.  The sender SIGKILLed: the writer sees the end of its
stdout, logs an error, and starts a new one (0.1 s, doubling up to 5 s
while they keep failing) from the cursor the last one reported: nothing is
lost, and what was in flight is sent again (duplicates).  Meanwhile the
writer appends as before (the spool fills, backpressure as in an outage).

`stop` closes the child's stdin: it stops (what is in flight and not
acknowledged stays in the spool, sent at the next start) and exits; one
still there after the timeout is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from aiokafka.errors import KafkaError

from streamtally._gc import tune_gc
from streamtally.connection import KafkaConnection
from streamtally.errors import StackError, StreamtallyError
from streamtally.producers.spool import Spool, SpoolReader
from streamtally.producers.spool_sender import KafkaSender, SpoolSender
from streamtally.wire.tenant_keys import ProducerKey

__all__ = ["REPORT_S", "STOP_S", "SenderConfig", "SenderProcess", "main"]

log = logging.getLogger("streamtally.producers.sender_process")

#: Seconds between two reports of the sender process at most (while the cursor moves).
REPORT_S: Final = 0.005
#: Seconds the sender process gives its producer to stop when told to, or orphaned.
STOP_S: Final = 5.0
#: Seconds between two looks of the sender process at whether its parent is alive.
PARENT_CHECK_S: Final = 1.0
#: First and longest wait before a sender process that died is started again.
RESTART_FIRST_S: Final = 0.1
RESTART_MAX_S: Final = 5.0
#: Seconds before a publication that found the pipe full is tried again.
REPUBLISH_S: Final = 0.01
#: The module the sender process runs (``python -m``).
MODULE: Final = "streamtally.producers.sender_child"


@dataclass(frozen=True, slots=True)
class SenderConfig:
    """How the sender process reaches Kafka (as `KafkaSender` takes it)."""

    servers: KafkaConnection | str
    namespace: str
    linger_ms: int
    key: ProducerKey | None = None
    max_in_flight: int | None = None


def _config_doc(config: SenderConfig, spool: Spool) -> dict[str, Any]:
    servers = config.servers
    connection: dict[str, Any] = {"servers": servers}
    if isinstance(servers, KafkaConnection):
        connection = {}
        for item in dataclasses.fields(servers):
            value = getattr(servers, item.name)
            if value is not None:
                connection[item.name] = str(value) if isinstance(value, Path) else value
    return {
        "directory": str(spool.directory),
        "cursor": spool.cursor,
        "end": spool.end,
        "written": spool.written,
        "before": spool.written - spool.unsent_records,
        "kafka": connection,
        "namespace": config.namespace,
        "linger_ms": config.linger_ms,
        "key": None
        if config.key is None
        else {"key_id": config.key.key_id, "secret": config.key.secret.hex()},
        "max_in_flight": config.max_in_flight,
        "parent": os.getpid(),
    }


class SenderProcess:
    """Starts and supervises the sender process of a `Spool` (see the module docstring);
    the same `start` / `drain` / `stop` as an in-process `SpoolSender`."""

    def __init__(
        self,
        spool: Spool,
        config: SenderConfig,
        *,
        python: str = sys.executable,
        module: str = MODULE,
        restart_first_s: float = RESTART_FIRST_S,
        restart_max_s: float = RESTART_MAX_S,
    ) -> None:
        self.spool = spool
        self.config = config
        #: The child is ``python -m module`` (tests run one whose Kafka is faked).
        self.python = python
        self.module = module
        self.restart_first_s = restart_first_s
        self.restart_max_s = restart_max_s
        #: Sender processes started again after one died.
        self.restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._fd: int | None = None  # the write end of the child's stdin
        #: The (end, written) the child was last told.
        self._published = (-1, -1)
        self._publishing = False
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        spool.read_elsewhere()
        spool.add_listener(self._appended)

    @property
    def pid(self) -> int | None:
        """The sender process's pid (None while there is none)."""
        proc = self._proc
        return None if proc is None or proc.returncode is not None else proc.pid

    async def start(self) -> SenderProcess:
        """Start the sender process and wait until its Kafka client started (`StackError`
        with its message when it could not), then supervise it."""
        await self._spawn()
        self._supervisor = asyncio.create_task(self._supervise(), name="streamtally-sender-process")
        return self

    async def drain(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds until Kafka has every record of the spool."""
        return await self.spool.wait_sent(timeout)

    async def stop(self, timeout: float = 30.0) -> None:
        """Tell the sender process to stop (its stdin closed) and wait for it (at most
        `timeout` seconds, then it is killed); what is unsent stays in the spool."""
        self._stopping = True
        self._close_pipe()
        await self._end_child(timeout)
        task, self._supervisor = self._supervisor, None
        if task is not None:
            # It reads the last reports, then returns at the end of the child's stdout.
            done, _ = await asyncio.wait([task], timeout=1.0)
            if not done:  # waiting to start a new one
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._close_pipe()
        await self._end_child(timeout)  # one it was starting when cancelled

    async def _end_child(self, timeout: float) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            log.warning("the spool's sender process did not stop within %gs: killed", timeout)
            proc.kill()
            await proc.wait()

    # ------------------------------------------------------------------ the child

    async def _spawn(self) -> None:
        """Start a sender process from the spool's cursor now and wait for its ``R``."""
        read_fd, write_fd = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-m",
                self.module,
                stdin=read_fd,
                stdout=asyncio.subprocess.PIPE,
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        doc = _config_doc(self.config, self.spool)
        line = (json.dumps(doc) + "\n").encode("utf-8")
        try:
            _write_all(write_fd, line)  # a fresh pipe: blocking, small
        except OSError as exc:
            os.close(write_fd)
            await proc.wait()
            raise StackError(
                f"the spool's sender process exited before it was configured ({exc})"
            ) from exc
        os.set_blocking(write_fd, False)
        self._proc, self._fd = proc, write_fd
        self._published = (self.spool.end, self.spool.written)
        assert proc.stdout is not None
        ready = await proc.stdout.readline()
        if ready.strip() == b"R":
            self._publish()  # what was appended while it started
            return
        self._close_pipe()
        code = await proc.wait()
        message = ready.decode("utf-8", "replace").strip()
        message = message[2:] if message.startswith("X ") else f"it exited with code {code}"
        raise StackError(f"the spool's sender process could not start: {message}")

    async def _supervise(self) -> None:
        """Apply the reports; start a new process when one dies (unless stopping)."""
        backoff = self.restart_first_s
        while True:
            proc = self._proc
            assert proc is not None
            assert proc.stdout is not None
            line = await proc.stdout.readline()
            if line:
                self._report(line)
                backoff = self.restart_first_s
                continue
            code = await proc.wait()
            self._close_pipe()
            if self._stopping:
                return
            log.error(
                "the spool's sender process %d exited (code %s): a new one sends from the "
                "cursor %d in %.1fs (nothing is lost; records in flight are sent again)",
                proc.pid,
                code,
                self.spool.cursor,
                backoff,
            )
            if not await self._restart(backoff):
                return

    async def _restart(self, backoff: float) -> bool:
        """Start a new sender process, waiting `backoff` first (doubled after each failed
        try); False when told to stop meanwhile."""
        while not self._stopping:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.restart_max_s)
            try:
                await self._spawn()
            except (StreamtallyError, OSError) as exc:
                log.error("%s (tried again in %.1fs)", exc, backoff)
                continue
            self.restarts += 1
            return True
        return False

    def _report(self, line: bytes) -> None:
        parts = line.split()
        if len(parts) == 4 and parts[0] == b"A":
            cursor, sent, rejected = (int(part) for part in parts[1:])
            self.spool.settled(cursor, sent, rejected)
        else:
            log.warning("the spool's sender process said %r (not a report)", line[:200])

    # ------------------------------------------------------------------ publishing

    def _appended(self) -> None:
        """A record was appended: publish the end once this turn of the loop is over."""
        if not self._publishing:
            self._publishing = True
            asyncio.get_running_loop().call_soon(self._publish)

    def _publish(self) -> None:
        self._publishing = False
        fd = self._fd
        if fd is None:
            return  # no sender now: the next one starts from the spool as it is then
        end, written = self.spool.end, self.spool.written
        if (end, written) == self._published:
            return
        try:
            os.write(fd, f"E {end} {written}\n".encode("ascii"))  # < PIPE_BUF: whole or not
        except BlockingIOError:
            self._publishing = True  # the pipe is full: the child is behind
            asyncio.get_running_loop().call_later(REPUBLISH_S, self._publish)
            return
        except OSError:
            return  # the child is gone: the supervisor starts a new one
        self._published = (end, written)

    def _close_pipe(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# ---------------------------------------------------------------------- the child's side


def _connection_of(doc: dict[str, Any]) -> KafkaConnection:
    fields = dict(doc)
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if fields.get(name) is not None:
            fields[name] = Path(fields[name])
    return KafkaConnection(**fields)


class _Reporter:
    """Writes ``A`` lines to the parent (stdout), at most one per `REPORT_S`."""

    def __init__(self, reader: SpoolReader) -> None:
        self.reader = reader
        self._sent = self._rejected = 0
        self._cursor = reader.cursor
        self._scheduled = False
        #: The parent stopped reading (its end of the pipe is closed).
        self.gone = asyncio.Event()

    def moved(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(REPORT_S, self.report)

    def report(self) -> None:
        self._scheduled = False
        reader = self.reader
        if reader.cursor == self._cursor:
            return
        line = f"A {reader.cursor} {reader.sent - self._sent} {reader.rejected - self._rejected}\n"
        self._say(line)
        self._cursor, self._sent, self._rejected = reader.cursor, reader.sent, reader.rejected

    def _say(self, line: str) -> None:
        try:
            _write_all(sys.stdout.fileno(), line.encode("ascii"))
        except OSError:
            self.gone.set()


async def _watch_parent(parent: int) -> None:
    """Return once the parent is gone (this process was handed to another parent)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)


async def _read_published(stdin: asyncio.StreamReader, reader: SpoolReader) -> None:
    """Apply the ``E`` lines until the end of stdin (the parent stops us, or died)."""
    while line := await stdin.readline():
        parts = line.split()
        if len(parts) == 3 and parts[0] == b"E":
            reader.publish(int(parts[1]), int(parts[2]))
        else:
            log.warning("the writer said %r (not a publication)", line[:200])


async def _child() -> int:
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the writer stops us
    terminated = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, terminated.set)
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    first = await stdin.readline()
    if not first:
        return 0  # the writer went before it said anything
    doc = json.loads(first)
    key = doc["key"]
    reader = SpoolReader(
        doc["directory"],
        cursor=doc["cursor"],
        end=doc["end"],
        written=doc["written"],
        before=doc["before"],
    )
    kafka = KafkaSender(
        _connection_of(doc["kafka"]),
        doc["namespace"],
        doc["linger_ms"],
        None if key is None else ProducerKey(key["key_id"], bytes.fromhex(key["secret"])),
    )
    max_in_flight = doc["max_in_flight"]
    sender = SpoolSender(
        reader, kafka, **({} if max_in_flight is None else {"max_in_flight": max_in_flight})
    )
    reporter = _Reporter(reader)
    reader.add_progress_listener(reporter.moved)
    try:
        await sender.start()
    except (StreamtallyError, KafkaError, OSError) as exc:
        reporter._say(f"X {' '.join(str(exc).split())}\n")
        reader.close()
        return 1
    reporter._say("R\n")
    tasks = [
        asyncio.create_task(_read_published(stdin, reader)),
        asyncio.create_task(_watch_parent(doc["parent"])),
        asyncio.create_task(reporter.gone.wait()),
        asyncio.create_task(terminated.wait()),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await sender.stop(STOP_S)
        reporter.report()
        reader.close()
    return 0


def main() -> None:
    """The sender process (``python -m streamtally.producers.sender_child``): its
    configuration and publications on stdin, its reports on stdout, its log on stderr."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s spool-sender[%(process)d] %(levelname)s %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    tune_gc()  # up to `max_in_flight` records and their futures live at once
    raise SystemExit(asyncio.run(_child()))
