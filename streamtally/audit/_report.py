"""The audit's report: one JSON document, or the discrepancies as CSV.

`Report.to_json` is the document ``streamtally audit --json`` prints: `requests` (counts),
`usage_rows` (counts), `discrepancies`, `aborted` (requests the replay billed as
cancelled before any usage: a count and their tenant and request id; no discrepancy),
`totals` (per tenant, from the replay),
`rerating` (``--prices``: per tenant, billed, at the other prices and the difference; null
without it), `provider_usage` (``--provider-usage``: the provider's reports against the
ledger, `streamtally.audit.provider_usage`; null without it), `corrections` (``--correct``:
what was written; null without it) and
`snapshot` (what was read: topics, partitions, offset ranges, and how the
raw records were used).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Any, Final

from streamtally.audit._compare import Discrepancy
from streamtally.audit._ledger import RequestCounts
from streamtally.audit._rows import RowComparison

__all__ = ["CSV_COLUMNS", "Report"]

CSV_COLUMNS: Final = ("kind", "request_id", "tenant", "model", "day", "field", "expected", "found")
#: What a spreadsheet would take for a formula at the start of a text cell.
_FORMULA_START: Final = ("=", "+", "-", "@", "\t", "\r")


def _cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if column in ("request_id", "tenant", "model") and text.startswith(_FORMULA_START):
        return "'" + text  # kept as text when the file is opened as a spreadsheet
    return text


@dataclass(frozen=True, slots=True)
class Report:
    requests: RequestCounts
    rows: RowComparison
    #: Rows of the audited tenants and days not checked: a partial request may be in them.
    rows_skipped: int
    discrepancies: tuple[Discrepancy, ...]
    totals: dict[str, dict[str, Any]]
    snapshot: dict[str, Any]
    #: `Rerating.to_json` with ``--prices``, else None.
    rerating: dict[str, Any] | None = None
    #: `Corrected.to_json` with ``--correct``, else None.
    corrections: dict[str, Any] | None = None
    #: `Aborted.to_json`: requests billed as aborted (cancelled before any usage), their
    #: own kind, not discrepancies.
    aborted: dict[str, Any] | None = None
    #: `ProviderCheck.to_json` with ``--provider-usage``, else None.
    provider_usage: dict[str, Any] | None = None

    @property
    def clean(self) -> bool:
        return not self.discrepancies

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests.to_json(),
            "usage_rows": {
                "checked": self.rows.checked,
                "matched": self.rows.matched,
                "mismatched": self.rows.mismatched,
                "skipped": self.rows_skipped,
            },
            "discrepancies": [d.to_json() for d in self.discrepancies],
            "aborted": self.aborted
            if self.aborted is not None
            else {"count": 0, "requests": [], "listed": 0},
            "totals": self.totals,
            "rerating": self.rerating,
            "provider_usage": self.provider_usage,
            "corrections": self.corrections,
            "snapshot": self.snapshot,
        }

    def csv_text(self) -> str:
        """The discrepancies as CSV with a header line (empty cells for null)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for d in self.discrepancies:
            row = d.to_json()
            writer.writerow([_cell(c, row[c]) for c in CSV_COLUMNS])
        return out.getvalue()
