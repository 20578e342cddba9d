"""`streamtally audit`'s options for the provider's usage report and the nightly run.

``--provider-usage FILE…`` with ``--provider-map FILE`` (and ``--provider-tolerance``)
compares the provider's usage with the bills that stand after the audit
(`streamtally.audit.provider_usage`); the files and the map are read before anything
else, so a malformed one stops the command (exit 2) before Kafka is read.

``--yesterday`` audits the previous UTC day (``--since`` its midnight, ``--until`` today's);
``--progress-lines`` writes a progress line to stderr per raw partition read to its end,
one at each step, and none that is rewritten in place (for a log file, a cron job's mail).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from streamtally.audit import Report, TimeRange
from streamtally.audit.provider_usage import (
    ProviderReport,
    TenantMap,
    Tolerance,
    compare_usage,
    load_reports,
    standing_bills,
)
from streamtally.cli._output import say
from streamtally.connection import KafkaConnection
from streamtally.errors import InputError
from streamtally.settings import Settings
from streamtally.topics import Topics

__all__ = [
    "PROVIDER_EPILOG",
    "PartitionLines",
    "ProviderInputs",
    "add_arguments",
    "add_provider_arguments",
    "check_provider_usage",
    "load_provider_inputs",
    "provider_summary",
    "window_of",
]

PROVIDER_EPILOG = """\
--provider-usage FILE... compares the provider's own usage report with the bills
that stand (the billing and corrections topics as of the snapshot, one bill per
request) per UTC day, model and tenant.  FILE is a page of OpenAI's organization
Usage API, completions (GET /v1/organization/usage/completions, group_by model and
api_key_id or project_id), a page of Anthropic's Admin API messages usage report
(GET /v1/organizations/usage_report/messages, group_by model and api_key_id or
workspace_id), each as saved (one page, a JSON array of pages, or one page per
line), or a CSV with the header day,model,key,input,output,cached[,requests] (input
includes cached) for any other provider.  Give every page of an export, in order:
the last one must not say has_more.  Buckets of a day or less, inside --since /
--until, are compared; a bill counts on the UTC day of its event time.
--provider-map FILE maps the report's ids to tenants: the proxy's --api-keys file
with "provider_key_id" in its entries, or {"provider_ids": {"<id>": "<tenant>"}}.
Compared: requests, input (cached included), output, cached tokens (OpenAI: no
cache writes; Anthropic: cache writes, no requests; CSV: no cache writes).
--provider-tolerance rel=F,tokens=N,requests=N (or STREAMTALLY_PROVIDER_TOLERANCE)
lets counts differ by N or by F times the larger (calls straddling a bucket's end);
default exact.  A difference beyond it is a provider_usage_mismatch (field: the
kind, expected: the provider's count, found: the ledger's), never corrected.

--yesterday audits the previous UTC day; --progress-lines writes one progress line
per raw partition read (and per step) to stderr.  The nightly job:
  streamtally audit --yesterday --progress-lines --out /var/lib/streamtally/audit.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--yesterday",
        action="store_true",
        help="audit the previous UTC day (--since its midnight, --until today's)",
    )
    parser.add_argument(
        "--progress-lines",
        action="store_true",
        help="a progress line on stderr per raw partition read and per step (for logs)",
    )
    add_provider_arguments(parser)


def add_provider_arguments(parser: argparse.ArgumentParser) -> None:
    """``--provider-usage``, ``--provider-map``, ``--provider-tolerance`` (``audit`` and
    ``audit merge``)."""
    parser.add_argument(
        "--provider-usage",
        nargs="+",
        metavar="FILE",
        help="compare with the provider's usage export(s): OpenAI, Anthropic JSON, or CSV",
    )
    parser.add_argument(
        "--provider-map",
        metavar="FILE",
        help="the provider's key, project or workspace ids -> tenants (see below)",
    )
    parser.add_argument(
        "--provider-tolerance",
        metavar="SPEC",
        help="rel=F,tokens=N,requests=N: differences allowed (default exact)",
    )


