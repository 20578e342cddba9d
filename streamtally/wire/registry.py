"""A schema registry client speaking the Confluent REST API (what the Confluent framing needs).

Confluent Schema Registry, Karapace and Apicurio Registry's ``ccompat`` API
(``<base>/apis/ccompat/v7``) all serve the calls made here:

=====================================  ==========================================
``POST /subjects/{subject}/versions``  `register`: the schema's id (idempotent: the
                                       same schema gets the same id)
``PUT /config/{subject}``              `set_compatibility` (BACKWARD)
``GET /schemas/ids/{id}``              `schema`: the schema text of an id
``POST /subjects/{subject}``           `lookup`: the id of a schema under a subject,
                                       None when it is not there
=====================================  ==========================================

Subjects are named by topic (``<topic>-value``, the TopicNameStrategy of the
Confluent serializers).  Ids and schemas are cached in memory: each is asked
once per client.

Synchronous, on the standard library's HTTP client: an id met while decoding
is asked for inside the (synchronous) decoders, the CLI's and the worker's alike;
the worker asks for a batch's unknown ids from a thread before it decodes
the batch (`streamtally.wire.framing.learn_ids`).  The transport is a plain
function (`Transport`), so tests give one of their own.

Errors are `SchemaRegistryError` (a `StreamtallyError`, not an `InputError`: a
registry that cannot be reached is no fault of a record, and the worker stops
rather than dead-letter records it could read later), saying what to do; the
URL is shown with its credentials hidden (`streamtally.redact`), and the
password is never part of a message.  A schema id the registry does not have
is `SchemaNotFound`.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from streamtally.errors import SchemaNotFound, SchemaRegistryError
from streamtally.redact import redact_text, redact_url
from streamtally.settings import Settings

__all__ = [
    "COMPATIBILITY",
    "CONTENT_TYPE",
    "HttpRequest",
    "HttpResponse",
    "SchemaNotFound",
    "SchemaRegistry",
    "SchemaRegistryError",
    "Transport",
    "subject_of",
    "urllib_transport",
]

#: The media type of the Confluent REST API's bodies.
CONTENT_TYPE: Final = "application/vnd.schemaregistry.v1+json"
_ACCEPT: Final = f"{CONTENT_TYPE}, application/vnd.schemaregistry+json, application/json"
#: The compatibility every subject the project writes is set to.
COMPATIBILITY: Final = "BACKWARD"
#: The Confluent API's error codes for "no such subject", "no such version" and "no such
#: schema" (HTTP 404).
_NOT_FOUND: Final = frozenset({40401, 40402, 40403})


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


#: Sends one request; raises `OSError` (timeouts included) when there is no answer.
Transport = Callable[[HttpRequest], HttpResponse]


def urllib_transport(timeout: float, context: ssl.SSLContext | None = None) -> Transport:
    """A `Transport` over `urllib.request` (TLS with `context` for ``https://`` URLs)."""

    def send(request: HttpRequest) -> HttpResponse:
        req = urllib.request.Request(
            request.url, data=request.body, headers=dict(request.headers), method=request.method
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as answer:
                return HttpResponse(answer.status, answer.read(), dict(answer.headers))
        except urllib.error.HTTPError as exc:
            with exc:
                return HttpResponse(exc.code, exc.read(), dict(exc.headers or {}))
        except urllib.error.URLError as exc:
            reason = exc.reason
            raise OSError(str(reason)) from (reason if isinstance(reason, BaseException) else exc)

    return send


def _ssl_context(
    cafile: Path | None, certfile: Path | None, keyfile: Path | None
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=None if cafile is None else str(cafile))
    if certfile is not None:
        context.load_cert_chain(str(certfile), None if keyfile is None else str(keyfile))
    return context


def subject_of(topic: str) -> str:
    """The subject of a topic's values: ``<topic>-value`` (TopicNameStrategy)."""
    return f"{topic}-value"


class SchemaRegistry:
    """A client of one registry's Confluent REST API (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 10.0,
        context: ssl.SSLContext | None = None,
        transport: Transport | None = None,
    ) -> None:
        #: The API's base URL (no trailing ``/``).
        self.url = url.strip().rstrip("/")
        #: As printed: credentials in the URL hidden.
        self.shown = redact_url(self.url)
        self._transport = transport or urllib_transport(timeout, context)
        self._headers = {"Accept": _ACCEPT, "Content-Type": CONTENT_TYPE}
        if username is not None:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode("ascii")
            self._headers["Authorization"] = f"Basic {token}"
        self._ids: dict[tuple[str, str], int] = {}
        self._schemas: dict[int, str] = {}

    @classmethod
    def from_settings(
        cls, settings: Settings, transport: Transport | None = None
    ) -> SchemaRegistry | None:
        """The registry of ``STREAMTALLY_SCHEMA_REGISTRY_URL`` (None when it is not set)."""
        url = (settings.schema_registry_url or "").strip()
        if not url:
            return None
        context = None
        if url.lower().startswith("https://") and transport is None:
            try:
                context = _ssl_context(
                    _expanded(settings.schema_registry_cafile),
                    _expanded(settings.schema_registry_certfile),
                    _expanded(settings.schema_registry_keyfile),
                )
            except (OSError, ssl.SSLError) as exc:
                raise SchemaRegistryError(
                    f"cannot load the schema registry's TLS files "
                    f"(STREAMTALLY_SCHEMA_REGISTRY_CAFILE, _CERTFILE, _KEYFILE): {exc}"
                ) from None
        password = settings.schema_registry_password
        return cls(
            url,
            username=settings.schema_registry_username,
            password=None if password is None else password.get_secret_value(),
            timeout=settings.schema_registry_timeout,
            context=context,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"SchemaRegistry({self.shown!r})"

    # -- the calls -----------------------------------------------------------------------

    def register(self, subject: str, schema: str) -> int:
        """The id of `schema` (its JSON text) under `subject`, registered if it is not yet.

        Idempotent: a schema the subject holds already keeps its id.  Refused (409) when
        the subject's compatibility does not allow it.
        """
        key = (subject, schema)
        cached = self._ids.get(key)
        if cached is not None:
            return cached
        answer = self._call(
            "POST",
            f"/subjects/{_segment(subject)}/versions",
            {"schema": schema},
            f"registering the schema of subject {subject!r}",
        )
        schema_id = _id_of(answer, self.shown)
        self._ids[key] = schema_id
        # Not `_schemas[schema_id] = schema`: a registry that deduplicates content by a
        # form of its own may have answered the id of another text (`framing` checks).
        return schema_id

    def set_compatibility(self, subject: str, level: str = COMPATIBILITY) -> None:
        """Set the compatibility level of `subject` (BACKWARD unless told)."""
        self._call(
            "PUT",
            f"/config/{_segment(subject)}",
            {"compatibility": level},
            f"setting the compatibility of subject {subject!r} to {level}",
        )

    def schema(self, schema_id: int) -> str:
        """The schema text the registry holds under `schema_id` (`SchemaNotFound` if none)."""
        cached = self._schemas.get(schema_id)
        if cached is not None:
            return cached
        answer = self._call("GET", f"/schemas/ids/{schema_id}", None, f"schema id {schema_id}")
        text = answer.get("schema") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise SchemaRegistryError(
                f"the schema registry at {self.shown} answered schema id {schema_id} without "
                "a schema: is STREAMTALLY_SCHEMA_REGISTRY_URL its Confluent REST API?"
            )
        self._schemas[schema_id] = text
        return text

    def lookup(self, subject: str, schema: str) -> int | None:
        """The id of `schema` under `subject`, or None when the subject does not hold it."""
        key = (subject, schema)
        cached = self._ids.get(key)
        if cached is not None:
            return cached
        try:
            answer = self._call(
                "POST",
                f"/subjects/{_segment(subject)}",
                {"schema": schema},
                f"looking the schema up under subject {subject!r}",
            )
        except SchemaNotFound:
            return None
        schema_id = _id_of(answer, self.shown)
        self._ids[key] = schema_id
        return schema_id

    # -- HTTP ----------------------------------------------------------------------------

    def _call(self, method: str, path: str, payload: Any, what: str) -> Any:
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        request = HttpRequest(method, self.url + path, self._headers, body)
        try:
            response = self._transport(request)
        except OSError as exc:
            raise SchemaRegistryError(
                f"cannot reach the schema registry at {self.shown} ({what}): "
                f"{redact_text(str(exc)) or type(exc).__name__}: start it (`streamtally stack "
                "up --registry` runs one) or set STREAMTALLY_SCHEMA_REGISTRY_URL to its "
                "Confluent REST API (Apicurio: <base>/apis/ccompat/v7)"
            ) from None
        if 200 <= response.status < 300:
            try:
                return json.loads(response.body) if response.body.strip() else None
            except ValueError:
                raise SchemaRegistryError(
                    f"the schema registry at {self.shown} answered {what} with no JSON "
                    f"(HTTP {response.status}): is STREAMTALLY_SCHEMA_REGISTRY_URL its "
                    "Confluent REST API?"
                ) from None
        raise self._refused(response, what)

    def _refused(self, response: HttpResponse, what: str) -> SchemaRegistryError:
        code, message = _error_of(response.body)
        said = f"HTTP {response.status}" + (f", error {code}" if code is not None else "")
        detail = f" ({said}: {message})" if message else f" ({said})"
        head = f"the schema registry at {self.shown} refused {what}{detail}"
        status = response.status
        if status == 404 and code in _NOT_FOUND:
            return SchemaNotFound(head)
        if status == 404:
            return SchemaRegistryError(
                f"{head}: is STREAMTALLY_SCHEMA_REGISTRY_URL the registry's Confluent REST "
                "API? (Apicurio: <base>/apis/ccompat/v7)"
            )
        if status in (401, 403):
            return SchemaRegistryError(
                f"{head}: check STREAMTALLY_SCHEMA_REGISTRY_USERNAME and "
                "STREAMTALLY_SCHEMA_REGISTRY_PASSWORD, and what that user may do"
            )
        if status == 409:
            return SchemaRegistryError(
                f"{head}: the subject holds schemas this one is not {COMPATIBILITY} compatible "
                "with; the project's schemas evolve compatibly, so the subject holds another "
                "project's schemas (another STREAMTALLY_NAMESPACE?) or its compatibility "
                "was changed"
            )
        if status == 422:
            return SchemaRegistryError(f"{head}: the registry takes it for no valid schema")
        if status >= 500:
            return SchemaRegistryError(f"{head}: the registry failed; try again")
        return SchemaRegistryError(head)


def _segment(text: str) -> str:
    return quote(text, safe="")


def _expanded(path: Path | None) -> Path | None:
    return None if path is None else path.expanduser()


def _id_of(answer: Any, shown: str) -> int:
    schema_id = answer.get("id") if isinstance(answer, dict) else None
    if not isinstance(schema_id, int) or isinstance(schema_id, bool) or schema_id < 0:
        raise SchemaRegistryError(
            f"the schema registry at {shown} answered without a schema id ({answer!r:.200})"
        )
    return schema_id


def _error_of(body: bytes) -> tuple[int | None, str]:
    """The Confluent error body's ``error_code`` and ``message`` (redacted, shortened)."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        code = doc.get("error_code")
        message = doc.get("message")
        text = message if isinstance(message, str) else ""
        return (code if isinstance(code, int) else None), _short(text)
    return None, _short(body.decode("utf-8", "replace"))


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(redact_text(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
