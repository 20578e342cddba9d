"""Shared test helpers (where the public transcripts live), and the tiers.

A test's tier is the folder it lives in: `pytest_collection_modifyitems` below gives every
test the markers of its folder (`TIERS`), so a new file gets its tier from where it is put,
and ``-m`` selects tiers (the markers are registered in pyproject.toml; ``--strict-markers``).

==========================  =======================  ==========================================
folder                      markers                  `make test` runs it
==========================  =======================  ==========================================
tests/unit/<concept>/       ``unit``                 with the agents, beside the integration
                                                     tier (``make unit``: pytest-xdist, -n 2)
tests/agents/               ``agent``                with the unit tier
tests/integration/          ``integration``          in parallel on the stack
                                                     (``-n 4 --dist loadscope``: a module
                                                     per process, `scope_of`, handed out in
                                                     `SCOPE_ORDER`)
tests/integration/heavy/    ``integration heavy``    with the integration tier, first (stacks
                                                     of their own, the outage tests on a fault
                                                     stack, or the stack under heavy load)
==========================  =======================  ==========================================

tests/README.md says how the integration tests stay apart.
Which concept folder of tests/unit holds what: tests/README.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from tests.integration.isolation import FAULT_STACK, FAULT_STACK_MODULES

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
SHARED = Path(os.environ.get("STREAMTALLY_SHARED", REPO.parent / "shared"))
PROVIDER_FIXTURES = SHARED / "fixtures" / "providers"

#: The markers of the tests in a folder of tests/ (and in its sub-folders, unless listed too).
TIERS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("unit",): ("unit",),
    ("agents",): ("agent",),
    ("integration",): ("integration",),
    ("integration", "heavy"): ("integration", "heavy"),
}


def tier_markers(path: Path) -> tuple[str, ...]:
    """The tier markers of the test file at `path`: those of its deepest folder in `TIERS`."""
    folders = path.resolve().relative_to(TESTS).parts[:-1]
    for depth in range(len(folders), 0, -1):
        if folders[:depth] in TIERS:
            return TIERS[folders[:depth]]
    raise pytest.UsageError(
        f"{path}: a test outside the tier folders ({', '.join('/'.join(f) for f in TIERS)})"
    )


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test gets the markers of its tier (`tier_markers`)."""
    for item in items:
        for name in tier_markers(item.path):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)


#: The order in which a parallel run (``--dist loadscope``) hands out its scopes: the
#: longest first, so that the short ones fill the end of the run (its tests, then the
#: number of tests, break ties).
SCOPE_ORDER: Final = (
    FAULT_STACK,
    "tests/integration/heavy/",
    "tests/integration/",
    "tests/agents/",
    "tests/unit/",
)


def scope_of(nodeid: str) -> str:
    """A test's scope in a parallel run: its module, or `FAULT_STACK` for the modules of
    the fault stack (one process starts that stack once for all of them)."""
    module = nodeid.split("::", 1)[0]
    return FAULT_STACK if module in FAULT_STACK_MODULES else module


def scope_rank(scope: str) -> int:
    """Where `scope` comes in `SCOPE_ORDER` (its first prefix that matches)."""
    return next((i for i, p in enumerate(SCOPE_ORDER) if scope.startswith(p)), len(SCOPE_ORDER))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope``: a module's tests go to one process (its module fixtures, a
    worker or a stack, start once), the fault-stack modules together to one, and the
    scopes go out in `SCOPE_ORDER`."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not getattr(self, "_ranked", False):  # once, before the first unit goes out
                ranked = sorted(self.workqueue.items(), key=lambda unit: scope_rank(unit[0]))
                self.workqueue.clear()
                self.workqueue.update(ranked)
                self._ranked = True
            super()._assign_work_unit(node)

    return ByModule(config, log)


def require_public_transcripts() -> Path:
    """The folder of public transcripts; skips (locally) or fails (CI) when it is missing."""
    if PROVIDER_FIXTURES.is_dir():
        return PROVIDER_FIXTURES
    if os.environ.get("CI"):
        pytest.fail(f"public transcripts missing at {PROVIDER_FIXTURES} (CI must have ../shared)")
    pytest.skip(f"public transcripts not found at {PROVIDER_FIXTURES}")


@pytest.fixture(autouse=True)
def _no_schema_ids_across_tests() -> Iterator[None]:
    """The process's table of Confluent schema ids (and its registry) start empty in every
    test: one test's registry is not the next one's."""
    from streamtally.wire import avro

    avro.forget_ids()
    yield
    avro.forget_ids()


@pytest.fixture(autouse=True)
def _environment_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A unit or agent test leaves os.environ as it found it (change it with `monkeypatch`).

    Those tiers run in parallel processes, each in an order of its own: a variable left
    behind would change what the later tests of one process see.  The environment is put
    back and the test fails, naming the variables.
    """
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    before = dict(os.environ)
    yield
    changed = sorted(
        name
        for name in before.keys() | os.environ.keys()
        if before.get(name) != os.environ.get(name) and name != "PYTEST_CURRENT_TEST"
    )
    if changed:
        os.environ.clear()
        os.environ.update(before)
        pytest.fail(f"the test left os.environ changed: {', '.join(changed)} (use monkeypatch)")
