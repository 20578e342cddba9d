"""`streamtally audit`: its arguments, its text output and its CSV (no Kafka, no Redis)."""

from __future__ import annotations

import csv
import dataclasses
import gc
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamtally._gc import GC_YOUNG_THRESHOLD
from streamtally.audit import Discrepancy, Kind, Report, RequestCounts, RowComparison
from streamtally.cli import audit as cli_audit
from streamtally.cli import main
from streamtally.cli.audit import SHOWN, format_report, rerate_prices
from streamtally.errors import InputError
from streamtally.settings import Settings


def report(*found: Discrepancy, tenants: list[str] | None = None) -> Report:
    return Report(
        requests=RequestCounts(replayed=3, billed=3, matched=2, mismatched=1),
        rows=RowComparison(2, 2, 0, []),
        rows_skipped=1,
        discrepancies=found,
        totals={},
        snapshot={
            "taken_at": "2026-11-24T12:00:00+00:00",
            "since": None,
            "until": "2026-11-24T00:00:00+00:00",
            "tenants": tenants,
            "raw_records": {"read": 1234},
        },
    )


HOSTILE = "evil\n\x1b[2Jtenant\u202e"
ROW = Discrepancy(Kind.USAGE_ROW_MISMATCH, None, HOSTILE, "m", "2026-11-23", "cost", "1.0", None)
BILL = Discrepancy(Kind.USAGE_MISMATCH, "=HYPERLINK(1)", "acme", None, None, "input_tokens", 1, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--since", "yesterday"], "is not an RFC 3339 time"),
        (["--until", "2026-11-23T10:00:00"], "is not an RFC 3339 time"),
        (["--since", "2026-11-24", "--until", "2026-11-24"], "must be before --until"),
        (["--out", "/nonexistent-folder/report.json"], "not a file in a writable folder"),
        (["--bootstrap-servers", "h:99999"], "port"),
        (["--workers", "0"], "want 1 to 256 processes"),
        (["merge", "--snapshot", "s.json", "p.json", "--provider-map", "m"], "go with --prov"),
        (["merge", "--snapshot", "s.json", "p.json", "--prices", "-"], "give a file, not -"),
        (["run", "--snapshot", "s.json", "--share", "2/2", "--out", "p.json"], "want 0 <= i < N"),
        (["merge", "--snapshot", "/nonexistent/s.json", "p.json"], "cannot read the snapshot"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: Any
    try:
        code = main(["audit", *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err


def test_help_names_every_discrepancy_kind(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for kind in Kind:
        assert kind.value in text


def test_the_text_report_is_a_summary_and_an_escaped_table() -> None:
    clean = format_report(report())
    assert "1,234 raw records" in clean
    assert "from the beginning to 2026-11-24T00:00:00+00:00 (all tenants)" in clean
    assert "3 replayed, 3 billed: 2 matched, 1 mismatched" in clean
    assert "2 checked: 2 matched, 0 mismatched (1 not checked" in clean
    assert clean.endswith("no discrepancies\n")
    text = format_report(report(ROW, BILL, tenants=["acme", HOSTILE]))
    assert "\x1b" not in text
    assert "\u202e" not in text
    assert "2 discrepancies:" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("KIND"))
    assert len(lines) == header + 3  # one line per discrepancy, whatever the tenant holds
    assert "evil\\n\\x1b[2Jtenant\\u202e" in lines[header + 1]
    assert lines[header + 2].split()[:3] == ["usage_mismatch", "=HYPERLINK(1)", "acme"]


def test_a_long_list_is_cut_in_the_text_only() -> None:
    many = [
        Discrepancy(Kind.MISSING_BILLING, f"r{i:03}", "acme", "m", None, "cost", "1", None)
        for i in range(SHOWN + 5)
    ]
    text = format_report(report(*many))
    assert text.endswith("... and 5 more (--json or --out lists all)\n")
    assert len(report(*many).to_json()["discrepancies"]) == SHOWN + 5


def test_the_csv_lists_every_discrepancy_safely() -> None:
    rows = list(csv.reader(io.StringIO(report(ROW, BILL).csv_text())))
    assert rows[0] == ["kind", "request_id", "tenant", "model", "day", "field", "expected", "found"]
    assert rows[1] == ["usage_row_mismatch", "", HOSTILE, "m", "2026-11-23", "cost", "1.0", ""]
    # a request id a spreadsheet would run as a formula stays text
    assert rows[2] == ["usage_mismatch", "'=HYPERLINK(1)", "acme", "", "", "input_tokens", "1", "2"]


def test_the_json_report_has_the_documented_shape() -> None:
    doc = json.loads(json.dumps(report(BILL).to_json()))
    assert set(doc) == {
        "requests",
        "usage_rows",
        "discrepancies",
        "aborted",
        "totals",
        "rerating",
        "provider_usage",
        "corrections",
        "snapshot",
    }
    assert doc["aborted"] == {"count": 0, "requests": [], "listed": 0}
    assert doc["rerating"] is None  # without --prices
    assert doc["corrections"] is None  # without --correct
    assert doc["provider_usage"] is None  # without --provider-usage
    assert set(doc["requests"]) == {
        "replayed",
        "amended",
        "billed",
        "matched",
        "mismatched",
        "missing_billing",
        "unexpected_billing",
        "conflicting_billing",
        "partial",
        "dead_lettered",
    }
    assert {"checked", "matched", "mismatched"} <= set(doc["usage_rows"])
    assert doc["discrepancies"] == [
        {
            "kind": "usage_mismatch",
            "request_id": "=HYPERLINK(1)",
            "tenant": "acme",
            "model": None,
            "day": None,
            "field": "input_tokens",
            "expected": 1,
            "found": 2,
        }
    ]


def _prices_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        (
            '{"currency": "USD", "versions": [{"version": "a", "unit": 1, "models": {}}, '
            '{"version": "b", "effective_from": "2026-11-01T00:00:00", "unit": 1, "models": {}}]}',
            "versions.1.effective_from: effective_from '2026-11-01T00:00:00' has no time zone",
        ),
        (
            '{"version": "v", "currency": "EUR", "unit": 1, "models": {}}',
            "prices in EUR, the bills in USD",
        ),
    ],
)
def test_a_bad_prices_file_is_one_line_and_status_2_before_connecting(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = _prices_file(tmp_path, "p.json", text)
    # nothing listens on port 9: a connection attempt would fail with another message
    code = main(["audit", "--prices", name, "--bootstrap-servers", "127.0.0.1:9"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("streamtally audit: ")
    assert message in err


def test_a_missing_prices_file_is_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["audit", "--prices", str(tmp_path / "none.json")])
    assert code == 2
    assert "cannot read price table" in capsys.readouterr().err


def test_rerate_prices_loads_the_file_in_the_settings_currency(tmp_path: Path) -> None:
    name = _prices_file(
        tmp_path, "p.json", '{"version": "v9", "currency": "USD", "unit": 1, "models": {}}'
    )
    table = rerate_prices(name, Settings())
    assert table is not None
    assert table.version == "v9"
    assert rerate_prices(None, Settings()) is None


RERATING = {
    "prices": "new\x1b.json",
    "currency": "USD",
    "versions": [{"version": "a", "effective_from": None}],
    "tenants": {
        "acme": {
            "requests": 1200,
            "billed": "1.000000000000",
            "rerated": "1.500000000000",
            "difference": "0.500000000000",
            "unpriced_billed": 2,
            "unpriced_rerated": 0,
        }
    },
    "total": {
        "requests": 1200,
        "billed": "1.000000000000",
        "rerated": "1.500000000000",
        "difference": "0.500000000000",
        "unpriced_billed": 2,
        "unpriced_rerated": 0,
    },
}


def test_the_text_report_shows_the_rerating_as_a_short_table() -> None:
    text = format_report(dataclasses.replace(report(), rerating=RERATING))
    assert "\x1b" not in text
    assert "re-rated at new\\x1b.json (versions a), USD; difference = re-rated - billed:" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("TENANT"))
    assert lines[header].split() == [
        "TENANT",
        "REQUESTS",
        "BILLED",
        "RERATED",
        "DIFFERENCE",
        "UNPRICED",
    ]
    assert lines[header + 2].split() == [
        "acme",
        "1,200",
        "1.000000000000",
        "1.500000000000",
        "0.500000000000",
        "2",
        "->",
        "0",
    ]
    assert lines[header + 4].split()[0] == "total"
    assert "re-rated" not in format_report(report())
    doc = json.loads(json.dumps(dataclasses.replace(report(), rerating=RERATING).to_json()))
    assert doc["rerating"] == RERATING


ABORTED = {
    "count": 12,
    "requests": [
        {"tenant": HOSTILE if i == 0 else "acme", "request_id": f"call-{i}"} for i in range(12)
    ],
    "listed": 12,
}


def test_aborted_requests_are_their_own_kind_not_a_discrepancy() -> None:
    """Named in the summary (escaped, the first ten) and in the JSON; the audit is clean."""
    done = dataclasses.replace(report(), aborted=ABORTED)
    assert done.clean
    assert done.to_json()["aborted"] == ABORTED
    text = format_report(done)
    line = next(x for x in text.splitlines() if x.startswith("aborted: "))
    assert "12 requests cancelled before the provider reported usage" in line
    assert "call-0 (evil\\n\\x1b[2Jtenant\\u202e)" in line
    assert "call-9 (acme)" in line
    assert "call-10" not in line
    assert "and 2 more (--json lists them)" in line
    assert text.endswith("no discrepancies\n")
    assert "aborted: " not in format_report(report())  # none: no line


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
@pytest.mark.parametrize(
    "argv",
    [[], ["run", "--snapshot", "s.json", "--share", "0/2", "--out", "p.json"]],
    ids=["one process", "a share"],
)
def test_the_replay_runs_with_the_workers_collector_settings(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay holds what a worker holds: tuned as `tune_gc` tunes the worker (else the
    collector rescans the open requests' state, a third of the audit's CPU)."""
    monkeypatch.chdir(tmp_path)
    gc.set_threshold(700, 10, 10)
    seen: list[int] = []

    def replay(*_args: object, **_kwargs: object) -> object:
        seen.append(gc.get_threshold()[0])
        raise InputError("stop here")

    monkeypatch.setattr(cli_audit, "run_redis", replay)
    monkeypatch.setattr(cli_audit, "_read_plan", lambda name: name)
    assert main(["audit", *argv]) == 2
    assert seen == [GC_YOUNG_THRESHOLD]
