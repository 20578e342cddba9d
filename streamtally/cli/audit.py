"""`streamtally audit`: replay the raw topics and prove every bill (`streamtally.audit`).

Read-only unless ``--correct``: the raw, billing and corrections topics are read with
consumers of no group, the processors' committed offsets with an admin request, Redis
through `RedisStore` reads.  ``--correct`` appends to the corrections topic and adds
usage row differences through `RedisStore.correct_row`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from streamtally._gc import tune_gc
from streamtally.audit import (
    CSV_COLUMNS,
    AuditOptions,
    Merged,
    Part,
    Plan,
    Report,
    Rerating,
    Share,
    TimeRange,
    correct_audit,
    merge_parts,
    merged_report,
    parse_time,
    run_audit,
    run_share,
    take_plan,
)
from streamtally.billing.pricing import PriceTable, PriceTableError
from streamtally.cli import _audit_extra, _output
from streamtally.cli._args import add_kafka_to_read, file_or_stdin, kafka_of
from streamtally.cli._output import escape, json_text, write_stdout
from streamtally.cli.tokens import add_redis_url, run_redis
from streamtally.errors import InputError
from streamtally.settings import Settings

__all__ = ["add_parser", "format_report", "format_rerating", "rerate_prices"]

#: Discrepancies the text output lists (``--json`` and ``--out`` list all).
SHOWN: Final = 50
#: Aborted requests the summary names (all of them with --json, up to the report's list).
SHOWN_ABORTED: Final = 10

_EPILOG = """\
TIME is RFC 3339 with an offset (2026-11-23T10:00:00Z) or a UTC date (2026-11-23,
its midnight); --since is included, --until excluded; both select raw records by
their receive time.  --tenant may be repeated.

discrepancy kinds:
  missing_billing      a request the replay closed has no billing event (field cost:
                       what it should have cost)
  unexpected_billing   a billing event in range names no request the replay found
  conflicting_billing  a request has two different billing events (field: where one
                       differs from the replay)
  usage_mismatch       its one billing event differs in a usage field, the model,
                       source, finish reason or event time (field names it)
  cost_mismatch        its one billing event differs in cost, priced or currency
  provenance_mismatch  its one billing event differs in what it says it was folded
                       from: raw_topic, raw_partition, first_offset, last_offset,
                       raw_sha256 (the hash of the raw records applied) or
                       usage_source (provider_reported, engine_counted, missing,
                       aborted);
                       an event of before BillingEvent v3 carries none: not compared
  usage_row_mismatch   a Redis usage row (tenant, model, day) differs from the sum of
                       the replayed requests (field names it; request_id is null)
  unbilled_amendment   records after a close at the timeout (or over a gap) change the
                       request's bill, but no billing event of that revision exists:
                       they were dead-lettered instead of amending it (field cost)
amended requests (records after a close at their timeout billed again as a later
revision) are counted: each revision is checked as its own billing event, and the rows
against the revision that stands.
partial requests (straddling the range, still open or not yet processed at the
snapshot) are counted, never mismatches; usage rows are checked only for audited
tenants, whole UTC days inside the range, and days no partial request ended on.
aborted requests (closed cancelled before the provider reported usage, billed with
what they had: usage_source aborted) are their own kind, no discrepancy: counted and
named in the summary, under "aborted" with --json.

--prices FILE re-rates the period: every request the replay closed is priced again
at FILE's prices (a price table, with or without history), at its receive time, and
the report shows per tenant the cost billed (the replay, at the prices in force),
the cost at FILE's prices and the difference (FILE's minus billed), under "rerating"
with --json.  It changes nothing; FILE must price in the settings' currency.

--correct (never the default) writes one correction per discrepancy to the
corrections topic (<namespace>.billing.corrections: the reason, the superseded
event_id, the bill that stands, with its usage and cost; the billing topic is never
rewritten) and adds each differing usage row's difference to Redis once.  Audits
read the bills as corrected, so the next run reports clean; a billing consumer
applies the corrections the same way (docs/billing.md, "One ledger, one rule").
The exit status is still 1 when there was something to correct.

