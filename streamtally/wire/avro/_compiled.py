"""Readers compiled from a schema: the raw records' bodies read by straight-line Python.

fastavro reads a body by walking the parsed schema for every datum: each
field's type looked up, each union resolved, each record built through its
generic reader.  For the raw records, read once per raw event, that walk was
most of the worker's decoding CPU (about 9 µs per SSE event, 20 µs per engine
output under the pipeline benchmark).  `compile_reader` turns one writer
schema, once, into Python source that reads exactly that schema field by field
(Avro 1.11 binary encoding: zig-zag varints, length-prefixed UTF-8 strings,
union branch indexes, array and map blocks, little-endian doubles and floats)
and returns what fastavro returns: the same dicts, lists, tuples of record
name and record for unions of several records, aware datetimes for
`timestamp-micros`.

It is used only when the body's writer schema is the reader's (no schema
resolution); an older writer goes through fastavro.  It is stricter than
fastavro where fastavro reads garbage without a word: a truncated string, a
negative length, a varint past 64 bits, an enum or union index out of range
all raise (`ValueError`, `IndexError` or `EOFError`: `DECODE_ERRORS`).
`tests/unit/wire/test_avro_compiled.py` compares both readers on every sample,
on random datums of each schema and on damaged bodies.

The two raw schemas' readers are also written out, typed, as a module
(`_raw_readers`, by ``python -m streamtally.wire.avro._compiled``): the
codec uses those, which mypyc compiles with the rest of the hot path
(`streamtally._native`), about twice as fast again.
"""

from __future__ import annotations

import inspect
import itertools
import re
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

__all__ = [
    "GENERATED",
    "GENERATED_FILE",
    "Reader",
    "Unsupported",
    "compile_reader",
    "generated_source",
    "module_source",
]

#: Reads one body: (the bytes, where the body starts) -> (the datum, where it ended).
Reader = Callable[[bytes, int], tuple[Any, int]]

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_DOUBLE: Final = struct.Struct("<d").unpack_from
_FLOAT: Final = struct.Struct("<f").unpack_from


class Unsupported(Exception):
    """A schema feature the compiler does not read (a logical type other than
    timestamp-micros): such a schema is read by fastavro."""


def _long_tail(buf: bytes, pos: int, b: int) -> tuple[int, int]:
    """The rest of a varint whose first byte `b` (already read) has its high bit set."""
    n = b & 0x7F
    shift = 7
    while True:
        b = buf[pos]  # IndexError past the end: a truncated body
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")
    if n >> 64:
        raise ValueError("a varint beyond 64 bits")
    return (n >> 1) ^ -(n & 1), pos


def _eof(what: str) -> EOFError:
    return EOFError(f"the body ends inside {what}")


