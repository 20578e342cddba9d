"""A call's own id (`new_call_id`) and the id of a new call that reused a closed one."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from streamtally.core.identity import call_request_id, epoch_micros, new_call_id


def _parts(call_id: str) -> tuple[int, uuid.UUID]:
    assert call_id.startswith("call-")
    u = uuid.UUID(call_id.removeprefix("call-"))
    return int(call_id[5:17], 16), u


def test_a_call_id_is_a_uuidv7_of_the_clock() -> None:
    before = datetime.now(UTC)
    ms, u = _parts(new_call_id())
    after = datetime.now(UTC)
    assert (u.version, u.variant) == (7, uuid.RFC_4122)
    assert epoch_micros(before) // 1000 <= ms <= epoch_micros(after) // 1000
    assert len(new_call_id()) == len("call-") + 32


def test_call_ids_are_unique_and_ordered_as_text() -> None:
    ids = [new_call_id() for _ in range(20_000)]  # many share a millisecond
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert len({_parts(i)[0] for i in ids}) < len(ids)  # the test did cover one millisecond


def test_call_ids_stay_ordered_when_the_clock_steps_back() -> None:
    now_ms = epoch_micros(datetime.now(UTC)) // 1000
    late = new_call_id(now_ms + 5)
    earlier = [new_call_id(now_ms - 60_000) for _ in range(3)]  # the clock went back a minute
    assert [late, *earlier] == sorted([late, *earlier])
    assert len({late, *earlier}) == 4
    assert {_parts(i)[0] for i in earlier} == {now_ms + 5}  # kept the last id's time


def test_call_ids_from_threads_are_unique() -> None:
    made: list[list[str]] = [[] for _ in range(4)]

    def make(out: list[str]) -> None:
        out.extend(new_call_id() for _ in range(2_000))

    threads = [threading.Thread(target=make, args=(out,)) for out in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for out in made for i in out]
    assert len(set(every)) == len(every)
    for out in made:
        assert out == sorted(out)


def test_a_time_beyond_48_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="48 bits"):
        new_call_id(1 << 48)


def test_a_new_calls_request_id_is_the_reused_id_and_its_first_receive_time() -> None:
    at = datetime(2026, 3, 1, 12, 0, 0, 250_001, tzinfo=UTC)
    assert call_request_id("chatcmpl-7", at) == "chatcmpl-7~1772366400250001"
    assert epoch_micros(at) == 1_772_366_400_250_001
    # Exact to the microsecond, also in another zone (the same instant, the same id).
    other_zone = at.astimezone(datetime.now().astimezone().tzinfo)
    assert call_request_id("chatcmpl-7", other_zone) == call_request_id("chatcmpl-7", at)
    assert call_request_id("x", at + timedelta(microseconds=1)) != call_request_id("x", at)
