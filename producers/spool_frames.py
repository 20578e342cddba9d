"""The spool's record format: how one record is framed on disk, and read back.

    frame = encode_frame(Source.OPENAI, request_id, value, auth, time.time())
    scan = decode_frames(data, base)     # the records of `data`, and where it stops

Each record is ``[u32 length][u32 crc32][payload]`` (little endian; zlib's
CRC-32 of the payload).  The payload is `HEAD` (format version, flags, the
lengths of the source's name, of the key and of the auth, the time it was
appended), then the source's name, the key (UTF-8), the ``st-auth`` bytes and
the value (the Avro raw record).  The segments, ``rejected/records.seg`` and
the tests all read it through `decode_frames`.

A module of its own because it runs once per record on both sides of the
spool (the tap frames every record it appends; the sender reads every one it
sends), so it is one of the compiled modules (`streamtally._native.MODULES`).
`streamtally.producers.spool` re-exports its names.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from struct import Struct
from typing import Any, Final, NamedTuple

from streamtally.core.models import Source

__all__ = [
    "FLAG_AUTH",
    "FORMAT_VERSION",
    "FRAME",
    "HEAD",
    "MAX_FRAME_BYTES",
    "SpoolRecord",
    "decode_frames",
    "encode_frame",
    "encode_frames",
]

#: ``[u32 length][u32 crc32]`` before each payload.
FRAME: Final = Struct("<II")
#: The payload's head: format version, flags, source length, appended at (unix seconds),
#: key length, auth length; then the source, the key, the auth and the value.
HEAD: Final = Struct("<BBBdII")
FORMAT_VERSION: Final = 1
FLAG_AUTH: Final = 1
#: A length field larger than this is corruption, not a record.
MAX_FRAME_BYTES: Final = 1 << 30


class SpoolRecord(NamedTuple):
    """One record of the spool, as the sender produces it.

    A named tuple, not a frozen dataclass: the sender reads one per record it sends,
    and a frozen dataclass's constructor (a field at a time through
    ``object.__setattr__``) cost 2.7 µs of it, a tuple's about 1."""

    #: Global byte position of its frame, and of the byte after it.
    position: int
    end: int
    source: Source
    #: The Kafka key: the request id.
    key: str
    value: bytes
    #: The ``st-auth`` header, when the tap signs its records.
    auth: bytes | None
    #: Wall-clock time (unix seconds) it was appended.
    appended_at: float

    @property
    def size(self) -> int:
        """Its framed size: what it counts in `Spool.unsent_bytes`."""
        return self.end - self.position


_tuple_new: Final[Any] = tuple.__new__
#: Each source's name as the frame writes it, and the source of each name.
_SOURCE_NAMES: Final = {source: source.value.encode("ascii") for source in Source}
_SOURCE_BY_NAME: Final = {name: source for source, name in _SOURCE_NAMES.items()}


def _head(src: bytes, k: bytes, appended_at: float, auth: bytes | None) -> bytes:
    """A payload's `HEAD`, then the source's name `src`, the key `k` and the auth bytes."""
    if auth is None:
        return HEAD.pack(FORMAT_VERSION, 0, len(src), appended_at, len(k), 0) + src + k
    head = HEAD.pack(FORMAT_VERSION, FLAG_AUTH, len(src), appended_at, len(k), len(auth))
    return head + src + k + auth


def encode_frame(
    source: Source, key: str, value: bytes, auth: bytes | None, appended_at: float
) -> bytes:
    """One record framed: ``[u32 length][u32 crc32][payload]``, the payload being
    `HEAD` (version 1, flags, source length, appended at, key length, auth length),
    then the source's name, the key (UTF-8), the auth bytes and the value."""
    return encode_frames(source, key, [value], appended_at, [auth])


