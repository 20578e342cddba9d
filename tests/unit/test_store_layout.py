"""The Redis layout is a contract with the stored data: every key, member and argument, pinned.

This is the one test that spells the layout literally (``st:...``); everything
else builds keys with `streamtally.store`.  A failure here means existing Redis
data would no longer be read or counted the same way: change the layout only
with a migration, never to make this test pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, FinishReason, Source, Tokens, Usage
from streamtally.core.pricing import PriceTable
from streamtally.store import (
    CLOSED_KEY,
    COST_FIELDS,
    DEAD_LETTER_SCRIPT,
    DEAD_SEEN_KEY,
    FLUSH_SCRIPT,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    RAW_RECORD_STATS,
    ROW_FIELDS,
    ROWS_KEY,
    STATS_FIELDS,
    STATS_KEY,
    TOKENS_PREFIX,
    UNKNOWN_MODEL,
    UNPRICED_FIELD,
    RedisStore,
    closed_field,
    day_of,
    finished_request,
    parse_tokens_key,
    position_of,
    row_member,
    tokens_json,
    tokens_key,
    tokens_pattern,
    usage_key,
)
from streamtally.store.layout import PREFIX, parse_row_member, tokens_pattern_of_id
from streamtally.store.scripts import (
    ARGS_PER_REQUEST,
    CLOSE_ONCE_SCRIPT,
    close_once_call,
    dead_letter_call,
    flush_call,
)
from streamtally.wire.billing import bill

PRICES = PriceTable.from_dict(
    {
        "version": "2026-11-01",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {"gpt-4.1-20*": {"input": "2.00", "cached_input": "0.50", "output": "8.00"}},
    }
)
DAY = "2026-11-21"


def make_tokens(request_id: str = "r1", model: str | None = "gpt-4.1-2025-04-14") -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model=model,
        text="Grüße, 世界",
        reasoning="",
        tool_calls=(),
        usage=Usage(
            input_tokens=1520,
            output_tokens=48,
            reasoning_tokens=7,
            cached_tokens=1408,
            cache_write_tokens=3,
        ),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=4,
    )


# --------------------------------------------------------------------------- keys


def test_the_fixed_keys() -> None:
    assert PREFIX == "st:"
    assert TOKENS_PREFIX == "st:tokens:"
    assert ROWS_KEY == "st:usage:rows"
    assert CLOSED_KEY == "st:closed"
    assert STATS_KEY == "st:stats"
    assert DEAD_SEEN_KEY == "st:deadletter:seen"
    assert LAYOUT_KEY == "st:layout"
    assert LAYOUT_VERSION == "2"
    assert MIGRATING == "1>2"


def test_tokens_key_is_the_escaped_tenant_then_the_request_id_as_is() -> None:
    assert tokens_key(RequestRef("acme", "r1")) == "st:tokens:acme:r1"
    assert tokens_key(RequestRef("acme", "a:b/c %3A ü")) == "st:tokens:acme:a:b/c %3A ü"
    # ":" and "%" of the tenant are escaped, so the first ":" ends the tenant
    assert tokens_key(RequestRef("a:b", "c")) == "st:tokens:a%3Ab:c"
    assert tokens_key(RequestRef("100%", "c")) == "st:tokens:100%25:c"
    assert tokens_key(RequestRef("a:b", "c")) != tokens_key(RequestRef("a", "b:c"))
    assert tokens_key(RequestRef("", "r")) == "st:tokens::r"
    with pytest.raises(ValueError, match="must not be empty"):
        tokens_key(RequestRef("acme", ""))
    for ref in (RequestRef("a:b", "c"), RequestRef("a", "b:c"), RequestRef("%3A", "%")):
        assert parse_tokens_key(tokens_key(ref)) == ref
        assert parse_tokens_key(tokens_key(ref).encode()) == ref
    for bad in ("st:tokens:r1", "st:usage:x:y", "st:tokens:a%41:r"):
        with pytest.raises(ValueError, match="not a"):
            parse_tokens_key(bad)
    assert tokens_pattern() == "st:tokens:*"
    assert tokens_pattern("bench", "run-1a2b-") == "st:tokens:bench:run-1a2b-*"
    assert tokens_pattern("a:b*", "x?[") == "st:tokens:a%3Ab\\*:x\\?\\[*"
    assert tokens_pattern_of_id("r-1") == "st:tokens:*:r-1"
    assert tokens_pattern_of_id("a*b?[c]") == "st:tokens:*:a\\*b\\?\\[c\\]"


def test_the_closed_field_is_the_request_reference() -> None:
    assert closed_field(RequestRef("acme", "r1")) == "acme:r1"
    assert closed_field(RequestRef("a:b", "c")) == "a%3Ab:c"
    with pytest.raises(ValueError, match="must not be empty"):
        closed_field(RequestRef("acme", ""))


@pytest.mark.parametrize(
    ("tenant", "model", "key"),
    [
        ("acme", "gpt-4o", "st:usage:2026-11-21:acme:gpt-4o"),
        # ":" and "%" of the tenant are escaped, nothing else; the model stays as is
        ("acme:eu", "m", "st:usage:2026-11-21:acme%3Aeu:m"),
        ("acme", "eu:m", "st:usage:2026-11-21:acme:eu:m"),
        ("100%", "m", "st:usage:2026-11-21:100%25:m"),
        ("%3A", "m", "st:usage:2026-11-21:%253A:m"),
        ("Grüße/x y", "org/model:tag", "st:usage:2026-11-21:Grüße/x y:org/model:tag"),
        ("acme", "unknown", "st:usage:2026-11-21:acme:unknown"),
    ],
)
def test_usage_key(tenant: str, model: str, key: str) -> None:
    assert usage_key(DAY, tenant, model) == key


def test_a_tenant_with_a_colon_never_collides_with_another_tenants_model() -> None:
    assert usage_key(DAY, "a:b", "m") != usage_key(DAY, "a", "b:m")


# --------------------------------------------------------------------------- members and values


def test_row_member_is_compact_json_with_the_values_unescaped() -> None:
    assert row_member(DAY, "acme:eu", "org/m:1") == '["2026-11-21","acme:eu","org/m:1"]'
    assert row_member(DAY, "Grüße", "m") == '["2026-11-21","Grüße","m"]'
    assert row_member(DAY, 'a"b', "m") == '["2026-11-21","a\\"b","m"]'
    assert parse_row_member(row_member(DAY, "Grüße", "m")) == (DAY, "Grüße", "m")
    assert parse_row_member(b'["2026-11-21", "t", "m"]') == (DAY, "t", "m")
    with pytest.raises(ValueError, match="not JSON"):
        parse_row_member(b"\xff")
    with pytest.raises(ValueError, match=r"not \[day, tenant, model\]"):
        parse_row_member('["2026-11-21","t"]')


def test_a_dead_letter_position_is_topic_partition_offset() -> None:
    assert position_of("streamtally.raw.sse", 3, 42) == "streamtally.raw.sse:3:42"
    assert RedisStore.position_of("ns.raw.engine", 0, 0) == "ns.raw.engine:0:0"


def test_the_day_is_the_utc_day_of_the_event_time() -> None:
    assert day_of(datetime(2026, 11, 21, 23, 59, 59, tzinfo=UTC)) == "2026-11-21"
    tokyo = timezone(timedelta(hours=9))
    assert day_of(datetime(2026, 11, 22, 8, 0, tzinfo=tokyo)) == "2026-11-21"
    with pytest.raises(ValueError, match="timezone-aware"):
        day_of(datetime(2026, 11, 21, 12, 0))  # noqa: DTZ001 - the naive case is the point


def test_the_stored_tokens_text_is_compact_utf8_json() -> None:
    tokens = make_tokens()
    text = tokens_json(tokens)
    assert text == json.dumps(tokens.to_json_dict(), ensure_ascii=False, separators=(",", ":"))
    assert '"text":"Grüße, 世界"' in text
    assert ": " not in text.replace("Grüße, 世界", "")


def test_the_field_names() -> None:
    assert UNKNOWN_MODEL == "unknown"
    assert COST_FIELDS == ("cost_units", "cost_pico")
    assert UNPRICED_FIELD == "unpriced_requests"
    assert ROW_FIELDS == (
        "requests",
        "input_tokens",
        "output_tokens",
        "reasoning_tokens",
        "cached_tokens",
        "cache_write_tokens",
        "cost_units",
        "cost_pico",
        "unpriced_requests",  # added last: the script reads cost_pico as values[8]
    )
    assert ROW_FIELDS[1:6] == USAGE_FIELDS
    assert STATS_FIELDS == ("records", "duplicates", "dead_lettered", "requests")
    assert RAW_RECORD_STATS == ("records", "duplicates", "dead_lettered")


# --------------------------------------------------------------------------- scripts


def test_the_script_texts_are_unchanged() -> None:
    """A script's SHA1 is its name in Redis's script cache: an edit is a new script.

    The flush and close-once scripts were last changed for layout version 2
    (they write only when ``st:layout`` is the version they are given); before,
    the flush script was 8403b48c6bafab472e83bcee360bd4664cae25f3.
    """
    assert hashlib.sha1(FLUSH_SCRIPT.encode()).hexdigest() == (
        "5cc20c960354096fdeacad1f176a8db9584efc33"
    )
    assert hashlib.sha1(CLOSE_ONCE_SCRIPT.encode()).hexdigest() == (
        "8fd0a255fc1f45fefaa3d37bd5610174233acb65"
    )
    assert hashlib.sha1(DEAD_LETTER_SCRIPT.encode()).hexdigest() == (
        "5f3aa4e824ff12f8f80c5d3e08f041f6565f722c"
    )


def _lua_list(name: str) -> tuple[str, ...]:
    found = re.search(rf"local {name} = \{{(.*?)\}}", FLUSH_SCRIPT, re.DOTALL)
    assert found is not None, name
    return tuple(re.findall(r"'([a-z_]+)'", found.group(1)))


def test_the_flush_script_names_the_row_fields_of_the_layout() -> None:
    assert _lua_list("FIELDS") == USAGE_FIELDS
    assert _lua_list("ALL") == ROW_FIELDS
    assert f"local a = 3 + {ARGS_PER_REQUEST} * (i - 1)" in FLUSH_SCRIPT
    assert ROW_FIELDS.index("cost_pico") + 1 == 8
    assert "local pico = tonumber(values[8] or '0')" in FLUSH_SCRIPT
    # the unpriced count is the last argument of a request, added only when it is not 0
    assert ARGS_PER_REQUEST == 14
    assert "if ARGV[a + 13] ~= '0' then" in FLUSH_SCRIPT
    assert "redis.call('HINCRBY', uk, 'unpriced_requests', ARGV[a + 13])" in FLUSH_SCRIPT


def test_flush_call_lays_out_keys_and_the_14_arguments_per_request() -> None:
    first = make_tokens("r1")
    event = dataclasses.replace(
        bill(first, "acme:eu", datetime(2026, 11, 21, 23, 30, tzinfo=UTC), PRICES),
        cost=Decimal("123.000000000456"),
    )
    second = make_tokens("r2", model=None)
    unpriced = bill(second, "globex", datetime(2026, 11, 22, 0, 0, tzinfo=UTC), PRICES)
    assert not unpriced.priced
    third = make_tokens("r3")
    negative = dataclasses.replace(
        bill(third, "acme", datetime(2026, 11, 21, 1, 0, tzinfo=UTC), PRICES),
        cost=Decimal("-0.5"),
    )
    batch = [
        finished_request(first, event, closed="12 timeout", records=4, duplicates=1),
        finished_request(second, unpriced),
        finished_request(third, negative),
    ]
    assert all(len(request.argv()) == ARGS_PER_REQUEST for request in batch)
    keys, argv = flush_call(batch)
    assert keys == [
        "st:usage:rows",
        "st:closed",
        "st:stats",
        "st:layout",
        "st:tokens:acme%3Aeu:r1",
        "st:usage:2026-11-21:acme%3Aeu:gpt-4.1-2025-04-14",
        "st:tokens:globex:r2",
        "st:usage:2026-11-22:globex:unknown",
        "st:tokens:acme:r3",
        "st:usage:2026-11-21:acme:gpt-4.1-2025-04-14",
    ]
    assert argv == [
        "3",
        "2",  # the layout version the keys are of
        tokens_json(first),
        '["2026-11-21","acme:eu","gpt-4.1-2025-04-14"]',
        "1520",  # the five usage fields, in USAGE_FIELDS order
        "48",
        "7",
        "1408",
        "3",
        "123",  # cost units
        "456",  # cost pico
        "acme%3Aeu:r1",  # the request's field of st:closed
        "12 timeout",  # closing marker
        "4",  # raw records
        "1",  # duplicates
        "0",  # priced: not counted in unpriced_requests
        tokens_json(second),
        '["2026-11-22","globex","unknown"]',
        "1520",
        "48",
        "7",
        "1408",
        "3",
        "0",  # unpriced: cost 0
        "0",
        "globex:r2",
        "0 end",  # the defaults
        "0",
        "0",
        "1",  # unpriced: one more in the row's unpriced_requests
        tokens_json(third),
        '["2026-11-21","acme","gpt-4.1-2025-04-14"]',
        "1520",
        "48",
        "7",
        "1408",
        "3",
        "-1",  # -0.5 = -1 + 0.5: floor division, the pico part never negative
        "500000000000",
        "acme:r3",
        "0 end",
        "0",
        "0",
        "0",
    ]


def test_close_once_call() -> None:
    assert close_once_call({"acme:r1": "12 end", "a%3Ab:c": "3 timeout"}) == (
        ["st:closed", "st:layout"],
        ["2", "acme:r1", "12 end", "a%3Ab:c", "3 timeout"],
    )


def test_dead_letter_call() -> None:
    positions = ["t:0:1", "t:1:7"]
    assert dead_letter_call(positions) == (["st:deadletter:seen", "st:stats"], positions)
