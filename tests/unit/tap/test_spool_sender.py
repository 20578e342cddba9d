"""The spool's sender (producers/spool_sender.py) with a fake producer: order, the cursor
over acknowledged records only, outages retried, refusals kept, restarts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError

from streamtally.core.models import Source
from streamtally.errors import StackError
from streamtally.producers.spool import Spool, decode_frames
from streamtally.producers.spool_sender import SpoolSender, is_refusal


class Producer:
    """A fake Kafka: `sent` is every send in order; futures are settled by the test
    (`ack`), or at once with `auto`; `failing` makes a send fail (or raise) as told."""

    def __init__(self, *, auto: bool = False) -> None:
        self.auto = auto
        self.sent: list[tuple[Source, str, bytes, bytes | None]] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.acked: list[str] = []
        self.failing: Callable[[str], BaseException | None] = lambda key: None
        self.raising: Callable[[str], BaseException | None] = lambda key: None

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(
        self, source: Source, request_id: str, value: bytes, *, auth: bytes | None = None
    ) -> asyncio.Future[Any]:
        if (raised := self.raising(request_id)) is not None:
            raise raised
        self.sent.append((source, request_id, value, auth))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.add_done_callback(
            lambda f: self.acked.append(request_id) if not f.exception() else None
        )
        self.futures.append(future)
        if (failure := self.failing(request_id)) is not None:
            future.set_exception(failure)
        elif self.auto:
            future.set_result(None)
        return future

    def ack(self, *indexes: int) -> None:
        for index in indexes:
            self.futures[index].set_result(None)

    def keys(self) -> list[str]:
        return [key for _, key, _, _ in self.sent]


async def settle(times: int = 10) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


async def until(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """Wait until `check()`, then let the callbacks of what happened meanwhile run."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)
    await settle()


def append(spool: Spool, *keys: str) -> list[int]:
    return [spool.append(Source.OPENAI, key, key.encode(), None) for key in keys]