def encode_frames(
    source: Source,
    key: str,
    values: list[bytes],
    appended_at: float,
    auths: list[bytes | None] | None = None,
) -> bytes:
    """`encode_frame` of each of `values` (with the ``st-auth`` of the same place in `auths`,
    when given), records of one key appended at one time (the tap's records of one upstream
    chunk), joined.  Without auths, one head serves them all."""
    src = _SOURCE_NAMES[source]
    k = key.encode("utf-8", "surrogatepass")
    if auths is not None and len(auths) != len(values):
        raise ValueError(f"{len(values)} values and {len(auths)} auths")
    shared = _head(src, k, appended_at, None)
    shared_crc = zlib.crc32(shared)
    parts: list[bytes] = []
    for n in range(len(values)):
        value = values[n]
        auth = None if auths is None else auths[n]
        if auth is None:
            head, head_crc = shared, shared_crc
        else:
            head = _head(src, k, appended_at, auth)
            head_crc = zlib.crc32(head)
        # The CRC runs over the head, then the value: the payload is never joined.
        parts.append(FRAME.pack(len(head) + len(value), zlib.crc32(value, head_crc)))
        parts.append(head)
        parts.append(value)
    return b"".join(parts)


def _decode_payload(payload: bytes, position: int, end: int) -> SpoolRecord:
    """A payload whose CRC was checked, as its record (ValueError when it is not one)."""
    if len(payload) < HEAD.size:
        raise ValueError(f"a payload of {len(payload)} bytes is shorter than its head")
    version, flags, src_len, appended_at, key_len, auth_len = HEAD.unpack_from(payload)
    if version != FORMAT_VERSION:
        raise ValueError(f"record format {version} is not {FORMAT_VERSION}")
    at = HEAD.size
    if at + src_len + key_len + auth_len > len(payload):
        raise ValueError("the lengths in the head run past the payload")
    name = payload[at : at + src_len]
    source = _SOURCE_BY_NAME.get(name)
    if source is None:
        raise ValueError(f"{name!r} is not a source")
    at += src_len
    key = payload[at : at + key_len].decode("utf-8", "surrogatepass")
    at += key_len
    auth = payload[at : at + auth_len] if flags & FLAG_AUTH else None
    at += auth_len
    # Made by `tuple.__new__`: calling the class runs its generated, interpreted `__new__`.
    record: SpoolRecord = _tuple_new(
        SpoolRecord, (position, end, source, key, payload[at:], auth, appended_at)
    )
    return record


@dataclass(frozen=True, slots=True)
class _Scan:
    """What `decode_frames` read: the records, where they end, and what stopped it."""

    records: list[SpoolRecord]
    #: Bytes of the buffer taken by whole, valid records.
    valid: int
    #: Why the bytes after `valid` are not a record (None: the buffer ended on a record).
    problem: str | None
    #: The buffer ended inside a frame whose length looked right (more bytes may come).
    short: bool = False


def decode_frames(data: bytes | memoryview, base: int, *, limit: int | None = None) -> _Scan:
    """The records framed in `data` (the bytes from global position `base` on), at most
    `limit` of them, stopping at the first one that is cut short or fails its check."""
    records: list[SpoolRecord] = []
    view = memoryview(data)
    at, size = 0, len(view)
    while at < size and (limit is None or len(records) < limit):
        if size - at < FRAME.size:
            return _Scan(records, at, f"{size - at} bytes, less than a frame header", True)
        length, crc = FRAME.unpack_from(view, at)
        if length > MAX_FRAME_BYTES:
            return _Scan(records, at, f"a frame length of {length} bytes")
        stop = at + FRAME.size + length
        if stop > size:
            return _Scan(records, at, f"a frame of {length} bytes cut short", True)
        payload = bytes(view[at + FRAME.size : stop])
        if zlib.crc32(payload) != crc:
            return _Scan(records, at, "a CRC mismatch")
        try:
            records.append(_decode_payload(payload, base + at, base + stop))
        except (ValueError, UnicodeDecodeError) as exc:
            return _Scan(records, at, f"a record that does not decode ({exc})")
        at = stop
    return _Scan(records, at, None)
