"""Helpers of the integration tests: which stack to use, and a `streamtally worker` process.

Stack selection (`choose_stack_mode`, used by the ``stack_endpoints`` fixture):

1. ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` set: that existing cluster, nothing started;
2. else a Docker engine answers: Kafka (``apache/kafka``, KRaft) and Redis containers;
3. else the local stack, `streamtally stack up` (idempotent).

`WorkerProcess` runs ``streamtally worker --loglevel info`` with its output in a
log file, so a failure message can show what the worker said.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import io
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from streamtally.core.identity import RequestRef
from streamtally.ops import worker_process
from streamtally.settings import ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL, Settings
from streamtally.store import RedisStore
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics, wait_served
from tests.integration.isolation import db_url, leased_db

REPO: Final = Path(__file__).resolve().parents[2]
SAMPLES: Final = REPO / "samples"
KAFKA_IMAGE: Final = "apache/kafka:4.1.2"
REDIS_IMAGE: Final = "redis:7.2"
#: What faust logs (at info level) once the worker has started and its agent runs.
READY_LINE: Final = worker_process.READY_LINE
#: Quiet seconds after which the test worker closes a request without end marker.
REQUEST_TIMEOUT_S: Final = 20
#: A small transcript the readiness probe produces.
PROBE_FILE: Final = SAMPLES / "openai" / "text_usage.sse"
PROBE_SOURCE: Final = "openai"


# --------------------------------------------------------------------------- stack selection


class StackMode(enum.Enum):
    EXTERNAL = "external"  # KAFKA_BOOTSTRAP_SERVERS / REDIS_URL point at a running cluster
    CONTAINERS = "containers"  # testcontainers: Kafka + Redis in Docker, for this session
    LOCAL = "local"  # `streamtally stack up`


def choose_stack_mode(environ: Mapping[str, str], docker_answers: Callable[[], bool]) -> StackMode:
    """Which stack the integration tests use; `docker_answers` is only asked when needed.

    "Set" means set and not blank, as `streamtally.settings` reads them; one
    of the two is enough (the other then defaults to the local stack's address,
    like every streamtally command does).
    """
    if any(environ.get(name, "").strip() for name in (ENV_BOOTSTRAP_SERVERS, ENV_REDIS_URL)):
        return StackMode.EXTERNAL
    if docker_answers():
        return StackMode.CONTAINERS
    return StackMode.LOCAL


def docker_answers(timeout: float = 5.0) -> bool:
    """Whether a Docker engine answers: ``docker info``, else the Docker SDK's ping."""
    if shutil.which("docker"):
        try:
            probe = subprocess.run(
                ["docker", "info"], capture_output=True, timeout=timeout, check=False
            )
        except (subprocess.TimeoutExpired, OSError):
            pass
        else:
            if probe.returncode == 0:
                return True
    try:
        import docker  # type: ignore[import-untyped]  # testcontainers' client; honours DOCKER_HOST
        from docker.errors import DockerException  # type: ignore[import-untyped]
        from requests.exceptions import RequestException
    except ImportError:
        return False
    try:
        return bool(docker.from_env(timeout=int(timeout)).ping())
    except (DockerException, RequestException, OSError):
        return False


@dataclass(frozen=True, slots=True)
class Endpoints:
    mode: StackMode
    bootstrap_servers: str
    redis_url: str

    def env(self) -> dict[str, str]:
        """The variables that point a streamtally process at this stack."""
        return {ENV_BOOTSTRAP_SERVERS: self.bootstrap_servers, ENV_REDIS_URL: self.redis_url}


def start_containers(stack: contextlib.ExitStack) -> Endpoints:
    """Kafka (KRaft) and Redis containers, stopped when `stack` closes."""
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:  # testcontainers < 4.14
        from testcontainers.redis import RedisContainer
    kafka = kafka_container(KAFKA_IMAGE)
    kafka.start(timeout=120)
    stack.callback(kafka.stop)
    redis_container = RedisContainer(REDIS_IMAGE)
    redis_container.start()
    stack.callback(redis_container.stop)
    host = redis_container.get_container_host_ip()
    port = redis_container.get_exposed_port(redis_container.port)
    return Endpoints(StackMode.CONTAINERS, kafka.get_bootstrap_server(), f"redis://{host}:{port}/0")


