"""Billing: deterministic event ids, one priced event per finished request."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from streamtally.billing.events import bill, event_id, price_request
from streamtally.billing.pricing import PriceTable
from streamtally.cli.billing import event_json
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.wire.avro import decode_billing_event, encode_billing_event
from streamtally.wire.provenance import EMPTY_SHA256, RawDigest, raw_sha256
from streamtally.wire.records import Provenance, UsageSource

PRICES = PriceTable.from_dict(
    {
        "version": "2026-11-01",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {
            "gpt-4.1-20*": {"input": "2.00", "cached_input": "0.50", "output": "8.00"},
            "claude-sonnet-4*": {
                "input": "3.00",
                "cached_input": "0.30",
                "cache_write": "3.75",
                "output": "15.00",
            },
        },
    }
)
WHEN = datetime(2026, 11, 21, 12, 30, 45, 123456, tzinfo=UTC)


def make_tokens(
    request_id: str = "chatcmpl-1",
    model: str | None = "gpt-4.1-2025-04-14",
    usage: Usage | None = None,
    finish: FinishReason = FinishReason.STOP,
    error: str | None = None,
) -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model=model,
        text="Hello, wörld",
        reasoning="",
        tool_calls=(),
        usage=usage or Usage(input_tokens=1520, cached_tokens=1408, output_tokens=48),
        finish_reason=finish,
        finish_reason_raw=finish.value,
        error=error,
        chunks=4,
    )


def test_event_id_is_a_versioned_sha256_of_the_request_identity() -> None:
    expected = hashlib.sha256(b"streamtally.billing.v2\x00acme:chatcmpl-1").hexdigest()[:32]
    assert event_id("acme", "chatcmpl-1") == expected
    assert event_id("acme", "chatcmpl-1") == event_id("acme", "chatcmpl-1")
    assert event_id("acme", "chatcmpl-2") != expected
    assert len(expected) == 32
    assert int(expected, 16) >= 0  # hex


def test_event_id_tells_tenants_apart_even_when_their_names_hold_the_separator() -> None:
    # Two tenants reusing one provider id are two requests: two event ids.
    assert event_id("acme", "chatcmpl-1") != event_id("globex", "chatcmpl-1")
    # The tenant is escaped: ("a:b", "c") and ("a", "b:c") do not collide.
    assert event_id("a:b", "c") != event_id("a", "b:c")
    expected = hashlib.sha256(b"streamtally.billing.v2\x00a%3Ab:c").hexdigest()[:32]
    assert event_id("a:b", "c") == expected


def test_event_id_refuses_an_empty_request_id() -> None:
    with pytest.raises(ValueError, match="empty"):
        event_id("acme", "")


def test_bill_prices_the_request_exactly() -> None:
    event = bill(make_tokens(), "acme", WHEN, PRICES)
    assert event.event_id == event_id("acme", "chatcmpl-1")
    assert event.tenant == "acme"
    assert event.model == "gpt-4.1-2025-04-14"
    assert event.cost == Decimal("0.001312")  # 112*2 + 1408*0.5 + 48*8 per million
    assert (event.input_tokens, event.cached_tokens, event.output_tokens) == (1520, 1408, 48)
    assert event.currency == "USD"
    assert event.price_table_version == "2026-11-01"
    assert event.event_time == WHEN
    assert event.finish_reason is FinishReason.STOP
    assert event.priced


def test_same_tokens_twice_give_identical_events_and_avro_bytes() -> None:
    first = bill(make_tokens(), "acme", WHEN, PRICES)
    second = bill(make_tokens(), "acme", WHEN, PRICES)
    assert first == second
    data = encode_billing_event(first)
    assert data == encode_billing_event(second)
    decoded = decode_billing_event(data)
    assert decoded == first
    assert encode_billing_event(decoded) == data  # a decoded event re-encodes byte for byte


def test_an_errored_request_is_billed_too() -> None:
    tokens = make_tokens(
        usage=Usage(input_tokens=10, output_tokens=2),
        finish=FinishReason.ERROR,
        error="overloaded",
    )
    event = bill(tokens, "acme", WHEN, PRICES)
    assert event.finish_reason is FinishReason.ERROR
    assert event.cost == Decimal("0.000036")  # 10*2 + 2*8 per million


def test_unpriced_model_is_billed_at_zero_flagged_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens = make_tokens(model="mystery-1")
    with caplog.at_level(logging.WARNING, logger="streamtally.billing.events"):
        billed = price_request(tokens, "acme", WHEN, PRICES)
    assert not billed.priced
    assert billed.event.cost == Decimal(0)
    assert billed.event.input_tokens == 1520  # the usage still goes out
    assert "unpriced model 'mystery-1'" in caplog.text
    encode_billing_event(billed.event)  # and it is a valid event


def test_an_unpriced_event_says_so_on_the_wire() -> None:
    event = bill(make_tokens(model="mystery-1"), "acme", WHEN, PRICES)
    assert event.priced is False
    assert event.cost == Decimal(0)
    back = decode_billing_event(encode_billing_event(event))
    assert back == event
    assert back.priced is False


def test_a_longer_model_is_not_billed_at_a_shorter_models_rates() -> None:
    """`gpt-4.1-mini-2025-04-14` is unpriced by a table that names `gpt-4.1` only."""
    only_gpt41 = PriceTable.from_dict(
        {
            "version": "v",
            "currency": "USD",
            "unit": 1_000_000,
            "models": {"gpt-4.1": {"input": "2.00", "cached_input": "0.50", "output": "8.00"}},
        }
    )
    event = bill(make_tokens(model="gpt-4.1-mini-2025-04-14"), "acme", WHEN, only_gpt41)
    assert (event.priced, event.cost) == (False, Decimal(0))
    priced = bill(make_tokens(model="gpt-4.1-mini-2025-04-14"), "acme", WHEN, PRICES)
    assert (priced.priced, priced.cost) == (False, Decimal(0))  # "gpt-4.1-20*" does not start it
    assert bill(make_tokens(model="gpt-4.1"), "acme", WHEN, only_gpt41).priced


def test_a_cost_the_record_cannot_carry_is_billed_unpriced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    huge = PriceTable.from_dict(
        {
            "version": "huge",
            "currency": "USD",
            "unit": 1,
            "models": {"m": {"input": "9" * 30, "output": "0"}},
        }
    )
    with caplog.at_level(logging.WARNING, logger="streamtally.billing.events"):
        billed = price_request(make_tokens(model="m"), "acme", WHEN, huge)
    assert billed.quote.cost is not None  # the table prices it ...
    assert not billed.priced  # ... but the billing record cannot carry it
    assert (billed.event.priced, billed.event.cost) == (False, Decimal(0))
    assert billed.event.input_tokens == 1520
    assert "does not fit the billing record" in caplog.text
    assert decode_billing_event(encode_billing_event(billed.event)) == billed.event


def test_an_unpriced_event_has_cost_zero_and_priced_is_a_bool() -> None:
    event = bill(make_tokens(), "acme", WHEN, PRICES)
    with pytest.raises(ValueError, match="an unpriced event has cost 0"):
        dataclasses.replace(event, priced=False)
    with pytest.raises(ValueError, match="priced must be a bool"):
        dataclasses.replace(event, priced=1)
    assert dataclasses.replace(event, priced=False, cost=Decimal(0)).priced is False


def test_request_without_model_is_unpriced() -> None:
    billed = price_request(make_tokens(model=None), "acme", WHEN, PRICES)
    assert not billed.priced
    assert billed.event.model is None


def test_priced_request_is_flagged_priced() -> None:
    billed = price_request(make_tokens(model="claude-sonnet-4-20250514"), "t", WHEN, PRICES)
    assert billed.priced
    assert billed.event.priced
    assert billed.quote.entry == "claude-sonnet-4*"


def test_event_time_must_be_aware_and_keeps_its_instant() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        bill(make_tokens(), "acme", datetime(2026, 11, 21, 12, 0), PRICES)  # noqa: DTZ001
    plus_two = WHEN.astimezone(timezone(timedelta(hours=2)))
    event = bill(make_tokens(), "acme", plus_two, PRICES)
    assert decode_billing_event(encode_billing_event(event)).event_time == WHEN


# --------------------------------------------------------------------------- provenance


def test_raw_sha256_is_pinned_to_its_exact_bytes() -> None:
    """Each value preceded by its length as 8 bytes big-endian, then SHA-256, hex."""
    spelled = b"\x00\x00\x00\x00\x00\x00\x00\x02" + b"ab" + b"\x00\x00\x00\x00\x00\x00\x00\x00"
    assert raw_sha256([b"ab", b""]) == hashlib.sha256(spelled).hexdigest()
    assert raw_sha256([b"ab", b""]) == (
        "5275cd81a7ab85c7219cbe049231f08aab0913631cfd098890af6791862ef41e"
    )
    assert raw_sha256([]) == EMPTY_SHA256 == hashlib.sha256(b"").hexdigest()
    # The length prefix keeps the boundaries: ["a", "b"] is not ["ab"].
    assert raw_sha256([b"a", b"b"]) == (
        "3c9d591045bc8876f9d0399bbfb05c6a412096e906f73278f98406cd5dca86df"
    )
    assert raw_sha256([b"ab"]) != raw_sha256([b"a", b"b"])
    incremental = RawDigest()
    for value in (b"ab", b""):
        incremental.add(value)
    assert incremental.hexdigest() == raw_sha256([b"ab", b""])


def test_provenance_goes_onto_the_event_and_leaves_price_and_id_alone() -> None:
    provenance = Provenance(
        raw_topic="streamtally.raw.sse",
        raw_partition=1,
        first_offset=10,
        last_offset=12,
        raw_sha256=raw_sha256([b"x"]),
        usage_source=UsageSource.PROVIDER_REPORTED,
    )
    plain = bill(make_tokens(), "acme", WHEN, PRICES)
    proven = bill(make_tokens(), "acme", WHEN, PRICES, provenance)
    assert not plain.has_provenance
    assert plain.usage_source is UsageSource.UNKNOWN
    assert proven.has_provenance
    assert (proven.event_id, proven.cost, proven.usage) == (plain.event_id, plain.cost, plain.usage)
    assert (
        dataclasses.replace(
            proven,
            raw_topic=None,
            raw_partition=None,
            first_offset=None,
            last_offset=None,
            raw_sha256=None,
            usage_source=UsageSource.UNKNOWN,
        )
        == plain
    )
    assert (proven.raw_topic, proven.raw_partition) == ("streamtally.raw.sse", 1)
    assert (proven.first_offset, proven.last_offset) == (10, 12)
    assert decode_billing_event(encode_billing_event(proven)) == proven


def test_billing_export_json_carries_the_provenance() -> None:
    old = bill(make_tokens(), "acme", WHEN, PRICES)
    assert {k: v for k, v in event_json(old).items() if k in _PROVENANCE_KEYS} == {
        "raw_topic": None,
        "raw_partition": None,
        "first_offset": None,
        "last_offset": None,
        "raw_sha256": None,
        "usage_source": "unknown",
    }
    provenance = Provenance(
        raw_topic="streamtally.raw.engine",
        raw_partition=0,
        first_offset=3,
        last_offset=9,
        raw_sha256=EMPTY_SHA256,
        usage_source=UsageSource.MISSING,
    )
    new = event_json(bill(make_tokens(), "acme", WHEN, PRICES, provenance))
    assert [new[k] for k in _PROVENANCE_KEYS] == [
        "streamtally.raw.engine",
        0,
        3,
        9,
        EMPTY_SHA256,
        "missing",
    ]


_PROVENANCE_KEYS = (
    "raw_topic",
    "raw_partition",
    "first_offset",
    "last_offset",
    "raw_sha256",
    "usage_source",
)
