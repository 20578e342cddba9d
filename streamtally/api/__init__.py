"""The read-only usage API (``streamtally api``): usage rows and requests' Tokens over HTTP.

For billing systems and dashboards that should not reach Redis themselves:

- `streamtally.api.auth`: bearer tokens, the tokens file of their SHA-256, the caller's role;
- `streamtally.api.query`: the query parameters, checked and scoped to the caller;
- `streamtally.api.models`: the response bodies (pydantic, documented by OpenAPI);
- `streamtally.api.routes`: ``GET /v1/usage`` and ``GET /v1/requests/{request_id}``;
- `streamtally.api.app`: `create_app`, the FastAPI application with its store.

It reads Redis only through `streamtally.store.RedisStore`, as the read
commands do; it never writes.
"""

from streamtally.api.app import create_app
from streamtally.api.auth import Principal, TokenTable, token_digest

__all__ = ["Principal", "TokenTable", "create_app", "token_digest"]