class _Writer:
    """Emits the source of the readers: one function per record type."""

    def __init__(self, named: Mapping[str, Any], record_names: bool) -> None:
        self.named = named
        self.record_names = record_names
        self.consts: dict[str, Any] = {
            "_long_tail": _long_tail,
            "_eof": _eof,
            "_EPOCH": _EPOCH,
            "_timedelta": timedelta,
            "_DOUBLE": _DOUBLE,
            "_FLOAT": _FLOAT,
        }
        self.functions: dict[str, str] = {}  # record full name -> function name
        self.bodies: list[str] = []
        self._ids = itertools.count()

    def var(self, stem: str) -> str:
        return f"{stem}{next(self._ids)}"

    def const(self, value: Any) -> str:
        name = self.var("_c")
        self.consts[name] = value
        return name

    # -- types -------------------------------------------------------------------------

    def read(self, schema: Any, target: str, lines: list[str], indent: str) -> None:
        """Append to `lines` the statements that read `schema` into the variable `target`."""
        if isinstance(schema, str):
            if schema in self.named:
                schema = self.named[schema]
            else:
                self.primitive(schema, target, lines, indent)
                return
        if isinstance(schema, list):
            self.union(schema, target, lines, indent)
            return
        kind = schema["type"]
        logical = schema.get("logicalType")
        if logical is not None:
            if logical == "timestamp-micros" and kind == "long":
                micros = self.var("us")
                self.long(micros, lines, indent)
                lines.append(f"{indent}{target} = _EPOCH + _timedelta(microseconds={micros})")
                return
            raise Unsupported(f"logical type {logical!r}")
        if kind == "record":
            lines.append(f"{indent}{target}, pos = {self.record(schema)}(buf, pos, size)")
        elif kind == "enum":
            symbols = self.const(tuple(schema["symbols"]))
            index = self.var("i")
            self.long(index, lines, indent)
            lines += [
                f"{indent}if not 0 <= {index} < {len(schema['symbols'])}:",
                f"{indent}    raise IndexError(f'enum index {{{index}}} out of range')",
                f"{indent}{target} = {symbols}[{index}]",
            ]
        elif kind == "array":
            self.blocks(
                target,
                "[]",
                lines,
                indent,
                lambda item, ls, ind: self.array_item(schema["items"], target, item, ls, ind),
            )
        elif kind == "map":
            self.blocks(
                target,
                "{}",
                lines,
                indent,
                lambda item, ls, ind: self.map_item(schema["values"], target, item, ls, ind),
            )
        elif kind == "fixed":
            width = int(schema["size"])
            lines += [
                f"{indent}if pos + {width} > size:",
                f"{indent}    raise _eof('a fixed')",
                f"{indent}{target} = buf[pos:pos + {width}]",
                f"{indent}pos += {width}",
            ]
        else:
            self.primitive(kind, target, lines, indent)

    def primitive(self, kind: str, target: str, lines: list[str], indent: str) -> None:
        if kind == "null":
            lines.append(f"{indent}{target} = None")
        elif kind in ("long", "int"):
            self.long(target, lines, indent)
        elif kind == "boolean":
            lines += [f"{indent}{target} = buf[pos] != 0", f"{indent}pos += 1"]
        elif kind in ("string", "bytes"):
            length = self.var("n")
            self.long(length, lines, indent)
            lines += [
                f"{indent}if {length} < 0 or pos + {length} > size:",
                f"{indent}    raise _eof('a {kind}')",
                f"{indent}{target} = buf[pos:pos + {length}]"
                + (".decode()" if kind == "string" else ""),
                f"{indent}pos += {length}",
            ]
        elif kind in ("double", "float"):
            width, unpack = (8, "_DOUBLE") if kind == "double" else (4, "_FLOAT")
            lines += [
                f"{indent}if pos + {width} > size:",
                f"{indent}    raise _eof('a {kind}')",
                f"{indent}{target} = {unpack}(buf, pos)[0]",
                f"{indent}pos += {width}",
            ]
        else:
            raise Unsupported(f"type {kind!r}")

    def long(self, target: str, lines: list[str], indent: str) -> None:
        """A zig-zag varint: one or two bytes inline (most values: counts, lengths, token
        ids below 8192), longer ones in `_long_tail`."""
        lines += [
            f"{indent}b = buf[pos]",
            f"{indent}if b < 0x80:",
            f"{indent}    {target} = (b >> 1) ^ -(b & 1)",
            f"{indent}    pos += 1",
            f"{indent}elif (c := buf[pos + 1]) < 0x80:",  # IndexError past the end
            f"{indent}    z = (b & 0x7F) | (c << 7)",
            f"{indent}    {target} = (z >> 1) ^ -(z & 1)",
            f"{indent}    pos += 2",
            f"{indent}else:",
            f"{indent}    {target}, pos = _long_tail(buf, pos + 1, b)",
        ]

    def union(self, branches: list[Any], target: str, lines: list[str], indent: str) -> None:
        index = self.var("u")
        self.long(index, lines, indent)
        records = (
            [b for b in branches if self.resolve(b).get("type") == "record"]
            if self.record_names
            else []
        )
        named = len(records) > 1  # fastavro's return_record_name_override
        for k, branch in enumerate(branches):
            lines.append(f"{indent}{'if' if k == 0 else 'elif'} {index} == {k}:")
            inner = indent + "    "
            resolved = self.resolve(branch)
            if named and resolved.get("type") == "record":
                value = self.var("r")
                self.read(branch, value, lines, inner)
                lines.append(f"{inner}{target} = ({resolved['name']!r}, {value})")
            else:
                self.read(branch, target, lines, inner)
        lines += [
            f"{indent}else:",
            f"{indent}    raise IndexError(f'union branch {{{index}}} out of range')",
        ]

    def resolve(self, schema: Any) -> dict[str, Any]:
        """The schema a branch names, as a dict (`{"type": name}` for a primitive)."""
        if isinstance(schema, str):
            found = self.named.get(schema)
            return found if found is not None else {"type": schema}
        return schema if isinstance(schema, dict) else {"type": "union"}

    def blocks(
        self,
        target: str,
        empty: str,
        lines: list[str],
        indent: str,
        item: Callable[[str, list[str], str], None],
    ) -> None:
        """Array or map blocks: a count (negative: its byte size follows), items, 0."""
        count, skip = self.var("k"), self.var("s")
        lines.append(f"{indent}{target} = {empty}")
        lines.append(f"{indent}while True:")
        inner = indent + "    "
        self.long(count, lines, inner)
        lines += [
            f"{inner}if {count} == 0:",
            f"{inner}    break",
            f"{inner}if {count} < 0:",
            f"{inner}    {count} = -{count}",
        ]
        self.long(skip, lines, inner + "    ")
        lines.append(f"{inner}for _ in range({count}):")
        item(self.var("x"), lines, inner + "    ")

    def array_item(self, items: Any, target: str, x: str, lines: list[str], indent: str) -> None:
        self.read(items, x, lines, indent)
        lines.append(f"{indent}{target}.append({x})")

    def map_item(self, values: Any, target: str, x: str, lines: list[str], indent: str) -> None:
        key = self.var("key")
        self.primitive("string", key, lines, indent)
        self.read(values, x, lines, indent)
        lines.append(f"{indent}{target}[{key}] = {x}")

    def record(self, schema: dict[str, Any]) -> str:
        """The function that reads a record of this type (written once per type)."""
        name = schema["name"]
        found = self.functions.get(name)
        if found is not None:
            return found
        function = self.functions[name] = f"_read_{len(self.functions)}"
        lines = [f"def {function}(buf, pos, size):"]
        values = []
        for field in schema["fields"]:
            value = self.var("f")
            self.read(field["type"], value, lines, "    ")
            values.append(f"{field['name']!r}: {value}")
        lines.append(f"    return {{{', '.join(values)}}}, pos")
        self.bodies.append("\n".join(lines))
        return function


