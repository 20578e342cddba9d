"""Shared fixtures of the integration tests: which Kafka and Redis, and a running worker.

`stack_endpoints` (session) picks the stack once (`tests.integration.worker.choose_stack_mode`):

1. ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` set: that existing cluster;
2. else, when a Docker engine answers: a Kafka (``apache/kafka``, KRaft) and a
   Redis container for the session, their addresses exported in those two
   variables so that every streamtally subprocess uses them too;
3. else the local stack: ``streamtally stack up`` (idempotent, left running).

`redis_url` and `bootstrap_servers` are its addresses (the local stack's and
a container's Redis URL name database 0).  That database must be empty or of
Redis layout version 3 (``st:layout``): a worker claims an empty one and
refuses to start on data of an older layout (``streamtally migrate``).  Tests
that need a database of their own use another number (`own_worker`).

`schema_registry_url` (session) is ``STREAMTALLY_SCHEMA_REGISTRY_URL`` when set (it must
answer), else the local stack's schema registry (`streamtally.stack.registry`), started
(and built, the first time in a state dir: under a minute) when it does not run, and left
running like the stack (a registry of another state dir answering on the stack's port serves
as well); tests marked ``registry`` get it before they run.  It is not put in the process's
environment: a test hands it to what it starts (``monkeypatch.setenv``), and the tests that
run after it in the same process never see it.

Every test marked ``integration`` gets the stack selected before it runs.  When the local stack
cannot start, the test is skipped (fails instead on CI).  `redis_client` skips
the test when Redis does not answer (fails instead on CI).

`worker` (module) is a ``streamtally worker`` subprocess that has joined its
consumer group and put a probe request through; `start_worker` starts more
(each test stops its own).  On teardown a worker gets SIGTERM and must exit 0
within 30 s; failures show the end of its log.

Tests share the stack with whoever else uses it: write only keys of your own
(unique request ids and tenants, uuid4 hex) and delete them afterwards; never
FLUSHDB, never delete topics.  Requests that went through a worker are the
exception: delete their tenants' usage rows (`forget_usage`) but keep their
Tokens keys, the idempotency markers that make a replay of their records a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamtally.errors import StackError
from streamtally.settings import ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL, Settings
from streamtally.stack import redis_cluster, registry
from streamtally.stack.config import StackConfig
from streamtally.topics import Topics
from tests.integration.isolation import (
    leased_db,
    machine_lock,
    process_namespace,
)
from tests.integration.spare_stack import claim_spare
from tests.integration.worker import (
    Endpoints,
    StackMode,
    WorkerProcess,
    assert_stopped_cleanly,
    choose_stack_mode,
    docker_answers,
    ensure_served_topics,
    forget_usage,
    local_stack_up,
    start_containers,
)

#: Seconds a new worker may take to join its group and put the probe through.
WORKER_READY_TIMEOUT_S = 60.0


def _unavailable(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def _process_namespace(worker_id: str) -> Iterator[str]:
    """The topic namespace of this pytest process (`process_namespace`), exported in
    ``STREAMTALLY_NAMESPACE`` for the session: in a parallel run each process's module
    workers form a consumer group of their own, on topics of their own, and serve no
    metrics (``STREAMTALLY_WEB_PORT=0``; `test_metrics` gives its worker a port)."""
    parallel = worker_id != "master"
    namespace = process_namespace(Settings.load().namespace, worker_id if parallel else None)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STREAMTALLY_NAMESPACE", namespace)
        if parallel:  # the module workers of two processes would both want the metrics port
            env.setenv("STREAMTALLY_WEB_PORT", "0")
        yield namespace


@pytest.fixture(scope="session")
def stack_endpoints(_process_namespace: str) -> Iterator[Endpoints]:
    """The Kafka and Redis of this session (see the module docstring), after this process's
    topic namespace is exported (`_process_namespace`)."""
    namespace = _process_namespace
    mode = choose_stack_mode(os.environ, docker_answers)
    if mode is StackMode.EXTERNAL:
        settings = Settings.load()
        yield _served(Endpoints(mode, settings.bootstrap_servers, settings.redis_url), namespace)
    elif mode is StackMode.CONTAINERS:
        with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as env:
            endpoints = start_containers(stack)
            env.setenv(ENV_BOOTSTRAP_SERVERS, endpoints.bootstrap_servers)
            env.setenv(ENV_REDIS_URL, endpoints.redis_url)
            yield _served(endpoints, namespace)
    else:
        with machine_lock("local-stack-up"):  # parallel processes: one starts it, all wait
            up = local_stack_up()
        if up.returncode != 0:
            _unavailable(
                f"`streamtally stack up` failed ({up.returncode}):\n{up.stdout}{up.stderr}"
            )
        cfg = StackConfig.from_settings(Settings.load())
        local = Endpoints(mode, cfg.local_bootstrap_servers(), cfg.local_redis_url())
        yield _served(local, namespace)


def _served(endpoints: Endpoints, namespace: str) -> Endpoints:
    """`endpoints`, once the broker serves the topics of this process's `namespace` (which
    the module workers use: `ensure_served_topics`)."""
    asyncio.run(ensure_served_topics(endpoints.bootstrap_servers, Topics.in_namespace(namespace)))
    return endpoints


@pytest.fixture(autouse=True)
def _integration_stack(request: pytest.FixtureRequest) -> None:
    """Select (and start) the stack before any test marked ``integration``, and the schema
    registry before any marked ``registry``."""
    if request.node.get_closest_marker("integration") is not None:
        request.getfixturevalue("stack_endpoints")
    if request.node.get_closest_marker("registry") is not None:
        request.getfixturevalue("schema_registry_url")


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis Cluster of three masters for the session (Debian's redis-server, spare ports).

    The same cluster `streamtally stack up --redis-cluster` runs, in a state dir
    of its own; stopped at the end of the session.  Its clients need
    ``REDIS_CLUSTER=1`` (`RedisStore.from_url(url, cluster=True)`).
    """
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    if missing:
        _unavailable(f"a Redis Cluster needs {', '.join(missing)}")
    state = tmp_path_factory.mktemp("redis-cluster")
    with contextlib.ExitStack() as held:
        cfg = _spare_cluster_config(state, held)
        held.callback(redis_cluster.down, cfg, say=lambda _: None)  # (before the ports are freed)
        redis_cluster.up(cfg, say=lambda _: None)
        yield cfg.local_redis_url()


