"""The corrections topic as a billing consumer applies it: `CorrectionLog`, the latest
correction per event id.

Its record, `BillingCorrection` (`streamtally.wire.records`), is one correction per discrepancy an
audit corrected.

Written only by ``streamtally audit --correct`` (`streamtally.audit`), never by the
worker, and never instead of a billing event: the billing topic is kept as it was
written, and a correction says which of its events it supersedes.  A billing consumer
applies a correction with replace semantics, so applying one twice, or two corrections of
one request from one audit (one per differing field), changes nothing more:

- `superseded_event_id` set, `corrected` set: what was billed under that id (from the
  billing events below `billing_before`) is replaced by `corrected`;
- `superseded_event_id` set, `corrected` None: that bill is withdrawn (an unexpected bill);
- `superseded_event_id` None, `corrected` set: `corrected` is billed (a missing bill);
- `request_id` None: a usage row was corrected in Redis; the usage fields, `requests` and
  `cost` are the whole row's corrected values (informational for a billing consumer).

`CorrectionLog` keeps, per event id, the correction that decides it.  How corrections
combine with the worker's revisions of a bill (BillingEvent v5) into the one bill that
stands per request is the rule of `streamtally.billing.ledger` (`BillingLedger`).

`streamtally.wire.avro` encodes and decodes the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from streamtally.wire.records import BillingCorrection, BillingEvent

__all__ = ["CorrectionLog"]


class CorrectionLog:
    """The corrections of a corrections topic read so far, as a billing consumer applies them.

    Add them in topic order (`add`); then a billing event is `superseded` when the latest
    correction of its event id says so, and `standing` are the bills the corrections
    put in place of what they superseded (revisions aside: `BillingLedger` applies both).
    Usage row corrections (no request) carry no bill and are only counted.
    """

    def __init__(self) -> None:
        self._latest: dict[str, BillingCorrection] = {}
        #: Corrections added, and of those the usage row ones.
        self.records = 0
        self.rows = 0

    def add(self, correction: BillingCorrection) -> None:
        self.records += 1
        event_id = correction.names
        if event_id is None:
            self.rows += 1
            return
        self._latest[event_id] = correction  # a later correction replaces an earlier one

    def superseded(self, event: BillingEvent, partition: int, offset: int) -> bool:
        """Whether the billing event at (`partition`, `offset`) is superseded by a correction."""
        latest = self._latest.get(event.event_id)
        return latest is not None and latest.covers(partition, offset)

    def latest(self, event_id: str) -> BillingCorrection | None:
        """The correction that decides `event_id` (the latest naming it), if any."""
        return self._latest.get(event_id)

    def decided(self) -> Mapping[str, BillingCorrection]:
        """Event id -> the correction that decides it (read-only view)."""
        return MappingProxyType(self._latest)

    def standing(self) -> list[BillingEvent]:
        """The bills that stand by correction (each event id's latest), in no set order."""
        return [c.corrected for c in self._latest.values() if c.corrected is not None]

    def corrected(self, event_id: str) -> bool:
        """Whether a correction names `event_id`."""
        return event_id in self._latest

    def __len__(self) -> int:
        return len(self._latest)