--workers N runs the audit as N processes on this machine: one snapshot, each
process replaying the raw partitions p with p % N == i and checking the bills of
their requests, the partial reports merged into the report one process writes,
byte for byte (the usage rows are compared once, after the merge).  With --prices
each process re-rates its requests and the sums per tenant are added up; with
--correct the corrections of the merged discrepancies are written once, after the
merge, by this process: the same corrections and usage row fixes as one process's.
On several machines, the same in three steps:
  streamtally audit snapshot --out SNAP [--since T] [--until T] [--tenant T]
  streamtally audit run --snapshot SNAP --share i/N --out PART [--prices FILE]
                                                                 (i = 0 .. N-1)
  streamtally audit merge --snapshot SNAP PART... [--prices FILE] [--correct]
        [--provider-usage FILE... --provider-map FILE] [--json] [--out FILE]
--prices on merge must name the table every share was run with (--prices on run),
and is given exactly when they were run with one;
--correct on merge writes the corrections from the machine that merges, once; the
provider comparison, like the usage rows', runs once there too.  Run merge --correct
soon after the snapshot: bills corrected since are judged as the snapshot saw them.

--out FILE writes the report as JSON, or the discrepancies as CSV when FILE ends
in .csv.  Progress (rate, ETA) goes to stderr on a terminal, never with --json.
exit status: 0 no discrepancy, 1 discrepancies, 2 a bad argument, Kafka or Redis
             unreachable, or a topic missing