def _spare_cluster_config(state: Path, held: contextlib.ExitStack) -> StackConfig:
    """A Redis Cluster config on spare ports (its nodes' and their bus ports), reserved
    until `held` closes."""

    def candidate() -> StackConfig:
        # Below Linux's ephemeral range (32768-60999), bus ports (+10000) included: an
        # outgoing connection may take any port in it between the check and the start.
        port = random.randrange(13000, 15000, 10)
        return StackConfig(state, redis_port=port, redis_cluster=True)

    return claim_spare(
        held,
        candidate,
        lambda cfg: [port for name, port in cfg.named_ports() if name.startswith("redis")],
        what="a Redis Cluster",
    )


@pytest.fixture(scope="session")
def schema_registry_url() -> str:
    """The session's schema registry: its Confluent-compatible API (see the module docstring).

    Not exported: a test that runs streamtally commands against it sets
    ``STREAMTALLY_SCHEMA_REGISTRY_URL`` for them itself.  Skips the test (fails it on CI)
    when the given one does not answer or the local one cannot start.
    """
    given = os.environ.get(registry.ENV_SCHEMA_REGISTRY_URL, "").strip().rstrip("/")
    if given:
        try:
            with urllib.request.urlopen(f"{given}/subjects", timeout=5) as answer:
                json.loads(answer.read())
        except (OSError, ValueError) as exc:
            _unavailable(
                f"no schema registry answers at {given}/subjects ({exc}): start one "
                "(`streamtally stack up --registry`) or set STREAMTALLY_SCHEMA_REGISTRY_URL to a "
                "registry's Confluent REST API"
            )
        return given
    settings = Settings.load()
    cfg = StackConfig.from_settings(settings)
    try:
        with machine_lock("schema-registry-up"):  # parallel processes: one starts it
            theirs = not registry.status(cfg).running and registry.answers(
                cfg.host, cfg.registry_port
            )
            if not theirs:  # else: another state dir's registry on the stack's port serves
                registry.up(cfg, print, java_override=settings.registry_java)
    except StackError as exc:
        _unavailable(f"the stack's schema registry did not start: {exc}")
    return cfg.local_registry_url()


