"""benchmarks/restart_pause.py: who held which partition when, from the workers' logs, and
the longest time a partition was read by nobody (the arithmetic, not a timing)."""

from __future__ import annotations

from datetime import UTC, datetime

from benchmarks.restart_pause import Held, longest_unread, read_holdings

T0 = datetime(2026, 11, 27, 17, 0, tzinfo=UTC).timestamp()


def _line(seconds: float, logger: str, message: str) -> str:
    at = datetime.fromtimestamp(T0 + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return f"[{at}] [4242] [INFO] {logger}: {message}"


def test_a_workers_log_says_what_it_held_and_when() -> None:
    log = "\n".join(
        [
            _line(0.0, "aiokafka.consumer.group_coordinator", "Revoking previously assigned "
                  "partitions set() for group g"),
            _line(1.0, "streamtally.processors.source", "raw partitions assigned: "
                  "[('ns.raw.engine', 0), ('ns.raw.sse', 1)]"),
            "a line of another shape",
            _line(5.0, "aiokafka.consumer.group_coordinator", "Revoking previously assigned "
                  "partitions frozenset({TopicPartition(topic='ns.raw.sse', partition=1)}) "
                  "for group g"),
            _line(6.5, "streamtally.processors.source", "raw partitions assigned: "
                  "[('ns.raw.sse', 1)]"),
        ]
    )  # fmt: skip
    held = read_holdings(log, until=T0 + 9.0)
    assert [(h.start - T0, h.end - T0, sorted(h.partitions)) for h in held] == [
        (1.0, 5.0, [("ns.raw.engine", 0), ("ns.raw.sse", 1)]),
        (6.5, 9.0, [("ns.raw.sse", 1)]),  # still held at its end
    ]


def test_the_pause_is_the_longest_time_a_partition_was_read_by_nobody() -> None:
    a, b = ("t", 0), ("t", 1)
    holdings = [
        Held(0.0, 10.0, frozenset({a, b})),  # the restarted worker, until the signal at 10
        Held(11.0, 12.0, frozenset({a, b})),  # another takes both over a second later
        Held(12.5, 30.0, frozenset({a})),  # the group rebalances again: b is left out
        Held(14.0, 30.0, frozenset({b})),
    ]
    gaps = longest_unread(holdings, [a, b, ("t", 2)], (10.0, 30.0))
    assert gaps == {a: 1.0, b: 2.0, ("t", 2): 20.0}  # ("t", 2): never held in the window
    # a partition held throughout by overlapping holdings was never paused
    assert longest_unread([Held(0, 20, frozenset({a})), Held(15, 40, frozenset({a}))], [a],
                          (10.0, 30.0)) == {a: 0.0}  # fmt: skip