def window_of(
    args: argparse.Namespace, now: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> TimeRange:
    """``--since`` / ``--until``, or with ``--yesterday`` the previous UTC day."""
    if not args.yesterday:
        return TimeRange(args.since, args.until)
    if args.since is not None or args.until is not None:
        raise InputError("--yesterday is a range of its own: drop --since and --until")
    today = datetime.combine(now().astimezone(UTC).date(), datetime.min.time(), UTC)
    return TimeRange(today - timedelta(days=1), today)


@dataclass(frozen=True, slots=True)
class ProviderInputs:
    reports: list[ProviderReport]
    tenant_map: TenantMap
    tolerance: Tolerance


def load_provider_inputs(args: argparse.Namespace, settings: Settings) -> ProviderInputs | None:
    """The exports, map and tolerance of ``--provider-usage`` (None without it)."""
    if not args.provider_usage:
        if args.provider_map is not None or args.provider_tolerance is not None:
            raise InputError("--provider-map and --provider-tolerance go with --provider-usage")
        return None
    if args.provider_map is None:
        raise InputError(
            "--provider-usage needs --provider-map FILE (the ids of its keys or projects "
            "-> tenants)"
        )
    tolerance = Tolerance.parse(args.provider_tolerance or settings.provider_tolerance)
    tenant_map = TenantMap.load(args.provider_map)
    reports = load_reports(args.provider_usage)
    return ProviderInputs(reports, tenant_map, tolerance)


def check_provider_usage(
    report: Report,
    inputs: ProviderInputs,
    *,
    servers: KafkaConnection | str,
    settings: Settings,
    tenants: frozenset[str] | None,
    window: TimeRange,
    quiet: bool,
) -> Report:
    """`report` with the provider comparison: its discrepancies added (in the report's
    order) and its section under ``provider_usage``."""
    topics = Topics.in_namespace(settings.namespace)
    audited = inputs.tenant_map.named() if tenants is None else inputs.tenant_map.named() & tenants
    if not quiet:
        for r in inputs.reports:
            say(
                f"streamtally audit: provider usage: {r.provider}, {len(r.files)} file(s), "
                f"{r.pages} page(s), {r.buckets} bucket(s), {len(r.lines)} line(s)"
            )
        say(
            f"streamtally audit: provider usage: reading the bills that stand of "
            f"{len(audited)} tenant(s) from {topics.billing.name}"
        )
    bad: list[tuple[int, int, str]] = []
    bills = asyncio.run(
        standing_bills(
            servers,
            report.snapshot,
            billing_topic=topics.billing.name,
            corrections_topic=topics.corrections.name,
            tenants=audited,
            bad=bad,
        )
    )
    check = compare_usage(
        inputs.reports,
        inputs.tenant_map,
        bills,
        window=window,
        tenants=tenants,
        tolerance=inputs.tolerance,
    )
    if not quiet:
        say(
            f"streamtally audit: provider usage: {len(bills):,} bills compared, "
            f"{len(check.discrepancies):,} provider_usage_mismatch, "
            f"{len(check.unmapped):,} unmapped (day, model, id)"
        )
    found = sorted([*report.discrepancies, *check.discrepancies], key=lambda d: d.sort_key())
    section = check.to_json()
    section["undecodable"] = len(bad)
    return dataclasses.replace(report, discrepancies=tuple(found), provider_usage=section)


def provider_summary(section: dict[str, Any] | None) -> list[str]:
    """The text report's lines of ``provider_usage`` (none without it)."""
    if section is None:
        return []
    out = []
    for p in section["providers"]:
        keys = p["keys"]
        out.append(
            f"provider usage ({p['provider']}): {p['buckets_compared']:,} buckets compared "
            f"({p['buckets_outside']:,} outside the range): {keys['matched']:,} (day, model, "
            f"tenant) matched, {keys['within_tolerance']:,} within tolerance, "
            f"{keys['mismatched']:,} mismatched"
        )
    if section["unmapped"]:
        ids = sorted({u["id"] for u in section["unmapped"]})
        out.append(
            f"provider usage of ids no tenant is mapped to (not compared): {', '.join(ids[:10])}"
            + (f" and {len(ids) - 10:,} more" if len(ids) > 10 else "")
        )
    return out


class PartitionLines:
    """``--progress-lines``: one line per raw partition read to its end, and per step."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        #: The audit's own count (`Progress`, every half second): billing records included.
        self.done = 0
        self.total = 0
        self.partitions = 0
        self.records = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def partition(self, topic: str, partition: int, records: int) -> None:
        self.partitions += 1
        self.records += records
        took = max(time.monotonic() - self._start, 1e-6)
        share = 100 * self.done / self.total if self.total else 0.0
        overall = f", {self.done:,} of {self.total:,} records in all ({share:.0f}%)"
        print(
            f"streamtally audit: {topic} partition {partition} read: {records:,} records; "
            f"{self.partitions:,} partitions, {self.records:,} raw records read so far, "
            f"{self.records / took:,.0f}/s" + (overall if self.total else ""),
            file=sys.stderr,
            flush=True,
        )

    def step(self, text: str) -> None:
        print(f"streamtally audit: {text}", file=sys.stderr, flush=True)