@pytest.fixture(scope="session")
def redis_url(stack_endpoints: Endpoints) -> str:
    """The session's Redis URL (``$REDIS_URL``, a container's, or the local stack's)."""
    return stack_endpoints.redis_url


@pytest.fixture(scope="session")
def bootstrap_servers(stack_endpoints: Endpoints) -> str:
    """The session's Kafka (``$KAFKA_BOOTSTRAP_SERVERS``, a container's, or the local stack's)."""
    return stack_endpoints.bootstrap_servers


@pytest.fixture
def own_db(redis_url: str) -> Iterator[int]:
    """A Redis database number of the test's own (`leased_db`): empty it before use."""
    with leased_db(redis_url) as db:
        yield db


@pytest.fixture(scope="module")
def module_db(redis_url: str) -> Iterator[int]:
    """A Redis database number of the module's own (`leased_db`): empty it before use."""
    with leased_db(redis_url) as db:
        yield db


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of `redis_url` that answered PING; skips (fails on CI) if Redis is down."""
    client = aioredis.from_url(redis_url, socket_connect_timeout=3)
    try:
        await client.ping()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        await client.aclose()
        message = f"Redis at {redis_url} does not answer ({exc}); run `streamtally stack up`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield client
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- workers


class Workers:
    """Starts workers that are ready (joined, probe through); forgets the probes' usage after."""

    def __init__(self, endpoints: Endpoints, directory: Path) -> None:
        self.endpoints = endpoints
        self.directory = directory
        self.started: list[WorkerProcess] = []
        self.probe_tenants: list[str] = []

    def start(self, name: str = "worker", *, ready: bool = True) -> WorkerProcess:
        tag = uuid.uuid4().hex
        log = self.directory / f"{name}-{tag[:8]}.log"
        worker = WorkerProcess(log, self.endpoints.env()).start()
        self.started.append(worker)
        if ready:
            self.probe_tenants.append(f"probe-{tag}")
            worker.wait_ready(
                self.endpoints, f"probe-{tag}", f"probe-{tag}", timeout=WORKER_READY_TIMEOUT_S
            )
        return worker

    def close(self) -> None:
        """Stop what still runs (a test that wanted a clean stop asserted it), forget probes.

        SIGTERM first: a killed worker stays in the consumer group until its
        session times out, which stalls the next worker's join.
        """
        for worker in self.started:
            if worker.returncode is None:
                worker.stop(timeout=30)  # kills it after 30 s
        forget_usage(self.endpoints.redis_url, self.probe_tenants)


@pytest.fixture(scope="module")
def worker(
    stack_endpoints: Endpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A ready ``streamtally worker`` for the module; must stop cleanly on SIGTERM after it."""
    workers = Workers(stack_endpoints, tmp_path_factory.mktemp("worker"))
    try:
        running = workers.start("module-worker")
        yield running
        assert_stopped_cleanly(running)
    finally:
        workers.close()


@pytest.fixture
def start_worker(
    stack_endpoints: Endpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., WorkerProcess]]:
    """``start_worker(name, ready=True)``: a new worker; the test stops it (killed after)."""
    workers = Workers(stack_endpoints, tmp_path_factory.mktemp("workers"))
    try:
        yield workers.start
    finally:
        workers.close()
