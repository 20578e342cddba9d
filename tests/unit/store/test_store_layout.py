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
import zlib
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from redis.crc import key_slot

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, FinishReason, Source, Tokens, Usage
from streamtally.store import (
    COST_FIELDS,
    DEAD_LETTER_SCRIPT,
    FLUSH_SCRIPT,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    RAW_RECORD_STATS,
    ROW_FIELDS,
    SHARDS,
    STATS_FIELDS,
    UNKNOWN_MODEL,
    UNPRICED_FIELD,
    RedisStore,
    closed_key,
    day_of,
    finished_request,
    parse_tokens_key,
    position_of,
    row_member,
    shard_of,
    tokens_json,
    tokens_key,
    tokens_pattern,
    usage_key,
)
from streamtally.store.layout import (
    PREFIX,
    SHARD_TAGS,
    closed_pattern,
    dead_key,
    guard_key,
    parse_row_member,
    rows_key,
    shard_of_position,
    stats_key,
    tokens_pattern_of_id,
)
from streamtally.store.scripts import (
    ARGS_PER_REQUEST,
    CLOSE_ONCE_SCRIPT,
    close_once_calls,
    dead_letter_calls,
    flush_calls,
)

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
    assert LAYOUT_KEY == "st:layout"
    assert LAYOUT_VERSION == "3"
    assert MIGRATING == "2>3"
    assert SHARDS == 16
    assert SHARD_TAGS == (
        "s0-60", "s1-63", "s2-40", "s3-43", "s4-10", "s5-13", "s6-3", "s7-0",
        "s8-1", "s9-2", "s10-0", "s11-3", "s12-60", "s13-63", "s14-22", "s15-21",
    )  # fmt: skip
    assert guard_key(0) == "st:{s0-60}:layout"
    assert rows_key(15) == "st:{s15-21}:usage:rows"
    assert stats_key(7) == "st:{s7-0}:stats"


def test_shard_i_hashes_into_the_ith_sixteenth_of_the_cluster_slots() -> None:
    """Redis Cluster hashes only the tag between braces: each shard is one slot."""
    for shard, tag in enumerate(SHARD_TAGS):
        slot = key_slot(f"{{{tag}}}".encode())
        assert shard * 1024 <= slot < (shard + 1) * 1024, (shard, tag, slot)
        keys = [
            guard_key(shard),
            rows_key(shard),
            stats_key(shard),
            usage_key(shard, DAY, "acme", "m"),
        ]
        assert {key_slot(k.encode()) for k in keys} == {slot}


def test_a_request_lives_in_the_shard_of_the_crc32_of_its_reference() -> None:
    for ref in (RequestRef("acme", "r1"), RequestRef("a:b", "c"), RequestRef("Grüße", "ü")):
        assert shard_of(ref) == zlib.crc32(ref.text.encode()) % 16
        slots = {key_slot(k.encode()) for k in (tokens_key(ref), closed_key(ref))}
        assert slots == {key_slot(guard_key(shard_of(ref)).encode())}
    assert shard_of_position("t:0:1") == zlib.crc32(b"t:0:1") % 16
    with pytest.raises(ValueError, match="must not be empty"):
        shard_of(RequestRef("acme", ""))


def test_tokens_and_closed_keys_are_the_shard_then_the_escaped_reference() -> None:
    assert tokens_key(RequestRef("acme", "r1")) == "st:{s14-22}:tokens:acme:r1"
    assert closed_key(RequestRef("acme", "r1")) == "st:{s14-22}:closed:acme:r1"
    # ":" and "%" of the tenant are escaped, so the first ":" ends the tenant
    assert tokens_key(RequestRef("a:b", "c")) == "st:{s1-63}:tokens:a%3Ab:c"
    assert tokens_key(RequestRef("100%", "c")) == "st:{s11-3}:tokens:100%25:c"
    assert tokens_key(RequestRef("a:b", "c")) != tokens_key(RequestRef("a", "b:c"))
    assert dead_key("streamtally.raw.sse:3:42") == "st:{s1-63}:dead:streamtally.raw.sse:3:42"
    with pytest.raises(ValueError, match="must not be empty"):
        tokens_key(RequestRef("acme", ""))
    for ref in (RequestRef("a:b", "c"), RequestRef("a", "b:c"), RequestRef("%3A", "%")):
        assert parse_tokens_key(tokens_key(ref)) == ref
        assert parse_tokens_key(tokens_key(ref).encode()) == ref
    for bad in ("st:tokens:acme:r1", "st:{s14-22}:usage:x:y", "st:{s14-22}:tokens:a%41:r"):
        with pytest.raises(ValueError, match="not a"):
            parse_tokens_key(bad)
    with pytest.raises(ValueError, match="wrong shard"):
        parse_tokens_key("st:{s0-60}:tokens:acme:r1")  # acme:r1 lives in shard 14


