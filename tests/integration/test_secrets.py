"""A Redis password never shows: the pipeline run against a Redis that requires one.

A `redis-server` of the test's own (``--requirepass``, on a free port, no
persistence) and the session's Kafka; a worker in a topic namespace of its
own; then ``produce``, ``fold``, ``tokens get``, ``usage``, commands given a
wrong password or none, a worker given a wrong password, ``stack status`` and
the ``--help`` of every command.  The password (as written and
percent-encoded) must not be in any of their outputs nor in the worker's log,
while the pipeline did its work: the usage row holds the counts `fold` gives.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from streamtally.cli import build_parser, main
from streamtally.core.identity import RequestRef
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics
from tests.integration.worker import (
    REPO,
    SAMPLES,
    WorkerProcess,
    assert_stopped_cleanly,
    streamtally,
    wait_for_tokens,
)

pytestmark = pytest.mark.integration

#: A password with the characters a URL must percent-encode, unique to this run.
PASSWORD = f"pw@{uuid.uuid4().hex[:12]}/:x%?#"
WRONG = f"wrong-{uuid.uuid4().hex[:12]}"
SAMPLE = SAMPLES / "openai" / "text_usage.sse"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _url(port: int, password: str | None) -> str:
    auth = "" if password is None else f":{quote(password, safe='')}@"
    return f"redis://{auth}127.0.0.1:{port}/0"


@pytest.fixture
def redis_port(tmp_path: Path) -> Iterator[int]:
    """A `redis-server` that requires `PASSWORD`, stopped (and reaped) after the test."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    data = tmp_path / "redis"
    data.mkdir()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(data)]
    with (data / "server.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=data)
    try:
        client = redis.Redis(port=port, password=PASSWORD, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=60, check=False
    )


def _every_parser(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from _every_parser(sub)


def _help_texts(monkeypatch: pytest.MonkeyPatch, url: str) -> dict[str, str]:
    """``--help`` of every command and subcommand, with REDIS_URL set (in this process)."""
    monkeypatch.setenv("REDIS_URL", url)
    texts: dict[str, str] = {}
    for parser in _every_parser(build_parser()):
        argv = [*parser.prog.split()[1:], "--help"]
        out, err = io.StringIO(), io.StringIO()
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            pytest.raises(SystemExit) as done,
        ):
            main(argv)
        assert done.value.code == 0, (argv, err.getvalue())
        texts[" ".join(argv)] = out.getvalue() + err.getvalue()
    return texts


def test_the_redis_password_never_shows(
    bootstrap_servers: str,
    redis_port: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    namespace = f"secrets-{uuid.uuid4().hex[:8]}"
    url = _url(redis_port, PASSWORD)
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "REDIS_URL": url,
        "STREAMTALLY_NAMESPACE": namespace,
    }
    asyncio.run(ensure_topics(bootstrap_servers, Topics.in_namespace(namespace).all))
    outputs: dict[str, str] = {}

    def record(name: str, done: subprocess.CompletedProcess[str]) -> str:
        outputs[f"{name} (stdout)"] = done.stdout
        outputs[f"{name} (stderr)"] = done.stderr
        return done.stderr

    worker = WorkerProcess(tmp_path / "worker.log", env).start()
    try:
        worker.wait_until_ready(60)
        tenant, request_id = f"t-{uuid.uuid4().hex[:8]}", f"secrets-{uuid.uuid4().hex}"
        sent = _run(
            streamtally("produce", "--source", "openai", "--tenant", tenant,
                        "--request-id", request_id, str(SAMPLE)),
            env,
        )  # fmt: skip
        assert sent.returncode == 0, record("produce", sent)
        record("produce", sent)
        folded = _run(
            streamtally("fold", "--source", "openai", "--request-id", request_id, str(SAMPLE)),
            env,
        )
        assert folded.returncode == 0, record("fold", folded)
        record("fold", folded)
        expected = json.loads(folded.stdout)
        ref = RequestRef(tenant, request_id)
        assert not wait_for_tokens(url, [ref], 30, worker), worker.describe()

        # Reads with the right password work, and say nothing of it.
        got = _run(streamtally("tokens", "get", request_id, "--tenant", tenant), env)
        assert got.returncode == 0, record("tokens get", got)
        record("tokens get", got)
        assert json.loads(got.stdout) == expected
        usage = _run(streamtally("usage", "--tenant", tenant, "--json"), env)
        assert usage.returncode == 0, record("usage", usage)
        record("usage", usage)
        [row] = json.loads(usage.stdout)
        assert row["requests"] == 1
        assert {name: row[name] for name in expected["usage"]} == expected["usage"]
        assert expected["usage"]["output_tokens"] > 0

        # A wrong password, or none: a clear error, exit 2, no password of either kind.
        wrong_env = {**env, "REDIS_URL": _url(redis_port, WRONG)}
        bad = _run(streamtally("usage"), wrong_env)
        assert bad.returncode == 2
        assert record("usage, wrong password", bad).startswith(
            f"streamtally usage: Redis at redis://:***@127.0.0.1:{redis_port}/0 refused the "
            "credentials ("
        ), bad.stderr
        no_password = _url(redis_port, None)
        bare = _run(streamtally("tokens", "get", request_id, "--redis-url", no_password), env)
        assert bare.returncode == 2
        assert "refused the credentials" in record("tokens get, no password", bare)
        refused = WorkerProcess(tmp_path / "wrong-worker.log", wrong_env).start()
        refused.proc.wait(timeout=60)
        outputs["worker, wrong password (log)"] = refused.log_text()
        assert refused.returncode == 2, refused.describe()
        assert "streamtally worker: Redis at redis://:***@" in refused.log_text()
        assert "refused the credentials" in refused.log_text()

        status = _run(streamtally("stack", "status"), env)
        record("stack status", status)
    finally:
        if worker.running:
            assert_stopped_cleanly(worker)
    log = worker.log_text()
    outputs["worker (log)"] = log
    assert f"redis redis://:***@127.0.0.1:{redis_port}/0" in log  # its start line, redacted
    outputs.update(_help_texts(monkeypatch, url))

    secrets = {PASSWORD, quote(PASSWORD, safe=""), WRONG}
    leaks = [(name, s) for name, text in outputs.items() for s in secrets if s in text]
    assert not leaks, leaks
    assert len(outputs) > 30  # every output above, and the help of every command
