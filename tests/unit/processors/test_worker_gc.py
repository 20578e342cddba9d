"""The worker's garbage-collector settings (`streamtally.cli.worker.tune_gc`)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from streamtally.cli.worker import GC_YOUNG_THRESHOLD, tune_gc


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