def test_the_scan_patterns_match_every_shard() -> None:
    assert tokens_pattern() == "st:{s*}:tokens:*"
    assert tokens_pattern("bench", "run-1a2b-") == "st:{s*}:tokens:bench:run-1a2b-*"
    assert tokens_pattern("a:b*", "x?[") == "st:{s*}:tokens:a%3Ab\\*:x\\?\\[*"
    assert tokens_pattern_of_id("r-1") == "st:{s*}:tokens:*:r-1"
    assert tokens_pattern_of_id("a*b?[c]") == "st:{s*}:tokens:*:a\\*b\\?\\[c\\]"
    assert closed_pattern() == "st:{s*}:closed:*"


@pytest.mark.parametrize(
    ("tenant", "model", "key"),
    [
        ("acme", "gpt-4o", "st:{s3-43}:usage:2026-11-21:acme:gpt-4o"),
        # ":" and "%" of the tenant are escaped, nothing else; the model stays as is
        ("acme:eu", "m", "st:{s3-43}:usage:2026-11-21:acme%3Aeu:m"),
        ("acme", "eu:m", "st:{s3-43}:usage:2026-11-21:acme:eu:m"),
        ("100%", "m", "st:{s3-43}:usage:2026-11-21:100%25:m"),
        ("%3A", "m", "st:{s3-43}:usage:2026-11-21:%253A:m"),
        ("Grüße/x y", "org/model:tag", "st:{s3-43}:usage:2026-11-21:Grüße/x y:org/model:tag"),
        ("acme", "unknown", "st:{s3-43}:usage:2026-11-21:acme:unknown"),
    ],
)
def test_usage_key(tenant: str, model: str, key: str) -> None:
    assert usage_key(3, DAY, tenant, model) == key