async def test_records_go_in_spool_order_and_the_cursor_moves_over_acknowledged_ones(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s")
    producer = Producer()
    sender = await SpoolSender(spool, producer, max_in_flight=3).start()
    positions = append(spool, "a", "b", "c", "d", "e")
    await settle()
    assert producer.keys() == ["a", "b", "c"], "three in flight at most"
    producer.ack(1, 2)  # b and c, not a
    await settle()
    assert spool.cursor == 0, "never past a record Kafka does not have"
    assert producer.keys() == ["a", "b", "c"]
    producer.ack(0)
    await settle()
    assert spool.cursor == positions[3], "the contiguous prefix a, b, c"
    assert producer.keys() == ["a", "b", "c", "d", "e"]
    producer.ack(3, 4)
    await settle()
    assert spool.cursor == spool.end
    assert spool.sent == 5
    assert spool.unsent_bytes == 0
    await sender.stop()
    await spool.close()


async def test_an_outage_is_retried_from_the_first_unacknowledged_record_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    producer = Producer(auto=True)
    down = True
    producer.failing = lambda key: KafkaConnectionError("away") if down else None
    producer.raising = lambda key: KafkaTimeoutError() if down and key == "c" else None
    sender = await SpoolSender(spool, producer, retry_first_s=0.01, retry_max_s=0.02).start()
    with caplog.at_level(logging.WARNING, "streamtally.producers.spool_sender"):
        append(spool, "a", "b", "c")
        await asyncio.sleep(0.2)
        assert spool.cursor == 0
        assert len(producer.sent) > 5, "tried again and again"
        assert sender.in_outage
        down = False
        await until(lambda: spool.unsent_records == 0)
    assert producer.acked == ["a", "b", "c"], "each once, in order, once Kafka is back"
    assert sender.outages == 1
    assert caplog.text.count("Kafka did not take a record") == 1, "once per outage"
    assert caplog.text.count("Kafka takes records again") == 1
    assert spool.rejected == 0
    await sender.stop()
    await spool.close()


async def test_a_failure_in_the_middle_resends_from_it_and_later_acks_are_duplicates(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "s")
    producer = Producer()
    sender = await SpoolSender(spool, producer, retry_first_s=0.01).start()
    positions = append(spool, "a", "b", "c")
    await settle()
    producer.ack(0, 2)  # a and c arrive
    producer.futures[1].set_exception(KafkaTimeoutError())  # b does not
    await until(lambda: len(producer.sent) == 5)
    assert spool.cursor == positions[1]
    assert producer.keys() == ["a", "b", "c", "b", "c"], "from b on, again"
    producer.ack(3, 4)
    await until(lambda: spool.unsent_records == 0)
    assert sender.resent == 2
    assert spool.sent == 3, "counted once each"
    await sender.stop()
    await spool.close()


async def test_a_record_kafka_refuses_is_kept_aside_and_the_rest_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    producer = Producer(auto=True)
    producer.failing = lambda key: MessageSizeTooLargeError() if key == "huge" else None
    sender = await SpoolSender(spool, producer).start()
    with caplog.at_level(logging.ERROR, "streamtally.producers.spool"):
        append(spool, "a", "huge", "b")
        await until(lambda: spool.unsent_records == 0)
    assert producer.acked == ["a", "b"]
    assert spool.rejected == 1
    assert spool.sent == 2
    assert "request 'huge'" in caplog.text
    kept = decode_frames((tmp_path / "s" / "rejected" / "records.seg").read_bytes(), 0)
    assert [r.key for r in kept.records] == ["huge"]
    await sender.stop()
    await spool.close()


async def test_a_restarted_sender_sends_from_the_cursor(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    producer = Producer()
    sender = await SpoolSender(spool, producer).start()
    append(spool, "a", "b", "c", "d")
    await settle()
    producer.ack(0, 2)  # a; c not contiguous
    await settle()
    await sender.stop()  # the process stops: b, c, d not all acknowledged
    await spool.close()
    again = Spool(tmp_path / "s")
    fresh = Producer(auto=True)
    sender = await SpoolSender(again, fresh).start()
    await until(lambda: again.unsent_records == 0)
    assert fresh.keys() == ["b", "c", "d"], "from the cursor: c again is a duplicate"
    assert [value for _, _, value, _ in fresh.sent] == [b"b", b"c", b"d"]
    await sender.stop()
    await again.close()


async def test_the_auth_header_travels_with_its_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", memory_bytes=0)  # read back from disk too
    producer = Producer(auto=True)
    sender = await SpoolSender(spool, producer).start()
    spool.append(Source.VLLM, "e", b"engine", b"signed")
    spool.append(Source.OPENAI, "s", b"sse", None)
    await until(lambda: spool.unsent_records == 0)
    assert producer.sent == [
        (Source.VLLM, "e", b"engine", b"signed"),
        (Source.OPENAI, "s", b"sse", None),
    ]
    await sender.stop()
    await spool.close()


def test_what_is_a_refusal_and_what_is_an_outage() -> None:
    assert is_refusal(MessageSizeTooLargeError())
    assert is_refusal(ValueError("cannot encode"))
    assert not is_refusal(KafkaConnectionError())
    assert not is_refusal(KafkaTimeoutError())
    assert not is_refusal(ConnectionResetError())
    assert not is_refusal(TimeoutError())


async def test_a_kafka_client_wedged_after_an_outage_is_started_afresh(tmp_path: Path) -> None:
    """Sends that keep failing through one client: after RESTART_EVERY failed tries the
    sender is stopped and started again (a failed start is tried again later)."""

    class Wedged(Producer):
        def __init__(self) -> None:
            super().__init__(auto=True)
            self.wedged = True
            self.starts = self.stops = 0
            self.failing = lambda key: KafkaTimeoutError() if self.wedged else None

        async def start(self) -> None:
            self.starts += 1
            if self.starts == 2:
                raise StackError("cannot reach Kafka")  # the first restart finds it away
            self.wedged = False  # a new client works

        async def stop(self) -> None:
            self.stops += 1

    spool = Spool(tmp_path / "s")
    producer = Wedged()
    producer.wedged = True
    sender = SpoolSender(spool, producer, retry_first_s=0.001, retry_max_s=0.002)
    await sender.start()
    producer.wedged = True  # started, and wedged from then on
    append(spool, "a", "b")
    await until(lambda: spool.unsent_records == 0)
    assert producer.acked == ["a", "b"]
    assert producer.starts == 3, "the first start, a failed restart, a good one"
    assert producer.stops == 1
    assert sender.restarts == 1
    await sender.stop()
    await spool.close()