#: Broker settings of docker-compose.yml that testcontainers does not set itself.
_KAFKA_BROKER_ENV: Final = {
    "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
    "KAFKA_NUM_PARTITIONS": "1",
    "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
}


def kafka_container(image: str) -> Any:
    """testcontainers' `KafkaContainer`, adapted to the ``apache/kafka`` image.

    Its own KRaft support targets Confluent images: ``with_kraft()`` refuses a
    tag below 7.0.0 ("4.1.2" included) and its start script runs
    ``/etc/confluent/docker/*``, which ``apache/kafka`` does not have.  So:
    its KRaft environment (node id, roles, controller listener and quorum),
    the broker settings of docker-compose.yml, and the image's own launcher
    ``/etc/kafka/docker/run`` once the advertised listener (the mapped port)
    is known.
    """
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:  # testcontainers < 4.14
        from testcontainers.kafka import KafkaContainer

    class ApacheKafkaContainer(KafkaContainer):
        def configure(self) -> None:
            self.kraft_enabled = True
            self._configure_kraft()
            self.env.pop("KAFKA_BROKER_ID", None)  # KRaft: node.id only
            for name, value in _KAFKA_BROKER_ENV.items():
                self.with_env(name, value)

        def tc_start(self) -> None:
            host = self.get_container_host_ip()
            port = self.get_exposed_port(self.port)
            listeners = f"{self.listener_name}://{host}:{port},BROKER://$(hostname):9092"
            script = (
                f"#!/bin/bash\nexport KAFKA_ADVERTISED_LISTENERS={listeners}\n"
                "exec /etc/kafka/docker/run\n"
            )
            self.create_file(script.encode(), self.TC_START_SCRIPT)

    return ApacheKafkaContainer(image)


