"""The providers' usage exports, read into one shape: `UsageLine`s grouped per provider.

Three formats, told apart by their content (`load_reports`):

- **OpenAI** organization Usage API, completions (``GET /v1/organization/usage/completions``):
  a page object (``"object": "page"``) whose ``data`` holds buckets (``start_time`` and
  ``end_time`` in Unix seconds) of results (``"object":
  "organization.usage.completions.result"``) with ``input_tokens`` (cached included),
  ``output_tokens``, ``input_cached_tokens``, ``num_model_requests``, and the ``model``,
  ``api_key_id`` and ``project_id`` they are grouped by (null when not grouped).
- **Anthropic** Admin API messages usage report (``GET
  /v1/organizations/usage_report/messages``): ``data`` buckets (``starting_at`` and
  ``ending_at``, RFC 3339) of results with ``uncached_input_tokens``,
  ``cache_read_input_tokens``, ``cache_creation`` (``ephemeral_5m_input_tokens``,
  ``ephemeral_1h_input_tokens``), ``output_tokens``, and ``model``, ``api_key_id`` and
  ``workspace_id`` when grouped by them.  It counts no requests.
- **CSV** for any other provider: a header line, then ``day,model,key,input,output,cached``
  (``key``: an API key id or a project id; ``input`` includes ``cached``, as our
  ``input_tokens`` does) and optionally ``requests``; ``day`` is a UTC date.

A JSON file holds one page, a JSON array of pages, or one page per line (JSON Lines, as
a loop appending each response writes it).  The pages of one provider, across all the
files given, are one export: the last page read must not say ``has_more`` (the export would
be incomplete), and no (bucket, model, key) may be counted twice.

Token kinds as streamtally counts them (docs ../shared/spec/normalization.md, *Usage*):

=================  ===================================  ===============================
our kind           OpenAI                               Anthropic
=================  ===================================  ===============================
requests           ``num_model_requests``               (not reported)
input_tokens       ``input_tokens`` (cached included)   ``uncached_input_tokens`` +
                                                        ``cache_read_input_tokens`` +
                                                        both ``cache_creation`` counts
cached_tokens      ``input_cached_tokens``              ``cache_read_input_tokens``
cache_write_tokens (not compared)                       both ``cache_creation`` counts
output_tokens      ``output_tokens``                    ``output_tokens``
=================  ===================================  ===============================

Audio tokens, server tool use and the other groupings (``user_id``, ``service_tier``,
``batch``, ``context_window``) are ignored: results that differ only in them are summed.

Every error is an `InputError` naming the file, the line or page and bucket, and what is
wrong.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from streamtally.audit import parse_time
from streamtally.errors import InputError

__all__ = [
    "ANTHROPIC",
    "CSV",
    "KINDS",
    "OPENAI",
    "PROVIDER_KINDS",
    "ProviderReport",
    "UsageLine",
    "load_reports",
    "parse_anthropic",
    "parse_csv",
    "parse_openai",
]

OPENAI: Final = "openai"
ANTHROPIC: Final = "anthropic"
CSV: Final = "csv"
#: Every kind compared, in report order.
KINDS: Final = ("requests", "input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens")
#: The kinds each format reports (the others are not compared for it).
PROVIDER_KINDS: Final = {
    OPENAI: ("requests", "input_tokens", "output_tokens", "cached_tokens"),
    ANTHROPIC: ("input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens"),
    CSV: ("input_tokens", "output_tokens", "cached_tokens"),
}
_OPENAI_RESULT: Final = "organization.usage.completions.result"
_CSV_COLUMNS: Final = ("day", "model", "key", "input", "output", "cached")
_DAY: Final = timedelta(days=1)


@dataclass(frozen=True, slots=True)
class UsageLine:
    """One result of one bucket: usage of one model through one key in [start, end)."""

    start: datetime
    end: datetime
    model: str
    #: The ids it may map to a tenant by, in order: the API key's, then the project's
    #: (OpenAI) or workspace's (Anthropic); for a CSV line, its ``key``.
    ids: tuple[str, ...]
    #: Kind -> count, for the kinds of its provider (`PROVIDER_KINDS`).
    counts: dict[str, int]
    #: Where it was read, for messages: ``FILE page 1 bucket 3 result 2`` or ``FILE line 4``.
    where: str

    @property
    def day(self) -> str:
        return self.start.date().isoformat()


@dataclass(slots=True)
class ProviderReport:
    """Every line of one provider's export, from one or several files."""

    provider: str
    files: list[str] = field(default_factory=list)
    lines: list[UsageLine] = field(default_factory=list)
    pages: int = 0
    buckets: int = 0

    @property
    def kinds(self) -> tuple[str, ...]:
        return PROVIDER_KINDS[self.provider]


def _count(value: Any, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where}: {name} must be a whole number >= 0, got {value!r}")
    return value


def _optional_count(result: dict[str, Any], name: str, where: str) -> int:
    value = result.get(name)
    return 0 if value is None else _count(value, where, name)


