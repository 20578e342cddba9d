"""The secured stack (``stack up --secure``): refused without the right credentials, whole with.

A stack of the module's own (its state dir, spare ports reserved as every stack of a
test's own gets them, `tests.integration.spare_stack`) is started with ``streamtally stack up
--secure``: the broker on SASL_SSL with SCRAM-SHA-512 users made at format,
Redis on TLS only with the worker's ACL user.  The client environment comes
from ``streamtally stack env``, as a user gets it.  Then:

- a plaintext Kafka client, a wrong SCRAM password, a Redis client without
  the password, and one without TLS are refused (exit 2, one line);
- the worker's Redis user cannot step outside its ACL (other keys, FLUSHALL,
  CONFIG, EVAL of its own script);
- with the right credentials, ``produce`` -> worker -> the request's Tokens
  (equal to ``fold``), its usage row and its billing event, and ``audit``
  finds nothing wrong;
- no password is in any output, the worker's log or ``stack status``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.exceptions

from streamtally.core.identity import RequestRef
from streamtally.settings import Settings
from streamtally.stack.client_env import SECURITY_VARIABLES
from streamtally.store import tokens_key
from tests.integration.spare_stack import spare_config, stack_variables
from tests.integration.worker import (
    REPO,
    SAMPLES,
    Endpoints,
    StackMode,
    WorkerProcess,
    assert_stopped_cleanly,
    cli,
    streamtally,
    wait_for_tokens,
)

pytestmark = pytest.mark.integration

SAMPLE = SAMPLES / "anthropic" / "text_end_turn.sse"
#: Variables of the session's own stack that must not leak into the secured one's clients.
_SESSION_VARIABLES = (
    "KAFKA_BOOTSTRAP_SERVERS",
    "REDIS_URL",
    "REDIS_CLUSTER",
    "STREAMTALLY_NAMESPACE",
    *SECURITY_VARIABLES,
)


@dataclass(frozen=True, slots=True)
class Secured:
    """The secured stack: the environment of its management commands, and a client's."""

    stack_env: dict[str, str]
    client_env: dict[str, str]
    #: Every output of the stack's own commands, for the search for secrets.
    outputs: dict[str, str]

    @property
    def passwords(self) -> set[str]:
        url = self.client_env["REDIS_URL"]
        redis_password = url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
        return {self.client_env["KAFKA_SASL_PASSWORD"], redis_password}


