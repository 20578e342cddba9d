"""`schemas/*.avsc` load as a set, in any order, in fastavro and in Apache Avro Java.

A tool given the folder reads the files in whatever order it lists them; a file may
name a type that another file defines.  Avro Java 1.12's `SchemaParser` reads each
file, then resolves the names, but it checks a field's default as it reads the field:
a default on a field whose type is defined in a file not yet read fails ("Invalid
default for field usage_source"), so such a type is defined inline, in the field
(`BillingEvent.usage_source` defines `UsageSource`).  `test_no_default_names_a_type_of_
another_file` checks that rule without Java; the Java tests run the real parser
(`tests/avro_java.py` fetches Avro 1.12 from Maven Central once, into the state
directory) and compare its fingerprints with the wire contract.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.repository.base import AbstractSchemaRepository, SchemaRepositoryError
from fastavro.schema import UnknownType, load_schema

from streamtally.wire import avro
from streamtally.wire.avro._compat import _samples
from tests.avro_java import AvroJava, AvroJavaUnavailable, avro_java

ROOT = Path(__file__).resolve().parents[3]
SCHEMAS = ROOT / "schemas"
FILES = sorted(SCHEMAS.glob("*.avsc"))
PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


def _orders() -> list[list[Path]]:
    """Sorted, reversed, each file first once, and more shuffles (fixed seed)."""
    rng = random.Random(25)
    orders = [list(FILES), FILES[::-1]]
    for first in FILES:
        rest = [p for p in FILES if p != first]
        rng.shuffle(rest)
        orders.append([first, *rest])
    for _ in range(8):
        orders.append(rng.sample(FILES, len(FILES)))
    return orders


ORDERS = _orders()


def _fullname(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


# --------------------------------------------------------------------------- the rule, statically


def _defined(node: Any, namespace: str | None, out: set[str]) -> None:
    if isinstance(node, list):
        for branch in node:
            _defined(branch, namespace, out)
    elif isinstance(node, dict):
        if node.get("type") in ("record", "error", "enum", "fixed"):
            full = _fullname(node["name"], node.get("namespace", namespace))
            out.add(full)
            namespace = full.rpartition(".")[0] or None
            for fld in node.get("fields", ()):
                _defined(fld["type"], namespace, out)
        for key in ("items", "values", "type"):
            if isinstance(node.get(key), (dict, list)):
                _defined(node[key], namespace, out)


def _defaulted_references(node: Any, namespace: str | None) -> Iterator[tuple[str, str]]:
    """(record.field, type name) for each field with a default whose type (or, for a
    union, first branch, the one the default is of) is a named type given by name."""
    if isinstance(node, list):
        for branch in node:
            yield from _defaulted_references(branch, namespace)
    elif isinstance(node, dict):
        inner = namespace
        if node.get("type") in ("record", "error"):
            full = _fullname(node["name"], node.get("namespace", namespace))
            inner = full.rpartition(".")[0] or None
            for fld in node["fields"]:
                kind = fld["type"]
                first = kind[0] if isinstance(kind, list) and kind else kind
                if "default" in fld and isinstance(first, str) and first not in PRIMITIVES:
                    yield f"{node['name']}.{fld['name']}", _fullname(first, inner)
                yield from _defaulted_references(kind, inner)
        for key in ("items", "values", "type"):
            if isinstance(node.get(key), (dict, list)):
                yield from _defaulted_references(node[key], inner)


def defaults_naming_other_files(folder: Path) -> list[str]:
    """Fields whose default Avro Java checks against a type another file defines."""
    found = []
    for path in sorted(folder.glob("*.avsc")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        own: set[str] = set()
        _defined(schema, None, own)
        found += [
            f"{path.name}: {where} -> {name}"
            for where, name in _defaulted_references(schema, None)
            if name not in own
        ]
    return found


def test_no_default_names_a_type_of_another_file() -> None:
    assert defaults_naming_other_files(SCHEMAS) == [], (
        "a field with a default must define its named type inline (Avro Java checks the "
        "default before a later file defines the type: see this module's docstring)"
    )


def _split_usage_source(folder: Path) -> Path:
    """A copy of schemas/ with UsageSource in a file of its own, as it was before issue 25."""
    for path in FILES:
        (folder / path.name).write_bytes(path.read_bytes())
    billing = json.loads((folder / "BillingEvent.avsc").read_text(encoding="utf-8"))
    field = next(f for f in billing["fields"] if f["name"] == "usage_source")
    enum, field["type"] = field["type"], "io.streamtally.v1.UsageSource"
    (folder / "BillingEvent.avsc").write_text(json.dumps(billing), encoding="utf-8")
    (folder / "UsageSource.avsc").write_text(json.dumps(enum), encoding="utf-8")
    return folder


def test_the_rule_finds_a_defaulted_reference_to_another_file(tmp_path: Path) -> None:
    split = _split_usage_source(tmp_path)
    assert defaults_naming_other_files(split) == [
        "BillingEvent.avsc: BillingEvent.usage_source -> io.streamtally.v1.UsageSource"
    ]


# --------------------------------------------------------------------------- fastavro


def load_set_in_fastavro(order: list[Path]) -> dict[str, Any]:
    """Each file's parsed schema (by file stem): one `named_schemas` for the whole set.

    `fastavro.parse_schema` needs the types a file names already parsed, so a file
    that names a type of a file not yet read waits for a later pass; a pass that
    reads nothing new means a name no file defines.  Each attempt parses into a copy
    of the names, so a failed one leaves nothing half-defined behind.
    """
    named: dict[str, Any] = {}
    loaded: dict[str, Any] = {}
    pending = [(path.stem, json.loads(path.read_text(encoding="utf-8"))) for path in order]
    while pending:
        waiting = []
        for stem, schema in pending:
            attempt = dict(named)
            try:
                loaded[stem] = fastavro.parse_schema(schema, named_schemas=attempt)
            except UnknownType:
                waiting.append((stem, schema))
            else:
                named = attempt
        if len(waiting) == len(pending):
            raise AssertionError(f"unresolved names in {[stem for stem, _ in waiting]}")
        pending = waiting
    return loaded


class SchemaFolder(AbstractSchemaRepository):
    """fastavro's repository of a folder whose files are named by short name (Usage.avsc).

    `fastavro.schema.load_schema` asks it for each type a file names that is not yet
    known (by full name).  fastavro's own `FlatDictRepository` expects files named by
    full name (io.streamtally.v1.Usage.avsc).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def load(self, name: str) -> dict[str, Any]:
        path = self.folder / f"{name.rpartition('.')[2]}.avsc"
        try:
            schema: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise SchemaRepositoryError(f"no schema {name} in {self.folder}") from exc
        return schema


