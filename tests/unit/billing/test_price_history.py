"""Price tables with history: the file format, the version in force, refusals, re-rating."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from streamtally.audit import RerateSum, Rerating, rerated_cost
from streamtally.billing.events import charge, event_id, price_request
from streamtally.billing.pricing import NO_VERSION, PriceTable, PriceTableError
from streamtally.core.models import FinishReason, Source, Usage
from streamtally.processors.requests import RequestProcessor
from streamtally.wire.records import BillingEvent
from tests.unit.billing.test_billing import make_tokens

NOV = datetime(2026, 11, 1, tzinfo=UTC)
DEC = datetime(2026, 12, 1, tzinfo=UTC)
TICK = timedelta(microseconds=1)
MILLION = Usage(input_tokens=1_000_000, output_tokens=0)


def rates(rate: str, **more: Any) -> dict[str, Any]:
    return {"input": rate, "output": rate, **more}


def history(*versions: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"currency": "USD", **top, "versions": list(versions)}


def version(name: str, since: str | None, models: dict[str, Any], **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"version": name, "unit": 1_000_000, "models": models, **more}
    if since is not None:
        out["effective_from"] = since
    return out


TWO = history(
    version("oct", None, {"m": rates("1.00"), "w*": rates("5")}),
    version("nov", "2026-11-01T00:00:00Z", {"m": rates("2.00")}),
    version(
        "dec",
        "2026-12-01T00:00:00+00:00",
        {"m": rates("3.00"), "new": rates("7", effective_from="2026-12-15T12:00:00Z")},
    ),
)


def load(data: dict[str, Any], origin: str = "h.json") -> PriceTable:
    return PriceTable.from_dict(data, origin=origin)


# ------------------------------------------------------------------------ format


def test_a_single_table_file_loads_and_prices_as_before_at_any_time() -> None:
    one = {"version": "v1", "currency": "USD", "unit": 1_000_000, "models": {"m": rates("1.5")}}
    table = load(one)
    assert [v.version for v in table.versions] == ["v1"]
    assert table.version == "v1"
    for at in (None, datetime(1990, 1, 1, tzinfo=UTC), DEC):
        quote = table.quote("m", MILLION, at)
        assert quote.cost == Decimal("1.500000000000")
        assert quote.version == "v1"


def test_the_packaged_table_is_one_version_in_force_since_always() -> None:
    table = PriceTable.default()
    assert len(table.versions) == 1
    assert table.versions[0].effective_from is None
    assert table.in_force(datetime(2000, 1, 1, tzinfo=UTC)) is table.versions[0]


def test_a_single_table_may_say_when_it_takes_effect() -> None:
    one = {
        "version": "v1",
        "effective_from": "2026-11-01T00:00:00Z",
        "currency": "EUR",
        "unit": 1000,
        "models": {"m": rates("1")},
    }
    table = load(one)
    assert table.versions[0].effective_from == NOV
    assert table.quote("m", Usage(input_tokens=1000), NOV).cost == Decimal("1.000000000000")
    before = table.quote("m", Usage(input_tokens=1000), NOV - TICK)
    assert (before.cost, before.version) == (None, None)


def test_history_file_loads_from_json_text(tmp_path: Path) -> None:
    path = tmp_path / "history.json"
    path.write_text(json.dumps(TWO), encoding="utf-8")
    table = PriceTable.load(path)
    assert table.currency == "USD"
    assert [(v.version, v.effective_from) for v in table.versions] == [
        ("oct", None),
        ("nov", NOV),
        ("dec", DEC),
    ]
    assert table.version == "dec"  # the newest
    assert table.models == ("m", "new")


# ------------------------------------------------------------------ selection


@pytest.mark.parametrize(
    ("at", "expected_version", "cost"),
    [
        (datetime(2000, 1, 1, tzinfo=UTC), "oct", "1"),
        (NOV - TICK, "oct", "1"),
        (NOV, "nov", "2"),  # exactly at effective_from: the new version
        (NOV + TICK, "nov", "2"),
        (DEC - TICK, "nov", "2"),
        (DEC, "dec", "3"),
        (datetime(2030, 1, 1, tzinfo=UTC), "dec", "3"),
        (NOV.astimezone(ZoneInfo("Europe/Paris")), "nov", "2"),
    ],
)
def test_the_version_in_force_prices_the_request(
    at: datetime, expected_version: str, cost: str
) -> None:
    table = load(TWO)
    found = table.in_force(at)
    assert found is not None
    assert found.version == expected_version
    quote = table.quote("m", MILLION, at)
    assert quote.version == expected_version
    assert quote.cost == Decimal(cost).quantize(Decimal("1e-12"))


def test_no_time_means_the_newest_prices() -> None:
    table = load(TWO)
    assert table.quote("m", MILLION).version == "dec"
    assert table.entry_for("new") == "new"


def test_a_version_prices_only_its_own_entries() -> None:
    table = load(TWO)
    assert table.entry_for("wx", NOV - TICK) == "w*"
    assert table.entry_for("wx", NOV) is None  # "nov" has no wildcard
    assert table.quote("wx", MILLION, NOV).version == "nov"


def test_an_entry_with_its_own_date_is_absent_before_it() -> None:
    table = load(TWO)
    since = datetime(2026, 12, 15, 12, tzinfo=UTC)
    assert table.entry_for("new", since - TICK) is None
    assert table.entry_for("new", since) == "new"
    assert table.cost("new", MILLION, since) == Decimal("7.000000000000")
    early = table.quote("new", MILLION, since - TICK)
    assert (early.cost, early.version) == (None, "dec")


def test_a_naive_lookup_time_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        load(TWO).quote("m", MILLION, datetime(2026, 11, 1))  # noqa: DTZ001


def test_before_the_first_version_nothing_is_in_force() -> None:
    table = load(history(version("a", "2026-11-01T00:00:00Z", {"*": rates("1")})))
    assert table.in_force(NOV - TICK) is None
    assert table.entry_for(None, NOV - TICK) is None
    assert table.entry_for(None, NOV) == "*"


def test_without_prices_keeps_the_versions_and_prices_nothing() -> None:
    empty = load(TWO).without_prices()
    assert [v.version for v in empty.versions] == ["oct", "nov", "dec"]
    assert empty.quote("m", MILLION, NOV).version == "nov"
    assert empty.quote("m", MILLION, NOV).cost is None


# ------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            history(
                version("a", None, {}),
                version("b", "2026-12-01T00:00:00Z", {}),
                version("c", "2026-11-01T00:00:00Z", {}),
            ),
            "versions.2.effective_from: 2026-11-01T00:00:00Z is not after versions.1's "
            "2026-12-01T00:00:00Z",
        ),
        (
            history(
                version("a", "2026-11-01T00:00:00Z", {}), version("b", "2026-11-01T00:00:00Z", {})
            ),
            "versions.1.effective_from: 2026-11-01T00:00:00Z is not after versions.0's",
        ),
        (
            history(version("a", None, {}), version("b", None, {})),
            "versions.1.effective_from: missing",
        ),
        (
            history(version("a", None, {}), version("a", "2026-11-01T00:00:00Z", {})),
            "versions.1.version: 'a' is also the name of versions.0",
        ),
        (
            history(version("a", "2026-11-01T00:00:00", {})),
            "versions.0.effective_from: effective_from '2026-11-01T00:00:00' has no time zone",
        ),
        (
            history(version("a", "2026-11-01T01:00:00+01:00", {})),
            "versions.0.effective_from: effective_from '2026-11-01T01:00:00+01:00' is not UTC",
        ),
        (
            history(version("a", "2026-11-01", {})),
            "versions.0.effective_from: effective_from '2026-11-01' is not an RFC 3339 time",
        ),
        (
            history(version("a", "2026-02-30T00:00:00Z", {})),
            "versions.0.effective_from: effective_from '2026-02-30T00:00:00Z' is not a valid time",
        ),
        (
            history(version("a", None, {"m": rates("-1")})),
            "versions.0.models.m.input: rate '-1' is not a plain non-negative decimal",
        ),
        (
            history(version("a", None, {"m": {"input": 1.5, "output": "1"}})),
            'versions.0.models.m.input: rate is the JSON number 1.5; write it as the string "1.5"',
        ),
        (
            history(
                version("a", "2026-11-01T00:00:00Z", {"m": rates("1", effective_from=None)}),
                version(
                    "b",
                    "2026-12-01T00:00:00Z",
                    {"m": rates("1", effective_from="2026-11-30T00:00:00Z")},
                ),
            ),
            "versions.1.models.m.effective_from: 2026-11-30T00:00:00Z is before its version's "
            "2026-12-01T00:00:00Z",
        ),
        (
            history(
                version("a", None, {"m": rates("1", effective_from="2026-12-01T00:00:00Z")}),
                version("b", "2026-12-01T00:00:00Z", {}),
            ),
            "versions.0.models.m.effective_from: 2026-12-01T00:00:00Z is not before the next "
            "version's 2026-12-01T00:00:00Z",
        ),
        (history(), "versions: List should have at least 1 item"),
        (history(version("a", None, {}), currency="usd"), "currency: currency must be an ISO"),
        (
            history(version(NO_VERSION, None, {})),
            "versions.0.version: '(none in force)' is reserved",
        ),
        ({**history(version("a", None, {})), "models": {}}, "models: Extra inputs"),
    ],
)
def test_malformed_histories_are_refused_naming_the_place(
    data: dict[str, Any], message: str
) -> None:
    with pytest.raises(PriceTableError) as info:
        load(data)
    text = str(info.value)
    assert text.startswith("h.json: invalid price table: ")
    assert message in text
    assert "\n" not in text


def test_a_single_table_names_its_own_places() -> None:
    one = {
        "version": "v",
        "effective_from": "2026-12-01T00:00:00Z",
        "currency": "USD",
        "unit": 1,
        "models": {"m": rates("1", effective_from="2026-11-01T00:00:00Z")},
    }
    with pytest.raises(PriceTableError, match=r"invalid price table: models\.m\.effective_from: "):
        load(one)


# -------------------------------------------------------------------- charging


def test_charge_names_the_version_in_force_or_none() -> None:
    table = load(history(version("a", "2026-11-01T00:00:00Z", {"m": rates("1")})))
    at_start = charge("m", MILLION, NOV, table)
    assert (at_start.cost, at_start.version) == (Decimal("1.000000000000"), "a")
    before = charge("m", MILLION, NOV - TICK, table)
    assert (before.cost, before.version, before.billed_cost) == (None, NO_VERSION, Decimal(0))
    with pytest.raises(ValueError, match="timezone-aware"):
        charge("m", MILLION, datetime(2026, 11, 1), table)  # noqa: DTZ001


def test_a_cost_beyond_the_record_is_charged_unpriced_naming_its_version() -> None:
    table = load(history(version("big", None, {"m": {"input": "9" * 30, "output": "1"}})))
    huge = charge("m", Usage(input_tokens=10**15), NOV, table)
    assert (huge.cost, huge.overflow, huge.version) == (None, True, "big")


# ------------------------------------------------------------------- re-rating


def billed(
    tenant: str, at: datetime, cost: str, *, model: str = "m", priced: bool = True
) -> BillingEvent:
    return BillingEvent(
        event_id=event_id(tenant, f"r-{at.isoformat()}-{cost}"),
        request_id=f"r-{at.isoformat()}-{cost}",
        tenant=tenant,
        model=model,
        source=Source.OPENAI,
        finish_reason=FinishReason.STOP,
        input_tokens=1_000_000,
        output_tokens=3,
        cost=Decimal(cost),
        priced=priced,
        currency="USD",
        price_table_version="x",
        event_time=at,
    )


def test_rerated_cost_prices_the_event_at_its_receive_time() -> None:
    table = load(TWO)
    # 1M input + 3 output tokens at the version in force: output adds 3 * rate / 1M
    assert rerated_cost(billed("t", NOV - TICK, "0"), table) == Decimal("1.000003000000")
    assert rerated_cost(billed("t", NOV, "0"), table) == Decimal("2.000006000000")
    assert rerated_cost(billed("t", DEC, "0", model="other"), table) is None


def test_rerating_sums_exactly_per_tenant_and_in_total() -> None:
    table = load(
        history(
            version("a", None, {"m": rates("0.000000000001")}),
            version("b", "2026-11-01T00:00:00Z", {"m": rates("0.1")}),
        )
    )
    rerating = Rerating(table, "other.json")
    events = [
        billed("acme", NOV - TICK, "0.000000000002"),
        billed("acme", NOV, "0.1"),
        billed("globex", NOV + TICK, "0.5"),
        billed("globex", NOV, "0", model="unknown", priced=False),
    ]
    for event in events:
        rerating.add(event)
    doc = rerating.to_json()
    # acme: 1,000,003 tokens at 10**-12 per 1M -> 0.000000000001 (half-even of 1.000003e-12);
    # then 1,000,003 tokens at 0.1 per 1M -> 0.1000003
    acme_rerated = Decimal("0.000000000001") + Decimal("0.1000003")
    acme_billed = Decimal("0.000000000002") + Decimal("0.1")
    assert doc["tenants"]["acme"] == {
        "requests": 2,
        "billed": f"{acme_billed:.12f}",
        "rerated": f"{acme_rerated:.12f}",
        "difference": f"{acme_rerated - acme_billed:.12f}",
        "unpriced_billed": 0,
        "unpriced_rerated": 0,
    }
    assert doc["tenants"]["acme"]["difference"] == "0.000000299999"
    globex = doc["tenants"]["globex"]
    assert (globex["billed"], globex["rerated"], globex["difference"]) == (
        "0.500000000000",
        "0.100000300000",
        "-0.399999700000",
    )
    assert (globex["unpriced_billed"], globex["unpriced_rerated"]) == (1, 1)
    total = doc["total"]
    assert total["requests"] == 4
    assert Decimal(total["difference"]) == sum(
        Decimal(t["difference"]) for t in doc["tenants"].values()
    )
    assert doc["prices"] == "other.json"
    assert doc["versions"] == [
        {"version": "a", "effective_from": None},
        {"version": "b", "effective_from": "2026-11-01T00:00:00Z"},
    ]


def test_rerate_sums_stay_exact_beyond_decimal_context_precision() -> None:
    big = "12345678901234567890123456.123456789012"  # 38 digits: beyond the 28 of a context
    one = RerateSum()
    one.add(billed("t", NOV, big), Decimal("12345678901234567890123456.123456789013"))
    one.add(billed("t", NOV, big), Decimal(big))
    doc = one.to_json()
    assert doc["billed"] == "24691357802469135780246912.246913578024"
    assert doc["difference"] == "0.000000000001"


# ------------------------------------------------------------------ billing events


def test_a_billing_event_names_the_version_in_force_at_its_receive_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens = make_tokens(model="m", usage=MILLION)
    table = load(TWO)
    assert price_request(tokens, "t", NOV - TICK, table).event.price_table_version == "oct"
    at_nov = price_request(tokens, "t", NOV, table).event
    assert (at_nov.price_table_version, at_nov.cost, at_nov.priced) == (
        "nov",
        Decimal("2.000000000000"),
        True,
    )
    late = load(history(version("late", "2026-11-01T00:00:00Z", {"m": rates("1")})))
    with caplog.at_level(logging.WARNING, logger="streamtally.billing.events"):
        early = price_request(tokens, "t", NOV - TICK, late).event
    assert (early.price_table_version, early.cost, early.priced) == (NO_VERSION, 0, False)
    assert "before the first version of the price table (late" in caplog.text


def test_the_unpriced_fallback_of_the_processor_keeps_the_version_in_force() -> None:
    processor = RequestProcessor(load(TWO))
    tokens = make_tokens(model="unknown", usage=MILLION)
    event, _ = processor.closer.bill(tokens, "t", NOV)
    assert (event.price_table_version, event.priced) == ("nov", False)
    assert processor.closer.no_prices.quote("m", MILLION, DEC).version == "dec"


def test_the_readme_history_example_loads_and_prices_as_described() -> None:
    root = Path(__file__).parents[3]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]  # docs/billing.md has it
    text = "".join(page.read_text(encoding="utf-8") for page in pages)
    blocks = [b.split("```", 1)[0] for b in text.split("```json\n")[1:]]
    (example,) = [b for b in blocks if '"versions"' in b]
    table = PriceTable.loads(example, origin="docs/billing.md")
    assert [v.version for v in table.versions] == ["2026-10-01", "2026-11-01"]
    assert table.cost("gpt-4.1", MILLION, NOV - TICK) == Decimal("2.000000000000")
    assert table.cost("gpt-4.1", MILLION, NOV) == Decimal("1.800000000000")
    assert table.cost("gpt-5.3", MILLION, NOV) is None
    assert table.cost("gpt-5.3", MILLION, datetime(2026, 11, 15, tzinfo=UTC)) is not None
