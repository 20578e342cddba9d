"""The hash of a request's raw input, carried by its billing event (`BillingEvent.raw_sha256`).

`raw_sha256` is the one definition; `RawDigest` computes the same value incrementally,
one record at a time, as the processor applies them.  Anyone holding the raw topic can
recompute it: take the Kafka *values* (the Avro single-object bytes, exactly as stored)
of the records the request was folded from, in the order they were applied (sequence
order: the END marker last; duplicates and dead-lettered records are not applied), and
hash each one preceded by its length::

    sha256( len(v1).to_bytes(8, "big") + v1 + len(v2).to_bytes(8, "big") + v2 + ... )

The length prefix makes the input unambiguous (no two different lists of values hash the
same bytes).  A request with no applied record hashes nothing: the SHA-256 of empty input.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final

__all__ = ["EMPTY_SHA256", "RawDigest", "raw_sha256"]

#: `raw_sha256(())`: a request with no applied raw record.
EMPTY_SHA256: Final = hashlib.sha256(b"").hexdigest()


def raw_sha256(values: Iterable[bytes]) -> str:
    """SHA-256 (64 lower-case hex digits) of raw record values, each length-prefixed.

    Each value is preceded by its length in bytes as an unsigned 64-bit big-endian
    integer; `values` are the request's applied raw record values in the order applied.
    """
    digest = RawDigest()
    for value in values:
        digest.add(value)
    return digest.hexdigest()


class RawDigest:
    """`raw_sha256` computed one value at a time (a request's state keeps one)."""

    __slots__ = ("_sha",)

    def __init__(self) -> None:
        self._sha = hashlib.sha256()

    def add(self, value: bytes) -> None:
        """Hash one more record value (its 8-byte big-endian length, then its bytes)."""
        sha = self._sha
        sha.update(len(value).to_bytes(8, "big"))
        sha.update(value)

    def hexdigest(self) -> str:
        """The hash of the values added so far (adding more afterwards is allowed)."""
        return self._sha.hexdigest()