def _write(schema: Any, datum: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, datum)
    return out.getvalue()


SAMPLES = {name: list(_samples(avro.current(name).schema)) for name in avro.RECORD_NAMES}


def assert_same_as_the_codec(name: str, schema: Any) -> None:
    """`schema` writes the bytes the codec's schema of record `name` writes, and reads them."""
    ours = avro.current(name).parsed
    for datum in SAMPLES[name]:  # through every union branch and enum symbol
        body = _write(ours, datum)
        assert _write(schema, datum) == body, name
        read = fastavro.schemaless_reader(io.BytesIO(body), schema, None)
        assert read == fastavro.schemaless_reader(io.BytesIO(body), ours, None), name


@pytest.mark.parametrize(
    "order", ORDERS, ids=[f"order{i}-{o[0].stem}-first" for i, o in enumerate(ORDERS)]
)
def test_fastavro_loads_the_set_in_any_order(order: list[Path]) -> None:
    loaded = load_set_in_fastavro(order)
    assert set(loaded) == {p.stem for p in FILES}
    for name in avro.RECORD_NAMES:
        assert_same_as_the_codec(name, loaded[name])


def test_fastavro_set_loader_refuses_a_name_no_file_defines(tmp_path: Path) -> None:
    split = _split_usage_source(tmp_path)
    (split / "UsageSource.avsc").unlink()
    with pytest.raises(AssertionError, match=r"unresolved names in \['BillingCorrection'"):
        load_set_in_fastavro(sorted(split.glob("*.avsc")))


