"""The usage API's query parameters, checked and scoped to the caller (`streamtally.api.query`)."""

from __future__ import annotations

from datetime import date

import pytest

from streamtally.api.auth import Principal
from streamtally.api.query import (
    BadQuery,
    Forbidden,
    UsageQuery,
    parse_day,
    request_tenant,
    usage_query,
)

ACME = Principal("acme-billing", "acme")
OPS = Principal("ops", None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("2026-11-21", date(2026, 11, 21)), ("2024-02-29", date(2024, 2, 29))],
)
def test_a_day_is_yyyy_mm_dd(value: str | None, expected: date | None) -> None:
    assert parse_day("from", value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "2026-11-31",
        "2025-02-29",
        "2026-1-2",
        "20261121",
        "2026-W47-1",
        "2026-11-21T00:00:00Z",
        "2026-11-21 ",
        "tomorrow",
        "\uff12\uff10\uff12\uff16-11-21",  # full-width digits,
    ],
)
def test_anything_else_is_a_bad_query_naming_the_parameter(value: str) -> None:
    with pytest.raises(BadQuery, match=r"^to: .* is not a UTC day YYYY-MM-DD$"):
        parse_day("to", value)


def test_the_operator_reads_every_tenant_or_the_one_named() -> None:
    assert usage_query(OPS, tenant=None, first=None, last=None) == UsageQuery(None, None, None)
    assert usage_query(OPS, tenant="globex", first="2026-11-01", last="2026-11-30") == (
        UsageQuery("globex", date(2026, 11, 1), date(2026, 11, 30))
    )


def test_a_tenant_token_reads_its_own_tenant_named_or_not() -> None:
    assert usage_query(ACME, tenant=None, first=None, last="2026-11-21") == UsageQuery(
        "acme", None, date(2026, 11, 21)
    )
    assert usage_query(ACME, tenant="acme", first=None, last=None).tenant == "acme"


@pytest.mark.parametrize("other", ["globex", "acme ", "ACME", "acme-eu", "*"])
def test_a_tenant_token_naming_another_tenant_is_forbidden(other: str) -> None:
    with pytest.raises(Forbidden, match="may not read another tenant"):
        usage_query(ACME, tenant=other, first=None, last=None)
    with pytest.raises(Forbidden):
        request_tenant(ACME, other)


def test_one_day_range_is_fine_and_from_after_to_is_refused() -> None:
    one = usage_query(OPS, tenant=None, first="2026-11-21", last="2026-11-21")
    assert one.first_day == one.last_day == date(2026, 11, 21)
    with pytest.raises(BadQuery, match=r"^from \(2026-11-22\) is after to \(2026-11-21\)$"):
        usage_query(OPS, tenant=None, first="2026-11-22", last="2026-11-21")


def test_a_bad_day_is_refused_before_the_tenant_is_judged() -> None:
    with pytest.raises(BadQuery, match=r"^from: "):
        usage_query(ACME, tenant="globex", first="2026-13-01", last=None)


@pytest.mark.parametrize("principal", [ACME, OPS])
def test_an_empty_tenant_is_a_bad_query(principal: Principal) -> None:
    with pytest.raises(BadQuery, match="tenant: must not be empty"):
        usage_query(principal, tenant="", first=None, last=None)
    with pytest.raises(BadQuery, match="tenant: must not be empty"):
        request_tenant(principal, "")


def test_whose_request_is_looked_up() -> None:
    assert request_tenant(ACME, None) == "acme"
    assert request_tenant(ACME, "acme") == "acme"
    assert request_tenant(OPS, None) is None  # found by its id
    assert request_tenant(OPS, "globex") == "globex"
