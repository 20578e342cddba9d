"""What `RequestProcessor` keeps per raw record (`_Raw`) and per open request (`_Open`).

Private to the processor's modules (`processors.requests` and its parts: `table`, `refusals`,
`sequencing`, `folding`, `closing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, NamedTuple, cast

from streamtally.core.fold import Fold
from streamtally.core.identity import RequestRef
from streamtally.core.normalize import Normalizer
from streamtally.processors.amendable import KeptRecord
from streamtally.processors.outputs import Closed, Position
from streamtally.wire.provenance import RawDigest
from streamtally.wire.records import BillingEvent, RawEngineOutput, RawSseEvent

RawRecord = RawSseEvent | RawEngineOutput


class _Raw(NamedTuple):
    """A decoded raw record with where it came from and its original bytes (a named tuple:
    one per raw record)."""

    record: RawRecord
    position: Position
    key: bytes | None
    value: bytes
    #: The request the record belongs to: (tenant, request id).
    ref: RequestRef


# The named tuples made once per raw record (a `Position`, a `_Raw`, its `RequestRef`, a
# `KeptRecord`) are made here with `tuple.__new__` from compiled code: calling the class
# runs its generated `__new__`, an interpreted frame, for each.  The same tuples.
_tuple_new: Final[Any] = tuple.__new__


def position_of(topic: str, partition: int, offset: int, timestamp: float | None) -> Position:
    """`Position(topic, partition, offset, timestamp)`."""
    return cast(Position, _tuple_new(Position, (topic, partition, offset, timestamp)))


def raw_of(
    record: RawRecord, position: Position, key: bytes | None, value: bytes, tenant: str
) -> _Raw:
    """`_Raw(record, position, key, value, RequestRef(tenant, record.request_id))`."""
    ref = _tuple_new(RequestRef, (tenant, record.request_id))
    return cast(_Raw, _tuple_new(_Raw, (record, position, key, value, ref)))


@dataclass(slots=True)
class _Open:
    normalizer: Normalizer
    fold: Fold
    tenant: str
    source: str
    next_seq: int
    last_time: datetime
    #: The latest receive time of any record that arrived for it (applied, re-sent or
    #: waiting): a new call of its id must be received after it (`Closed.last_received`).
    latest: datetime
    #: Its partition's input clock at its last record (`processors.clock`).
    last_input: float
    #: The highest offset of any record of this request seen so far: where it closes.
    max_offset: int
    topic_partition: tuple[str, int]
    records: int = 0
    duplicates: int = 0
    #: Records that arrived ahead of a missing sequence number, by seq, with their bytes.
    waiting: dict[int, _Raw] = field(default_factory=dict)
    #: Set when an earlier run decided to close this request here.
    close_at: Closed | None = None
    #: Provenance of its billing event: `raw_sha256` of the records applied so far, and
    #: the lowest and highest of their offsets (None: none applied yet).
    digest: RawDigest = field(default_factory=RawDigest)
    first_offset: int | None = None
    last_offset: int | None = None
    #: The data of the part records applied since the request's last whole event, in
    #: order, and their UTF-8 bytes: the next event of the request is their sum.
    parts: list[str] = field(default_factory=list)
    part_bytes: int = 0
    #: Why the request closes at a limit other than its record count (None: that one).
    limit_reason: str | None = None
    #: The records applied, kept for amendments should it close without its END
    #: (`processors.amendable`).
    kept: list[KeptRecord] = field(default_factory=list)
    #: Which bill of the request its close makes (0: the first; n: its n-th amendment),
    #: and the bill of revision n - 1 it supersedes.
    revision: int = 0
    previous: BillingEvent | None = None
    #: The close marker of that revision (the store records this close only over it).
    previous_marker: str | None = None
    #: The offset the superseded revision closed at: records up to it are its replays.
    floor: int = -1
    #: Sequence numbers of records an amended request had already, applied again without
    #: being counted or written again (those after a gap wait here for the missing one).
    uncounted: set[int] = field(default_factory=set)

    def applied(self, raw: _Raw) -> None:
        """Count `raw` (just applied) into the request's provenance."""
        self.digest.add(raw.value)
        offset = raw.position.offset
        self.kept.append(_tuple_new(KeptRecord, (offset, raw.record.seq, raw.value)))
        first = self.first_offset
        if first is None:
            self.first_offset = self.last_offset = offset
        elif offset < first:
            self.first_offset = offset
        elif offset > (self.last_offset or 0):
            self.last_offset = offset
