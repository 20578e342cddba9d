"""Schema ids of the Confluent wire format: the header's bytes and the process's table of ids.

A Confluent-framed value::

    00 | schema id (4 bytes, big-endian) | Avro binary body

The id is the one a schema registry gave the writer schema.  Every reader of
the process decodes through one table, schema id -> `SchemaVersion`
(`writer_by_id`): filled by the registration at start (`learn_id`: the ids of
the schemas the process writes) and, for an id met while reading that the table
does not hold, by the resolver the process installed (`set_resolver`: the
registry client asks ``GET /schemas/ids/{id}`` and matches the schema to a
known version by Parsing Canonical Form), once per id.  A refusal is kept as
well, so an id the project does not know costs one request, not one per
record.  Without a resolver an unknown id is refused at once.

The table is process-wide, as the schemas of `_schemas` are: one process talks
to one registry (the settings').  `forget_ids` empties it (tests).

This module holds no codec: `_codec.read` calls `confluent_writer` when the
first byte of a value is ``00``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from streamtally.errors import AvroDecodeError, AvroEncodeError
from streamtally.wire.avro._schemas import SchemaVersion

__all__ = [
    "CONFLUENT_HEADER_SIZE",
    "CONFLUENT_MAGIC",
    "MAX_SCHEMA_ID",
    "Resolver",
    "confluent_header",
    "confluent_writer",
    "forget_ids",
    "known_ids",
    "learn_id",
    "schema_id_in",
    "set_resolver",
    "unknown_ids",
    "writer_by_id",
]

#: The byte that opens every Confluent-framed value.
CONFLUENT_MAGIC: Final = b"\x00"
#: Magic byte plus the 4-byte schema id.
CONFLUENT_HEADER_SIZE: Final = 5
#: Schema ids are Java ints (signed, 32 bits) in the registries' clients: 0 to 2**31 - 1.
MAX_SCHEMA_ID: Final = (1 << 31) - 1

#: Schema id -> the writer schema it names, as this codec's version; `AvroDecodeError`
#: when the registry has no such id or its schema is none the codec knows.
Resolver = Callable[[int], SchemaVersion]

#: Schema id -> the version it names (learnt at registration, or resolved).
_BY_ID: dict[int, SchemaVersion] = {}
#: Schema id -> why it was refused (resolved once).
_REFUSED: dict[int, str] = {}
#: The resolver of unknown ids, if the process has a registry (one slot).
_RESOLVER: list[Resolver] = []


def confluent_header(schema_id: int) -> bytes:
    """The 5 bytes in front of every value written with the schema of this id."""
    if not 0 <= schema_id <= MAX_SCHEMA_ID:
        raise AvroEncodeError(f"schema id {schema_id} is not between 0 and {MAX_SCHEMA_ID}")
    return CONFLUENT_MAGIC + schema_id.to_bytes(4, "big")


def schema_id_in(data: bytes) -> int:
    """The schema id of a Confluent-framed value's header (`AvroDecodeError` if none)."""
    if len(data) < CONFLUENT_HEADER_SIZE:
        raise AvroDecodeError(
            f"{len(data)} bytes: too short for a Confluent-framed Avro value "
            f"(a {CONFLUENT_HEADER_SIZE}-byte header comes first)"
        )
    if data[:1] != CONFLUENT_MAGIC:
        raise AvroDecodeError(
            f"bad magic byte {bytes(data[:1]).hex()}: not the Confluent wire format (00)"
        )
    return int.from_bytes(data[1:CONFLUENT_HEADER_SIZE], "big")


def learn_id(schema_id: int, version: SchemaVersion) -> None:
    """The registry gave `version` the id `schema_id` (registered, or looked up)."""
    _BY_ID[schema_id] = version
    _REFUSED.pop(schema_id, None)


def set_resolver(resolver: Resolver | None) -> None:
    """Resolve unknown ids with `resolver` from now on (None: refuse them)."""
    _RESOLVER.clear()
    if resolver is not None:
        _RESOLVER.append(resolver)
    _REFUSED.clear()


def forget_ids() -> None:
    """Empty the table and drop the resolver (a test's registry is not the next one's)."""
    _BY_ID.clear()
    _REFUSED.clear()
    _RESOLVER.clear()


def known_ids() -> dict[int, SchemaVersion]:
    """The ids known so far (a copy)."""
    return dict(_BY_ID)


def unknown_ids(values: list[bytes | None]) -> list[int]:
    """The schema ids of the Confluent-framed `values` not resolved yet, once each, in order."""
    found: dict[int, None] = {}
    for value in values:
        if value and value[0] == 0 and len(value) >= CONFLUENT_HEADER_SIZE:
            schema_id = int.from_bytes(value[1:CONFLUENT_HEADER_SIZE], "big")
            if schema_id not in _BY_ID and schema_id not in _REFUSED:
                found[schema_id] = None
    return list(found)


def writer_by_id(schema_id: int) -> SchemaVersion:
    """The version the id names: from the table, else asked of the resolver once.

    `AvroDecodeError` when there is no resolver, or the id names no schema this codec
    knows; whatever else the resolver raises (the registry unreachable) goes through
    and is not remembered: the id is asked again next time.
    """
    version = _BY_ID.get(schema_id)
    if version is not None:
        return version
    refused = _REFUSED.get(schema_id)
    if refused is not None:
        raise AvroDecodeError(refused)
    if schema_id > MAX_SCHEMA_ID:  # no registry gives it (Java ints); some answer 404 oddly
        raise AvroDecodeError(
            f"schema id {schema_id} (Confluent framing) is above {MAX_SCHEMA_ID}, the largest "
            "a schema registry gives: not a Confluent-framed value"
        )
    if not _RESOLVER:
        raise AvroDecodeError(
            f"unknown schema id {schema_id} (Confluent framing): no schema registry to ask "
            "(set STREAMTALLY_SCHEMA_REGISTRY_URL)"
        )
    try:
        version = _RESOLVER[0](schema_id)
    except AvroDecodeError as exc:
        _REFUSED[schema_id] = why = f"schema id {schema_id} (Confluent framing): {exc}"
        raise AvroDecodeError(why) from None
    _BY_ID[schema_id] = version
    return version


def confluent_writer(name: str, data: bytes) -> SchemaVersion:
    """The writer schema of a Confluent-framed value of record `name` (`AvroDecodeError`)."""
    if len(data) < CONFLUENT_HEADER_SIZE:
        raise AvroDecodeError(
            f"{name}: {len(data)} bytes: too short for a Confluent-framed Avro value "
            f"(a {CONFLUENT_HEADER_SIZE}-byte header comes first)"
        )
    try:
        return writer_by_id(int.from_bytes(data[1:CONFLUENT_HEADER_SIZE], "big"))
    except AvroDecodeError as exc:
        raise AvroDecodeError(f"{name}: {exc}") from None
