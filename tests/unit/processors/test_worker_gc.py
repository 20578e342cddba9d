"""The garbage-collector settings of the worker, the audit and the tap's sender
(`streamtally._gc.tune_gc`)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from streamtally._gc import GC_YOUNG_THRESHOLD, tune_gc
from streamtally.producers import sender_process


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_tune_gc_freezes_start_up_objects_and_raises_only_the_young_threshold() -> None:
    gc.unfreeze()
    _young, middle, old = gc.get_threshold()
    tune_gc()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, middle, old)
    assert gc.get_freeze_count() > 1000  # the modules, classes and app built at start


@pytest.mark.usefixtures("restored_gc")
def test_cyclic_garbage_is_still_collected_after_tuning() -> None:
    tune_gc()

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    assert gone() is not None  # a cycle: reference counting alone keeps it
    kept: list[list[None]] = [
        [] for _ in range(2 * GC_YOUNG_THRESHOLD)
    ]  # new objects alone trigger a pass
    assert gone() is None
    assert len(kept) == 2 * GC_YOUNG_THRESHOLD


@pytest.mark.usefixtures("restored_gc")
def test_the_tap_sender_process_runs_with_the_tuned_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It holds up to `max_in_flight` records and their futures at once: with the default
    thresholds the collector was a quarter of its CPU under the proxy benchmark."""
    seen: list[int] = []

    async def child() -> int:
        seen.append(gc.get_threshold()[0])
        return 0

    monkeypatch.setattr(sender_process, "_child", child)
    gc.set_threshold(700, 10, 10)
    with pytest.raises(SystemExit) as stopped:
        sender_process.main()
    assert stopped.value.code == 0
    assert seen == [GC_YOUNG_THRESHOLD]