def test_a_tenant_with_a_colon_never_collides_with_another_tenants_model() -> None:
    assert usage_key(0, DAY, "a:b", "m") != usage_key(0, DAY, "a", "b:m")


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

    Layout 3 changed all three (one shard each, its guard key, the state TTL);
    the layout-2 flush script was 5cc20c960354096fdeacad1f176a8db9584efc33.
    """
    assert hashlib.sha1(FLUSH_SCRIPT.encode()).hexdigest() == (
        "103186a0b9e38db1f9e8f3b37bcb73c577abf611"
    )
    assert hashlib.sha1(CLOSE_ONCE_SCRIPT.encode()).hexdigest() == (
        "6a5926bed79b089fade64c1f119c2c563bab014b"
    )
    assert hashlib.sha1(DEAD_LETTER_SCRIPT.encode()).hexdigest() == (
        "e46677a20d4cfcec3ab13134b42d84991747ac2f"
    )


def _lua_list(name: str) -> tuple[str, ...]:
    found = re.search(rf"local {name} = \{{(.*?)\}}", FLUSH_SCRIPT, re.DOTALL)
    assert found is not None, name
    return tuple(re.findall(r"'([a-z_]+)'", found.group(1)))


def test_the_flush_script_names_the_row_fields_of_the_layout() -> None:
    assert _lua_list("FIELDS") == USAGE_FIELDS
    assert _lua_list("ALL") == ROW_FIELDS
    assert f"local a = 4 + {ARGS_PER_REQUEST} * (i - 1)" in FLUSH_SCRIPT
    assert ROW_FIELDS.index("cost_pico") + 1 == 8
    assert "local pico = tonumber(values[8] or '0')" in FLUSH_SCRIPT
    # the unpriced count is the last argument of a request, added only when it is not 0
    assert ARGS_PER_REQUEST == 13
    assert "if ARGV[a + 12] ~= '0' then" in FLUSH_SCRIPT
    assert "redis.call('HINCRBY', uk, 'unpriced_requests', ARGV[a + 12])" in FLUSH_SCRIPT


def test_flush_calls_lay_out_one_call_per_shard_with_13_arguments_per_request() -> None:
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
    assert [r.shard for r in batch] == [5, 6, 2]  # shard_of of acme:eu:r1, globex:r2, acme:r3
    assert all(len(request.argv()) == ARGS_PER_REQUEST for request in batch)
    calls = flush_calls(batch, ttl_s=691_200)
    assert [(c.shard, c.indexes) for c in calls] == [(2, [2]), (5, [0]), (6, [1])]
    by_shard = {c.shard: c for c in calls}
    assert by_shard[5].keys == [
        "st:{s5-13}:layout",
        "st:{s5-13}:usage:rows",
        "st:{s5-13}:stats",
        "st:{s5-13}:tokens:acme%3Aeu:r1",
        "st:{s5-13}:closed:acme%3Aeu:r1",
        "st:{s5-13}:usage:2026-11-21:acme%3Aeu:gpt-4.1-2025-04-14",
    ]
    assert by_shard[5].argv == [
        "1",  # requests in this call
        "3",  # the layout version the keys are of
        "691200",  # the state TTL, seconds
        tokens_json(first),
        '["2026-11-21","acme:eu","gpt-4.1-2025-04-14"]',
        "1520",  # the five usage fields, in USAGE_FIELDS order
        "48",
        "7",
        "1408",
        "3",
        "123",  # cost units
        "456",  # cost pico
        "12 timeout",  # closing marker
        "4",  # raw records
        "1",  # duplicates
        "0",  # priced: not counted in unpriced_requests
    ]
    assert by_shard[6].keys[3:] == [
        "st:{s6-3}:tokens:globex:r2",
        "st:{s6-3}:closed:globex:r2",
        "st:{s6-3}:usage:2026-11-22:globex:unknown",
    ]
    assert by_shard[6].argv[3:] == [
        tokens_json(second),
        '["2026-11-22","globex","unknown"]',
        "1520",
        "48",
        "7",
        "1408",
        "3",
        "0",  # unpriced: cost 0
        "0",
        "0 end",  # the defaults
        "0",
        "0",
        "1",  # unpriced: one more in the row's unpriced_requests
    ]
    assert by_shard[2].argv[3 + 7 : 3 + 9] == ["-1", "500000000000"]  # -0.5 = -1 + 0.5
    # every key of a call is in its shard's slot
    for call in calls:
        assert len({key_slot(k.encode()) for k in call.keys}) == 1
    with pytest.raises(ValueError, match=">= 0"):
        flush_calls(batch, ttl_s=-1)


def test_two_requests_of_one_shard_share_a_call_in_batch_order() -> None:
    a, b = make_tokens("r1"), make_tokens("r1")
    when = datetime(2026, 11, 21, tzinfo=UTC)
    batch = [
        finished_request(a, bill(a, "acme", when, PRICES)),
        finished_request(b, bill(b, "acme", when, PRICES), closed="9 end"),
    ]
    (call,) = flush_calls(batch, ttl_s=0)
    assert call.indexes == [0, 1]
    assert call.argv[:3] == ["2", "3", "0"]
    assert call.keys[3] == call.keys[6] == "st:{s14-22}:tokens:acme:r1"


def test_close_once_calls() -> None:
    r1, r2 = RequestRef("acme", "r1"), RequestRef("a:b", "c")
    decisions = [(14, closed_key(r1), "12 end"), (1, closed_key(r2), "3 timeout")]
    calls = close_once_calls(decisions, ttl_s=60)
    assert [(c.shard, c.keys, c.argv, c.indexes) for c in calls] == [
        (1, ["st:{s1-63}:layout", "st:{s1-63}:closed:a%3Ab:c"], ["3", "60", "3 timeout"], [1]),
        (14, ["st:{s14-22}:layout", "st:{s14-22}:closed:acme:r1"], ["3", "60", "12 end"], [0]),
    ]


def test_dead_letter_calls() -> None:
    positions = ["streamtally.raw.sse:3:42", "t:1:7"]
    marks = [(shard_of_position(p), dead_key(p)) for p in positions]
    calls = dead_letter_calls(marks, ttl_s=0)
    assert sorted(c.shard for c in calls) == sorted({m[0] for m in marks})
    first = next(c for c in calls if 0 in c.indexes)
    assert first.keys == [
        "st:{s1-63}:layout",
        "st:{s1-63}:stats",
        "st:{s1-63}:dead:streamtally.raw.sse:3:42",
    ]
    assert first.argv == ["3", "0"]
