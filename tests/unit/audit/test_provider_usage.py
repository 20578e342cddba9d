"""`audit --provider-usage`: the providers' exports, the tenant map, the comparison and its
tolerance (`streamtally.audit.provider_usage`), and the nightly options (no Kafka, no Redis).

The exports below are written from the providers' public API references: OpenAI's
organization Usage API, completions (a ``page`` of ``bucket``s of
``organization.usage.completions.result``), Anthropic's Admin API messages usage report
(``data`` buckets with ``starting_at`` / ``ending_at``, ``cache_creation``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from streamtally.audit import Kind, TimeRange
from streamtally.audit.provider_usage import (
    ProviderReport,
    TenantMap,
    Tolerance,
    compare_usage,
    load_reports,
    parse_anthropic,
    parse_csv,
    parse_openai,
)
from streamtally.cli import main
from streamtally.cli._audit_extra import window_of
from streamtally.core.models import FinishReason, Source
from streamtally.errors import InputError
from streamtally.producers.proxy.api_keys import ApiKeyTenants
from streamtally.wire.records import BillingEvent

DAY = datetime(2026, 11, 23, tzinfo=UTC)
DAY_S = int(DAY.timestamp())


def openai_result(model: str = "gpt-4o-mini-2024-07-18", **counts: Any) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": 1000,
        "output_tokens": 500,
        "input_cached_tokens": 800,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": 5,
        "project_id": "proj_acme",
        "user_id": None,
        "api_key_id": "key_acme",
        "model": model,
        "batch": None,
        **counts,
    }


def openai_page(
    *buckets: tuple[int, list[dict[str, Any]]], has_more: bool = False
) -> dict[str, Any]:
    return {
        "object": "page",
        "data": [
            {"object": "bucket", "start_time": s, "end_time": s + 86400, "results": r}
            for s, r in buckets
        ],
        "has_more": has_more,
        "next_page": "page_AAAAAGdGxdEiJdKOAAAAAGcqsYA=" if has_more else None,
    }


def anthropic_result(**changes: Any) -> dict[str, Any]:
    return {
        "api_key_id": "apikey_01Acme",
        "workspace_id": "wrkspc_01Acme",
        "model": "claude-sonnet-4-20250514",
        "service_tier": "standard",
        "context_window": "0-200k",
        "uncached_input_tokens": 1500,
        "cache_read_input_tokens": 200,
        "cache_creation": {"ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 1000},
        "output_tokens": 500,
        "server_tool_use": {"web_search_requests": 10},
        **changes,
    }


def anthropic_page(*results: dict[str, Any], has_more: bool = False) -> dict[str, Any]:
    return {
        "data": [
            {
                "starting_at": "2026-11-23T00:00:00Z",
                "ending_at": "2026-11-24T00:00:00Z",
                "results": list(results),
            }
        ],
        "has_more": has_more,
        "next_page": "page_MjAyNi0xMS0yNFQwMDowMDowMFo=" if has_more else None,
    }


# -- the parsers -------------------------------------------------------------------------


def test_openai_buckets_are_read_with_input_including_cached() -> None:
    page = openai_page(
        (DAY_S, [openai_result(), openai_result(api_key_id=None, input_cached_tokens=None)]),
        (DAY_S + 86400, []),
    )
    lines = list(parse_openai(page, "u.json page 1"))
    assert [line.ids for line in lines] == [("key_acme", "proj_acme"), ("proj_acme",)]
    first = lines[0]
    assert (first.start, first.end, first.day) == (DAY, DAY + timedelta(days=1), "2026-11-23")
    assert first.model == "gpt-4o-mini-2024-07-18"
    assert first.counts == {
        "requests": 5,
        "input_tokens": 1000,
        "output_tokens": 500,
        "cached_tokens": 800,
    }
    assert lines[1].counts["cached_tokens"] == 0  # null: none
    assert first.where == "u.json page 1 bucket 1 result 1"


def test_anthropic_input_is_uncached_plus_cache_reads_plus_cache_writes() -> None:
    (line,) = parse_anthropic(anthropic_page(anthropic_result()), "a.json page 1")
    assert line.ids == ("apikey_01Acme", "wrkspc_01Acme")
    assert line.start == DAY
    assert line.counts == {
        "input_tokens": 1500 + 200 + 500 + 1000,
        "output_tokens": 500,
        "cached_tokens": 200,
        "cache_write_tokens": 1500,
    }


def test_csv_lines_are_read_with_an_optional_requests_column() -> None:
    text = "day,model,key,input,output,cached,requests\n2026-11-23,llama-3,key_1,100,20,30,4\n\n"
    (line,) = parse_csv(csv.reader(io.StringIO(text)), "u.csv")
    assert (line.start, line.model, line.ids) == (DAY, "llama-3", ("key_1",))
    assert line.counts == {
        "input_tokens": 100,
        "output_tokens": 20,
        "cached_tokens": 30,
        "requests": 4,
    }


@pytest.mark.parametrize(
    ("page", "message"),
    [
        (
            openai_page((DAY_S, [openai_result(model=None)])),
            "u.json page 1 bucket 1 result 1: no model: export the usage grouped by model",
        ),
        (
            openai_page((DAY_S, [openai_result(api_key_id=None, project_id=None)])),
            "result 1: neither api_key_id nor project_id",
        ),
        (
            openai_page((DAY_S, [openai_result(output_tokens=-1)])),
            "result 1: output_tokens must be a whole number >= 0, got -1",
        ),
        (
            openai_page((DAY_S, [openai_result(input_cached_tokens=2000)])),
            "input_cached_tokens exceeds input_tokens",
        ),
        (
            openai_page((DAY_S, [{"object": "organization.usage.embeddings.result"}])),
            "not a completions usage result",
        ),
        (
            openai_page((DAY_S + 3600, [openai_result()])),
            "u.json page 1 bucket 1: the bucket 2026-11-23T01:00:00+00:00 to "
            "2026-11-24T01:00:00+00:00 spans more than one UTC day",
        ),
        ({"object": "list", "data": []}, "not a usage page"),
    ],
)
def test_a_malformed_openai_page_names_where_and_what(page: Any, message: str) -> None:
    with pytest.raises(InputError) as error:
        list(parse_openai(page, "u.json page 1"))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (anthropic_result(model=None), "no model"),
        (anthropic_result(api_key_id=None, workspace_id=None), "neither api_key_id nor"),
        (anthropic_result(uncached_input_tokens="7"), "uncached_input_tokens must be a whole"),
        (anthropic_result(cache_creation=[1]), "cache_creation must be an object"),
    ],
)
def test_a_malformed_anthropic_result_names_where_and_what(
    result: dict[str, Any], message: str
) -> None:
    with pytest.raises(InputError) as error:
        list(parse_anthropic(anthropic_page(result), "a.json page 2"))
    assert str(error.value).startswith("a.json page 2 bucket 1 result 1: ")
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("day,model,input,output,cached\n", "u.csv line 1: the header lacks key"),
        ("day,model,key,input,output,cached\n2026-11-32,m,k,1,1,0\n", "u.csv line 2: day"),
        ("day,model,key,input,output,cached\n2026-11-23,m,k,1,1.5,0\n", "line 2: output must"),
        ("day,model,key,input,output,cached\n2026-11-23,m,k,1,1\n", "line 2: 5 cells"),
        ("day,model,key,input,output,cached\n2026-11-23,m,k,1,1,2\n", "cached exceeds input"),
    ],
)
def test_a_malformed_csv_names_the_line(text: str, message: str) -> None:
    with pytest.raises(InputError) as error:
        list(parse_csv(csv.reader(io.StringIO(text)), "u.csv"))
    assert message in str(error.value)


def write(path: Path, doc: Any) -> str:
    path.write_text(json.dumps(doc), encoding="utf-8")
    return str(path)


def test_pages_of_one_export_are_read_across_files_and_formats(tmp_path: Path) -> None:
    first = openai_page((DAY_S, [openai_result()]), has_more=True)
    second = openai_page((DAY_S + 86400, [openai_result()]))
    array = write(tmp_path / "openai.json", [first, second])
    lines = tmp_path / "anthropic.jsonl"
    lines.write_text(
        json.dumps(anthropic_page(anthropic_result(), has_more=True))
        + "\n"
        + json.dumps({"data": [], "has_more": False, "next_page": None})
        + "\n",
        encoding="utf-8",
    )
    reports = load_reports([array, str(lines)])
    assert [(r.provider, r.pages, r.buckets, len(r.lines)) for r in reports] == [
        ("openai", 2, 2, 2),
        ("anthropic", 2, 1, 1),
    ]
    # the same pages as two files
    one = write(tmp_path / "p1.json", first)
    two = write(tmp_path / "p2.json", second)
    assert len(load_reports([one, two])[0].lines) == 2


def test_an_export_cut_short_or_given_twice_is_refused(tmp_path: Path) -> None:
    first = write(tmp_path / "p1.json", openai_page((DAY_S, [openai_result()]), has_more=True))
    with pytest.raises(InputError) as error:
        load_reports([first])
    assert "p1.json page 1: has_more is true and no page follows it" in str(error.value)
    assert "page=page_AAAAAGdGxdEiJdKOAAAAAGcqsYA=" in str(error.value)
    last = write(tmp_path / "p2.json", openai_page((DAY_S, [openai_result()])))
    with pytest.raises(InputError, match=r"is also on .*p1.json page 1: a page given twice"):
        load_reports([first, last])


def test_a_file_of_no_known_shape_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"x.json page 1: neither an OpenAI"):
        load_reports([write(tmp_path / "x.json", {"usage": []})])
    bad = tmp_path / "y.json"
    bad.write_text('{"object": "page"\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"y.json line 1: not JSON"):
        load_reports([str(bad)])
    with pytest.raises(InputError, match="cannot read it"):
        load_reports([str(tmp_path / "absent.json")])


# -- the tenant map ----------------------------------------------------------------------


def test_the_api_keys_file_maps_by_provider_key_id_and_the_proxy_still_reads_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.json"
    keys = [
        {"sha256": "a" * 64, "tenant": "acme", "name": "acme prod", "provider_key_id": "key_a"},
        {"sha256": "b" * 64, "tenant": "globex"},
    ]
    write(path, {"keys": keys})
    mapping = TenantMap.load(path)
    assert mapping.tenants == {"key_a": "acme"}
    assert mapping.tenant_of(["key_zz", "key_a"]) == "acme"
    assert mapping.tenant_of(["key_zz"]) is None
    assert ApiKeyTenants.load(path).tenants == {"a" * 64: "acme", "b" * 64: "globex"}


def test_a_map_of_its_own_and_its_errors(tmp_path: Path) -> None:
    own = write(tmp_path / "own.json", {"provider_ids": {"proj_1": "acme", "wrkspc_2": "b"}})
    assert TenantMap.load(own).named() == {"acme", "b"}
    for doc, message in [
        ({"keys": [{"sha256": "a" * 64, "tenant": "acme"}]}, "no entry of keys has a provider"),
        ({"provider_ids": {"proj_1": ""}}, 'provider_ids["proj_1"]: the tenant must be'),
        ({"keys": [{"provider_key_id": "k", "tenant": "a"}, {"provider_key_id": "k"}]}, "entry 1"),
        ([], "expected"),
    ]:
        with pytest.raises(InputError) as error:
            TenantMap.load(write(tmp_path / "bad.json", doc))
        assert str(error.value).startswith(f"--provider-map {tmp_path / 'bad.json'}: ")
        assert message in str(error.value)


# -- the comparison ----------------------------------------------------------------------

MAP = TenantMap({"key_acme": "acme", "proj_globex": "globex"})
MODEL = "gpt-4o-mini-2024-07-18"


def bill(
    n: int, tenant: str = "acme", at: datetime = DAY + timedelta(hours=12), **usage: Any
) -> BillingEvent:
    counts = {"input_tokens": 200, "output_tokens": 100, "cached_tokens": 160, **usage}
    return BillingEvent(
        event_id=f"{n:032x}",
        request_id=f"r{n}",
        tenant=tenant,
        model=usage.pop("model", MODEL),
        source=Source.OPENAI,
        finish_reason=FinishReason.STOP,
        **{k: v for k, v in counts.items() if k != "model"},
        cost=Decimal("0.001"),
        price_table_version="v1",
        event_time=at,
    )


def openai_report(*results: dict[str, Any], start: int = DAY_S) -> list[ProviderReport]:
    report = ProviderReport("openai", files=["u.json"])
    report.lines = list(parse_openai(openai_page((start, list(results))), "u.json page 1"))
    return [report]


def test_a_matching_report_is_clean() -> None:
    reports = openai_report(openai_result())  # 5 requests: 1000 in, 800 cached, 500 out
    bills = [bill(n) for n in range(5)]
    check = compare_usage(reports, MAP, bills, window=TimeRange())
    assert check.discrepancies == []
    assert check.providers[0]["keys"] == {"matched": 1, "within_tolerance": 0, "mismatched": 0}
    assert check.providers[0]["provider_totals"] == check.providers[0]["ledger_totals"]


def test_calls_the_ledger_lacks_are_mismatches_with_both_numbers() -> None:
    reports = openai_report(openai_result())
    check = compare_usage(reports, MAP, [bill(n) for n in range(2)], window=TimeRange())
    found = {
        (d.kind, d.tenant, d.model, d.day, d.field): (d.expected, d.found)
        for d in check.discrepancies
    }
    key = (Kind.PROVIDER_USAGE_MISMATCH, "acme", MODEL, "2026-11-23")
    assert found == {
        (*key, "requests"): (5, 2),
        (*key, "input_tokens"): (1000, 400),
        (*key, "output_tokens"): (500, 200),
        (*key, "cached_tokens"): (800, 320),
    }
    assert all(d.request_id is None for d in check.discrepancies)


def test_usage_the_provider_never_reported_is_a_mismatch_too() -> None:
    reports = openai_report(openai_result())
    bills = [bill(n) for n in range(5)] + [bill(9, tenant="globex")]
    check = compare_usage(reports, MAP, bills, window=TimeRange())
    assert {(d.tenant, d.field, d.expected, d.found) for d in check.discrepancies} == {
        ("globex", "requests", 0, 1),
        ("globex", "input_tokens", 0, 200),
        ("globex", "output_tokens", 0, 100),
        ("globex", "cached_tokens", 0, 160),
    }


def test_what_is_not_compared() -> None:
    reports = openai_report(openai_result(), openai_result(api_key_id="key_x", project_id=None))
    bills = [bill(n) for n in range(5)] + [
        bill(10, at=DAY + timedelta(days=1)),  # after the bucket
        bill(11, model="claude-sonnet-4-20250514"),  # a model the export does not report
        bill(12, tenant="initech"),  # a tenant the map does not name
    ]
    check = compare_usage(reports, MAP, bills, window=TimeRange())
    assert check.discrepancies == []
    assert check.unmapped == [
        {
            "provider": "openai",
            "day": "2026-11-23",
            "model": MODEL,
            "id": "key_x",
            "requests": 5,
            "input_tokens": 1000,
            "output_tokens": 500,
            "cached_tokens": 800,
        }
    ]
    # a bucket outside --since / --until is left out, and the bills in it
    outside = compare_usage(
        reports, MAP, [bill(1)], window=TimeRange(DAY + timedelta(days=1), None)
    )
    assert outside.discrepancies == []
    assert outside.providers[0]["buckets_outside"] == 1
    # --tenant: only those tenants
    only = compare_usage(reports, MAP, [], window=TimeRange(), tenants=frozenset({"globex"}))
    assert only.discrepancies == []


def test_hourly_buckets_compare_only_the_hours_they_cover() -> None:
    report = ProviderReport("openai", files=["h.json"])
    hour = {
        "object": "page",
        "data": [
            {
                "object": "bucket",
                "start_time": DAY_S + 3600 * 12,
                "end_time": DAY_S + 3600 * 13,
                "results": [
                    openai_result(
                        num_model_requests=1,
                        input_tokens=200,
                        output_tokens=100,
                        input_cached_tokens=160,
                    )
                ],
            }
        ],
    }
    report.lines = list(parse_openai(hour, "h.json page 1"))
    bills = [
        bill(1, at=DAY + timedelta(hours=12, minutes=5)),
        bill(2, at=DAY + timedelta(hours=14)),
    ]
    assert compare_usage([report], MAP, bills, window=TimeRange()).discrepancies == []


def test_anthropic_cache_writes_are_compared() -> None:
    report = ProviderReport("anthropic", files=["a.json"])
    report.lines = list(parse_anthropic(anthropic_page(anthropic_result()), "a.json page 1"))
    mapping = TenantMap({"apikey_01Acme": "acme"})
    same = bill(
        1,
        model="claude-sonnet-4-20250514",
        input_tokens=3200,
        output_tokens=500,
        cached_tokens=200,
        cache_write_tokens=1500,
    )
    assert compare_usage([report], mapping, [same], window=TimeRange()).discrepancies == []
    fewer_writes = bill(
        1,
        model="claude-sonnet-4-20250514",
        input_tokens=3200,
        output_tokens=500,
        cached_tokens=200,
        cache_write_tokens=500,
    )
    check = compare_usage([report], mapping, [fewer_writes], window=TimeRange())
    assert [(d.field, d.expected, d.found) for d in check.discrepancies] == [
        ("cache_write_tokens", 1500, 500)
    ]


def test_a_call_straddling_midnight_is_within_a_stated_tolerance() -> None:
    # The provider counts the call on the 23rd (its start), the ledger on the 24th (its
    # last receive time): each day differs by one call.
    report = ProviderReport("openai", files=["u.json"])
    report.lines = list(
        parse_openai(
            openai_page(
                (
                    DAY_S,
                    [
                        openai_result(
                            num_model_requests=3,
                            input_tokens=600,
                            output_tokens=300,
                            input_cached_tokens=480,
                        )
                    ],
                ),
                (
                    DAY_S + 86400,
                    [
                        openai_result(
                            num_model_requests=1,
                            input_tokens=200,
                            output_tokens=100,
                            input_cached_tokens=160,
                        )
                    ],
                ),
            ),
            "u.json page 1",
        )
    )
    bills = [
        bill(1),
        bill(2),
        bill(3, at=DAY + timedelta(days=1, seconds=1)),
        bill(4, at=DAY + timedelta(days=1, hours=1)),
    ]
    exact = compare_usage([report], MAP, bills, window=TimeRange())
    assert {(d.day, d.field, d.expected, d.found) for d in exact.discrepancies} >= {
        ("2026-11-23", "requests", 3, 2),
        ("2026-11-24", "requests", 1, 2),
    }
    loose = Tolerance.parse("tokens=200,requests=1")
    check = compare_usage([report], MAP, bills, window=TimeRange(), tolerance=loose)
    assert check.discrepancies == []
    assert check.providers[0]["keys"]["within_tolerance"] == 2
    relative = Tolerance.parse("rel=0.5")  # 1 of 3 and 1 of 2: within half the larger
    assert (
        compare_usage([report], MAP, bills, window=TimeRange(), tolerance=relative).discrepancies
        == []
    )
    tight = Tolerance.parse("rel=0.1,tokens=199,requests=1")
    assert {
        d.field
        for d in compare_usage(
            [report], MAP, bills, window=TimeRange(), tolerance=tight
        ).discrepancies
    } == {"input_tokens"}


def test_the_tolerance_setting() -> None:
    assert Tolerance.parse(None) == Tolerance()
    assert Tolerance.parse(" rel=0.001 , tokens=2000,requests=2") == Tolerance(
        Decimal("0.001"), 2000, 2
    )
    assert not Tolerance().allows("input_tokens", 10, 11)
    assert Tolerance(tokens=1).allows("input_tokens", 10, 11)
    assert not Tolerance(tokens=1).allows("requests", 10, 11)
    for text in ("rel=2", "rel=x", "tokens=-1", "tokens=1,tokens=2", "cost=1", "rel"):
        with pytest.raises(InputError, match="provider tolerance"):
            Tolerance.parse(text)


def test_a_model_in_two_exports_is_refused() -> None:
    csv_report = ProviderReport("csv", files=["u.csv"])
    csv_report.lines = list(
        parse_csv(
            csv.reader(
                io.StringIO(f"day,model,key,input,output,cached\n2026-11-23,{MODEL},k,1,1,0\n")
            ),
            "u.csv",
        )
    )
    with pytest.raises(InputError, match="is in the openai and the csv exports"):
        compare_usage([*openai_report(openai_result()), csv_report], MAP, [], window=TimeRange())


# -- the command -------------------------------------------------------------------------


def test_yesterday_is_the_previous_utc_day() -> None:
    args = argparse.Namespace(yesterday=True, since=None, until=None)
    now = datetime(2026, 11, 24, 0, 30, tzinfo=UTC)
    assert window_of(args, lambda: now) == TimeRange(DAY, DAY + timedelta(days=1))
    with pytest.raises(InputError, match="drop --since and --until"):
        window_of(argparse.Namespace(yesterday=True, since=DAY, until=None), lambda: now)
    plain = argparse.Namespace(yesterday=False, since=DAY, until=None)
    assert window_of(plain) == TimeRange(DAY, None)


def run_audit_command(argv: list[str]) -> int:
    code: Any
    try:
        code = main(["audit", *argv])
    except SystemExit as exit_:
        code = exit_.code
    return int(code)


def test_bad_provider_input_stops_the_audit_before_kafka_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An unreachable Kafka would fail later, and differently: the files are read first.
    kafka = ["--bootstrap-servers", "127.0.0.1:1"]
    good_map = write(tmp_path / "map.json", {"provider_ids": {"key_acme": "acme"}})
    bad = write(tmp_path / "usage.json", openai_page((DAY_S, [openai_result(model=None)])))
    cases = [
        (["--provider-usage", bad], "--provider-usage needs --provider-map FILE"),
        (["--provider-map", good_map], "go with --provider-usage"),
        (
            ["--provider-usage", bad, "--provider-map", good_map],
            f"{bad} page 1 bucket 1 result 1: no model",
        ),
        (
            ["--provider-usage", bad, "--provider-map", good_map, "--provider-tolerance", "x=1"],
            "provider tolerance 'x=1'",
        ),
    ]
    for argv, message in cases:
        assert run_audit_command([*argv, *kafka]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert message in err


def test_the_help_documents_the_provider_and_nightly_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_audit_command(["--help"]) == 0
    text = capsys.readouterr().out
    for word in (
        "--provider-usage",
        "--provider-map",
        "--provider-tolerance",
        "STREAMTALLY_PROVIDER_TOLERANCE",
        "provider_usage_mismatch",
        "has_more",
        "provider_key_id",
        "--yesterday",
        "--progress-lines",
    ):
        assert word in text


def test_each_raw_partition_is_told_once_when_read_to_its_end() -> None:
    from streamtally.audit._run import _partitions_read
    from streamtally.wire.kafka import TopicRecord

    def record(partition: int, offset: int) -> TopicRecord:
        return TopicRecord("t", partition, offset, None, b"", 0)

    told: list[tuple[str, int, int]] = []
    seen: set[int] = set()
    ranges = {0: (10, 12), 1: (0, 3), 2: (5, 5), 3: (0, 4)}
    tell = lambda *args: told.append(args)  # noqa: E731
    _partitions_read([record(0, 10), record(1, 0)], "t", ranges, tell, seen)
    assert told == []
    _partitions_read([record(0, 11), record(1, 1), record(0, 11)], "t", ranges, tell, seen)
    assert told == [("t", 0, 2)]
    # the topic read: the partitions with records in range not told yet (3's last record
    # was not seen: a gap at its end), never one with none in range
    _partitions_read(None, "t", ranges, tell, seen)
    assert told == [("t", 0, 2), ("t", 1, 3), ("t", 3, 4)]
