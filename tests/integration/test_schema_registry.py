"""The stack's schema registry (`stack up --registry`): the Confluent API and ids that last.

A registry of the test's own runs from the application built in the stack's
state dir (built there first if it is not: ~30 s with the jars in ~/.m2), on
a free port with its database in a temporary folder, so that the stack's
registry and its schemas are left alone.  Through the ``ccompat`` API it
registers the project's BillingEvent schema, reads it back by id, registers
it again (same id, also when spelled differently), then the registry is
killed (SIGKILL: no clean shutdown) and started again: the id still names the
schema, and registering it again still returns that id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamtally.settings import LOCAL_HOST, Settings
from streamtally.stack import port_in_use, registry
from streamtally.stack.config import StackConfig
from streamtally.stack.java import Java
from streamtally.wire.avro import current, known_version
from tests.integration.isolation import machine_lock

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCAL_HOST, 0))
        port: int = sock.getsockname()[1]
    return port


def _call(url: str, body: dict[str, Any] | None = None, method: str = "GET") -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": CONTENT_TYPE}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def built() -> tuple[registry.RegistryHome, Java]:
    """The application built in the stack's state dir (built now if it is not, or taken from
    the machine's cache as `stack up --registry` would), and a Java."""
    settings = Settings.load()
    cfg = StackConfig.from_settings(settings)
    home = registry.home(cfg)
    java = registry.find_registry_java(
        settings.registry_java, need_compiler=not registry.app_built(home)
    )
    start = time.monotonic()
    with machine_lock("schema-registry-up"):  # not while another process builds it
        registry.ensure_built(home, java, print, cfg.cache("registry"))
    print(f"registry application ready in {time.monotonic() - start:.1f} s")
    return home, java


class OwnRegistry:
    """A registry of the test's own: started, killed and started again on one database."""

    def __init__(self, home: registry.RegistryHome, java: Java, root: Path) -> None:
        self.home, self.java = home, java
        self.paths = registry.RegistryPaths(root)
        self.port = _free_port()
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"{registry.base_url(LOCAL_HOST, self.port)}{registry.CCOMPAT_PATH}"

    def start(self) -> float:
        self.pid, waited = registry.start(
            self.java, self.home, self.paths, (LOCAL_HOST, self.port), print
        )
        print(f"registry answered in {waited:.1f} s")
        return waited

    def kill(self) -> None:
        """SIGKILL: whatever the registry had not written is lost."""
        assert self.pid is not None
        os.killpg(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while registry.answers(LOCAL_HOST, self.port, timeout=0.5) or port_in_use(
            LOCAL_HOST, self.port
        ):
            assert time.monotonic() < deadline, "the killed registry still holds its port"
            time.sleep(0.2)
        self.paths.pid_file.unlink(missing_ok=True)
        self.pid = None

    def stop(self) -> None:
        registry.stop(self.paths, print, self.port)


@pytest.fixture
def own_registry(
    built: tuple[registry.RegistryHome, Java], tmp_path: Path
) -> Iterator[OwnRegistry]:
    home, java = built
    own = OwnRegistry(home, java, tmp_path / "registry")
    try:
        yield own
    finally:
        own.stop()


def _register(url: str, subject: str, schema: str) -> int:
    answer = _call(f"{url}/subjects/{subject}/versions", {"schema": schema}, "POST")
    schema_id: int = answer["id"]
    return schema_id


def test_schemas_are_registered_once_and_their_ids_survive_a_kill(
    own_registry: OwnRegistry,
) -> None:
    own_registry.start()
    url = own_registry.url
    billing = current("BillingEvent")
    text = json.dumps(billing.schema)
    subject = f"st-test-{uuid.uuid4().hex}-value"

    schema_id = _register(url, subject, text)
    assert _register(url, subject, text) == schema_id  # idempotent
    assert _call(f"{url}/subjects/{subject}/versions") == [1]
    # another schema gets another id
    tokens_id = _register(
        url, f"st-test-{uuid.uuid4().hex}-value", json.dumps(current("Tokens").schema)
    )
    assert tokens_id != schema_id

    read = _call(f"{url}/schemas/ids/{schema_id}")
    assert known_version(read["schema"]) is billing  # same canonical form as the codec's
    latest = _call(f"{url}/subjects/{subject}/versions/latest")
    assert (latest["id"], latest["version"], latest["subject"]) == (schema_id, 1, subject)

    # compatibility, as the Confluent framing sets it per subject
    assert _call(f"{url}/config/{subject}", {"compatibility": "BACKWARD"}, "PUT") == {
        "compatibility": "BACKWARD"
    }

    own_registry.kill()
    own_registry.start()

    assert known_version(_call(f"{url}/schemas/ids/{schema_id}")["schema"]) is billing
    assert _call(f"{url}/schemas/ids/{tokens_id}")["schema"]
    assert _register(url, subject, text) == schema_id
    assert _call(f"{url}/config/{subject}")["compatibilityLevel"] == "BACKWARD"


def test_the_sessions_registry_serves_the_confluent_api(schema_registry_url: str) -> None:
    """The registry other tests get (`schema_registry_url`: the stack's, started if need be)."""
    subject = f"st-test-{uuid.uuid4().hex}-value"
    tokens = current("Tokens")
    schema_id = _register(schema_registry_url, subject, json.dumps(tokens.schema))
    try:
        assert subject in _call(f"{schema_registry_url}/subjects")
        read = _call(f"{schema_registry_url}/schemas/ids/{schema_id}")
        assert known_version(read["schema"]) is tokens
    finally:  # a registry others use: leave no test subject behind
        _call(f"{schema_registry_url}/subjects/{subject}", method="DELETE")
        _call(f"{schema_registry_url}/subjects/{subject}?permanent=true", method="DELETE")
