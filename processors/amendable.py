"""What a closed request keeps so that later records can still amend its bill.

A request that closed at its END marker has all its records (the END is its
last, and it closes only once every sequence number before it was applied), and
one closed at a limit was refused the rest on purpose.  A request closed at its
timeout or over a gap may not have: a reasoning model thinking for minutes, a
producer catching up after an outage, a missing record sent again.  Records
that arrive for it afterwards are applied to its fold and it is billed again,
as a new revision (`streamtally.wire.records.BillingEvent.revision`).

`Amendable` is what that takes: the raw records applied to the request (their
Kafka values, offsets and sequence numbers, in the order applied), the bill it
closed with (the revision the next one supersedes, and the usage an amendment
moves its usage row away from), its source and where it closed (records at or
before that offset are replays of it).  Re-applying the records through the
same `Normalizer` and `Fold` gives back the very state the request closed with,
so an amendment is what one stream with every record would have been.

`encode` and `decode` make the bytes the Redis store keeps under the request's
``amend`` key for the state TTL (zlib-compressed): the cost of keeping a
timed-out request amendable is about the compressed size of its raw records.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final, NamedTuple

from streamtally.errors import InputError
from streamtally.wire import avro
from streamtally.wire.records import BillingEvent

__all__ = ["Amendable", "KeptRecord"]

#: The first bytes of an encoded `Amendable` (after decompression): name and format version.
MAGIC: Final = b"streamtally.amendable\x01"
_HEAD: Final = struct.Struct(">IqIB")  # revision, closed offset, partition, engine
_RECORD: Final = struct.Struct(">qqI")  # offset, seq, value length
_LEN: Final = struct.Struct(">I")


class KeptRecord(NamedTuple):
    """A raw record applied to a request, kept for its amendments."""

    offset: int
    seq: int
    value: bytes


@dataclass(frozen=True, slots=True)
class Amendable:
    """A request closed at its timeout or over a gap, as the next revision starts from."""

    #: The revision of `bill` (0: the bill made at the first close).
    revision: int
    #: The offset the request closed at: its records up to it are replays.
    closed_offset: int
    topic: str
    partition: int
    #: Whether its records are of the raw engine topic (else the raw SSE topic).
    engine: bool
    #: The bill of `revision`, which the next revision supersedes.
    bill: BillingEvent
    #: The records applied to it, in the order applied.
    records: tuple[KeptRecord, ...]
    #: Its close marker (`processors.outputs.Closed.marker`): the store records the next
    #: revision's close only over this one.
    marker: str = ""

    @property
    def seqs(self) -> frozenset[int]:
        """The sequence numbers applied: a record of one of them is a duplicate."""
        return frozenset(record.seq for record in self.records)

    @property
    def size(self) -> int:
        """Bytes of record values held (what it costs in memory, roughly)."""
        return sum(len(record.value) for record in self.records)

    def encode(self) -> bytes:
        topic = self.topic.encode("utf-8")
        marker = self.marker.encode("utf-8")
        bill = avro.encode_billing_event(self.bill)
        parts = [
            MAGIC,
            _HEAD.pack(self.revision, self.closed_offset, self.partition, self.engine),
            _LEN.pack(len(topic)),
            topic,
            _LEN.pack(len(marker)),
            marker,
            _LEN.pack(len(bill)),
            bill,
            _LEN.pack(len(self.records)),
        ]
        for record in self.records:
            parts.append(_RECORD.pack(record.offset, record.seq, len(record.value)))
            parts.append(record.value)
        return zlib.compress(b"".join(parts), 6)

    @classmethod
    def decode(cls, data: bytes) -> Amendable:
        """The state `encode` made; `InputError` for anything else (a corrupt or foreign
        value under the key)."""
        try:
            raw = zlib.decompress(data)
        except zlib.error as exc:
            raise InputError(f"amendable state does not decompress: {exc}") from exc
        if not raw.startswith(MAGIC):
            raise InputError("amendable state of an unknown format")
        try:
            at = len(MAGIC)
            revision, closed_offset, partition, engine = _HEAD.unpack_from(raw, at)
            at += _HEAD.size
            topic, at = _chunk(raw, at)
            marker, at = _chunk(raw, at)
            bill, at = _chunk(raw, at)
            (count,) = _LEN.unpack_from(raw, at)
            at += _LEN.size
            records = []
            for _ in range(count):
                offset, seq, size = _RECORD.unpack_from(raw, at)
                at += _RECORD.size
                if at + size > len(raw):
                    raise InputError("amendable state is truncated")
                records.append(KeptRecord(offset, seq, raw[at : at + size]))
                at += size
        except struct.error as exc:
            raise InputError(f"amendable state is truncated: {exc}") from exc
        if at != len(raw):
            raise InputError(f"amendable state has {len(raw) - at} bytes after its records")
        return cls(
            revision,
            closed_offset,
            topic.decode("utf-8"),
            partition,
            bool(engine),
            avro.decode_billing_event(bill),
            tuple(records),
            marker.decode("utf-8"),
        )


def _chunk(raw: bytes, at: int) -> tuple[bytes, int]:
    (size,) = _LEN.unpack_from(raw, at)
    at += _LEN.size
    if at + size > len(raw):
        raise InputError("amendable state is truncated")
    return raw[at : at + size], at + size
