"""`streamtally migrate`: the Redis layout moved in place, version 1 to 2 here, 2 to 3 in `shards`.

This package and its private modules move layout 1 to 2, the first step;
`streamtally.ops.migrate.shards` moves 2 to 3, the second.

Version 1 (streamtally before layout 2) keyed a request by its provider
request id alone: ``st:tokens:{request_id}`` and `st:closed` fields
``{request_id}``, one tenant per id.  Version 2 keys it by tenant and request
id (`RequestRef`, see `streamtally.store.layout`): ``st:tokens:{ref}`` and
fields ``{ref}``.  The usage rows, ``st:usage:rows``, ``st:stats`` and
``st:deadletter:seen`` are the same in both versions and are not touched.

The tenant of a version-1 request is not in Redis (its Tokens JSON holds the
request id, not the tenant).  The billing topic has it: every billed request's
`BillingEvent` carries its tenant and request id, kept forever.  So `migrate`:

1. marks Redis as migrating (``st:layout`` = ``"1>2"``, `MIGRATING`): from then
   on workers refuse to start and the store's write scripts refuse to write,
   until the migration ends;
2. reads the billing topic to its end (`read_billing`): request id -> tenants;
3. lists what is still of version 1 (`scan`): the Tokens keys and the
   `st:closed` fields, less those moved by an earlier, interrupted run;
4. plans one `Step` per version-1 request id (`plan`, a pure function);
5. applies the steps, `BATCH_SIZE` per atomic script call (`apply`,
   `MIGRATE_SCRIPT`): each call checks every step first and writes nothing
   when one no longer fits what Redis holds;
6. scans again (nothing of version 1 may be left: a worker of a version before
   2 still running would write some), then sets ``st:layout`` to ``"2"`` and
   deletes `MOVED_KEY`, in one atomic step (`finish`).

The steps (`Action`):

``move``
    A Tokens key whose id the billing topic knows for exactly one tenant:
    RENAMEd to the request's version-2 key; its close marker, if any, moves
    to the field of its `RequestRef`, unchanged.
``move-closed``
    A close marker without Tokens (the close was decided, the request never
    applied: the worker stopped in between) of an id billed to one tenant:
    moved to the field of its `RequestRef`, so that the worker, re-reading
    the request's records, closes it at the same offset for the same reason.
``unplace``
    A Tokens key whose id has no billing event (the billing topic lost it, or
    the request was caught mid-flush) or several tenants (version 1 could not
    tell them apart): it cannot be placed, so it moves out of the Tokens keys
    into the hash `UNPLACED_KEY` (field: the request id, value: the Tokens
    JSON), its close marker into `UNPLACED_CLOSED_KEY`.  Such a request is no
    longer marked as counted (its usage stays in the usage rows): should the
    worker read its raw records again, it would count it again.  Resolve each
    by hand (its tenant known: SET its version-2 key to the JSON, HSET its
    close marker), then HDEL it.
``drop-closed``
    A close marker without Tokens whose id has no single tenant: deleted.  No
    billing event means its outputs were never sent; the worker decides again
    when it re-reads the request's records.

Resumable: every step of a batch, and the record of what it moved, is written
in one script call.  A moved request's ``{ref}`` text is added to the set
`MOVED_KEY` in the same call, so a rerun does not mistake the moved key
``st:tokens:acme:r1`` for the version-1 key of a request id ``acme:r1``; the
set is deleted when ``st:layout`` becomes ``"2"``.  An interrupted run (killed,
Kafka or Redis gone) leaves ``st:layout`` at ``"1>2"``: run it again.

Order: a version-2 name is ``{tenant}:{id}``, longer than the id, and may be
the name of another version-1 request (ids may hold ``:``: request ``r1`` of
tenant ``acme`` and request ``acme:r1`` of another tenant).  Steps run longest
id first, so such a name is always moved out of the way before it is needed;
the script refuses to overwrite anything.

Stop every worker first: one of version 2 refuses to start while this runs,
but a worker of a version before 2 does not know ``st:layout`` and would keep
writing version-1 keys (the final scan finds them and the migration stops).
Run one migration at a time.  Both the billing map and the list of version-1
entries are held in memory.  A single Redis, not Redis Cluster (the script's
keys span hash slots).
"""

from __future__ import annotations

from streamtally.errors import MigrateError
from streamtally.ops.migrate._billing import Billing, read_billing
from streamtally.ops.migrate._plan import Action, Counts, Plan, Step, plan
from streamtally.ops.migrate._redis import (
    BATCH_SIZE,
    MOVED_KEY,
    UNPLACED_CLOSED_KEY,
    UNPLACED_KEY,
    Entries,
    apply,
    apply_batch,
    begin,
    finish,
    scan,
)
from streamtally.ops.migrate._run import Outcome, Report, migrate
from streamtally.ops.migrate._scripts import FINISH_SCRIPT, MIGRATE_SCRIPT

__all__ = [
    "BATCH_SIZE",
    "FINISH_SCRIPT",
    "MIGRATE_SCRIPT",
    "MOVED_KEY",
    "UNPLACED_CLOSED_KEY",
    "UNPLACED_KEY",
    "Action",
    "Billing",
    "Counts",
    "Entries",
    "MigrateError",
    "Outcome",
    "Plan",
    "Report",
    "Step",
    "apply",
    "apply_batch",
    "begin",
    "finish",
    "migrate",
    "plan",
    "read_billing",
    "scan",
]