"""


def _time(text: str) -> datetime:
    try:
        return parse_time(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="replay the raw topics and check every billing event and usage row",
        description=(
            "Replay the raw topics up to their current end (read-only) with the processors' "
            "own fold and pricing, and compare each request with its billing event and the "
            "usage rows in Redis."
        ),
        epilog=_EPILOG + "\n" + _audit_extra.PROVIDER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--since", type=_time, metavar="TIME", help="first receive time audited")
    parser.add_argument("--until", type=_time, metavar="TIME", help="receive time audited before")
    parser.add_argument(
        "--tenant", action="append", metavar="T", help="audit this tenant (repeatable)"
    )
    parser.add_argument(
        "--prices",
        type=file_or_stdin,
        metavar="FILE",
        help="also re-rate the period at the prices of this price table (changes nothing)",
    )
    parser.add_argument(
        "--correct",
        action="store_true",
        help="write a correction per discrepancy and set the Redis usage rows right",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument(
        "--out", type=file_or_stdin, metavar="FILE", help="also write the report (.csv: CSV)"
    )
    parser.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N",
        help="run the audit as N processes, each a share of the raw partitions (default 1)",
    )
    _audit_extra.add_arguments(parser)
    add_kafka_to_read(parser)
    add_redis_url(parser)
    parser.set_defaults(func=run)
    steps = parser.add_subparsers(dest="step", metavar="STEP", required=False)
    snap = steps.add_parser(
        "snapshot",
        help="take an audit's snapshot (offsets and usage rows) into a file",
        description="Take the snapshot of a split audit: what every `audit run` reads.",
    )
    snap.add_argument("--since", type=_time, metavar="TIME", help="first receive time audited")
    snap.add_argument("--until", type=_time, metavar="TIME", help="receive time audited before")
    snap.add_argument("--tenant", action="append", metavar="T", help="audit this tenant")
    snap.add_argument("--out", required=True, metavar="FILE", help="the snapshot file")
    add_kafka_to_read(snap)
    add_redis_url(snap)
    snap.set_defaults(func=run_snapshot)
    share = steps.add_parser(
        "run",
        help="audit one share of a snapshot's raw partitions into a part file",
        description="Replay share i/N of the raw partitions of a snapshot (see audit --help).",
    )
    share.add_argument("--snapshot", required=True, metavar="FILE", help="`audit snapshot`'s")
    share.add_argument("--share", required=True, metavar="i/N", help="0-based: 0/2 and 1/2")
    share.add_argument("--out", required=True, metavar="PART", help="the part file")
    share.add_argument(
        "--prices",
        type=file_or_stdin,
        metavar="FILE",
        help="also re-rate the share at this price table (merge with the same --prices)",
    )
    add_kafka_to_read(share)
    add_redis_url(share)
    share.set_defaults(func=run_part)
    merge = steps.add_parser(
        "merge",
        help="merge the parts of every share into the audit's report",
        description=(
            "Merge the parts of shares 0/N to N-1/N of one snapshot into its report: the\n"
            "usage rows, and with --provider-usage the provider's report, compared once,\n"
            "here; with --correct the corrections written once, here; --prices names the\n"
            "table every share was run with (see streamtally audit --help)."
        ),
        epilog=_audit_extra.PROVIDER_EPILOG.split("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    merge.add_argument("--snapshot", required=True, metavar="FILE", help="`audit snapshot`'s")
    merge.add_argument("parts", nargs="+", metavar="PART", help="`audit run`'s part files")
    merge.add_argument("--json", action="store_true", help="print the report as JSON")
    merge.add_argument(
        "--out", type=file_or_stdin, metavar="FILE", help="also write the report (.csv: CSV)"
    )
    merge.add_argument(
        "--prices",
        type=file_or_stdin,
        metavar="FILE",
        help="the re-rating's table: the one every share was run with (audit run --prices)",
    )
    merge.add_argument(
        "--correct",
        action="store_true",
        help="write the corrections of the merged report, once (needs Kafka and Redis)",
    )
    _audit_extra.add_provider_arguments(merge)
    add_kafka_to_read(merge)
    add_redis_url(merge)
    merge.set_defaults(func=run_merge)


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: want 1 to 256 processes")
    return value


class _ProgressLine:
    """One line on stderr, rewritten: records read, rate, time left."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        took = max(time.monotonic() - self._start, 1e-6)
        rate = done / took
        left = f"{(total - done) / rate:.0f} s" if rate > 0 and total > done else "-"
        sys.stderr.write(
            f"\rstreamtally audit: {done:,} of {total:,} records, {rate:,.0f}/s, ETA {left}\x1b[K"
        )
        sys.stderr.flush()
        self._shown = True

    def end(self) -> None:
        if self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _out_path(name: str | None) -> Path | None:
    if name is None:
        return None
    path = Path(name)
    folder = path.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise InputError(f"--out {escape(name)}: not a file in a writable folder")
    return path


def rerate_prices(name: str | None, settings: Settings) -> PriceTable | None:
    """The table of ``--prices`` (None without it); `PriceTableError` when it is not a valid
    price table or prices in another currency than the settings' table."""
    if name is None:
        return None
    if name == "-":
        raise InputError("--prices: give a file, not - (standard input)")
    other = PriceTable.load(name)
    billed = PriceTable.load_or_default(settings.prices_path)
    if other.currency != billed.currency:
        raise PriceTableError(
            f"--prices {name}: prices in {other.currency}, the bills in {billed.currency}: "
            "re-rating compares costs in one currency"
        )
    return other


