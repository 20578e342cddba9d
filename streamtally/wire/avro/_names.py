"""Named types in Avro schema JSON: full names, where each type is defined, and expansion.

The `.avsc` files define one top-level named type each (and any defined inline in
it) and refer to the others by name;
`expand` turns a record of them into one self-contained schema (each named type
defined where it first occurs, referred to by full name after), the form that
is fingerprinted and stored in `schemas/history/`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from streamtally.errors import AvroSchemaError

__all__ = ["NAMED", "PRIMITIVES", "SchemaJSON", "expand", "fullname", "namespace_of", "register"]

SchemaJSON = dict[str, Any]

PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
)
NAMED: Final = frozenset({"record", "error", "enum", "fixed"})


def fullname(name: str, namespace: str | None) -> str:
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


def namespace_of(name: str) -> str | None:
    return name.rpartition(".")[0] or None


def register(node: Any, namespace: str | None, defs: dict[str, SchemaJSON], origin: str) -> None:
    """Record every named type defined in `node` (a file's schema) into `defs`."""
    if isinstance(node, list):
        for branch in node:
            register(branch, namespace, defs, origin)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind in NAMED:
        full = fullname(node["name"], node.get("namespace", namespace))
        if full in defs:
            raise AvroSchemaError(f"{origin}: {full} is defined twice")
        defs[full] = {**node, "name": full.rpartition(".")[2], "namespace": namespace_of(full)}
        inner = namespace_of(full)
        for fld in node.get("fields", ()):
            register(fld["type"], inner, defs, origin)
    elif kind == "array":
        register(node["items"], namespace, defs, origin)
    elif kind == "map":
        register(node["values"], namespace, defs, origin)
    elif isinstance(kind, (dict, list)):
        register(kind, namespace, defs, origin)


def expand(node: Any, namespace: str | None, defs: Mapping[str, SchemaJSON], seen: set[str]) -> Any:
    """A self-contained copy of `node`: each named type defined at its first occurrence."""
    if isinstance(node, str):
        if node in PRIMITIVES:
            return node
        full = fullname(node, namespace)
        if full in seen:
            return full
        if full not in defs:
            raise AvroSchemaError(f"unknown type {node!r} (as {full})")
        return expand(defs[full], namespace_of(full), defs, seen)
    if isinstance(node, list):
        return [expand(branch, namespace, defs, seen) for branch in node]
    if not isinstance(node, dict):
        raise AvroSchemaError(f"not a schema: {node!r}")
    kind = node.get("type")
    if kind in NAMED:
        full = fullname(node["name"], node.get("namespace", namespace))
        if full in seen:
            return full
        seen.add(full)
        out = {**node, "name": full.rpartition(".")[2], "namespace": namespace_of(full)}
        if "fields" in node:
            inner = namespace_of(full)
            out["fields"] = [
                {**fld, "type": expand(fld["type"], inner, defs, seen)} for fld in node["fields"]
            ]
        return out
    if kind == "array":
        return {**node, "items": expand(node["items"], namespace, defs, seen)}
    if kind == "map":
        return {**node, "values": expand(node["values"], namespace, defs, seen)}
    if isinstance(kind, (dict, list)):
        return expand(kind, namespace, defs, seen)
    if kind in PRIMITIVES:
        return dict(node)
    raise AvroSchemaError(f"not a schema: {node!r}")
