"""An in-memory schema registry behind a `Transport`: the Confluent REST API calls streamtally
makes, enough to run the client and the framing without a server (tests only)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from streamtally.wire.registry import HttpRequest, HttpResponse


@dataclass
class FakeRegistry:
    """Subjects and ids as a registry keeps them; every request recorded."""

    base: str = "http://registry.test/apis/ccompat/v7"
    #: schema text -> id (ids from `first_id` on, one per distinct schema text).
    ids: dict[str, int] = field(default_factory=dict)
    subjects: dict[str, list[str]] = field(default_factory=dict)
    config: dict[str, str] = field(default_factory=dict)
    requests: list[HttpRequest] = field(default_factory=list)
    first_id: int = 1
    #: HTTP status to answer every request with instead (e.g. 401), or None.
    fail_with: int | None = None
    #: Raise OSError (unreachable) instead of answering.
    down: bool = False

    def add(self, schema: str) -> int:
        """A schema registered by someone else (no subject): its id."""
        return self.ids.setdefault(schema, self.first_id + len(self.ids))

    def __call__(self, request: HttpRequest) -> HttpResponse:
        self.requests.append(request)
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        if self.fail_with is not None:
            return _answer(self.fail_with, {"error_code": self.fail_with, "message": "refused"})
        assert request.url.startswith(self.base), request.url
        path = request.url[len(self.base) :]
        body: Any = json.loads(request.body) if request.body else None
        if request.method == "POST" and (m := re.fullmatch(r"/subjects/([^/]+)/versions", path)):
            subject = m.group(1)
            schema = body["schema"]
            schema_id = self.add(schema)
            versions = self.subjects.setdefault(subject, [])
            if schema not in versions:
                versions.append(schema)
            return _answer(200, {"id": schema_id})
        if request.method == "POST" and (m := re.fullmatch(r"/subjects/([^/]+)", path)):
            versions = self.subjects.get(m.group(1))
            if versions is None:
                return _answer(404, {"error_code": 40401, "message": "Subject not found."})
            if body["schema"] not in versions:
                return _answer(404, {"error_code": 40403, "message": "Schema not found"})
            schema = body["schema"]
            return _answer(200, {"id": self.ids[schema], "version": versions.index(schema) + 1})
        if request.method == "PUT" and (m := re.fullmatch(r"/config/([^/]+)", path)):
            self.config[m.group(1)] = body["compatibility"]
            return _answer(200, body)
        if request.method == "GET" and (m := re.fullmatch(r"/schemas/ids/(\d+)", path)):
            wanted = int(m.group(1))
            for schema, schema_id in self.ids.items():
                if schema_id == wanted:
                    return _answer(200, {"schema": schema})
            return _answer(404, {"error_code": 40403, "message": "Schema not found"})
        return _answer(404, {"error_code": 404, "message": f"HTTP 404 Not Found {path}"})

    def calls(self, method: str | None = None) -> list[str]:
        """``METHOD path`` of every request so far (of `method` only, if given)."""
        return [
            f"{r.method} {r.url[len(self.base) :]}"
            for r in self.requests
            if method is None or r.method == method
        ]


def _answer(status: int, doc: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(doc).encode(), {"Content-Type": "application/json"})
