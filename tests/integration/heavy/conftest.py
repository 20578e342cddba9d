"""The heavy tier's stacks.

A test marked ``fault_stack`` stops, pauses or restarts the stack's services.  It runs
on a single-node stack of this pytest process's own (`fault_stack`: started on spare
ports when the first such test needs it, stopped at the end of the session), never on
the shared stack, so that the tests running beside it in a parallel run see no outage
that is not theirs.  For such a test `stack_endpoints`, `redis_url` and
`bootstrap_servers` name the fault stack, and its environment points streamtally
commands at it (its state dir and ports), so `StackConfig.from_settings` finds its
processes.  The fault-stack tests of a parallel run share one process (``--dist loadscope``:
`FAULT_STACK_MODULES`), hence one fault stack, one test at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from streamtally.stack import StackConfig
from tests.integration.isolation import FAULT_STACK_MODULES
from tests.integration.spare_stack import own_stack, stack_variables
from tests.integration.worker import REPO, Endpoints, StackMode, external_stack


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``fault_stack`` are those of `FAULT_STACK_MODULES`, which a
    parallel run gives to one process."""
    for item in items:
        module = item.path.relative_to(REPO).as_posix()
        marked = item.get_closest_marker("fault_stack") is not None
        if marked != (module in FAULT_STACK_MODULES):
            raise pytest.UsageError(
                f"{item.nodeid}: marked fault_stack only if its module is in "
                "FAULT_STACK_MODULES (tests/integration/conftest.py), and the reverse"
            )


@pytest.fixture(scope="session")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    """A single-node stack of this process's own (see the module docstring)."""
    if (external := external_stack()) is not None:
        pytest.skip(external)
    with own_stack(tmp_path_factory.mktemp("fault-stack")) as cfg:
        yield cfg


@pytest.fixture
def stack_endpoints(
    stack_endpoints: Endpoints, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Endpoints:
    """The shared stack's endpoints, or the fault stack's for a test marked ``fault_stack``
    (with the environment pointed at it for the test)."""
    if request.node.get_closest_marker("fault_stack") is None:
        return stack_endpoints
    cfg: StackConfig = request.getfixturevalue("fault_stack")
    for name, value in stack_variables(cfg).items():
        monkeypatch.setenv(name, value)
    return Endpoints(StackMode.LOCAL, cfg.local_bootstrap_servers(), cfg.local_redis_url())


@pytest.fixture
def redis_url(stack_endpoints: Endpoints) -> str:
    return stack_endpoints.redis_url


@pytest.fixture
def bootstrap_servers(stack_endpoints: Endpoints) -> str:
    return stack_endpoints.bootstrap_servers
