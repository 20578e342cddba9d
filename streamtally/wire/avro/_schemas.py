"""The schema registry: every version of every record schema, read once from the package data.

Each `schemas/*.avsc` file (one top-level named type, namespace `io.streamtally.v1`) and
each released version in `schemas/history/<Name>/<n>.avsc` is read and parsed
exactly once, at import.  The schemas are package data: `streamtally/_schemas`
(in the repository a link to the top-level `schemas/` folder).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

from fastavro.schema import SchemaParseException, parse_schema, to_parsing_canonical_form
from fastavro.schema import fingerprint as _fastavro_fingerprint

from streamtally.errors import AvroDecodeError, AvroSchemaError
from streamtally.wire.avro._framing import fingerprint_in, header
from streamtally.wire.avro._names import SchemaJSON, expand, fullname, register

__all__ = [
    "CURRENT",
    "HISTORY",
    "NAMESPACE",
    "RECORD_NAMES",
    "SCHEMA_DIR",
    "SchemaVersion",
    "canonical_form",
    "current",
    "fingerprint",
    "history",
    "known_version",
    "parse",
    "schema_fingerprint",
    "writer_of",
]

NAMESPACE: Final = "io.streamtally.v1"


def _schema_dir() -> Path:
    """`streamtally/_schemas`: the schemas shipped with the package."""
    data = resources.files("streamtally") / "_schemas"
    if not isinstance(data, Path):
        raise AvroSchemaError(f"{data}: the schemas must be files on disk")
    return data


SCHEMA_DIR: Final = _schema_dir()


def parse(schema: SchemaJSON) -> Any:
    """fastavro's parsed form of one self-contained schema."""
    return parse_schema(schema, named_schemas={})


def canonical_form(schema: SchemaJSON) -> str:
    """The Parsing Canonical Form of a self-contained schema (Avro spec)."""
    pcf: str = to_parsing_canonical_form(schema)
    return pcf


def schema_fingerprint(schema: SchemaJSON) -> bytes:
    """The 8-byte little-endian CRC-64-AVRO fingerprint of a schema's Parsing Canonical Form.

    These are the bytes that follow `MARKER` in a single-object message.
    """
    return bytes.fromhex(_fastavro_fingerprint(canonical_form(schema), "CRC-64-AVRO"))


@dataclass(frozen=True, slots=True, eq=False)
class SchemaVersion:
    """One version of a record schema.  `version` is None for an unreleased current schema.

    `schema` is the self-contained JSON schema (treat it as read-only), `parsed`
    fastavro's form of it, `header` the 10 bytes every message written with it
    starts with.
    """

    name: str
    version: int | None
    schema: SchemaJSON
    canonical_form: str
    fingerprint: bytes
    parsed: Any
    header: bytes

    @classmethod
    def build(cls, name: str, version: int | None, schema: SchemaJSON) -> SchemaVersion:
        if schema.get("type") != "record" or schema.get("name") != name:
            raise AvroSchemaError(f"{name} v{version}: not the record {name}")
        try:
            parsed = parse(schema)
            pcf = canonical_form(schema)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # fastavro's parse errors
            raise AvroSchemaError(f"{name} v{version}: {exc}") from exc
        fp = bytes.fromhex(_fastavro_fingerprint(pcf, "CRC-64-AVRO"))
        return cls(name, version, schema, pcf, fp, parsed, header(fp))

    @property
    def label(self) -> str:
        return (
            f"{self.name} v{self.version}"
            if self.version is not None
            else f"{self.name} (unreleased)"
        )


def _load_current(directory: Path) -> dict[str, SchemaVersion]:
    """Every record of `directory/*.avsc`, expanded into a self-contained schema."""
    defs: dict[str, SchemaJSON] = {}
    tops: dict[str, str] = {}  # short name -> full name, for record files
    for path in sorted(directory.glob("*.avsc")):
        try:
            node = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise AvroSchemaError(f"{path}: {exc}") from exc
        if not isinstance(node, dict) or node.get("name") != path.stem:
            raise AvroSchemaError(f"{path}: must define the named type {path.stem!r}")
        if node.get("namespace") != NAMESPACE:
            raise AvroSchemaError(f"{path}: namespace must be {NAMESPACE!r}")
        register(node, NAMESPACE, defs, str(path))
        if node.get("type") == "record":
            tops[path.stem] = fullname(path.stem, NAMESPACE)
    if not tops:
        raise AvroSchemaError(f"no schema found in {directory}")
    return {
        name: SchemaVersion.build(name, None, expand(defs[full], NAMESPACE, defs, set()))
        for name, full in tops.items()
    }


