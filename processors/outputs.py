"""What the request processor hands back: its outputs, where records came from, its counts.

`RequestProcessor` (processors/requests.py) adds to an `Outputs` per batch:
the chunks it made, the requests it completed (Tokens, billing event, how it
closed, record counts; every value already Avro-encoded), and the dead
letters.  `Counters` tally every raw record by outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from streamtally.core.identity import RequestRef
from streamtally.core.models import Chunk, Tokens
from streamtally.wire.records import BillingEvent, DeadLetter

__all__ = ["CloseReason", "Closed", "Completed", "Counters", "Outputs", "Position", "Refused"]


class CloseReason(StrEnum):
    END = "end"  #: the producer's end-of-stream marker
    TIMEOUT = "timeout"  #: quiet for longer than the timeout
    GAP = "gap"  #: quiet for longer than the timeout with sequence numbers missing
    LIMIT = "limit"  #: passed its record limit (`Limits.records_per_request`)


class Position(NamedTuple):
    """Where a raw record came from; `timestamp` is the Kafka record time (seconds).

    A named tuple, not a frozen dataclass: one is made per raw record, and a tuple is
    made in a third of the time.
    """

    topic: str
    partition: int
    offset: int
    timestamp: float | None = None


@dataclass(frozen=True, slots=True)
class Closed:
    """What is known of a closed request: where and why it closed, and if it was applied.

    `last_received` is the latest receive time (microseconds since the epoch) of the
    records that arrived for the request until it closed: a record that starts a new
    call of the same id is received after it (`RequestTable.call_of`).  None in a
    marker written before it existed (or by `streamtally rebuild`): no new call of that
    id is then recognised (its records are late, as before).
    """

    offset: int
    reason: CloseReason
    applied: bool = True
    last_received: int | None = None
    #: Which bill of the request this close made (0: the first; n: its n-th amendment).
    revision: int = 0

    def marker(self) -> str:
        """``"offset reason"``, `` last_received`` when known (``-`` when not, before a
        revision), and `` revision`` when it is not 0 (the Redis close marker)."""
        text = f"{self.offset} {self.reason.value}"
        if self.last_received is not None:
            text += f" {self.last_received}"
        elif self.revision:
            text += " -"
        if self.revision:
            text += f" {self.revision}"
        return text

    @classmethod
    def from_marker(cls, text: str, *, applied: bool) -> Closed:
        offset, _, rest = text.partition(" ")
        reason, _, rest = rest.partition(" ")
        received, _, revision = rest.partition(" ")
        return cls(
            int(offset),
            CloseReason(reason or "end"),
            applied,
            int(received) if received and received != "-" else None,
            int(revision) if revision else 0,
        )

    @property
    def amendable(self) -> bool:
        """Whether records after it may amend the request: it closed without its END
        marker, at its timeout or over a gap (`processors.amendable`)."""
        return self.reason is CloseReason.TIMEOUT or self.reason is CloseReason.GAP


@dataclass(frozen=True, slots=True)
class Completed:
    """A finished request: its record, its billing event and its record counts."""

    tokens: Tokens
    billing: BillingEvent
    closed: Closed
    #: Raw records applied to it (its events and its end marker).
    records: int
    #: Re-sent records dropped as duplicates.
    duplicates: int
    #: `tokens` and `billing` as their topics' Avro values (encoded once, here).
    tokens_value: bytes = b""
    billing_value: bytes = b""
    #: For a request closed at its timeout or over a gap: its encoded
    #: `processors.amendable.Amendable`, kept for its amendments (None: not amendable).
    amendable: bytes | None = None
    #: For an amendment (`billing.revision` > 0): the bill it supersedes, and that
    #: bill's close marker (the store records this close only over it).
    supersedes: BillingEvent | None = None
    supersedes_marker: str | None = None

    @property
    def ref(self) -> RequestRef:
        """The request: its tenant (the billing event's) and its request id."""
        return RequestRef(self.billing.tenant, self.tokens.request_id)


@dataclass(slots=True)
class Outputs:
    chunks: list[Chunk] = field(default_factory=list)
    #: Each chunk's Avro value, in `chunks` order (encoded once, when it was made).
    chunk_values: list[bytes] = field(default_factory=list)
    #: Each chunk's request (a chunk names its request id, not its tenant), in `chunks` order.
    chunk_refs: list[RequestRef] = field(default_factory=list)
    completed: list[Completed] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)

    def extend(self, other: Outputs) -> None:
        self.chunks.extend(other.chunks)
        self.chunk_values.extend(other.chunk_values)
        self.chunk_refs.extend(other.chunk_refs)
        self.completed.extend(other.completed)
        self.dead_letters.extend(other.dead_letters)

    def without(self, refs: set[RequestRef]) -> Outputs:
        """These outputs less the completions of the requests `refs` (their chunks stay)."""
        return Outputs(
            chunks=self.chunks,
            chunk_values=self.chunk_values,
            chunk_refs=self.chunk_refs,
            completed=[c for c in self.completed if c.ref not in refs],
            dead_letters=self.dead_letters,
        )

    def __bool__(self) -> bool:
        return bool(self.chunks or self.completed or self.dead_letters)


@dataclass(slots=True)
class Counters:
    """Raw records of this process by outcome.

    `received == applied + duplicates + dead_lettered + replayed + revoked + waiting`,
    where `waiting` are records held for a missing sequence number.
    """

    received: int = 0
    applied: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    replayed: int = 0
    #: Waiting records forgotten when their partition went to another worker.
    revoked: int = 0
    requests_completed: int = 0
    requests_timed_out: int = 0
    #: Closes that billed an amendment (a revision > 0), counted in `requests_completed` too.
    requests_amended: int = 0
    #: Requests billed at 0 because no price applied (or the cost overflowed the record).
    unpriced: int = 0


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a message is refused before it reaches a request (it is dead-lettered).

    (Here rather than beside `Refusals.examine`, which makes it: a compiled module cannot
    define a dataclass with a field typed as a built-in exception.)
    """

    reason: Exception
    #: The record's source and request id, when it decoded.
    source: str | None = None
    request_id: str | None = None
