"""`streamtally usage`: the usage table (per UTC day, tenant and model) from Redis."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import date
from typing import Any

from streamtally.cli import _output
from streamtally.cli._output import escape, json_text, write_stdout
from streamtally.cli.tokens import add_redis_url, run_redis
from streamtally.core.models import USAGE_FIELDS
from streamtally.core.money import PICO
from streamtally.settings import Settings

__all__ = ["add_parser", "format_table"]

_EPILOG = """\
cost is exact: the sum of the billed costs, in the price table's currency.
exit status: 0 printed (also when there are no rows), 2 a bad argument or
             Redis unreachable (message on stderr)
"""

#: (header, row key) of the table columns, in order.
_COLUMNS = (
    ("DAY", "day"),
    ("TENANT", "tenant"),
    ("MODEL", "model"),
    ("REQUESTS", "requests"),
    ("UNPRICED", "unpriced_requests"),
    ("INPUT", "input_tokens"),
    ("CACHED", "cached_tokens"),
    ("CACHE_WRITE", "cache_write_tokens"),
    ("OUTPUT", "output_tokens"),
    ("REASONING", "reasoning_tokens"),
    ("COST", "cost"),
)
#: Columns aligned right: the numbers.
_RIGHT = frozenset(
    i for i, (_, key) in enumerate(_COLUMNS) if key not in {"day", "tenant", "model"}
)


def _day(value: str) -> str:
    try:
        parsed = date.fromisoformat(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed.isoformat() != value:
        raise argparse.ArgumentTypeError(f"'{escape(value)}' is not a day YYYY-MM-DD")
    return value


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "usage",
        help="show the usage table (per UTC day, tenant and model) from Redis",
        description=(
            "Print the usage rows the worker keeps in Redis, one per UTC day, tenant and "
            "model, with a totals row; or, with --json, a JSON list of rows."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tenant", metavar="T", help="only this tenant")
    parser.add_argument("--day", metavar="YYYY-MM-DD", type=_day, help="only this UTC day")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    add_redis_url(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    tenant: str | None = args.tenant
    day: str | None = args.day
    rows = run_redis(
        args.redis_url or settings.redis_url,
        lambda store: store.usage_rows(tenant=tenant, day=day),
        cluster=settings.redis_cluster,
    )
    if args.json:
        write_stdout(json_text(rows, indent=2) + "\n")
    elif not rows:
        write_stdout(escape("no usage recorded" + _filters(tenant, day)) + "\n")
    else:
        write_stdout(format_table(rows))
    return 0


def _filters(tenant: str | None, day: str | None) -> str:
    parts = []
    if tenant is not None:
        parts.append(f"tenant {tenant}")
    if day is not None:
        parts.append(f"day {day}")
    return f" for {', '.join(parts)}" if parts else ""


def _total_cost(costs: Sequence[str]) -> str:
    """The exact sum of decimal cost strings, formatted like them (12 places)."""
    total = 0
    for cost in costs:
        sign = -1 if cost.startswith("-") else 1
        whole, _, frac = cost.lstrip("-").partition(".")
        total += sign * (int(whole) * PICO + int(frac.ljust(12, "0")))
    whole_part, frac_part = divmod(abs(total), PICO)
    return f"{'-' if total < 0 else ''}{whole_part}.{frac_part:012d}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows as an aligned text table with a totals row (text left, numbers right).

    Tenants and models are escaped: a control character in one cannot forge a row.
    """
    totals: dict[str, Any] = {"day": "TOTAL", "tenant": "", "model": ""}
    totals["requests"] = sum(int(r["requests"]) for r in rows)
    totals["unpriced_requests"] = sum(int(r.get("unpriced_requests", 0)) for r in rows)
    for name in USAGE_FIELDS:
        totals[name] = sum(int(r[name]) for r in rows)
    totals["cost"] = _total_cost([str(r["cost"]) for r in rows])
    body = [[str(r.get(key, 0)) for _, key in _COLUMNS] for r in rows]
    total_line = [str(totals[key]) for _, key in _COLUMNS]
    headers = [header for header, _ in _COLUMNS]
    return _output.format_table(headers, body, right=_RIGHT, footer=[total_line], ruled=True)
