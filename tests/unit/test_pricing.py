"""Price tables: validation, model lookup and exact costs."""

from __future__ import annotations

import json
import logging
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Usage
from streamtally.core.money import scaled_cost
from streamtally.core.pricing import PriceTable, PriceTableError

REPO = Path(__file__).resolve().parents[2]


def table(models: dict[str, Any], **top: Any) -> PriceTable:
    data = {"version": "t1", "currency": "USD", "unit": 1_000_000, "models": models, **top}
    return PriceTable.loads(json.dumps(data), origin="test.json")


# --------------------------------------------------------------------------- exactness


def test_one_token_at_0_075_per_million_is_exact() -> None:
    prices = table({"m": {"input": "0.075", "output": "0"}})
    cost = prices.cost("m", Usage(input_tokens=1))
    assert cost == Decimal("0.000000075")
    assert Decimal.from_float(0.075) / 1_000_000 != cost  # the float 0.075 is not 0.075
    assert cost is not None
    assert cost.as_tuple().exponent == -12


def test_all_five_rates_are_applied_to_their_parts() -> None:
    prices = table(
        {
            "m": {
                "input": "3",
                "cached_input": "0.30",
                "cache_write": "3.75",
                "output": "15",
                "reasoning": "20",
            }
        }
    )
    usage = Usage(
        input_tokens=10_000,
        cached_tokens=6_000,
        cache_write_tokens=1_000,
        output_tokens=700,
        reasoning_tokens=200,
    )
    # 3000*3 + 6000*0.30 + 1000*3.75 + 500*15 + 200*20 = 9000 + 1800 + 3750 + 7500 + 4000
    assert prices.cost("m", usage) == Decimal("0.02605")


def test_defaults_cached_and_cache_write_to_input_and_reasoning_to_output() -> None:
    prices = table({"m": {"input": "2", "output": "8", "reasoning": None}})
    usage = Usage(
        input_tokens=100, cached_tokens=30, cache_write_tokens=20, output_tokens=50,
        reasoning_tokens=40,
    )  # fmt: skip
    assert prices.cost("m", usage) == Decimal(100 * 2 + 50 * 8) / 1_000_000


def test_big_counts_stay_exact_beyond_float_and_default_decimal_precision() -> None:
    prices = table({"m": {"input": "0.000000000001", "output": "123456.789"}})
    usage = Usage(input_tokens=10**30 + 1, output_tokens=10**20 + 3)
    quote = prices.quote("m", usage)
    # (10**18 + 1e-12 + 1.23456789e25 + 370370.367) / 1e6: 32 significant digits, more than
    # a float (17) or the default Decimal context (28) keeps; the 1e-18 is rounded away.
    assert quote.cost == Decimal("12345679900000000000.370370367000")
    assert quote.rounded
    assert quote.cost is not None
    scaled_cost(quote.cost)  # fits the Avro decimal(38, 12)


def test_rounds_half_even_only_when_more_than_12_places() -> None:
    prices = table({"m": {"input": "0.0000005", "output": "0.0000015"}})
    quote = prices.quote("m", Usage(input_tokens=1))  # 5e-13: a tie, rounds to even 0
    assert quote.cost == Decimal(0)
    assert quote.rounded
    quote = prices.quote("m", Usage(output_tokens=1))  # 1.5e-12: tie, rounds to even 2e-12
    assert quote.cost == Decimal("0.000000000002")
    assert quote.rounded
    quote = prices.quote("m", Usage(input_tokens=2))  # exactly 1e-12
    assert quote.cost == Decimal("0.000000000001")
    assert not quote.rounded


def test_odd_unit_divides_exactly_then_rounds() -> None:
    prices = table({"m": {"input": "1", "output": "1"}}, unit=3)
    assert prices.cost("m", Usage(input_tokens=1)) == Decimal("0.333333333333")
    assert prices.cost("m", Usage(input_tokens=3)) == Decimal(1)


def test_parts_larger_than_their_total_are_priced_as_reported_and_noted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prices = table({"m": {"input": "10", "cached_input": "1", "output": "100", "reasoning": "50"}})
    usage = Usage(input_tokens=5, cached_tokens=8, output_tokens=2, reasoning_tokens=3)
    with caplog.at_level(logging.WARNING, logger="streamtally.core.pricing"):
        quote = prices.quote("m", usage)
    # uncached input and non-reasoning output floor at 0; the parts are priced in full
    assert quote.cost == Decimal(8 * 1 + 3 * 50) / 1_000_000
    assert len(quote.notes) == 2
    assert "input_tokens (5)" in quote.notes[0]
    assert "reasoning_tokens (3) > output_tokens (2)" in quote.notes[1]
    assert "inconsistent usage" in caplog.text


def test_consistent_usage_has_no_notes() -> None:
    prices = table({"m": {"input": "1", "output": "1"}})
    assert prices.quote("m", Usage(input_tokens=5, cached_tokens=5)).notes == ()


# --------------------------------------------------------------------------- lookup


