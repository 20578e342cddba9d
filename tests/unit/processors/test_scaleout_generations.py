"""The scale-out run's reading of the workers' logs: which generation held which partitions,
and which generation a SIGKILL cut short (its victim died before it logged its share)."""

from __future__ import annotations

from tests.integration.scaleout import GroupEvent, generations

P = [("t", 0), ("t", 1), ("t", 2), ("t", 3)]


def _join(at: float, generation: int) -> GroupEvent:
    return GroupEvent(at, "join", generation=generation)


def _assign(at: float, *parts: tuple[str, int]) -> GroupEvent:
    return GroupEvent(at, "assign", partitions=parts)


def test_a_generation_the_kill_cut_short_is_named_and_others_are_not() -> None:
    histories = {
        # w3 alone first, then with w1 (whose lines of generation 2 died with it), then with w4
        "w3": [
            _join(10.0, 1), _assign(10.1, *P),
            GroupEvent(20.0, "revoke"), _join(20.5, 2), _assign(20.6, P[0], P[2]),
            GroupEvent(31.0, "revoke"), _join(31.5, 3), _assign(31.6, P[0], P[1]),
        ],
        "w1": [],
        "w4": [_join(31.5, 3), _assign(31.6, P[2], P[3])],
    }  # fmt: skip
    gens = generations(histories, {"w1": 20.7})
    assert [gens[n]["cut_short_by"] for n in (1, 2, 3)] == [None, "w1", None]
    assert gens[2]["partitions"] == [P[0], P[2]]
    assert gens[3]["partitions"] == P
    assert not any(g["partitions_twice"] for g in gens.values())
    # without the kill, nothing explains generation 2's missing half
    assert generations(histories)[2]["cut_short_by"] is None


def test_a_partition_held_twice_in_one_generation_is_seen() -> None:
    histories = {
        "a": [_join(1.0, 1), _assign(1.1, P[0], P[1])],
        "b": [_join(1.0, 1), _assign(1.1, P[1], P[2], P[3])],
    }
    gens = generations(histories, {})
    assert gens[1]["partitions_twice"]
    assert gens[1]["members"] == ["a", "b"]
