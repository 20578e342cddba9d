"""An outage never becomes a timeout: quiet time runs on the input's own clock.

Before, a request's quiet time was the worker's wall clock since it last saw
a record of the request, so a Redis or Kafka outage longer than the request
timeout closed every open request as `error` (timed out) once the stack was
back, and their usage went unbilled.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from streamtally.billing.pricing import PriceTable
from streamtally.core.models import FinishReason, Source
from streamtally.processors.clock import SKEW_S, InputClock, input_time
from streamtally.processors.requests import Outputs, Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key

TOPIC = Topics.in_namespace().raw_sse.name
TP = (TOPIC, 0)
TIMEOUT = 30.0
T0 = 1_790_000_000.0

STREAM = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
)


class Wall:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- the clock


def test_a_records_time_is_its_receive_time_never_past_its_append_time() -> None:
    assert input_time(T0, T0 + 30) == T0  # sent late (Kafka was down): its own time
    assert input_time(T0 + 3_600, T0) == T0 + SKEW_S  # dated ahead: the broker's time
    assert input_time(T0, None) == T0


def test_records_move_their_partition_clock_and_no_other() -> None:
    wall = Wall()
    clock = InputClock(wall)
    assert clock.saw(TP, 0, T0) == T0
    assert clock.saw(TP, 1, T0 + 5) == T0 + 5
    assert clock.saw(TP, 2, T0 + 2) == T0 + 5  # a clock never runs back
    assert clock.now((TOPIC, 1)) is None
    clock.saw((TOPIC, 1), 0, T0 + 50)
    assert clock.now(TP) == T0 + 5


def test_wall_time_counts_only_while_healthy() -> None:
    wall = Wall()
    healthy = {"ok": True}
    clock = InputClock(wall, lambda: healthy["ok"])
    clock.saw(TP, 0, T0)
    wall.now += 10
    clock.tick()
    assert clock.now(TP) == T0 + 10
    healthy["ok"] = False  # Redis or Kafka stopped answering
    wall.now += 1_000
    clock.tick()
    assert clock.now(TP) == T0 + 10
    healthy["ok"] = True
    wall.now += 3
    clock.tick()
    assert clock.now(TP) == T0 + 13


def test_a_partition_behind_or_unreachable_is_frozen_until_its_records_come() -> None:
    wall = Wall()
    clock = InputClock(wall)
    clock.saw(TP, 4, T0)
    highwater = {"offset": 5}

    def live(tp: Hashable, next_offset: int) -> bool:
        return next_offset >= highwater["offset"]

    wall.now += 2
    clock.tick(live)
    assert clock.now(TP) == T0 + 2  # caught up: wall time counts
    highwater["offset"] = 900  # a backlog arrives (or the broker stops answering)
    wall.now += 600
    clock.tick(live)
    assert clock.now(TP) == T0 + 2  # frozen: judged by its records, not by the wall
    assert clock.saw(TP, 5, T0 + 40) == T0 + 40  # the backlog's own times move it
    highwater["offset"] = 6
    wall.now += 1
    clock.tick(live)
    wall.now += 1
    clock.tick(live)
    assert clock.now(TP) == T0 + 41  # caught up again: counts from the freeze's end


# --------------------------------------------------------------------------- the processor


def _records(request_id: str) -> list[bytes]:
    _, records = raw_records(Source.OPENAI, STREAM, tenant="acme", request_id=request_id)
    return records


def _feed(
    processor: RequestProcessor, request_id: str, value: bytes, offset: int, time: float
) -> Outputs:
    return processor.handle_sse(encode_key(request_id), value, Position(TOPIC, 0, offset, time))


@pytest.fixture
def setup() -> tuple[RequestProcessor, Wall, dict[str, bool]]:
    wall = Wall()
    healthy = {"ok": True}
    processor = RequestProcessor(PriceTable.default(), timeout=TIMEOUT, clock=wall)
    processor.input_clock.healthy = lambda: healthy["ok"]
    return processor, wall, healthy


def test_an_outage_longer_than_the_timeout_closes_nothing(
    setup: tuple[RequestProcessor, Wall, dict[str, bool]],
) -> None:
    processor, wall, healthy = setup
    a = _records("a")
    _feed(processor, "a", a[0], 0, T0)
    healthy["ok"] = False  # the stack goes down for 3 request timeouts
    for _ in range(90):
        wall.now += 1
        assert not processor.expire().completed
    healthy["ok"] = True  # back: the rest of the request was waiting in Kafka
    wall.now += 1
    assert not processor.expire().completed
    _feed(processor, "a", a[1], 1, T0 + 2)
    out = _feed(processor, "a", a[2], 2, T0 + 3)
    (done,) = out.completed
    assert done.tokens.finish_reason is FinishReason.STOP
    assert done.billing.input_tokens == 3
    assert processor.counters.requests_timed_out == 0


def test_a_backlog_is_judged_by_its_own_times(
    setup: tuple[RequestProcessor, Wall, dict[str, bool]],
) -> None:
    """Records read long after they arrived: only their times say who went quiet."""
    processor, wall, _ = setup
    processor.live = lambda tp, next_offset: next_offset >= 5  # offsets 0-4 are a backlog
    a, b = _records("a"), _records("b")
    _feed(processor, "a", a[0], 0, T0)
    _feed(processor, "b", b[0], 1, T0 + 1)
    wall.now += 500  # the worker reads the backlog late
    assert not processor.expire().completed
    _feed(processor, "b", b[1], 2, T0 + 2)
    _feed(processor, "b", b[2], 3, T0 + TIMEOUT + 5)  # b ends; the input clock passes a
    out = processor.expire()
    assert [c.tokens.request_id for c in out.completed] == ["a"]  # quiet by the input's time
    assert processor.counters.requests_timed_out == 1


def test_a_dead_producer_still_times_out_once_the_worker_is_caught_up(
    setup: tuple[RequestProcessor, Wall, dict[str, bool]],
) -> None:
    processor, wall, _ = setup
    _feed(processor, "a", _records("a")[0], 0, T0)
    wall.now += TIMEOUT / 2
    assert not processor.expire().completed
    wall.now += TIMEOUT / 2 + 1
    (done,) = processor.expire().completed
    assert done.tokens.finish_reason is FinishReason.ERROR
    assert done.tokens.usage.output_tokens == 0
