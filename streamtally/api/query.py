"""What a caller may ask: the query parameters of the API, checked and scoped to the caller.

Pure functions, no HTTP and no Redis: the routes turn `BadQuery` into 400 and
`Forbidden` into 403.  The scoping rules, in one place:

- ``/v1/usage``: the operator may name any tenant, or none (every tenant); a
  tenant's token reads its own rows, with or without ``tenant=`` naming it,
  and naming another tenant is refused (403: the caller asked for what its
  token may never read, whatever exists).
- ``/v1/requests/{id}``: the same for ``tenant=``.  A tenant's token looks up
  only its own tenant's request, so another tenant's request is not found
  (404), exactly like a request that does not exist: the answer never tells
  whether another tenant used that id.

Days are UTC days spelled ``YYYY-MM-DD`` (the usage rows' own days), ``from``
and ``to`` both included; ``from`` after ``to`` is refused, not an empty answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from streamtally.api.auth import Principal

__all__ = ["BadQuery", "Forbidden", "UsageQuery", "parse_day", "request_tenant", "usage_query"]


class BadQuery(ValueError):
    """A query parameter that is not valid (400); the message says which and why."""


class Forbidden(PermissionError):
    """The caller's token may not read what the query names (403)."""


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """The rows to read: of `tenant` (None: every tenant), between two UTC days included."""

    tenant: str | None
    first_day: date | None
    last_day: date | None


def parse_day(name: str, value: str | None) -> date | None:
    """A query's UTC day, ``YYYY-MM-DD`` exactly (no time, no zone, no week date)."""
    if value is None:
        return None
    try:
        parsed = date.fromisoformat(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed.isoformat() != value:
        raise BadQuery(f"{name}: {value!r} is not a UTC day YYYY-MM-DD")
    return parsed


def _tenant_asked(principal: Principal, tenant: str | None) -> str | None:
    """The tenant the caller reads: its own, the one an operator names, or None (all)."""
    if tenant is not None and not tenant:
        raise BadQuery("tenant: must not be empty (leave it out instead)")
    if tenant is not None and not principal.may_read(tenant):
        raise Forbidden("this token may not read another tenant's data")
    return principal.tenant if tenant is None else tenant


def usage_query(
    principal: Principal, *, tenant: str | None, first: str | None, last: str | None
) -> UsageQuery:
    """The usage rows `principal` asks for with ``tenant``, ``from`` and ``to``.

    Raises `BadQuery` (a bad day, ``from`` after ``to``, an empty tenant) or
    `Forbidden` (a tenant's token naming another tenant).
    """
    first_day = parse_day("from", first)
    last_day = parse_day("to", last)
    if first_day is not None and last_day is not None and first_day > last_day:
        raise BadQuery(f"from ({first_day}) is after to ({last_day})")
    return UsageQuery(_tenant_asked(principal, tenant), first_day, last_day)


def request_tenant(principal: Principal, tenant: str | None) -> str | None:
    """Whose request ``/v1/requests/{id}`` looks up: a tenant, or None (the operator: find it).

    Raises `BadQuery` (an empty tenant) or `Forbidden` (a tenant's token naming another).
    """
    return _tenant_asked(principal, tenant)
