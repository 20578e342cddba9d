"""The plan of a migration: one `Step` per version-1 request id, and what the steps do.

`plan` is a pure function (keys, fields and the billing map in; ordered
steps out); `Counts` adds up what steps plan or did.  The package
docstring (`streamtally.ops.migrate`) says what each `Action` does and why
the steps run longest request id first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import StrEnum

from streamtally.core.identity import RequestRef


class Action(StrEnum):
    """What a `Step` does with one version-1 request id."""

    MOVE = "move"
    MOVE_CLOSED = "move-closed"
    UNPLACE = "unplace"
    DROP_CLOSED = "drop-closed"


@dataclass(frozen=True, slots=True)
class Step:
    """One version-1 request id and what becomes of its Tokens key and close marker."""

    action: Action
    request_id: str
    #: The tenant it is placed under (`MOVE`, `MOVE_CLOSED`); None otherwise.
    tenant: str | None
    #: Whether a close marker (a `CLOSED_KEY` field) of the id goes along.
    closed: bool
    #: Every tenant the billing topic names for the id, sorted (none, one or several).
    tenants: tuple[str, ...] = ()

    @property
    def ref(self) -> RequestRef | None:
        """The version-2 identity the id moves to; None when it cannot be placed."""
        return None if self.tenant is None else RequestRef(self.tenant, self.request_id)

    @property
    def reason(self) -> str:
        """Why an id was not placed ("" when it was)."""
        if self.tenant is not None:
            return ""
        if not self.tenants:
            return "no billing event"
        return f"billed to {len(self.tenants)} tenants"


@dataclass(frozen=True, slots=True)
class Counts:
    """How many of each: planned (`Plan.counts`) or done (`apply`)."""

    #: Tokens keys renamed to their version-2 key.
    moved: int = 0
    #: Close markers moved to their version-2 field (with their Tokens or alone).
    closed_moved: int = 0
    #: Tokens moved to `UNPLACED_KEY`.
    unplaced: int = 0
    #: Close markers moved to `UNPLACED_CLOSED_KEY`.
    closed_unplaced: int = 0
    #: Close markers without Tokens and without a single tenant, deleted.
    closed_dropped: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.moved + other.moved,
            self.closed_moved + other.closed_moved,
            self.unplaced + other.unplaced,
            self.closed_unplaced + other.closed_unplaced,
            self.closed_dropped + other.closed_dropped,
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps, in the order they must run (longest request id first)."""

    steps: tuple[Step, ...] = ()
    #: Requests an earlier, interrupted run moved already (members of `MOVED_KEY`).
    already_moved: int = 0

    def of(self, *actions: Action) -> list[Step]:
        """The steps doing one of `actions`, in order."""
        return [s for s in self.steps if s.action in actions]

    @property
    def counts(self) -> Counts:
        """What the steps will do."""
        moves = self.of(Action.MOVE)
        unplaced = self.of(Action.UNPLACE)
        return Counts(
            moved=len(moves),
            closed_moved=sum(s.closed for s in moves) + len(self.of(Action.MOVE_CLOSED)),
            unplaced=len(unplaced),
            closed_unplaced=sum(s.closed for s in unplaced),
            closed_dropped=len(self.of(Action.DROP_CLOSED)),
        )


def _order(request_id: str) -> tuple[int, str]:
    return -len(request_id), request_id


def plan(
    tokens: Iterable[str],
    closed: Iterable[str],
    billing: Mapping[str, Collection[str]],
    moved: AbstractSet[str] = frozenset(),
) -> Plan:
    """The steps moving version-1 entries to version 2.

    `tokens`: what follows ``st:tokens:`` in each Tokens key; `closed`: each
    field of `CLOSED_KEY` (repeats are fine, SCAN may repeat); `billing`:
    request id -> the tenants the billing topic names for it; `moved`: the
    members of `MOVED_KEY`, whose keys and fields are version 2 already and
    are left alone.  Every other key or field is a version-1 request id; an id
    with exactly one tenant is placed under it, the others are unplaced
    (Tokens) or dropped (a close marker alone).  Steps are ordered longest
    id first, then by id (see the package docstring: a version-2 name is
    longer than its id, so a version-1 entry of that name moves first).
    """
    with_tokens = {text for text in tokens if text not in moved}
    with_closed = {text for text in closed if text not in moved}
    steps = []
    for request_id in sorted(with_tokens | with_closed, key=_order):
        tenants = tuple(sorted(billing.get(request_id, ())))
        tenant = tenants[0] if len(tenants) == 1 else None
        if request_id in with_tokens:
            action = Action.MOVE if tenant is not None else Action.UNPLACE
        else:
            action = Action.MOVE_CLOSED if tenant is not None else Action.DROP_CLOSED
        steps.append(Step(action, request_id, tenant, request_id in with_closed, tenants))
    return Plan(tuple(steps), already_moved=len(moved))
