"""Price tables: validation, model lookup and exact costs."""

from __future__ import annotations

import json
import logging
import random
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from streamtally.billing.pricing import PriceTable, PriceTableError
from streamtally.core.models import Usage
from streamtally.core.money import scaled_cost

REPO = Path(__file__).resolve().parents[3]


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


def _reference_scaled(rates: dict[str, str], unit: int, usage: Usage) -> Fraction:
    """The cost in units of 10**-12 by the definition, in `Fraction`s: each part's count
    times its rate, over the unit."""
    r = {k: Fraction(Decimal(v)) for k, v in rates.items()}
    parts = usage.cached_tokens + usage.cache_write_tokens
    return (
        (
            max(0, usage.input_tokens - parts) * r["input"]
            + usage.cached_tokens * r["cached_input"]
            + usage.cache_write_tokens * r["cache_write"]
            + max(0, usage.output_tokens - usage.reasoning_tokens) * r["output"]
            + usage.reasoning_tokens * r["reasoning"]
        )
        / unit
        * 10**12
    )


def test_the_integer_quote_equals_the_fraction_definition_on_random_tables() -> None:
    """The quote's integer arithmetic (rates over one denominator) against the definition
    in `Fraction`s: rates of up to 15 decimal places, odd units, ties, huge counts."""
    rng = random.Random(28)
    ties = rounded = 0
    for _ in range(3000):
        rates = {
            name: format(
                Decimal(rng.randrange(0, 10 ** rng.randrange(1, 9))).scaleb(-rng.randrange(0, 16)),
                "f",
            )
            for name in ("input", "cached_input", "cache_write", "output", "reasoning")
        }
        unit = rng.choice([1, 3, 7, 1000, 1_000_000, 999_983])
        prices = table({"m": rates}, unit=unit)
        counts = [
            rng.choice([0, 1, 2, rng.randrange(10**6), rng.randrange(10**15)]) for _ in range(5)
        ]
        usage = Usage(
            input_tokens=counts[0] + counts[1] + counts[2],
            cached_tokens=counts[1],
            cache_write_tokens=counts[2],
            output_tokens=counts[3] + counts[4],
            reasoning_tokens=counts[4],
        )
        quote = prices.quote("m", usage)
        scaled = _reference_scaled(rates, unit, usage)
        expected = Decimal(f"{round(scaled)}E-12")  # half even, exact, 12 places
        assert (quote.cost, quote.rounded) == (expected, scaled.denominator != 1), (
            rates,
            unit,
            usage,
        )
        assert quote.cost is not None
        assert quote.cost.as_tuple().exponent == -12
        rounded += scaled.denominator != 1
        ties += (scaled - int(scaled)) == Fraction(1, 2)
    assert rounded > 300  # both kinds were drawn
    assert ties > 0


def test_odd_unit_divides_exactly_then_rounds() -> None:
    prices = table({"m": {"input": "1", "output": "1"}}, unit=3)
    assert prices.cost("m", Usage(input_tokens=1)) == Decimal("0.333333333333")
    assert prices.cost("m", Usage(input_tokens=3)) == Decimal(1)


def test_parts_larger_than_their_total_are_priced_as_reported_and_noted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prices = table({"m": {"input": "10", "cached_input": "1", "output": "100", "reasoning": "50"}})
    usage = Usage(input_tokens=5, cached_tokens=8, output_tokens=2, reasoning_tokens=3)
    with caplog.at_level(logging.WARNING, logger="streamtally.billing.pricing"):
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


GPT41 = {"input": "2.00", "cached_input": "0.50", "output": "8.00"}
GPT41_MINI = {"input": "0.40", "cached_input": "0.10", "output": "1.60"}


def test_a_name_prices_that_model_only_never_a_longer_one() -> None:
    """`gpt-4.1-mini-2025-04-14` is not billed at `gpt-4.1` rates unless a wildcard says so."""
    prices = table({"gpt-4.1": GPT41})
    assert prices.entry_for("gpt-4.1") == "gpt-4.1"
    assert prices.entry_for("gpt-4.1-mini-2025-04-14") is None
    assert prices.cost("gpt-4.1-mini-2025-04-14", Usage(input_tokens=1_000_000)) is None
    assert prices.entry_for("gpt-4.1-2025-04-14") is None  # a dated snapshot too: say so
    assert prices.entry_for("gpt-4") is None


def test_a_wildcard_prices_every_model_it_starts() -> None:
    prices = table({"gpt-4.1*": GPT41})
    assert prices.entry_for("gpt-4.1-mini-2025-04-14") == "gpt-4.1*"  # the table says so
    assert prices.cost("gpt-4.1-mini-2025-04-14", Usage(input_tokens=1_000_000)) == Decimal(2)
    assert prices.entry_for("gpt-4.1") == "gpt-4.1*"  # "*" matches nothing too
    assert prices.entry_for("gpt-4") is None
    assert prices.entry_for("xgpt-4.1") is None  # a prefix, not a substring
    assert prices.entry_for(None) is None


def test_the_longest_wildcard_wins_and_an_exact_name_beats_every_wildcard() -> None:
    prices = table(
        {
            "*": {"input": "1", "output": "1"},
            "gpt-4.1*": GPT41,
            "gpt-4.1-mini*": GPT41_MINI,
            "gpt-4.1-mini-2025-04-14": {"input": "0.30", "output": "1.20"},
            "gpt-4.1-mini-2025-04-14*": {"input": "9", "output": "9"},
        }
    )
    assert prices.entry_for("gpt-4.1-mini-2025-04-14") == "gpt-4.1-mini-2025-04-14"
    assert prices.entry_for("gpt-4.1-mini-2025-04-14-x") == "gpt-4.1-mini-2025-04-14*"
    assert prices.entry_for("gpt-4.1-mini-2026-01-01") == "gpt-4.1-mini*"
    assert prices.entry_for("gpt-4.1-nano") == "gpt-4.1*"
    assert prices.entry_for("claude-x") == "*"  # the catch-all is the shortest wildcard
    assert prices.entry_for(None) == "*"  # a request without a model matches only "*"
    assert prices.models[0] == "*"