def _load_history(directory: Path, names: Sequence[str]) -> dict[str, tuple[SchemaVersion, ...]]:
    out: dict[str, tuple[SchemaVersion, ...]] = {}
    for name in names:
        versions: list[SchemaVersion] = []
        folder = directory / "history" / name
        for path in sorted(folder.glob("*.avsc"), key=lambda p: (len(p.stem), p.stem)):
            if not path.stem.isdigit():
                raise AvroSchemaError(f"{path}: history files are named <n>.avsc")
            try:
                schema = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise AvroSchemaError(f"{path}: {exc}") from exc
            versions.append(SchemaVersion.build(name, int(path.stem), schema))
        out[name] = tuple(versions)
    return out


_CURRENT_UNRELEASED: Final = _load_current(SCHEMA_DIR)
#: Released versions of each record, oldest first.
HISTORY: Final = _load_history(SCHEMA_DIR, sorted(_CURRENT_UNRELEASED))


def _release_current() -> dict[str, SchemaVersion]:
    """The current schemas, numbered with the history version they equal (if released)."""
    out: dict[str, SchemaVersion] = {}
    for name, cur in _CURRENT_UNRELEASED.items():
        released = [v for v in HISTORY[name] if v.fingerprint == cur.fingerprint]
        version = released[-1].version if released else None
        out[name] = SchemaVersion(
            name, version, cur.schema, cur.canonical_form, cur.fingerprint, cur.parsed, cur.header
        )
    return out


#: The current schema of each record, by short name.
CURRENT: Final = _release_current()


def _index() -> dict[bytes, SchemaVersion]:
    index: dict[bytes, SchemaVersion] = {}
    for versions in HISTORY.values():
        for version in versions:
            other = index.get(version.fingerprint)
            if other is not None and other.name != version.name:
                raise AvroSchemaError(f"{version.label} and {other.label} share a fingerprint")
            index[version.fingerprint] = version
    for cur in CURRENT.values():
        index[cur.fingerprint] = cur  # the current parsed schema: no resolution needed
    return index


_BY_FINGERPRINT: Final = _index()

#: Every record schema that `encode` and `decode` accept, by short name.
RECORD_NAMES: Final = tuple(sorted(CURRENT))


def current(name: str) -> SchemaVersion:
    """The current schema of a record (`Chunk`, `Tokens`, ...)."""
    try:
        return CURRENT[name]
    except KeyError:
        raise KeyError(f"no Avro record named {name!r}; known: {', '.join(RECORD_NAMES)}") from None


def history(name: str) -> tuple[SchemaVersion, ...]:
    """Released versions of a record, oldest first (`schemas/history/<name>/<n>.avsc`)."""
    current(name)
    return HISTORY[name]


def fingerprint(name: str) -> bytes:
    """The 8 fingerprint bytes of the current schema of a record."""
    return current(name).fingerprint


def known_version(schema: SchemaJSON | str) -> SchemaVersion:
    """The known version (current or released) of the schema `schema` (JSON, or its text).

    Matched by fingerprint (docs, defaults and the order of JSON keys do not matter;
    the canonical form does): how a writer schema that a schema registry returns for
    an id maps to this codec's.  `AvroDecodeError` if it is none of them.
    """
    try:
        node = json.loads(schema) if isinstance(schema, str) else schema
        fp = schema_fingerprint(node)
    except (ValueError, TypeError, KeyError, AttributeError, SchemaParseException) as exc:
        raise AvroDecodeError(f"not an Avro schema: {exc}") from exc
    version = _BY_FINGERPRINT.get(fp)
    if version is None:
        raise AvroDecodeError(f"a schema this codec does not know (fingerprint {fp.hex()})")
    return version


def writer_of(data: bytes) -> SchemaVersion:
    """The writer schema of a single-object message, from its header alone."""
    fp = fingerprint_in(data)
    version = _BY_FINGERPRINT.get(fp)
    if version is None:
        raise AvroDecodeError(f"unknown writer schema fingerprint {fp.hex()}")
    return version