def run(args: argparse.Namespace, settings: Settings) -> int:
    # aiokafka logs every failed connection attempt; the error raised says it in one line.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    provider = _audit_extra.load_provider_inputs(args, settings)  # before anything is read
    lines = _audit_extra.PartitionLines() if args.progress_lines else None
    options = AuditOptions(
        window=_audit_extra.window_of(args),
        tenants=frozenset(args.tenant) if args.tenant else None,
        rerate=rerate_prices(args.prices, settings),
        rerate_name=args.prices or "",
        correct=args.correct,
        partition_read=None if lines is None else lines.partition,
    )
    out = _out_path(args.out)
    servers = kafka_of(args, settings)
    progress: Any = lines
    if lines is None and not args.json and sys.stderr.isatty() and args.workers == 1:
        progress = _ProgressLine()
    if lines is not None:
        lines.step(f"auditing {_window_text(options.window)}")
    if args.workers > 1:
        report = _run_workers(args, settings, options)
    else:
        tune_gc()  # the replay holds what a worker holds: the worker's collector settings
        try:
            report = run_redis(
                args.redis_url or settings.redis_url,
                lambda store: run_audit(
                    settings, store, options, servers=servers, progress=progress
                ),
                cluster=settings.redis_cluster,
            )
        finally:
            if isinstance(progress, _ProgressLine):
                progress.end()
    if lines is not None:
        lines.step(f"replay and comparisons done: {len(report.discrepancies):,} discrepancies")
    if provider is not None:
        report = _audit_extra.check_provider_usage(
            report,
            provider,
            servers=servers,
            settings=settings,
            tenants=options.tenants,
            window=options.window,
            quiet=args.json and lines is None,
        )
    return _print(report, args.json, out, lines)


def _child_args(args: argparse.Namespace) -> list[str]:
    """The connection options given to this command, for its worker processes."""
    out = []
    for name, flag in (("bootstrap_servers", "--bootstrap-servers"), ("redis_url", "--redis-url")):
        value = getattr(args, name, None)
        if value:
            out += [flag, value]
    return out


def _run_workers(args: argparse.Namespace, settings: Settings, options: AuditOptions) -> Report:
    """The snapshot here, each share in a process of its own, the parts merged here (and
    with ``--correct`` the corrections written here, once, after the merge)."""
    servers = kafka_of(args, settings)
    plan = run_redis(
        args.redis_url or settings.redis_url,
        lambda store: take_plan(settings, store, options, servers=servers),
        cluster=settings.redis_cluster,
    )
    with tempfile.TemporaryDirectory(prefix="streamtally-audit-") as folder:
        snapshot = Path(folder) / "snapshot.json"
        snapshot.write_text(json_text(plan.to_json()), encoding="utf-8")
        children = []
        for i in range(args.workers):
            part = Path(folder) / f"part-{i}.json"
            command = [
                sys.executable,
                "-c",
                "import sys; from streamtally.cli import main; sys.exit(main())",
                "audit",
                "run",
                "--snapshot",
                str(snapshot),
                "--share",
                f"{i}/{args.workers}",
                "--out",
                str(part),
                *(["--prices", args.prices] if args.prices else []),
                *_child_args(args),
            ]
            children.append((part, subprocess.Popen(command, stdout=subprocess.DEVNULL)))
        failed = [str(i) for i, (_, child) in enumerate(children) if child.wait() != 0]
        if failed:
            raise InputError(f"audit --workers: share(s) {', '.join(failed)} failed (above)")
        parts = [_read_part(part) for part, _ in children]
    return _finish(
        args, settings, plan, merge_parts(parts), prices=options.rerate, correct=options.correct
    )


def _finish(
    args: argparse.Namespace,
    settings: Settings,
    plan: Plan,
    merged: Merged,
    *,
    prices: PriceTable | None,
    correct: bool,
) -> Report:
    """The report of the merged parts; with `correct`, its corrections written (once)."""
    rerating = None if prices is None else Rerating(prices, args.prices)
    if not correct:
        return merged_report(plan, merged, rerate=rerating)
    servers = kafka_of(args, settings)
    return run_redis(
        args.redis_url or settings.redis_url,
        lambda store: correct_audit(
            settings, store, plan, merged, rerate=rerating, servers=servers
        ),
        cluster=settings.redis_cluster,
    )


