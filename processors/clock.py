"""When a request has gone quiet: the input's own clock, never the worker's wall clock alone.

A request is closed as timed out when its partition's clock has moved more
than the request timeout past the request's last record.  Each partition's
clock is an `InputClock` reading that moves two ways:

- with the input: a record's time moves its partition's clock up to it.  A
  record's time is the receive time its producer stamped on the event, which
  a producer keeps while Kafka is down and sends later, capped by the time the
  broker appended the record (`message.timestamp.type=LogAppendTime` on the
  raw topics, plus `SKEW_S`): a producer can date its events earlier, never
  later than the broker saw them, so no tenant can push another's clock;
- with the wall clock between records, but only while the worker is healthy
  (no sink write failing: Redis and Kafka answer) and the partition is
  *live*: its consumer is caught up and the broker answered a fetch of it
  recently.  A partition behind (a backlog after an outage) or unreachable
  is frozen: its clock waits for its records.

So an outage of Redis or Kafka stops every clock (nothing times out while the
worker cannot see or write its input), a backlog is judged by the times of
its own records, and an idle partition still times out a request whose
producer died, once the worker has seen all there is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

__all__ = ["SKEW_S", "InputClock", "input_time"]

#: How far a producer's clock may run ahead of the broker's.
SKEW_S = 1.0


def input_time(received_at: float, appended_at: float | None) -> float:
    """A record's time on the input clock: its receive time, never past its append time."""
    if appended_at is None:
        return received_at
    return min(received_at, appended_at + SKEW_S)


@dataclass(slots=True)
class _Partition:
    #: The partition's clock at the anchor, in seconds since the epoch.
    anchor: float
    #: The healthy seconds counted when the anchor was set.
    anchor_healthy: float
    #: The offset after the last record seen (what "caught up" is judged by).
    next_offset: int
    frozen: bool = False


#: Wall time is counted in steps of at least this (seconds).
_STEP_S = 0.001


def _always() -> bool:
    return True


class InputClock:
    """One clock per partition; see the module docstring.

    `clock` is a monotonic wall clock (seconds); `healthy` says whether wall
    time counts now (the worker wires it to its sinks' state).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        healthy: Callable[[], bool] = _always,
    ) -> None:
        self._clock = clock
        self.healthy = healthy
        self._last = clock()
        self._healthy_total = 0.0
        self._parts: dict[Hashable, _Partition] = {}

    def _advance(self) -> float:
        now = self._clock()
        elapsed = now - self._last
        # Counted in steps of a millisecond or more: records of a batch come microseconds
        # apart, and the step's time is kept (not lost) until it is counted.
        if elapsed >= _STEP_S:
            self._last = now
            if self.healthy():
                self._healthy_total += elapsed
        return self._healthy_total

    @staticmethod
    def _value(part: _Partition, healthy_total: float) -> float:
        if part.frozen:
            return part.anchor
        return part.anchor + (healthy_total - part.anchor_healthy)

    def saw(self, tp: Hashable, offset: int, record_time: float | None = None) -> float | None:
        """A record of `tp` at `offset`, with its time if it has one; returns the clock after it.

        A record without a time (one that could not be decoded) moves only
        what "caught up" is judged by.
        """
        healthy_total = self._advance()
        part = self._parts.get(tp)
        if part is None:
            if record_time is None:
                return None
            self._parts[tp] = _Partition(record_time, healthy_total, offset + 1)
            return record_time
        if offset >= part.next_offset:
            part.next_offset = offset + 1
        value = self._value(part, healthy_total)
        if record_time is not None and record_time > value:
            value = record_time
        part.anchor, part.anchor_healthy = value, healthy_total
        return value

    def now(self, tp: Hashable) -> float | None:
        """The clock of `tp` (None: no record of it seen yet)."""
        part = self._parts.get(tp)
        return None if part is None else self._value(part, self._healthy_total)

    def tick(self, live: Callable[[Hashable, int], bool] | None = None) -> None:
        """Count the wall time since the last call; freeze the partitions not live.

        `live(tp, next_offset)` says whether a partition is caught up and
        answering; None treats every partition as live (no consumer to ask).
        An interval is judged by what is true at its end: a partition found
        behind or unreachable is frozen as of the interval's start, and one
        found live again counts from now on.
        """
        before = self._healthy_total
        after = self._advance()
        for tp, part in self._parts.items():
            is_live = True if live is None else live(tp, part.next_offset)
            if part.frozen and is_live:
                part.anchor_healthy = after
                part.frozen = False
            elif not part.frozen and not is_live:
                part.anchor += max(0.0, before - part.anchor_healthy)
                part.anchor_healthy = before
                part.frozen = True

    def forget(self, tps: Iterable[Hashable]) -> None:
        """These partitions went to another worker."""
        for tp in tps:
            self._parts.pop(tp, None)
