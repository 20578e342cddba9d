"""`streamtally.ops.migrate.plan`: which version-1 entry moves where, in which order.

The plan is pure (keys, fields, billing map in; steps out).  What matters:
an id billed to one tenant moves to that tenant's key, the others are
unplaced or dropped; moved refs (an interrupted run) are never read as ids;
and no step ever lands on a name another version-1 entry still holds (the
longest-first order), checked by replaying the steps on a dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from streamtally.cli import build_parser
from streamtally.cli.migrate import _summary_json, _summary_text
from streamtally.core.identity import RequestRef
from streamtally.ops.migrate import (
    UNPLACED_KEY,
    Action,
    Billing,
    Counts,
    Outcome,
    Plan,
    Report,
    Step,
    plan,
)
from streamtally.ops.migrate.shards import ShardMoves
from streamtally.store.layout_v2 import TOKENS_PREFIX, closed_field, parse_tokens_key, tokens_key


def steps_by_id(p: Plan) -> dict[str, Step]:
    return {s.request_id: s for s in p.steps}


def replay(
    tokens: dict[str, str], closed: dict[str, str], p: Plan
) -> tuple[dict[str, str], dict[str, str], dict[str, str], dict[str, str]]:
    """The steps run on dicts as the script runs them on Redis, refusing to overwrite.

    `tokens` is keyed by full key (`TOKENS_PREFIX` + id or ref), `closed` by field.
    Returns (tokens, closed, unplaced, unplaced closed).
    """
    tokens, closed = dict(tokens), dict(closed)
    unplaced: dict[str, str] = {}
    unplaced_closed: dict[str, str] = {}
    for step in p.steps:
        old = TOKENS_PREFIX + step.request_id
        ref = step.ref
        marker = closed.pop(step.request_id, None)
        assert (marker is not None) == step.closed, step
        if step.action is Action.MOVE:
            assert ref is not None
            assert tokens_key(ref) not in tokens, f"{step} would overwrite"
            tokens[tokens_key(ref)] = tokens.pop(old)
        elif step.action is Action.UNPLACE:
            unplaced[step.request_id] = tokens.pop(old)
        else:
            assert old not in tokens
        if marker is not None:
            if ref is not None:
                assert closed_field(ref) not in closed, f"{step} would overwrite"
                closed[closed_field(ref)] = marker
            elif step.action is Action.UNPLACE:
                unplaced_closed[step.request_id] = marker
    return tokens, closed, unplaced, unplaced_closed


def test_an_id_billed_to_one_tenant_moves_with_its_close_marker() -> None:
    p = plan(["r1", "r2"], ["r1"], {"r1": ["acme"], "r2": ["globex"]})
    assert p.steps == (
        Step(Action.MOVE, "r1", "acme", True, ("acme",)),
        Step(Action.MOVE, "r2", "globex", False, ("globex",)),
    )
    assert p.steps[0].ref == RequestRef("acme", "r1")
    assert p.steps[0].reason == ""
    assert p.counts == Counts(moved=2, closed_moved=1)
    assert p.already_moved == 0


def test_tokens_without_billing_or_with_several_tenants_are_unplaced() -> None:
    p = plan(["lost", "shared"], ["lost", "shared"], {"shared": {"b", "a"}, "other": ["acme"]})
    lost, shared = steps_by_id(p)["lost"], steps_by_id(p)["shared"]
    assert (lost.action, lost.ref, lost.tenants, lost.reason) == (
        Action.UNPLACE,
        None,
        (),
        "no billing event",
    )
    assert (shared.action, shared.ref, shared.tenants, shared.reason) == (
        Action.UNPLACE,
        None,
        ("a", "b"),
        "billed to 2 tenants",
    )
    assert p.counts == Counts(unplaced=2, closed_unplaced=2)


def test_a_close_marker_alone_moves_to_its_single_tenant_or_is_dropped() -> None:
    p = plan([], ["decided", "orphan", "twice"], {"decided": ["acme"], "twice": ["a", "b"]})
    by_id = steps_by_id(p)
    assert by_id["decided"] == Step(Action.MOVE_CLOSED, "decided", "acme", True, ("acme",))
    assert by_id["orphan"] == Step(Action.DROP_CLOSED, "orphan", None, True, ())
    assert by_id["twice"] == Step(Action.DROP_CLOSED, "twice", None, True, ("a", "b"))
    assert p.counts == Counts(closed_moved=1, closed_dropped=2)


def test_ids_and_tenants_holding_colons_and_percents_get_unambiguous_keys() -> None:
    billing = {"x:%3A:y": ["t:1%"], "%25": ["a%3Ab"], "plain": [":"]}
    p = plan(billing, billing, billing)
    refs = {s.request_id: s.ref for s in p.steps}
    assert refs == {
        "x:%3A:y": RequestRef("t:1%", "x:%3A:y"),
        "%25": RequestRef("a%3Ab", "%25"),
        "plain": RequestRef(":", "plain"),
    }
    keys = {rid: tokens_key(ref) for rid, ref in refs.items() if ref is not None}
    assert keys == {
        "x:%3A:y": TOKENS_PREFIX + "t%3A1%25:x:%3A:y",
        "%25": TOKENS_PREFIX + "a%253Ab:%25",
        "plain": TOKENS_PREFIX + "%3A:plain",
    }
    for rid, key in keys.items():  # the version-2 reads find them again
        assert parse_tokens_key(key) == refs[rid]
    assert all(s.action is Action.MOVE and s.closed for s in p.steps)


def test_moved_refs_are_not_read_as_version_1_ids() -> None:
    """A rerun sees ``st:tokens:acme:r1`` moved by the run before: not the id ``acme:r1``."""
    moved = {"acme:r1", "t%3A1:x"}
    p = plan(["acme:r1", "t%3A1:x", "r2"], ["acme:r1", "t%3A1:x", "c"], {"r2": ["acme"]}, moved)
    assert [(s.action, s.request_id) for s in p.steps] == [
        (Action.MOVE, "r2"),
        (Action.DROP_CLOSED, "c"),
    ]
    assert p.already_moved == 2


def test_nothing_of_version_1_is_an_empty_plan() -> None:
    assert plan([], [], {"r1": ["acme"]}) == Plan()
    assert plan(["acme:r1"], ["acme:r1"], {}, {"acme:r1"}) == Plan((), already_moved=1)


def test_longest_ids_move_first_so_no_step_lands_on_a_name_still_held() -> None:
    """``r1`` of acme moves to ``acme:r1``, the name of another version-1 request: that one
    (of x, whose key becomes ``x:acme:r1``, the name of a third) must move first."""
    ids = {"r1": "acme", "acme:r1": "x", "x:acme:r1": "y", "acme": "acme"}
    tokens = {TOKENS_PREFIX + rid: f"json of {rid}" for rid in ids}
    closed = {rid: f"{n} end" for n, rid in enumerate(ids)}
    p = plan([*ids, *ids], closed, {rid: [t] for rid, t in ids.items()})  # SCAN repeats
    assert [s.request_id for s in p.steps] == ["x:acme:r1", "acme:r1", "acme", "r1"]
    moved_tokens, moved_closed, unplaced, _ = replay(tokens, closed, p)
    assert moved_tokens == {
        tokens_key(RequestRef(t, rid)): f"json of {rid}" for rid, t in ids.items()
    }
    assert moved_closed == {closed_field(RequestRef(t, rid)): closed[rid] for rid, t in ids.items()}
    assert unplaced == {}


def test_unplaced_entries_leave_the_names_free_too() -> None:
    ids = ["r1", "acme:r1", "acme:r2"]
    tokens = {TOKENS_PREFIX + rid: rid for rid in ids}
    closed = dict.fromkeys(["r1", "acme:r1", "orphan:x", "acme:orphan:x"], "1 end")
    billing: Mapping[str, list[str]] = {"r1": ["acme"], "orphan:x": ["acme"]}
    p = plan(tokens_ids := [k.removeprefix(TOKENS_PREFIX) for k in tokens], closed, billing)
    assert sorted(tokens_ids) == sorted(ids)
    done_tokens, done_closed, unplaced, unplaced_closed = replay(tokens, closed, p)
    assert done_tokens == {TOKENS_PREFIX + "acme:r1": "r1"}
    assert done_closed == {"acme:r1": "1 end", "acme:orphan:x": "1 end"}
    assert unplaced == {"acme:r1": "acme:r1", "acme:r2": "acme:r2"}
    assert unplaced_closed == {"acme:r1": "1 end"}
    assert p.counts == Counts(
        moved=1, closed_moved=2, unplaced=2, closed_unplaced=1, closed_dropped=1
    )


def test_billing_keeps_one_tenant_lean_and_several_sorted() -> None:
    billing = Billing()
    for rid, tenant in [("r1", "acme"), ("r1", "acme"), ("r2", "b"), ("r2", "a"), ("r2", "c")]:
        billing.add(rid, tenant)
    assert dict(billing) == {"r1": ("acme",), "r2": ("a", "b", "c")}
    assert len(billing) == 2
    assert billing.get("r3") is None
    assert "r2" in billing


def test_the_summary_escapes_what_ids_and_tenants_hold() -> None:
    bad = Step(Action.UNPLACE, "r\n1\x1b[2J", None, False, ("t\u202e1", "t2"))
    p = Plan((bad,))
    report = Report(Outcome.PLANNED, None, Billing(), p, p.counts)
    text = _summary_text(report, dry_run=True)
    assert "\x1b" not in text
    assert "\u202e" not in text
    assert "unplaced r\\n1\\x1b[2J: billed to 2 tenants (t\\u202e1, t2)" in text
    assert text.startswith("dry run, nothing written")
    summary = _summary_json(report, None, None, dry_run=True)
    assert summary["unplaced_requests"] == [
        {
            "request_id": "r\n1\x1b[2J",
            "reason": "billed to 2 tenants",
            "tenants": ["t\u202e1", "t2"],
        }
    ]
    assert (summary["unplaced"], summary["layout"]) == (1, None)


def test_the_json_summary_of_a_move_into_shards_names_both_layouts() -> None:
    moves = ShardMoves(tokens=3, closed=2, rows=1, stats=1, dead_letters=0)
    dry = _summary_json(None, moves, "2", dry_run=True)
    assert (dry["layout_before"], dry["layout"], dry["outcome"]) == ("2", "2", "planned")
    assert dry["shards"] == dataclasses.asdict(moves)
    done = _summary_json(None, moves, "2", dry_run=False)
    assert (done["layout_before"], done["layout"]) == ("2", "3")
    nothing = _summary_json(None, None, "3", dry_run=False)
    assert (nothing["outcome"], nothing["shards"]) == ("up to date", None)


def test_help_names_what_is_migrated_and_the_exit_statuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["migrate", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for text in (UNPLACED_KEY, "exit status", "--dry-run", '"1>2"', "billing topic"):
        assert text in out


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--progress-every", "x"]])
def test_bad_numbers_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["migrate", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "is not a whole number >= 1" in err