def test_model_lookup_exact_then_longest_prefix_then_wildcard() -> None:
    prices = table(
        {
            "gpt-4o": {"input": "2.50", "output": "10"},
            "gpt-4o-mini": {"input": "0.15", "output": "0.60"},
            "gpt-4o-mini-2024-07-18": {"input": "0.20", "output": "0.60"},
        }
    )
    assert prices.entry_for("gpt-4o-2024-08-06") == "gpt-4o"
    assert prices.entry_for("gpt-4o-mini-2024-09-09") == "gpt-4o-mini"
    assert prices.entry_for("gpt-4o-mini-2024-07-18") == "gpt-4o-mini-2024-07-18"
    assert prices.entry_for("gpt-4") is None
    assert prices.cost("gpt-4", Usage(input_tokens=1)) is None
    assert prices.cost(None, Usage(input_tokens=1)) is None
    assert prices.cost("gpt-4o-2024-08-06", Usage(input_tokens=1_000_000)) == Decimal("2.5")

    with_star = table(
        {"gpt-4o": {"input": "2.50", "output": "10"}, "*": {"input": "1", "output": "1"}}
    )
    assert with_star.entry_for("claude-x") == "*"
    assert with_star.entry_for(None) == "*"
    assert with_star.entry_for("gpt-4o-x") == "gpt-4o"  # a real prefix beats "*"


def test_unpriced_quote() -> None:
    quote = table({}).quote("nobody", Usage(input_tokens=3))
    assert quote.cost is None
    assert not quote.priced
    assert quote.entry is None


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("rate", ["0.075", "2.50", "0", "15"])
def test_decimal_strings_are_accepted(rate: str) -> None:
    assert table({"m": {"input": rate, "output": rate}}).rates_for("m") is not None


def test_float_rate_is_refused_with_its_place_and_a_fix() -> None:
    text = (
        '{"version": "v", "currency": "USD", "unit": 1000000, '
        '"models": {"gpt-4.1": {"input": 0.075, "output": "8"}}}'
    )
    with pytest.raises(PriceTableError) as info:
        PriceTable.loads(text, origin="prices.json")
    message = str(info.value)
    assert message.startswith("prices.json: ")
    assert "models.gpt-4.1.input" in message
    assert 'write it as the string "0.075"' in message


@pytest.mark.parametrize(
    ("entry", "where"),
    [
        ({"input": 2, "output": "1"}, "models.m.input"),
        ({"input": "1", "output": "1", "reasoning": 2.5}, "models.m.reasoning"),
        ({"input": "-1", "output": "1"}, "models.m.input"),
        ({"input": "1e-6", "output": "1"}, "models.m.input"),
        ({"input": "NaN", "output": "1"}, "models.m.input"),
        ({"input": "1"}, "models.m.output"),
        ({"input": "1", "output": "1", "cache_read": "1"}, "models.m.cache_read"),
    ],
)
def test_bad_entries_name_the_field(entry: dict[str, Any], where: str) -> None:
    with pytest.raises(PriceTableError, match=rf"test\.json: invalid price table: .*{where}"):
        table({"m": entry})


@pytest.mark.parametrize(
    ("top", "where"),
    [
        ({"unit": 1000000.0}, "unit"),
        ({"unit": 0}, "unit"),
        ({"currency": "usd"}, "currency"),
        ({"version": ""}, "version"),
        ({"version": 2026.11}, "version"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_top_level_fields_are_named(top: dict[str, Any], where: str) -> None:
    with pytest.raises(PriceTableError, match=rf"invalid price table: {where}"):
        table({"m": {"input": "1", "output": "1"}}, **top)


def test_duplicate_model_and_bad_json_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PriceTableError, match="duplicate key 'm'"):
        PriceTable.loads('{"models": {"m": {}, "m": {}}}')
    with pytest.raises(PriceTableError, match="not valid JSON"):
        PriceTable.loads("{")
    with pytest.raises(PriceTableError, match="cannot read price table"):
        PriceTable.load(tmp_path / "missing.json")


def test_load_from_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(
        '{"version": "2026-11-01", "currency": "EUR", "unit": 1000, '
        '"models": {"m": {"input": "1.5", "output": "2"}}}'
    )
    prices = PriceTable.load(path)
    assert (prices.version, prices.currency, prices.unit) == ("2026-11-01", "EUR", 1000)
    assert prices.cost("m", Usage(input_tokens=1, output_tokens=1)) == Decimal("0.0035")


# --------------------------------------------------------------------------- the sample table


def test_sample_table_loads_and_prices_the_fixture_models() -> None:
    prices = PriceTable.default()
    assert "*" not in prices.models  # unknown models must stay visibly unpriced
    expected_entries = {
        "gpt-4o-2024-08-06": "gpt-4o",
        "gpt-4o-mini-2024-07-18": "gpt-4o-mini",
        "gpt-4.1-2025-04-14": "gpt-4.1",
        "gpt-4.1-mini-2025-04-14": "gpt-4.1-mini",
        "claude-sonnet-4-5-20250929": "claude-sonnet-4-5",
        "claude-haiku-4-5-20251001": "claude-haiku-4-5",
        "claude-3-haiku-20240307": "claude-3-haiku",
        "gemini-2.5-flash": "gemini-2.5-flash",
        "gemini-2.5-flash-lite": "gemini-2.5-flash-lite",
        "deepseek-reasoner": "deepseek-reasoner",
        "qwen3-max": "qwen3-max",
        "meta-llama/Meta-Llama-3.1-70B-Instruct": "meta-llama/Meta-Llama-3.1-70B-Instruct",
    }
    for model, entry in expected_entries.items():
        assert prices.entry_for(model) == entry, model
    assert prices.entry_for("claude-fable-5") is None
    # gpt-4.1: 112 uncached * 2.00 + 1408 cached * 0.50 + 48 output * 8.00, per million
    usage = Usage(input_tokens=1520, cached_tokens=1408, output_tokens=48)
    assert prices.cost("gpt-4.1-2025-04-14", usage) == Decimal("0.001312")