def compile_reader(parsed: Mapping[str, Any], *, record_names: bool = False) -> Reader:
    """A reader of bodies written with `parsed` (fastavro's parsed form of a record schema).

    It returns what `fastavro.schemaless_reader(body, parsed, None,
    return_record_name=record_names, return_record_name_override=record_names)`
    returns, and where the body ended.  Raises `Unsupported` for a schema it
    cannot read (then read it with fastavro).
    """
    writer = _Writer(parsed.get("__named_schemas", {}), record_names)
    top = writer.record(dict(parsed))
    entry = f"def read(buf, pos):\n    return {top}(buf, pos, len(buf))"
    source = "\n\n".join([*writer.bodies, entry])
    scope: dict[str, Any] = dict(writer.consts)
    exec(compile(source, f"<avro reader of {parsed['name']}>", "exec"), scope)
    reader: Reader = scope["read"]
    reader.__doc__ = f"Reads a {parsed['name']} body (compiled from its schema)."
    return reader


# --------------------------------------------------------------------------- generated module

#: The readers written into `_raw_readers` (schema, record names, function), which the
#: codec uses for the current raw schemas; compiled with the rest of the hot path
#: (`streamtally._native`).  ``python -m streamtally.wire.avro._compiled`` writes it.
GENERATED: Final = (
    ("RawSseEvent", False, "read_raw_sse_event"),
    ("RawEngineOutput", True, "read_raw_engine_output"),
)
_MODULE_DOC = '''"""Readers of the raw records' Avro bodies, generated from schemas/: do not edit.

Written by ``python -m streamtally.wire.avro._compiled`` (`module_source`):
the readers `compile_reader` makes for the current RawSseEvent and
RawEngineOutput schemas, as typed functions that mypy checks and mypyc
compiles.  `tests/unit/wire/test_avro_compiled.py` checks that this file is what
the generator writes for the schemas of today.
"""
'''
#: Values a generated reader holds that are not counts or positions (typed `Any`).
_VALUES = re.compile(r"\b((?:f|x|r|key)\d+)\b")


def module_source(schemas: Sequence[tuple[str, Mapping[str, Any], bool, str]]) -> str:
    """The source of a module with one reader per (name, parsed schema, record names,
    function name): the functions `compile_reader` makes, typed for mypy and mypyc."""
    parts = [
        _MODULE_DOC,
        "from __future__ import annotations\n\n"
        "from datetime import timedelta as _timedelta\n"
        "from typing import Any, Final\n\n"
        "from streamtally.wire.avro._compiled import _DOUBLE, _EPOCH, _FLOAT\n",
        inspect.getsource(_long_tail),
        inspect.getsource(_eof),
    ]
    for name, parsed, record_names, function in schemas:
        writer = _Writer(parsed.get("__named_schemas", {}), record_names)
        top = writer.record(dict(parsed))
        prefix = f"_{name.lower()}"

        def local(text: str, prefix: str = prefix) -> str:
            text = re.sub(r"\b_read_(\d+)\b", lambda m: f"{prefix}_{m.group(1)}", text)
            return re.sub(r"\b_(c\d+)\b", lambda m: f"{prefix}_{m.group(1)}", text)

        parts += [
            f"{local(const)}: Final = {value!r}\n"
            for const, value in writer.consts.items()
            if re.fullmatch(r"_c\d+", const)
        ]
        for body in writer.bodies:
            head, *rest = local(body).split("\n")
            head = head.replace(
                "(buf, pos, size):", "(buf: bytes, pos: int, size: int) -> tuple[Any, int]:"
            )
            values = sorted(set(_VALUES.findall(body)), key=lambda v: (len(v), v))
            parts.append("\n".join([head, *(f"    {v}: Any" for v in values), *rest]) + "\n")
        parts.append(
            f"def {function}(buf: bytes, pos: int) -> tuple[Any, int]:\n"
            f'    """Reads a {name} body written with the current schema."""\n'
            f"    return {local(top)}(buf, pos, len(buf))\n"
        )
    return "\n\n".join(part.rstrip("\n") + "\n" for part in parts)


def generated_source() -> str:
    """What `_raw_readers.py` must hold for the current schemas."""
    from streamtally.wire.avro._schemas import current

    return module_source(
        [(name, current(name).parsed, names, function) for name, names, function in GENERATED]
    )


#: The generated module's source file.
GENERATED_FILE: Final = Path(__file__).with_name("_raw_readers.py")

if __name__ == "__main__":
    GENERATED_FILE.write_text(generated_source(), encoding="utf-8")
    sys.stdout.write(f"wrote {GENERATED_FILE}\n")