def _read_json(name: str, what: str) -> Any:
    try:
        return json.loads(Path(name).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read {what} {escape(name)}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise InputError(f"{what} {escape(name)} is not JSON: {exc}") from exc


def _read_part(path: Path) -> Part:
    return Part.from_json(_read_json(str(path), "the part"))


def _read_plan(name: str) -> Plan:
    return Plan.from_json(_read_json(name, "the snapshot"))


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot write {escape(str(path))}: {exc.strerror or exc}") from exc


def run_snapshot(args: argparse.Namespace, settings: Settings) -> int:
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    out = _out_path(args.out)
    assert out is not None
    options = AuditOptions(
        window=TimeRange(args.since, args.until),
        tenants=frozenset(args.tenant) if args.tenant else None,
    )
    servers = kafka_of(args, settings)
    plan = run_redis(
        args.redis_url or settings.redis_url,
        lambda store: take_plan(settings, store, options, servers=servers),
        cluster=settings.redis_cluster,
    )
    _write(out, json_text(plan.to_json()) + "\n")
    snap = plan.snapshot
    write_stdout(
        escape(
            f"snapshot of {snap.raw_records():,} raw and {snap.billing_records():,} billing "
            f"records, {len(plan.rows):,} usage rows, taken at {snap.taken_at.isoformat()}"
        )
        + "\n"
    )
    return 0


def run_part(args: argparse.Namespace, settings: Settings) -> int:
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    out = _out_path(args.out)
    assert out is not None
    share = Share.parse(args.share)
    plan = _read_plan(args.snapshot)
    prices = rerate_prices(args.prices, settings)
    rerating = None if prices is None else Rerating(prices, args.prices)
    servers = kafka_of(args, settings)
    tune_gc()  # as `run`: the replay holds what a worker holds
    done = run_redis(
        args.redis_url or settings.redis_url,
        lambda store: run_share(settings, store, plan, share, rerate=rerating, servers=servers),
        cluster=settings.redis_cluster,
    )
    _write(out, json_text(done.part.to_json()) + "\n")
    read = done.part.raw_records["read"]
    write_stdout(escape(f"share {share}: {read:,} raw records replayed") + "\n")
    return 0


def run_merge(args: argparse.Namespace, settings: Settings) -> int:
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    provider = _audit_extra.load_provider_inputs(args, settings)  # before anything is read
    prices = rerate_prices(args.prices, settings)
    out = _out_path(args.out)
    plan = _read_plan(args.snapshot)
    parts = [_read_part(Path(name)) for name in args.parts]
    if any(part.plan != plan.digest() for part in parts):
        raise InputError("a part is of another snapshot than --snapshot")
    if args.correct or provider is not None:  # they read or write the settings' topics
        plan.check_namespace(settings.namespace)
    report = _finish(args, settings, plan, merge_parts(parts), prices=prices, correct=args.correct)
    if provider is not None:
        report = _audit_extra.check_provider_usage(
            report,
            provider,
            servers=kafka_of(args, settings),
            settings=settings,
            tenants=plan.tenants,
            window=plan.snapshot.window,
            quiet=args.json,
        )
    return _print(report, args.json, out)


def _print(
    report: Report,
    as_json: bool,
    out: Path | None,
    lines: _audit_extra.PartitionLines | None = None,
) -> int:
    if as_json:
        write_stdout(json_text(report.to_json()) + "\n")
    else:
        write_stdout(format_report(report))
    if out is not None:
        text = (
            report.csv_text()
            if out.suffix.lower() == ".csv"
            else (json_text(report.to_json(), indent=2) + "\n")
        )
        _write(out, text)
    if lines is not None:
        lines.step(
            f"done: {len(report.discrepancies):,} discrepancies"
            + (f", report in {out}" if out is not None else "")
        )
    return 0 if report.clean else 1


def _window_text(window: TimeRange) -> str:
    since = "the beginning" if window.since is None else window.since.isoformat()
    until = "the snapshot" if window.until is None else window.until.isoformat()
    return f"raw records received from {since} to {until}"


def format_report(report: Report) -> str:
    """A short summary and the table of discrepancies (every value escaped)."""
    doc = report.to_json()
    r, rows, snap = doc["requests"], doc["usage_rows"], doc["snapshot"]
    since, until = snap["since"] or "the beginning", snap["until"] or "the snapshot"
    tenants = ", ".join(snap["tenants"]) if snap["tenants"] else "all tenants"
    lines = [
        f"audit of {snap['raw_records']['read']:,} raw records received from {since} to "
        f"{until} ({tenants}), snapshot at {snap['taken_at']}",
        f"requests: {r['replayed']:,} replayed, {r['billed']:,} billed: {r['matched']:,} matched, "
        f"{r['mismatched']:,} mismatched, {r['missing_billing']:,} missing billing, "
        f"{r['unexpected_billing']:,} unexpected billing, {r['conflicting_billing']:,} "
        f"conflicting billing; {r['partial']:,} partial, {r['dead_lettered']:,} dead-lettered",
        f"usage rows: {rows['checked']:,} checked: {rows['matched']:,} matched, "
        f"{rows['mismatched']:,} mismatched ({rows['skipped']:,} not checked: a partial "
        "request may be counted in them)",
    ]
    if r.get("amended"):
        lines.append(
            f"amended: {r['amended']:,} requests billed again after a close at their timeout "
            "(each revision checked as its own billing event)"
        )
    aborted = doc["aborted"]
    if aborted["count"]:
        named = ", ".join(
            f"{a['request_id']} ({a['tenant']})" for a in aborted["requests"][:SHOWN_ABORTED]
        )
        more = aborted["count"] - min(aborted["count"], SHOWN_ABORTED)
        lines.append(
            f"aborted: {aborted['count']:,} requests cancelled before the provider reported "
            f"usage, billed with what they had (usage_source aborted): {named}"
            + (f" and {more:,} more (--json lists them)" if more else "")
        )
    corrections = doc["corrections"]
    if corrections is not None:
        lines.append(
            f"corrected: {corrections['written']:,} corrections written to "
            f"{corrections['topic']} (audit {corrections['audit_id']}), "
            f"{corrections['rows_fixed']:,} usage rows set right"
            + (
                f" ({corrections['rows_applied_before']:,} were already)"
                if corrections["rows_applied_before"]
                else ""
            )
        )
    lines.extend(_audit_extra.provider_summary(doc.get("provider_usage")))
    text = "".join(escape(line) + "\n" for line in lines)
    if doc["rerating"] is not None:
        text += format_rerating(doc["rerating"])
    found = report.discrepancies
    if not found:
        return text + "no discrepancies\n"
    text += f"{len(found):,} discrepanc{'y' if len(found) == 1 else 'ies'}:\n"
    headers = [c.upper() for c in CSV_COLUMNS]
    body = [
        ["-" if v is None else str(v) for v in (d.to_json()[c] for c in CSV_COLUMNS)]
        for d in found[:SHOWN]
    ]
    text += _output.format_table(headers, body)
    if len(found) > SHOWN:
        text += f"... and {len(found) - SHOWN:,} more (--json or --out lists all)\n"
    return text


def format_rerating(rerating: dict[str, Any]) -> str:
    """``--prices``: one line naming the prices, then per tenant and in total the requests,
    the cost billed, the cost at those prices and the difference (every value escaped)."""
    versions = ", ".join(v["version"] for v in rerating["versions"])
    text = escape(
        f"re-rated at {rerating['prices']} (versions {versions}), {rerating['currency']}; "
        "difference = re-rated - billed:"
    )
    headers = ["TENANT", "REQUESTS", "BILLED", "RERATED", "DIFFERENCE", "UNPRICED"]

    def row(name: str, t: dict[str, Any]) -> list[str]:
        unpriced = f"{t['unpriced_billed']:,} -> {t['unpriced_rerated']:,}"
        counts = [f"{t['requests']:,}", t["billed"], t["rerated"], t["difference"]]
        return [name, *counts, unpriced]

    return (
        text
        + "\n"
        + _output.format_table(
            headers,
            [row(name, t) for name, t in rerating["tenants"].items()],
            right=(1, 2, 3, 4),
            footer=[row("total", rerating["total"])],
            ruled=True,
        )
    )
