"""Schema evolution: whether data written with one schema version reads correctly with another.

`compatibility_errors` is what the tests run against every released version
in `schemas/history/`; `release` adds the current schemas that are not yet
released there (`python -m streamtally.wire.avro release`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

import fastavro

from streamtally.errors import AvroSchemaError
from streamtally.wire.avro._codec import DECODE_ERRORS, ENCODE_ERRORS
from streamtally.wire.avro._names import (
    NAMED,
    PRIMITIVES,
    SchemaJSON,
    fullname,
    namespace_of,
    register,
)
from streamtally.wire.avro._schemas import CURRENT, HISTORY, RECORD_NAMES, SCHEMA_DIR, parse

__all__ = ["compatibility_errors", "release"]

_EPOCH: Final = datetime(2024, 1, 1, tzinfo=UTC)
_STRINGS: Final = ("", "a", "é✓ 𝄞", "x" * 40)


def _leaf_types(schema: Any) -> dict[tuple[str, ...], tuple[Any, ...]]:
    """(record, field, path in the field's type) -> (type, logicalType, precision, scale).

    One entry per primitive leaf of each record's fields: what the fingerprint
    leaves out (logical types) but reading depends on.
    """
    out: dict[tuple[str, ...], tuple[Any, ...]] = {}

    def walk(node: Any, where: tuple[str, ...], namespace: str | None) -> None:
        if isinstance(node, list):
            for branch in node:
                label = branch if isinstance(branch, str) else str(branch.get("type"))
                walk(branch, (*where, f"|{label}"), namespace)
        elif isinstance(node, str):
            if node in PRIMITIVES:
                out[where] = (node, None, None, None)
        elif isinstance(node, dict):
            kind = node.get("type")
            if kind in ("record", "error"):
                full = fullname(node["name"], node.get("namespace", namespace))
                inner = namespace_of(full)
                for fld in node["fields"]:
                    walk(fld["type"], (full, fld["name"]), inner)
            elif kind == "array":
                walk(node["items"], (*where, "[]"), namespace)
            elif kind == "map":
                walk(node["values"], (*where, "{}"), namespace)
            elif isinstance(kind, (dict, list)):
                walk(kind, where, namespace)
            elif kind in PRIMITIVES:
                logical = node.get("logicalType")
                out[where] = (kind, logical, node.get("precision"), node.get("scale"))

    walk(schema, (), None)
    return out


def _sample(node: Any, i: int, names: dict[str, Any], namespace: str | None) -> Any:
    """A datum of `node`; varying `i` goes through every union branch and enum symbol."""
    if isinstance(node, str):
        if node in PRIMITIVES:
            return _primitive(node, i)
        return _sample(names[fullname(node, namespace)], i, names, namespace)
    if isinstance(node, list):
        branch = node[i % len(node)]
        value = _sample(branch, i, names, namespace)
        target = names.get(fullname(branch, namespace)) if isinstance(branch, str) else branch
        if isinstance(target, dict) and target.get("type") in ("record", "error"):
            full = fullname(target["name"], target.get("namespace", namespace))
            return (full, value)
        return value
    kind = node["type"]
    if kind in NAMED:
        inner = namespace_of(fullname(node["name"], node.get("namespace", namespace)))
        if kind == "enum":
            symbols = node["symbols"]
            return symbols[i % len(symbols)]
        if kind == "fixed":
            return bytes([i % 256]) * int(node["size"])
        return {
            fld["name"]: _sample(fld["type"], i + k, names, inner)
            for k, fld in enumerate(node["fields"])
        }
    if kind == "array":
        return [_sample(node["items"], i + j, names, namespace) for j in range(i % 3)]
    if kind == "map":
        return {f"k{j}": _sample(node["values"], i + j, names, namespace) for j in range(i % 3)}
    logical = node.get("logicalType")
    if logical in ("timestamp-micros", "local-timestamp-micros"):
        return _EPOCH + timedelta(microseconds=i)
    if logical in ("timestamp-millis", "local-timestamp-millis"):
        return _EPOCH + timedelta(milliseconds=i)
    if logical == "decimal":
        return Decimal(i * 7).scaleb(-int(node.get("scale", 0)))
    if isinstance(kind, (dict, list)):
        return _sample(kind, i, names, namespace)
    return _primitive(kind, i)


def _primitive(kind: str, i: int) -> Any:
    if kind == "null":
        return None
    if kind == "boolean":
        return i % 2 == 1
    if kind in ("int", "long"):
        return i * 7
    if kind in ("float", "double"):
        return i + 0.5
    if kind == "bytes":
        return bytes([i % 256]) * (i % 3)
    if kind == "string":
        return _STRINGS[i % len(_STRINGS)]
    raise AvroSchemaError(f"unknown primitive {kind!r}")


def _widest(node: Any) -> int:
    """The largest union or enum in a schema (how many samples reach every branch)."""
    if isinstance(node, list):
        return max([len(node), *(_widest(b) for b in node)])
    if not isinstance(node, dict):
        return 1
    kind = node.get("type")
    if kind == "enum":
        return len(node["symbols"])
    if kind in ("record", "error"):
        return max([1, *(_widest(f["type"]) for f in node["fields"])])
    if kind == "array":
        return _widest(node["items"])
    if kind == "map":
        return _widest(node["values"])
    if isinstance(kind, (dict, list)):
        return _widest(kind)
    return 1


def _samples(schema: SchemaJSON) -> Iterator[Any]:
    names: dict[str, SchemaJSON] = {}
    register(schema, None, names, "schema")
    for i in range(2 * _widest(schema) + 3):
        yield _sample(schema, i, names, None)


def compatibility_errors(writer: SchemaJSON, reader: SchemaJSON) -> list[str]:
    """Why data written with `writer` would not decode correctly with `reader` (empty: it does).

    Records generated from `writer` (going through every union branch and
    enum symbol) are written with it and read back through fastavro's schema
    resolution into `reader`; and a logical type (timestamp unit, decimal
    precision and scale) must not change under a field both schemas have, as
    the fingerprint ignores it.  Full compatibility is both directions.
    """
    errors: list[str] = []
    try:
        w, r = parse(writer), parse(reader)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return [f"schema does not parse: {exc}"]
    for n, datum in enumerate(_samples(writer)):
        out = io.BytesIO()
        try:
            fastavro.schemaless_writer(out, w, datum)
        except ENCODE_ERRORS as exc:
            errors.append(f"sample {n}: cannot write with the writer schema: {exc}")
            continue
        out.seek(0)
        try:
            fastavro.schemaless_reader(out, w, r)
        except DECODE_ERRORS as exc:
            message = f"{type(exc).__name__}: {exc}"
            if message not in errors:
                errors.append(message)
    old, new = _leaf_types(writer), _leaf_types(reader)
    for where in sorted(old.keys() & new.keys()):
        if old[where][1:] != new[where][1:]:
            errors.append(
                f"{'.'.join(where)}: logical type {old[where][1:]} became {new[where][1:]}"
            )
    return errors


def release(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Write `history/<Name>/<n+1>.avsc` for each record whose current schema is unreleased."""
    written: list[Path] = []
    for name in RECORD_NAMES:
        cur = CURRENT[name]
        if cur.version is not None:
            continue
        versions = HISTORY[name]
        number = (versions[-1].version or 0) + 1 if versions else 1
        path = directory / "history" / name / f"{number}.avsc"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(cur.schema, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        written.append(path)
    return written