def _id(value: Any, where: str, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InputError(f"{where}: {name} must be a non-empty string or null, got {value!r}")
    return value


def _one_day(start: datetime, end: datetime, where: str) -> None:
    if end <= start:
        raise InputError(f"{where}: the bucket ends ({end.isoformat()}) before it starts")
    if (end - timedelta(microseconds=1)).date() != start.date():
        raise InputError(
            f"{where}: the bucket {start.isoformat()} to {end.isoformat()} spans more than "
            "one UTC day: export buckets of a day (1d) or less, starting at midnight UTC"
        )


def _ids_and_model(
    result: dict[str, Any], where: str, key_names: tuple[str, str]
) -> tuple[str, tuple[str, ...]]:
    model = result.get("model")
    if not isinstance(model, str) or not model:
        raise InputError(f"{where}: no model: export the usage grouped by model (group_by=model)")
    ids = tuple(i for i in (_id(result.get(n), where, n) for n in key_names) if i is not None)
    if not ids:
        raise InputError(
            f"{where}: neither {key_names[0]} nor {key_names[1]}: export the usage grouped "
            f"by {key_names[0]} or {key_names[1]} (group_by), which map to tenants"
        )
    return model, ids


def _results(bucket: Any, where: str) -> list[Any]:
    if not isinstance(bucket, dict):
        raise InputError(f"{where}: a bucket must be an object")
    results = bucket.get("results")
    if not isinstance(results, list):
        raise InputError(f"{where}: results must be a list")
    return results


def _unix(value: Any, where: str, name: str) -> datetime:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {name} must be Unix seconds (an integer), got {value!r}")
    return datetime.fromtimestamp(value, UTC)


def parse_openai(page: dict[str, Any], where: str) -> Iterator[UsageLine]:
    """The lines of one page of OpenAI's completions usage (`where`: ``FILE page N``)."""
    data = page.get("data")
    if page.get("object") != "page" or not isinstance(data, list):
        raise InputError(f'{where}: not a usage page (want "object": "page" and a data list)')
    for b, bucket in enumerate(data, 1):
        at = f"{where} bucket {b}"
        results = _results(bucket, at)
        start = _unix(bucket.get("start_time"), at, "start_time")
        end = _unix(bucket.get("end_time"), at, "end_time")
        _one_day(start, end, at)
        for r, result in enumerate(results, 1):
            here = f"{at} result {r}"
            if not isinstance(result, dict) or result.get("object") != _OPENAI_RESULT:
                raise InputError(
                    f'{here}: not a completions usage result (want "object": "{_OPENAI_RESULT}")'
                )
            model, ids = _ids_and_model(result, here, ("api_key_id", "project_id"))
            counts = {
                "requests": _count(result.get("num_model_requests"), here, "num_model_requests"),
                "input_tokens": _count(result.get("input_tokens"), here, "input_tokens"),
                "output_tokens": _count(result.get("output_tokens"), here, "output_tokens"),
                "cached_tokens": _optional_count(result, "input_cached_tokens", here),
            }
            if counts["cached_tokens"] > counts["input_tokens"]:
                raise InputError(f"{here}: input_cached_tokens exceeds input_tokens")
            yield UsageLine(start, end, model, ids, counts, here)


def _rfc3339(value: Any, where: str, name: str) -> datetime:
    if not isinstance(value, str):
        raise InputError(f"{where}: {name} must be an RFC 3339 time, got {value!r}")
    try:
        return parse_time(value)
    except InputError as exc:
        raise InputError(f"{where}: {name}: {exc}") from None


def parse_anthropic(page: dict[str, Any], where: str) -> Iterator[UsageLine]:
    """The lines of one page of Anthropic's messages usage report."""
    data = page.get("data")
    if not isinstance(data, list):
        raise InputError(f"{where}: not a usage report (want a data list)")
    for b, bucket in enumerate(data, 1):
        at = f"{where} bucket {b}"
        results = _results(bucket, at)
        start = _rfc3339(bucket.get("starting_at"), at, "starting_at")
        end = _rfc3339(bucket.get("ending_at"), at, "ending_at")
        _one_day(start, end, at)
        for r, result in enumerate(results, 1):
            here = f"{at} result {r}"
            if not isinstance(result, dict):
                raise InputError(f"{here}: a result must be an object")
            model, ids = _ids_and_model(result, here, ("api_key_id", "workspace_id"))
            creation = result.get("cache_creation") or {}
            if not isinstance(creation, dict):
                raise InputError(f"{here}: cache_creation must be an object")
            writes = _optional_count(creation, "ephemeral_5m_input_tokens", here) + (
                _optional_count(creation, "ephemeral_1h_input_tokens", here)
            )
            uncached = _count(result.get("uncached_input_tokens"), here, "uncached_input_tokens")
            reads = _optional_count(result, "cache_read_input_tokens", here)
            counts = {
                "input_tokens": uncached + reads + writes,
                "output_tokens": _count(result.get("output_tokens"), here, "output_tokens"),
                "cached_tokens": reads,
                "cache_write_tokens": writes,
            }
            yield UsageLine(start, end, model, ids, counts, here)


def parse_csv(rows: Iterable[Sequence[str]], where: str) -> Iterator[UsageLine]:
    """The lines of a CSV export (`rows` with its header first; `where`: the file)."""
    lines = iter(rows)
    header = [h.strip().lower() for h in next(lines, [])]
    missing = [c for c in _CSV_COLUMNS if c not in header]
    if missing:
        raise InputError(
            f"{where} line 1: the header lacks {', '.join(missing)} "
            f"(want {','.join(_CSV_COLUMNS)}[,requests])"
        )
    at = {name: header.index(name) for name in header}
    for n, row in enumerate(lines, 2):
        here = f"{where} line {n}"
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise InputError(f"{here}: {len(row)} cells, the header has {len(header)}")
        cell = {name: row[i].strip() for name, i in at.items()}
        try:
            day = date.fromisoformat(cell["day"])
        except ValueError:
            raise InputError(f"{here}: day {cell['day']!r} is not a date (YYYY-MM-DD)") from None
        if not cell["model"] or not cell["key"]:
            raise InputError(f"{here}: model and key must not be empty")
        counts = {}
        for kind, column in (
            ("input_tokens", "input"),
            ("output_tokens", "output"),
            ("cached_tokens", "cached"),
            *((("requests", "requests"),) if "requests" in at else ()),
        ):
            text = cell[column]
            if not text.isdigit():
                raise InputError(f"{here}: {column} must be a whole number >= 0, got {text!r}")
            counts[kind] = int(text)
        if counts["cached_tokens"] > counts["input_tokens"]:
            raise InputError(f"{here}: cached exceeds input (input includes the cached tokens)")
        start = datetime.combine(day, datetime.min.time(), UTC)
        yield UsageLine(start, start + _DAY, cell["model"], (cell["key"],), counts, here)


def _pages(path: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, page) of a JSON file: one page, an array of pages, or JSON Lines."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        pages = []
        for n, line in lines:
            try:
                pages.append((f"{path} line {n}", json.loads(line)))
            except ValueError as exc:
                raise InputError(f"{path} line {n}: not JSON ({exc})") from None
    else:
        if isinstance(doc, list):
            pages = [(f"{path} page {n}", page) for n, page in enumerate(doc, 1)]
        else:
            pages = [(f"{path} page 1", doc)]
    for where, page in pages:
        if not isinstance(page, dict):
            raise InputError(f"{where}: a page must be a JSON object")
    return pages


def _provider_of(page: dict[str, Any], where: str) -> str:
    data = page.get("data")
    if isinstance(data, list):
        first = next((b for b in data if isinstance(b, dict)), None)
        if page.get("object") == "page" or (first is not None and "start_time" in first):
            return OPENAI
        if first is None or "starting_at" in first:
            return ANTHROPIC
    raise InputError(
        f"{where}: neither an OpenAI completions usage page nor an Anthropic messages "
        "usage report (see `streamtally audit --help`, --provider-usage)"
    )


def _check_unique(report: ProviderReport) -> None:
    """A bucket on two pages, or a CSV line twice: counted twice, refused."""
    if report.provider == CSV:
        rows: dict[tuple[datetime, str, tuple[str, ...]], str] = {}
        for line in report.lines:
            key = (line.start, line.model, line.ids)
            if key in rows:
                raise InputError(f"{line.where}: the same day, model and key as {rows[key]}")
            rows[key] = line.where
        return
    pages: dict[tuple[datetime, datetime], str] = {}
    for line in report.lines:
        page = line.where.rsplit(" bucket ", 1)[0]
        first = pages.setdefault((line.start, line.end), page)
        if first != page:
            raise InputError(
                f"{line.where}: the bucket {line.start.isoformat()} to {line.end.isoformat()} "
                f"is also on {first}: a page given twice?"
            )


def load_reports(paths: Sequence[str]) -> list[ProviderReport]:
    """Every file of `paths` read, grouped per provider (in the order first given)."""
    reports: dict[str, ProviderReport] = {}
    last_page: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(
                f"--provider-usage {path}: cannot read it: {exc.strerror or exc}"
            ) from exc
        except UnicodeDecodeError:
            raise InputError(f"--provider-usage {path}: not UTF-8 text") from None
        if path.lower().endswith(".csv"):
            report = reports.setdefault(CSV, ProviderReport(CSV))
            found = list(parse_csv(csv.reader(text.splitlines()), path))
            report.pages += 1
            report.buckets += len({line.start for line in found})
            report.lines.extend(found)
            report.files.append(path)
            continue
        for where, page in _pages(path, text):
            provider = _provider_of(page, where)
            report = reports.setdefault(provider, ProviderReport(provider))
            parse = parse_openai if provider == OPENAI else parse_anthropic
            report.lines.extend(parse(page, where))
            report.pages += 1
            report.buckets += len(page["data"])
            if path not in report.files:
                report.files.append(path)
            last_page[provider] = (where, page)
    for provider, (where, page) in last_page.items():
        if page.get("has_more") is True:
            raise InputError(
                f"{where}: has_more is true and no page follows it: the {provider} export is "
                f"incomplete; fetch the next page (page={page.get('next_page')!s}) and give "
                "it too, after this one"
            )
    for report in reports.values():
        _check_unique(report)
    return list(reports.values())
