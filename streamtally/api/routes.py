"""The two read-only endpoints, ``GET /v1/usage`` and ``GET /v1/requests/{request_id}``.

Each one authenticates the bearer token (`caller`: 401 without a token or
with one the tokens file does not hold), scopes the query to the caller
(`streamtally.api.query`: 400, 403) and reads Redis only through
`RedisStore`, the same reads as ``streamtally usage`` (`usage_rows`) and
``streamtally tokens get`` (`tenants_of`, `tokens_text`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from streamtally.api.auth import Principal, TokenTable
from streamtally.api.models import Problem, RequestTokens, UsageResponse, UsageRow
from streamtally.api.query import BadQuery, Forbidden, request_tenant, usage_query
from streamtally.core.identity import RequestRef
from streamtally.store import RedisStore

__all__ = ["NOT_FOUND", "router"]

#: The one answer for a request the caller cannot read: unknown, streaming, or another's.
NOT_FOUND: Final = "request not found (unknown, still streaming, or not this token's tenant)"

_bearer = HTTPBearer(
    auto_error=False,
    description="a token of the API tokens file: a tenant's, or the operator's",
)


def _problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": Problem} for code in codes}


async def caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The authenticated caller, or 401 (the token itself is never logged or echoed)."""
    tokens: TokenTable = request.app.state.tokens
    principal = tokens.authenticate(None if credentials is None else credentials.credentials)
    if principal is None:
        raise HTTPException(
            status_code=401,
            detail="missing or unknown bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


def store_of(request: Request) -> RedisStore:
    """The app's store (opened by its lifespan)."""
    store: RedisStore = request.app.state.store
    return store


Caller = Annotated[Principal, Depends(caller)]
Store = Annotated[RedisStore, Depends(store_of)]

router = APIRouter(prefix="/v1")


def _refused(exc: BadQuery | Forbidden) -> HTTPException:
    return HTTPException(status_code=400 if isinstance(exc, BadQuery) else 403, detail=str(exc))


@router.get(
    "/usage",
    response_model=UsageResponse,
    responses=_problems(400, 401, 403, 503),
    summary="Usage rows per tenant, model and UTC day",
)
async def usage(
    principal: Caller,
    store: Store,
    tenant: Annotated[
        str | None,
        Query(description="only this tenant (a tenant's token: its own only; operator: any)"),
    ] = None,
    first: Annotated[
        str | None, Query(alias="from", description="first UTC day included, YYYY-MM-DD")
    ] = None,
    last: Annotated[
        str | None, Query(alias="to", description="last UTC day included, YYYY-MM-DD")
    ] = None,
) -> UsageResponse:
    """The usage rows the caller may read: requests, the five token counts, exact cost."""
    try:
        query = usage_query(principal, tenant=tenant, first=first, last=last)
    except (BadQuery, Forbidden) as exc:
        raise _refused(exc) from None
    rows = await store.usage_rows(
        tenant=query.tenant, first_day=query.first_day, last_day=query.last_day
    )
    return UsageResponse(
        tenant=query.tenant,
        first_day=query.first_day,
        last_day=query.last_day,
        rows=[UsageRow.model_validate(row) for row in rows],
    )


@router.get(
    "/requests/{request_id:path}",
    response_model=RequestTokens,
    responses=_problems(400, 401, 403, 404, 409, 503),
    summary="A finished request's Tokens",
)
async def request_tokens(
    request_id: str,
    principal: Caller,
    store: Store,
    tenant: Annotated[
        str | None,
        Query(
            description=(
                "the request's tenant; a tenant's token: its own only; the operator needs it "
                "when several tenants used the id"
            )
        ),
    ] = None,
) -> Response:
    """The stored Tokens of a finished request, as ``streamtally tokens get`` prints them.

    404 both when no such request is stored and when it belongs to another
    tenant than the token's: the answer does not say which.
    """
    try:
        whose = request_tenant(principal, tenant)
    except (BadQuery, Forbidden) as exc:
        raise _refused(exc) from None
    if whose is None:  # the operator, no tenant named: the id's one tenant
        tenants = await store.tenants_of(request_id)
        if len(tenants) > 1:
            shown = ", ".join(tenants[:10]) + (", ..." if len(tenants) > 10 else "")
            raise HTTPException(
                status_code=409,
                detail=f"{len(tenants)} tenants used this request id ({shown}): pass tenant=",
            )
        whose = tenants[0] if tenants else None
    stored = None if whose is None else await store.tokens_text(RequestRef(whose, request_id))
    if whose is None or stored is None:
        raise HTTPException(status_code=404, detail=NOT_FOUND)
    # The stored JSON as is (what `tokens get` prints), inside {"tenant", "tokens"}.
    body = f'{{"tenant":{json.dumps(whose, ensure_ascii=False)},"tokens":{stored}}}'
    return Response(content=body.encode("utf-8"), media_type="application/json")