@pytest.mark.parametrize("name", avro.RECORD_NAMES)
def test_fastavro_load_schema_with_a_folder_repository(name: str) -> None:
    """The recipe of docs/avro-framing.md: one `load_schema` per record, its own names."""
    assert_same_as_the_codec(name, load_schema(name, repo=SchemaFolder(SCHEMAS)))


# --------------------------------------------------------------------------- Avro Java


@pytest.fixture(scope="module")
def java() -> AvroJava:
    try:
        return avro_java()
    except AvroJavaUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"Apache Avro Java is needed in CI: {exc}")
        pytest.skip(f"Apache Avro Java unavailable: {exc}")


def _pairs(line: str) -> list[tuple[str, int]]:
    """(full name, fingerprint) per file of a job's answer, in the job's order."""
    status, *pairs = line.split("\t")
    assert status == "ok", line
    return [(name, int(fp)) for name, _, fp in (pair.partition("=") for pair in pairs)]


def _fingerprints(line: str) -> dict[str, int]:
    return dict(_pairs(line))


def _long(fingerprint: bytes) -> int:
    """The fingerprint as Java's `SchemaNormalization.parsingFingerprint64` returns it."""
    return int.from_bytes(fingerprint, "little", signed=True)


def _expected_fingerprints() -> dict[str, int]:
    """Every file's type: records from the wire contract, enums from fastavro alone."""
    expected = {}
    for path in FILES:
        schema = json.loads(path.read_text(encoding="utf-8"))
        full = _fullname(schema["name"], schema["namespace"])
        if path.stem in avro.RECORD_NAMES:
            expected[full] = _long(avro.fingerprint(path.stem))
        else:
            expected[full] = _long(avro.schema_fingerprint(schema))
    return expected


def test_avro_java_loads_the_set_in_any_order(java: AvroJava) -> None:
    expected = _expected_fingerprints()
    history = [v for name in avro.RECORD_NAMES for v in avro.history(name)]
    history_files = [SCHEMAS / "history" / v.name / f"{v.version}.avsc" for v in history]
    jobs = [["set", *map(str, order)] for order in ORDERS]
    jobs.append(["each", *map(str, history_files)])
    *sets, each = java.run(jobs)
    for order, line in zip(ORDERS, sets, strict=True):
        assert _fingerprints(line) == expected, [p.stem for p in order]
    # Each released version, alone, fingerprinted by Java as by the codec.
    assert _pairs(each) == [(f"{avro.NAMESPACE}.{v.name}", _long(v.fingerprint)) for v in history]


def test_avro_java_refuses_a_default_of_a_type_defined_later(
    java: AvroJava, tmp_path: Path
) -> None:
    """What the rule prevents: the set as it was before issue 25 fails in Avro Java."""
    split = sorted(_split_usage_source(tmp_path).glob("*.avsc"))
    last = [p for p in split if p.stem != "UsageSource"] + [tmp_path / "UsageSource.avsc"]
    first = [tmp_path / "UsageSource.avsc"] + [p for p in split if p.stem != "UsageSource"]
    refused, loaded = java.run([["set", *map(str, last)], ["set", *map(str, first)]])
    assert refused.startswith("error\t"), refused
    assert "Invalid default for field usage_source" in refused
    assert _fingerprints(loaded)["io.streamtally.v1.BillingEvent"] == _long(
        avro.fingerprint("BillingEvent")
    )
