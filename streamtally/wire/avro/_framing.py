"""Avro single-object framing: the 10-byte header in front of every message body.

    C3 01 | CRC-64-AVRO fingerprint of the writer schema (8 bytes, little-endian) | Avro binary body

Which schema a fingerprint names is the registry's business (`writer_of` in
`_schemas`); this module only knows the bytes.
"""

from __future__ import annotations

from typing import Final

from streamtally.errors import AvroDecodeError

__all__ = ["HEADER_SIZE", "MARKER", "fingerprint_in", "header"]

#: The two marker bytes that open every single-object encoded message.
MARKER: Final = b"\xc3\x01"
#: Marker plus the 8-byte fingerprint.
HEADER_SIZE: Final = 10


def header(fingerprint: bytes) -> bytes:
    """The header of every message written with the schema of this 8-byte fingerprint."""
    return MARKER + fingerprint


def fingerprint_in(data: bytes) -> bytes:
    """The 8 fingerprint bytes of a single-object message's header (`AvroDecodeError` if none)."""
    if len(data) < HEADER_SIZE:
        raise AvroDecodeError(
            f"{len(data)} bytes: too short for an Avro single-object message "
            f"(a {HEADER_SIZE}-byte header comes first)"
        )
    if data[:2] != MARKER:
        raise AvroDecodeError(
            f"bad marker {bytes(data[:2]).hex()}: neither Avro single-object encoding (c301) "
            "nor the Confluent wire format (00)"
        )
    return bytes(data[2:HEADER_SIZE])