def _run(
    argv: list[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout, check=False
    )


def _exports(text: str) -> dict[str, str]:
    """The ``export NAME=value`` lines of ``stack env``, as a shell would read them."""
    env = {}
    for line in text.splitlines():
        words = shlex.split(line)
        assert words[0] == "export", line
        name, _, value = words[1].partition("=")
        env[name] = value
    return env


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    base = {k: v for k, v in os.environ.items() if k not in _SESSION_VARIABLES}
    # Below Linux's ephemeral range, and reserved: ports picked in it (this test's were
    # 39394-39399) can be taken by any outgoing connection before the broker binds them.
    with contextlib.ExitStack() as held:  # the ports stay reserved until the stack is down
        cfg = spare_config(tmp_path_factory.mktemp("secured-stack"), held)
        stack_env = {**base, **stack_variables(cfg), "STREAMTALLY_WEB_PORT": "0"}
        outputs: dict[str, str] = {}
        up = _run(streamtally("stack", "up", "--secure"), stack_env, timeout=600)
        outputs["stack up"] = up.stdout + up.stderr
        try:
            assert up.returncode == 0, outputs["stack up"]
            printed = _run(streamtally("stack", "env"), stack_env)
            assert printed.returncode == 0, printed.stderr
            client_env = {**stack_env, **_exports(printed.stdout)}
            status = _run(streamtally("stack", "status"), stack_env)
            assert status.returncode == 0, status.stdout + status.stderr
            outputs["stack status"] = status.stdout + status.stderr
            yield Secured(stack_env, client_env, outputs)
        finally:
            down = _run(streamtally("stack", "down"), stack_env)
            assert down.returncode == 0, down.stdout + down.stderr


def test_stack_env_describes_a_secured_stack(secured: Secured) -> None:
    env = secured.client_env
    assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert env["REDIS_URL"].startswith("rediss://streamtally:")
    assert Path(env["KAFKA_SSL_CAFILE"]).is_file()
    assert "SASL_SSL, SCRAM-SHA-512 as streamtally" in secured.outputs["stack status"]
    assert "rediss://streamtally:***@" in secured.outputs["stack status"]


def test_without_the_right_credentials_nothing_gets_in(secured: Secured) -> None:
    env = secured.client_env
    plaintext = {k: v for k, v in env.items() if k not in SECURITY_VARIABLES}
    plaintext["REDIS_URL"] = env["REDIS_URL"]
    plaintext["REDIS_SSL_CAFILE"] = env["REDIS_SSL_CAFILE"]
    wrong_password = f"wrong-{uuid.uuid4().hex}"
    redis_without_password = "rediss://" + env["REDIS_URL"].split("@", 1)[1]
    redis_without_tls = "redis://" + env["REDIS_URL"].split("://", 1)[1]
    refusals = {
        "kafka, plaintext": (
            ["billing", "export"], plaintext, "cannot reach Kafka at 127.0.0.1:"
        ),
        "kafka, wrong SCRAM password": (
            ["billing", "export"],
            {**env, "KAFKA_SASL_PASSWORD": wrong_password},
            "refused these credentials or TLS settings",
        ),
        "redis, no password": (
            ["usage"], {**env, "REDIS_URL": redis_without_password}, "refused the credentials"
        ),
        "redis, no TLS": (["usage"], {**env, "REDIS_URL": redis_without_tls}, "cannot reach Redis"),
    }  # fmt: skip
    for name, (command, command_env, said) in refusals.items():
        done = _run(streamtally(*command), command_env)
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        assert said in done.stderr, (name, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (name, done.stderr)
        for secret in (*secured.passwords, wrong_password):
            assert secret not in done.stdout + done.stderr, name


def test_the_worker_redis_user_stays_inside_its_acl(secured: Secured) -> None:
    settings = Settings.load(secured.client_env)
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    try:
        assert client.ping()
        own_key = tokens_key(RequestRef("acl-probe", uuid.uuid4().hex))  # a key of the layout
        assert client.set(own_key, "1")
        assert client.delete(own_key) == 1
        denied = [
            lambda: client.set("other-app:key", "1"),
            lambda: client.get("other-app:key"),
            client.flushall,
            lambda: client.config_get("dir"),
            lambda: client.eval("return 1", 0),
            lambda: client.execute_command("ACL", "LIST"),
        ]
        for attempt in denied:
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
    finally:
        client.close()


def test_with_the_right_credentials_the_pipeline_works_end_to_end(
    secured: Secured, tmp_path: Path
) -> None:
    namespace = f"secure-{uuid.uuid4().hex[:8]}"
    env = {**secured.client_env, "STREAMTALLY_NAMESPACE": namespace}
    settings = Settings.load(env)
    outputs = dict(secured.outputs)
    tenant, request_id = f"t-{uuid.uuid4().hex[:8]}", f"secure-{uuid.uuid4().hex}"
    worker = WorkerProcess(tmp_path / "worker.log", env).start()
    try:
        worker.wait_until_ready(60)
        sent = _run(
            streamtally("produce", "--source", "anthropic", "--tenant", tenant,
                        "--request-id", request_id, str(SAMPLE)),
            env,
        )  # fmt: skip
        outputs["produce"] = sent.stdout + sent.stderr
        assert sent.returncode == 0, outputs["produce"]
        ref = RequestRef(tenant, request_id)
        assert not wait_for_tokens(settings.redis_url, [ref], 30, worker), worker.describe()

        folded = _run(
            streamtally("fold", "--source", "anthropic", "--request-id", request_id, str(SAMPLE)),
            env,
        )
        expected = json.loads(folded.stdout)
        got = _run(streamtally("tokens", "get", request_id, "--tenant", tenant), env)
        outputs["tokens get"] = got.stdout + got.stderr
        assert got.returncode == 0, outputs["tokens get"]
        assert json.loads(got.stdout) == expected

        usage = _run(streamtally("usage", "--tenant", tenant, "--json"), env)
        outputs["usage"] = usage.stdout + usage.stderr
        [row] = json.loads(usage.stdout)
        assert row["requests"] == 1
        assert {name: row[name] for name in expected["usage"]} == expected["usage"]

        billing = _run(streamtally("billing", "export", "--json"), env)
        outputs["billing export"] = billing.stdout + billing.stderr
        assert billing.returncode == 0, outputs["billing export"]
        [event] = [json.loads(line) for line in billing.stdout.splitlines()]
        assert (event["tenant"], event["request_id"]) == (tenant, request_id)
        assert event["output_tokens"] == expected["usage"]["output_tokens"] > 0

        # The audit's own clients (admin, consumer) connect the same way: nothing to report.
        audit = _run(streamtally("audit", "--tenant", tenant, "--json"), env)
        outputs["audit"] = audit.stdout + audit.stderr
        assert audit.returncode == 0, outputs["audit"]
    finally:
        if worker.running:
            assert_stopped_cleanly(worker)
    log = worker.log_text()
    outputs["worker (log)"] = log
    assert "kafka 127.0.0.1:" in log
    assert "(SASL_SSL, SCRAM-SHA-512 as streamtally)" in log  # its start line
    assert "redis rediss://streamtally:***@127.0.0.1:" in log
    leaks = [(name, s) for name, text in outputs.items() for s in secured.passwords if s in text]
    assert not leaks, [name for name, _ in leaks]


def test_stack_env_of_the_plaintext_stack(stack_endpoints: Endpoints) -> None:
    """The session's own local stack: its servers and URL, the security variables unset."""
    if stack_endpoints.mode is not StackMode.LOCAL:
        pytest.skip("the session does not run on the local stack")
    done = cli("stack", "env")
    assert done.code == 0, done.err
    lines = done.out.decode().splitlines()
    servers = f"export KAFKA_BOOTSTRAP_SERVERS={stack_endpoints.bootstrap_servers}"
    assert any(line.startswith(servers) for line in lines), lines  # the first broker first
    assert f"export REDIS_URL={stack_endpoints.redis_url}" in lines
    assert lines[-1] == f"unset {' '.join(SECURITY_VARIABLES)}"
