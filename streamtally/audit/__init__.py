"""`streamtally audit`: replay the raw topics and prove every bill (read-only).

What it does, in order (`run_audit`):

1. **Snapshot** (`_snapshot`): the processors' committed offsets, then the end offsets of
   the billing topic, then of the raw topics (and where ``--since`` / ``--until`` start and
   stop reading them, by `offsets_for_times`); the audit reads up to these offsets and no
   further, so it ends, and the report names them.  Right after, the usage rows are read
   from Redis (`RedisStore.usage_rows`).
2. **Billing index** (`_billing`): the billing topic up to its snapshot, each event whose
   tenant is audited and whose `event_time` (its request's last receive time) lies in the
   range kept as 64 bits of its `event_id` and 64 bits of a digest of its fields.
3. **Replay** (`_replay`): the raw records of the range through the processors' own
   `RequestProcessor` (the same fold and pricing as the worker and ``streamtally fold``),
   its clock driven by the records' times alone, and the worker's close decisions taken
   from Redis, so requests closed by timeout are closed where the worker closed them.
   Each request is compared as it closes and its state dropped (`_ledger`): memory grows
   with the requests open at once and the index, not with the period.
4. **Resolution**: the few billing events behind a discrepancy are read again, whole, and
   compared field by field (`_compare`); the usage rows the audit covers fully are
   compared with the replay's sums (`_rows`).

Partial requests are never mismatches: a request whose first record in the range is not
its first event (it began before ``--since``, or before retention deleted its start), one
still open at the snapshot's end (also one cut by ``--until``), and one the replay closed
at an offset the processors had not committed at the snapshot (its outputs may still be
on their way).  Their billing events are set aside, and their rows are not checked.

Usage rows (tenant, model, UTC day) are checked only when the audit saw every request they
can hold: the tenant is audited, the whole day lies in the range (after ``--since``, or
from the first record retention kept plus the request timeout; before ``--until``), and no
partial request of that tenant ended on that day.  Without ``--since`` / ``--until`` and
with nothing deleted yet, every row is checked.

What is compared of a billing event: every field but `event_id` (its key) and
`price_table_version`.  The replay prices with the settings' price table, each request by
the version in force at its receive time (`streamtally.billing.events.charge`), so a table
that keeps its history re-bills the past as it was billed; a bill made under a version the
table no longer holds shows as a ``cost_mismatch``.

Split (``--workers N``, or ``audit snapshot`` / ``run --share i/N`` / ``merge`` on several
machines; `_split`): one snapshot, each share replaying the raw partitions ``p % N == i``
and checking its requests' bills, the parts merged into the report one process writes
(one process runs share 0/1 and merges it alone); the usage rows compared after the merge.
``--prices`` re-rates in each share (sums per tenant, added up), ``--correct`` writes the
corrections of the merged discrepancies once, from the process that merged (`correct_audit`).

Re-rating (``--prices FILE``, `_rerate`): every request the replay closed is priced again
at FILE's prices, at its receive time, and the report sums per tenant what was billed,
what FILE charges and the difference.  Nothing is written.
"""

from __future__ import annotations

from streamtally.audit._compare import EVENT_FIELDS, Discrepancy, Kind
from streamtally.audit._ledger import RequestCounts
from streamtally.audit._range import TimeRange, parse_time
from streamtally.audit._report import CSV_COLUMNS, Report
from streamtally.audit._rerate import RerateSum, Rerating, rerated_cost
from streamtally.audit._rows import ROW_FIELDS, RowComparison, compare_rows
from streamtally.audit._run import (
    AuditOptions,
    Progress,
    ShareRun,
    audit_corrections,
    correct_audit,
    merged_report,
    run_audit,
    run_share,
    take_plan,
)
from streamtally.audit._split import Merged, Part, Plan, Share, merge_parts, raw_partition_of

__all__ = [
    "CSV_COLUMNS",
    "EVENT_FIELDS",
    "ROW_FIELDS",
    "AuditOptions",
    "Discrepancy",
    "Kind",
    "Merged",
    "Part",
    "Plan",
    "Progress",
    "Report",
    "RequestCounts",
    "RerateSum",
    "Rerating",
    "RowComparison",
    "Share",
    "ShareRun",
    "TimeRange",
    "audit_corrections",
    "compare_rows",
    "correct_audit",
    "merge_parts",
    "merged_report",
    "parse_time",
    "raw_partition_of",
    "rerated_cost",
    "run_audit",
    "run_share",
    "take_plan",
]