def local_stack_up(timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """`streamtally stack up` (idempotent: fast when both services already run)."""
    return subprocess.run(
        streamtally("stack", "up"), capture_output=True, text=True, timeout=timeout, check=False
    )


def external_stack(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a test that stops and starts the local stack's services must leave this session's
    stack alone, or None: ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` name an external stack
    (or the session's containers, which the ``stack_endpoints`` fixture exports there), and
    others may be using it."""
    if environ.get(ENV_BOOTSTRAP_SERVERS) or environ.get(ENV_REDIS_URL):
        return "stops and starts the local stack's services; an external stack is set"
    return None


# --------------------------------------------------------------------------- commands


#: The argv running ``streamtally ARGS`` with this interpreter.
streamtally = worker_process.streamtally_command


def run_streamtally(
    *args: str, env: Mapping[str, str], timeout: float = 120.0
) -> subprocess.CompletedProcess[bytes]:
    """Run one streamtally command as a subprocess; its output is kept as bytes."""
    return subprocess.run(
        streamtally(*args),
        capture_output=True,
        env={**os.environ, **env},
        timeout=timeout,
        check=False,
    )


@dataclass(frozen=True, slots=True)
class CliResult:
    code: int
    out: bytes
    err: str


def cli(*argv: str) -> CliResult:
    """``streamtally ARGV`` in this process: exit status, stdout bytes, stderr text.

    The command's own code (`streamtally.cli.main`), without the ~0.5 s of a
    new interpreter; it runs its own event loop, so call it outside of one.
    """
    from streamtally.cli import main

    out, err = io.BytesIO(), io.StringIO()
    text = io.TextIOWrapper(out, encoding="utf-8", newline="")
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(err):
        code = main(list(argv))
    text.flush()
    data = out.getvalue()
    text.detach()
    return CliResult(code, data, err.getvalue())


def write_manifest(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """A `streamtally produce --manifest` file (absolute file paths are kept as they are)."""
    path.write_text("".join(json.dumps(dict(row)) + "\n" for row in rows))
    return path


def wait_for_tokens(
    redis_url: str,
    refs: Iterable[RequestRef],
    timeout: float,
    worker: WorkerProcess | None = None,
    *,
    cluster: bool = False,
) -> set[RequestRef]:
    """Wait until every request's Tokens is in Redis; returns those still missing.

    A request is its tenant and its request id (`RequestRef`): the Tokens of
    the same id of another tenant do not count.  Stops early when `worker`
    has exited: nothing more will arrive.
    """

    async def wait() -> set[RequestRef]:
        waiting = set(refs)
        store = RedisStore.from_url(redis_url, cluster=cluster, connect_timeout=5)
        deadline = time.monotonic() + timeout
        try:
            while waiting:
                waiting = set(await store.missing_tokens(sorted(waiting)))
                if not waiting or time.monotonic() > deadline:
                    break
                if worker is not None and worker.returncode is not None:
                    break
                await asyncio.sleep(0.25)
        finally:
            await store.aclose()
        return waiting

    return asyncio.run(wait())


# --------------------------------------------------------------------------- the worker


class WorkerError(worker_process.WorkerError, AssertionError):
    """The worker did not do what a test needed; the message carries its log."""


class WorkerProcess(worker_process.WorkerProcess):
    """``streamtally worker --loglevel info`` as a subprocess, its output in `log`.

    `env` is added to this process's environment, after an unbuffered output
    and a request timeout of `REQUEST_TIMEOUT_S`.  It runs in the repository
    and in its own session (a Ctrl-C of pytest is not the worker's SIGINT).
    """

    def __init__(self, log: Path, env: Mapping[str, str]) -> None:
        super().__init__(
            log,
            {
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "STREAMTALLY_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S),
                **env,
            },
            cwd=REPO,
        )

    def wait_ready(self, endpoints: Endpoints, probe_id: str, tenant: str, timeout: float) -> None:
        """Wait until the worker has joined its group and a probe request went through."""
        start = time.monotonic()
        self.wait_until_ready(timeout)
        sent = run_streamtally(
            "produce", "--source", PROBE_SOURCE, "--tenant", tenant, "--request-id", probe_id,
            str(PROBE_FILE), env=endpoints.env(), timeout=60,
        )  # fmt: skip
        if sent.returncode != 0:
            raise WorkerError(f"probe produce failed: {sent.stderr.decode(errors='replace')}")
        left = max(5.0, timeout - (time.monotonic() - start))
        if wait_for_tokens(endpoints.redis_url, [RequestRef(tenant, probe_id)], left, self):
            raise WorkerError(f"probe {probe_id} never reached Redis\n{self.describe()}")


def assert_stopped_cleanly(worker: WorkerProcess, timeout: float = 30.0) -> float:
    """SIGTERM the worker and assert it exits 0 within `timeout`; returns the seconds taken."""
    code, took = worker.stop(timeout)
    if code is None:
        raise WorkerError(f"worker ignored SIGTERM for {timeout:g} s\n{worker.describe()}")
    if code != 0:
        raise WorkerError(f"worker exited {code} after SIGTERM, not 0\n{worker.describe()}")
    return took


# --------------------------------------------------------------------------- cleanup


def forget_usage(redis_url: str, tenants: Iterable[str]) -> None:
    """Delete the usage rows of `tenants` (only theirs) and their members of the row index.

    The requests' Tokens keys and closing markers stay: they are the pipeline's
    idempotency markers.  Without them a replay of the raw records (the worker
    re-reads every record after its partition's oldest open request when it
    restarts or rebalances) would write the requests and their usage again.
    """
    wanted = set(tenants)

    async def forget() -> None:
        store = RedisStore.from_url(redis_url, connect_timeout=5)
        try:
            await store.delete_usage(wanted)
        finally:
            await store.aclose()

    asyncio.run(forget())


async def ensure_served_topics(bootstrap_servers: str, topics: Topics) -> None:
    """Create the namespace's topics that are missing, and return once the broker serves
    every partition's offsets (its leader took over), those that existed already too."""
    await ensure_topics(bootstrap_servers, topics.all)
    await wait_served(bootstrap_servers, list(topics.all))


# --------------------------------------------------------------------------- isolated runs


def flush_db(url: str) -> None:
    """Empty the Redis database `url` names (a test's own)."""
    import redis as redis_sync

    client = redis_sync.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


@contextlib.contextmanager
def own_worker(
    bootstrap_servers: str,
    redis_url: str,
    *,
    prefix: str,
    log: Path,
    request_timeout: float,
) -> Iterator[tuple[Settings, worker_process.WorkerProcess]]:
    """A ready worker in a topic namespace and a leased Redis database of its own (emptied
    before and after, `leased_db`), and the settings a test's producers and reads use with it."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    with leased_db(redis_url) as db:
        url = db_url(redis_url, db)
        settings = Settings.load(
            {
                "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
                "REDIS_URL": url,
                "STREAMTALLY_NAMESPACE": namespace,
            }
        )
        flush_db(url)
        asyncio.run(ensure_served_topics(bootstrap_servers, Topics.in_namespace(namespace)))
        env = dict(os.environ)
        env.update(
            KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers,
            REDIS_URL=url,
            STREAMTALLY_NAMESPACE=namespace,
            STREAMTALLY_REQUEST_TIMEOUT=str(request_timeout),
        )
        worker = worker_process.WorkerProcess(log, env, cwd=REPO).start()
        try:
            worker.wait_until_ready(60)
            yield settings, worker
        finally:
            worker.stop(timeout=30)
            flush_db(url)


def raw_sse_of(bootstrap_servers: str, namespace: str, tenants: Iterable[str]) -> list[Any]:
    """Every raw SSE record (`RawSseEvent`) of `tenants` on the namespace's raw topic, in
    the order read (partitions interleave), copies included; other tests' poison records
    on the shared topic are passed over."""
    from streamtally.errors import InputError
    from streamtally.wire import avro
    from streamtally.wire.kafka import read_topic

    wanted = set(tenants)
    found: list[Any] = []

    async def read() -> None:
        topic = Topics.in_namespace(namespace).raw_sse.name
        async for record in read_topic(bootstrap_servers, topic):
            if record.value is None:
                continue
            try:
                raw = avro.decode_raw_sse_event(record.value)
            except InputError:
                continue
            if raw.tenant in wanted:
                found.append(raw)

    asyncio.run(read())
    return found


def tapped_calls(
    bootstrap_servers: str, namespace: str, tenants: Iterable[str]
) -> dict[str, list[str]]:
    """The request ids the raw SSE topic holds for each of `tenants`, in the order of their
    first records' receive times (the order the calls were made).

    The proxy keys every call by an id of its own (``call-…``), which a client does not
    see: a test finds its calls' Tokens through their raw records.
    """
    wanted = list(tenants)
    first: dict[str, dict[str, Any]] = {tenant: {} for tenant in wanted}
    for raw in raw_sse_of(bootstrap_servers, namespace, wanted):
        seen = first[raw.tenant].get(raw.request_id)
        if seen is None or raw.received_at < seen:
            first[raw.tenant][raw.request_id] = raw.received_at
    return {tenant: sorted(ids, key=ids.__getitem__) for tenant, ids in first.items()}


def as_called(expected: Mapping[str, Any], call_id: str) -> dict[str, Any]:
    """`streamtally fold`'s JSON of a call (keyed by the provider's id) as `tokens get`
    prints the proxy's call: keyed by its call id, the provider's id beside it."""
    out = dict(expected)
    provider = out["request_id"]
    out["request_id"] = call_id
    if provider != call_id:
        out["provider_request_id"] = provider
    return out
