"""`create_app`: the FastAPI application of ``streamtally api``, with its store and its tokens.

The app is given what it needs rather than reading settings: the `TokenTable`
and a function that opens the `RedisStore` (of one Redis or of a Redis
Cluster).  The store is opened when the server starts (inside its event
loop, where the client's connections live) and closed when it stops.

A Redis that fails or cannot be reached answers 503 with a fixed message: the
caller learns that the data is unavailable, not the address, the error or a
credential of the Redis behind the API; the log line says more (without
credentials, `streamtally.redact`).  OpenAPI: ``/openapi.json``, browsable at
``/docs``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from streamtally import __version__
from streamtally.api.auth import TokenTable
from streamtally.api.routes import router
from streamtally.redact import redact_text
from streamtally.store import RedisStore

__all__ = ["UNAVAILABLE", "create_app"]

log = logging.getLogger("streamtally.api")

#: The body of a 503: the same whatever failed.
UNAVAILABLE = "the usage store (Redis) is unavailable; try again later"

_DESCRIPTION = """\
Read-only access to streamtally's usage rows and finished requests' Tokens.

Every call needs `Authorization: Bearer <token>`. A tenant's token reads that
tenant's data only; the operator's token reads every tenant's.
"""


def create_app(tokens: TokenTable, open_store: Callable[[], RedisStore]) -> FastAPI:
    """The API, authenticating with `tokens` and reading the store `open_store` opens."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = open_store()
        app.state.store = store
        try:
            yield
        finally:
            await store.aclose()

    app = FastAPI(
        title="streamtally usage API",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.tokens = tokens
    app.include_router(router)

    @app.exception_handler(RedisError)
    async def redis_failed(request: Request, exc: RedisError) -> JSONResponse:
        log.warning(
            "%s %s: Redis failed: %s: %s",
            request.method,
            request.url.path,
            type(exc).__name__,
            redact_text(str(exc)),
        )
        return JSONResponse(status_code=503, content={"detail": UNAVAILABLE})

    return app
