"""The schema registry client (`streamtally.wire.registry`): the Confluent REST API calls,
their caching, basic auth, and errors that say what to do without showing secrets."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from streamtally.errors import InputError, StreamtallyError
from streamtally.settings import Settings
from streamtally.wire.registry import (
    CONTENT_TYPE,
    HttpRequest,
    HttpResponse,
    SchemaNotFound,
    SchemaRegistry,
    SchemaRegistryError,
    subject_of,
    urllib_transport,
)
from tests.fake_registry import FakeRegistry

SCHEMA = json.dumps({"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]})
OTHER = json.dumps({"type": "record", "name": "R", "fields": []})


def client(fake: FakeRegistry, **kwargs: str) -> SchemaRegistry:
    return SchemaRegistry(fake.base + "/", transport=fake, **kwargs)  # type: ignore[arg-type]


def test_the_subject_of_a_topic_is_its_name_and_value() -> None:
    assert subject_of("streamtally.billing") == "streamtally.billing-value"


def test_register_posts_the_schema_and_caches_its_id() -> None:
    fake = FakeRegistry(first_id=41)
    registry = client(fake)
    assert registry.register("t-value", SCHEMA) == 41
    assert registry.register("t-value", SCHEMA) == 41  # cached: asked once
    assert registry.register("t-value", OTHER) == 42
    assert fake.calls() == ["POST /subjects/t-value/versions", "POST /subjects/t-value/versions"]
    first = fake.requests[0]
    assert json.loads(first.body or b"") == {"schema": SCHEMA}
    assert first.headers["Content-Type"] == CONTENT_TYPE
    assert "application/json" in first.headers["Accept"]
    assert "Authorization" not in first.headers
    # A fresh client (another process) gets the same id from the registry: idempotent.
    assert client(fake).register("t-value", SCHEMA) == 41
    assert fake.subjects == {"t-value": [SCHEMA, OTHER]}


def test_subjects_are_one_path_segment() -> None:
    fake = FakeRegistry()
    client(fake).set_compatibility("a/b c-value")
    assert fake.calls() == ["PUT /config/a%2Fb%20c-value"]
    assert fake.config == {"a%2Fb%20c-value": "BACKWARD"}  # (the fake does not unquote)
    assert json.loads(fake.requests[0].body or b"") == {"compatibility": "BACKWARD"}


def test_schema_by_id_is_fetched_once() -> None:
    fake = FakeRegistry()
    schema_id = fake.add(SCHEMA)
    registry = client(fake)
    assert registry.schema(schema_id) == SCHEMA
    assert registry.schema(schema_id) == SCHEMA
    assert fake.calls() == [f"GET /schemas/ids/{schema_id}"]
    with pytest.raises(SchemaNotFound, match=r"schema id 999 \(HTTP 404, error 40403"):
        registry.schema(999)


def test_lookup_says_whether_a_subject_holds_a_schema() -> None:
    fake = FakeRegistry(first_id=5)
    registry = client(fake)
    assert registry.lookup("t-value", SCHEMA) is None  # no such subject (40401)
    client(fake).register("t-value", SCHEMA)
    assert registry.lookup("t-value", OTHER) is None  # not under it (40403)
    assert registry.lookup("t-value", SCHEMA) == 5
    assert registry.lookup("t-value", SCHEMA) == 5  # cached
    assert fake.calls("POST").count("POST /subjects/t-value") == 3


def test_basic_auth_header_and_no_password_in_repr_or_errors() -> None:
    fake = FakeRegistry(fail_with=401)
    registry = client(fake, username="svc", password="s3cret-pw")
    with pytest.raises(SchemaRegistryError) as raised:
        registry.register("t-value", SCHEMA)
    header = fake.requests[0].headers["Authorization"]
    assert header == "Basic " + base64.b64encode(b"svc:s3cret-pw").decode()
    message = str(raised.value)
    assert "HTTP 401" in message
    assert "STREAMTALLY_SCHEMA_REGISTRY_USERNAME" in message
    assert "s3cret-pw" not in message + repr(registry)


def test_credentials_in_the_url_are_hidden() -> None:
    fake = FakeRegistry(down=True)
    registry = SchemaRegistry("https://svc:hunter22@registry.test/api", transport=fake)
    assert "hunter22" not in repr(registry)
    with pytest.raises(SchemaRegistryError) as raised:
        registry.schema(1)
    message = str(raised.value)
    assert "hunter22" not in message
    assert "https://svc:***@registry.test/api" in message


def test_an_unreachable_registry_says_what_to_do() -> None:
    registry = client(FakeRegistry(down=True))
    with pytest.raises(SchemaRegistryError) as raised:
        registry.register("t-value", SCHEMA)
    message = str(raised.value)
    assert "cannot reach the schema registry at http://registry.test/apis/ccompat/v7" in message
    assert "registering the schema of subject 't-value'" in message
    assert "STREAMTALLY_SCHEMA_REGISTRY_URL" in message
    assert "Connection refused" in message
    # Not an input error: the worker stops instead of dead-lettering what it could read.
    assert isinstance(raised.value, StreamtallyError)
    assert not isinstance(raised.value, InputError)


@pytest.mark.parametrize(
    ("status", "needle"),
    [
        (403, "USERNAME"),
        (409, "not BACKWARD compatible"),
        (422, "no valid schema"),
        (500, "try again"),
    ],
)
def test_refusals_say_why(status: int, needle: str) -> None:
    registry = client(FakeRegistry(fail_with=status))
    with pytest.raises(SchemaRegistryError, match=needle) as raised:
        registry.register("t-value", SCHEMA)
    assert f"HTTP {status}, error {status}: refused" in str(raised.value)
    assert not isinstance(raised.value, SchemaNotFound)


def test_a_404_outside_the_api_names_the_url_to_set() -> None:
    """A 404 without the API's error code: the URL is not the Confluent REST API."""
    registry = SchemaRegistry(
        "http://r.test/apis/registry/v3", transport=lambda r: HttpResponse(404, b"<html>")
    )
    with pytest.raises(SchemaRegistryError, match="ccompat/v7") as raised:
        registry.register("t-value", SCHEMA)
    assert not isinstance(raised.value, SchemaNotFound)