def test_a_model_named_by_no_wildcard_of_a_table_without_star_is_unpriced() -> None:
    prices = table({"gpt-4o-20*": {"input": "2.50", "output": "10"}})
    assert prices.entry_for("gpt-4o-2024-08-06") == "gpt-4o-20*"
    assert prices.entry_for("gpt-4o-mini-2024-07-18") is None
    assert prices.entry_for("gpt-4o") is None


@pytest.mark.parametrize("name", ["gpt-*-mini", "*gpt-4.1", "gpt-4.1**", "**", "a*b*"])
def test_a_star_anywhere_but_at_the_end_is_refused(name: str) -> None:
    with pytest.raises(PriceTableError) as info:
        table({name: {"input": "1", "output": "1"}})
    message = str(info.value)
    assert message.startswith("test.json: invalid price table: models: ")
    assert f"model name {name!r} has a '*' before its end" in message
    assert 'like "gpt-4.1*"' in message


@pytest.mark.parametrize("name", ["", " gpt-4.1", "gpt-4.1* "])
def test_empty_names_and_surrounding_spaces_are_refused(name: str) -> None:
    with pytest.raises(PriceTableError, match="is empty or has surrounding spaces"):
        table({name: {"input": "1", "output": "1"}})


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
        "gpt-4o-2024-08-06": "gpt-4o-2024-08-06",
        "gpt-4o-mini-2024-07-18": "gpt-4o-mini-20*",
        "gpt-4.1-2025-04-14": "gpt-4.1-20*",
        "gpt-4.1-mini-2025-04-14": "gpt-4.1-mini-20*",
        "claude-sonnet-4-5-20250929": "claude-sonnet-4-5-20*",
        "claude-sonnet-4-20250514": "claude-sonnet-4-20*",
        "claude-haiku-4-5-20251001": "claude-haiku-4-5-20*",
        "claude-3-haiku-20240307": "claude-3-haiku-20*",
        "gemini-2.5-flash": "gemini-2.5-flash",
        "gemini-2.5-flash-lite": "gemini-2.5-flash-lite",
        "deepseek-reasoner": "deepseek-reasoner",
        "qwen3-max": "qwen3-max",
        "meta-llama/Meta-Llama-3.1-70B-Instruct": "meta-llama/Meta-Llama-3.1-70B-Instruct",
    }
    for model, entry in expected_entries.items():
        assert prices.entry_for(model) == entry, model
    assert prices.entry_for("claude-fable-5") is None
    assert prices.entry_for("claude-opus-4-7") is None  # no "claude-opus-4-*": not opus 4 rates
    # gpt-4o's first snapshot cost more than the later ones: not covered by a wildcard
    assert prices.entry_for("gpt-4o-2024-05-13") is None
    # gpt-4.1: 112 uncached * 2.00 + 1408 cached * 0.50 + 48 output * 8.00, per million
    usage = Usage(input_tokens=1520, cached_tokens=1408, output_tokens=48)
    assert prices.cost("gpt-4.1-2025-04-14", usage) == Decimal("0.001312")


def _fixture_models() -> set[str]:
    """Every model the expectations (public transcripts and samples) and the manifest name."""
    models: set[str] = set()
    for path in sorted((REPO / "tests" / "expectations").glob("*.json")):
        for expected in json.loads(path.read_text("utf-8")).values():
            if expected.get("model"):
                models.add(expected["model"])
    for line in (REPO / "samples" / "manifest.jsonl").read_text("utf-8").splitlines():
        if json.loads(line).get("model"):
            models.add(json.loads(line)["model"])
    return models


def test_sample_table_prices_every_fixture_model_as_the_former_prefix_rule_did() -> None:
    """Explicit entries and wildcards give each fixture model the rates the implicit
    longest-prefix match of earlier versions gave it (and leave the same ones unpriced)."""
    prices = PriceTable.default()
    exact = [name for name in prices.models if not name.endswith("*")]
    models = _fixture_models()
    assert len(models) > 35
    for model in sorted(models):
        former = max((name for name in exact if model.startswith(name)), key=len, default=None)
        want = None if former is None else prices.rates_for(former)
        assert prices.rates_for(model) == want, model
    # the names that matched by prefix and now have an exact entry of their own
    for model, former in {
        "gpt-4o-2024-08-06": "gpt-4o",
        "gpt-5.1-codex-max": "gpt-5.1",
        "gpt-5.2-codex": "gpt-5.2",
        "claude-3-opus-latest": "claude-3-opus",
        "magistral-medium-2507": "magistral-medium",
    }.items():
        assert model in models
        assert prices.entry_for(model) == model
        assert prices.rates_for(model) == prices.rates_for(former), model


def test_every_wildcard_of_the_sample_table_names_dated_snapshots() -> None:
    """A packaged wildcard covers a model's dated snapshots only, never another model."""
    prices = PriceTable.default()
    wildcards = [name for name in prices.models if name.endswith("*")]
    assert wildcards
    for name in wildcards:
        assert name.endswith("-20*"), name
        base = name.removesuffix("-20*")
        assert prices.rates_for(base) == prices.rates_for(name), name
