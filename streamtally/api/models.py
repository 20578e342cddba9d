"""The API's response bodies as pydantic models, so that ``/openapi.json`` documents them.

`UsageRow` has the fields, order and values of ``streamtally usage --json``
(`RedisStore.usage_rows`): counts as integers and ``cost`` as the store's
exact decimal string with 12 places, never a float.  `RequestTokens` wraps
the stored Tokens (`streamtally.core.models.Tokens`, the JSON ``streamtally
tokens get`` prints) with the tenant it belongs to.
"""

from __future__ import annotations

from datetime import date

from pydantic import BaseModel, ConfigDict, Field

from streamtally.core.models import Tokens

__all__ = ["Problem", "RequestTokens", "UsageResponse", "UsageRow"]


class UsageRow(BaseModel):
    """One tenant's use of one model on one UTC day."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    model: str
    day: date = Field(description="the UTC day, YYYY-MM-DD")
    requests: int = Field(ge=0, description="requests billed")
    unpriced_requests: int = Field(
        ge=0, description="of `requests`, those billed unpriced (cost 0: no price matched)"
    )
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    reasoning_tokens: int = Field(ge=0)
    cached_tokens: int = Field(ge=0)
    cache_write_tokens: int = Field(ge=0)
    cost: str = Field(
        pattern=r"^-?\d+\.\d{12}$",
        description="exact total cost in the price table's currency, 12 decimal places",
        examples=["0.004000000000"],
    )


class UsageResponse(BaseModel):
    """The rows asked for, sorted by (day, tenant, model), with the filters applied."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    tenant: str | None = Field(description="the tenant read; null: every tenant (operator)")
    first_day: date | None = Field(
        alias="from", description="the first UTC day included; null: no lower bound"
    )
    last_day: date | None = Field(
        alias="to", description="the last UTC day included; null: no upper bound"
    )
    rows: list[UsageRow]


class RequestTokens(BaseModel):
    """A finished request's Tokens, exactly as stored, and its tenant."""

    tenant: str
    tokens: Tokens


class Problem(BaseModel):
    """Why a call was refused: 400, 401, 403, 404, 409 or 503."""

    detail: str