def test_an_answer_without_an_id_or_json_is_an_error() -> None:
    registry = SchemaRegistry("http://r.test", transport=lambda r: HttpResponse(200, b"{}"))
    with pytest.raises(SchemaRegistryError, match="without a schema id"):
        registry.register("s", SCHEMA)
    registry = SchemaRegistry("http://r.test", transport=lambda r: HttpResponse(200, b"<x>"))
    with pytest.raises(SchemaRegistryError, match="no JSON"):
        registry.register("s", SCHEMA)


def test_from_settings() -> None:
    assert SchemaRegistry.from_settings(Settings()) is None
    settings = Settings(
        schema_registry_url="http://r.test:8081/apis/ccompat/v7/",
        schema_registry_username="u",
        schema_registry_password="p",
        schema_registry_timeout=2.5,
    )
    fake = FakeRegistry(base="http://r.test:8081/apis/ccompat/v7")
    registry = SchemaRegistry.from_settings(settings, transport=fake)  # type: ignore[arg-type]
    assert registry is not None
    assert registry.url == "http://r.test:8081/apis/ccompat/v7"
    registry.set_compatibility("s")
    assert fake.requests[0].headers["Authorization"] == "Basic " + base64.b64encode(b"u:p").decode(
        "ascii"
    )


# --------------------------------------------------------------------------- real HTTP


class _Handler(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str, str | None, bytes]]] = []

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        if self.path.startswith("/schemas/ids/7"):
            status, doc = 200, {"schema": SCHEMA}
        elif self.path.startswith("/subjects/"):
            status, doc = 200, {"id": 7}
        else:
            status, doc = 404, {"error_code": 40403, "message": "Schema 8 not found"}
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = _reply

    def log_message(self, format: str, *args: object) -> None:
        del format, args


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_urllib_transport_over_real_http(server: str) -> None:
    _Handler.seen = []
    registry = SchemaRegistry(server, username="u", password="p", timeout=5)
    assert registry.register("t-value", SCHEMA) == 7
    assert registry.schema(7) == SCHEMA  # asked: a registration caches no schema text
    assert registry.schema(7) == SCHEMA  # cached
    with pytest.raises(SchemaNotFound, match="Schema 8 not found"):
        registry.schema(8)
    method, path, auth, body = _Handler.seen[0]
    assert (method, path) == ("POST", "/subjects/t-value/versions")
    assert auth == "Basic " + base64.b64encode(b"u:p").decode()
    assert json.loads(body) == {"schema": SCHEMA}
    assert [(m, p) for m, p, _, _ in _Handler.seen] == [
        ("POST", "/subjects/t-value/versions"),
        ("GET", "/schemas/ids/7"),
        ("GET", "/schemas/ids/8"),
    ]


def test_the_urllib_transport_raises_oserror_when_nothing_listens() -> None:
    send = urllib_transport(2.0)
    with pytest.raises(OSError):  # noqa: PT011 - any refusal of the connection
        send(HttpRequest("GET", "http://127.0.0.1:9/subjects", {}))
    registry = SchemaRegistry("http://127.0.0.1:9", timeout=2.0)
    with pytest.raises(SchemaRegistryError, match="cannot reach the schema registry"):
        registry.schema(1)
