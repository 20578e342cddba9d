"""The selectable framing (`streamtally.wire.framing`) and every decoder reading both framings.

Registration at a writer's start (subjects, compatibility, ids), the exact bytes a
Confluent writer sends, the process's table of ids (asked of the registry once per
id, matched by canonical form), the refusals, and the worker fed a raw topic holding
both framings: the same outputs as from one framing alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.core.models import Source
from streamtally.processors.sinks import KafkaSink
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire import avro
from streamtally.wire.framing import (
    SINGLE_OBJECT,
    Framing,
    framing_for,
    install_registry,
    learn_ids,
    register_topics,
    registered_schema,
)
from streamtally.wire.registry import SchemaRegistry, SchemaRegistryError
from tests.fake_registry import FakeRegistry
from tests.unit.processors.test_requests import MANIFEST, Run, sample
from tests.unit.wire.test_avro import BILLING, PINNED_CHUNK, PINNED_CHUNK_HEX, TOKENS

TOPICS = Topics.in_namespace("unit")
HISTORY = Path(avro.SCHEMA_DIR) / "history"


def registry_of(fake: FakeRegistry) -> SchemaRegistry:
    return SchemaRegistry(fake.base, transport=fake)


def confluent_settings(**kwargs: Any) -> Settings:
    return Settings(
        avro_framing="confluent", schema_registry_url=FakeRegistry.base, namespace="unit", **kwargs
    )


# --------------------------------------------------------------------------- writing


def test_registration_registers_each_topic_under_its_value_subject() -> None:
    fake = FakeRegistry(first_id=7)
    framing = register_topics(registry_of(fake), TOPICS.all)
    assert framing.name == "confluent"
    subjects = {f"{t.name}-value": t.value_schema for t in TOPICS.all}
    assert set(fake.subjects) == set(subjects)
    assert fake.config == dict.fromkeys(subjects, "BACKWARD")
    for subject, record in subjects.items():
        (text,) = fake.subjects[subject]
        # What the subject holds is the released version's schema (same canonical form).
        latest = max(HISTORY.joinpath(record).glob("*.avsc"), key=lambda p: int(p.stem))
        released = json.loads(latest.read_text(encoding="utf-8"))
        assert avro.canonical_form(json.loads(text)) == avro.canonical_form(released)
        assert avro.known_version(text) is avro.current(record)
    # The ids are learnt: the process decodes what it writes without asking again.
    assert {v.name for v in avro.known_ids().values()} == set(subjects.values())
    # A second start (another process) registers nothing new: same ids, one version each.
    again = register_topics(registry_of(fake), TOPICS.all)
    assert again.headers == framing.headers
    assert all(len(v) == 1 for v in fake.subjects.values())


def test_a_confluent_writer_sends_exactly_magic_id_body() -> None:
    fake = FakeRegistry(first_id=0x01020300)
    framing = register_topics(registry_of(fake), [TOPICS.chunks])
    value = framing.frame(avro.encode_chunk(PINNED_CHUNK))
    assert value == bytes.fromhex("0001020300" + PINNED_CHUNK_HEX[20:])
    assert avro.decode_chunk(value) == PINNED_CHUNK
    # Not registered: another topic's record is refused, never sent single-object.
    with pytest.raises(avro.AvroEncodeError, match="not registered at start"):
        framing.frame(avro.encode_tokens(TOKENS[0]))
    assert SINGLE_OBJECT.frame(avro.encode_chunk(PINNED_CHUNK)).hex() == PINNED_CHUNK_HEX


def test_framing_for_follows_the_setting() -> None:
    fake = FakeRegistry()
    single = framing_for(Settings(schema_registry_url=fake.base), TOPICS.all, registry_of(fake))
    assert single is SINGLE_OBJECT
    assert fake.requests == []  # nothing registered, nothing asked
    confluent = framing_for(confluent_settings(), TOPICS.raw, registry_of(fake))
    assert confluent.name == "confluent"
    assert set(fake.subjects) == {"unit.raw.sse-value", "unit.raw.engine-value"}


class SortingRegistry(FakeRegistry):
    """A registry that deduplicates content by a form sorting each record's fields."""

    def add(self, schema: str) -> int:
        for text, schema_id in self.ids.items():
            if _sorted_form(text) == _sorted_form(schema):
                return schema_id
        return super().add(schema)


def _sorted_form(text: str) -> str:
    node = json.loads(text)
    return json.dumps(sorted(node["fields"], key=lambda f: f["name"]), sort_keys=True)


def test_a_writer_does_not_start_when_the_registry_serves_another_schema_under_its_id() -> None:
    version = avro.current("Chunk")
    reordered = dict(version.schema)
    reordered["fields"] = list(reversed(version.schema["fields"]))
    fake = SortingRegistry()
    taken = fake.add(json.dumps(reordered))  # someone else's text, first under the content
    with pytest.raises(SchemaRegistryError, match=f"gave id {taken} .* serves another schema"):
        register_topics(registry_of(fake), [TOPICS.chunks])
    assert taken not in avro.known_ids()  # nothing learnt, nothing framed with it
    # The same registry holding the schema as registered: the writer starts.
    assert register_topics(registry_of(SortingRegistry()), [TOPICS.chunks]).name == "confluent"


def test_a_writer_does_not_start_when_the_registry_is_down() -> None:
    with pytest.raises(SchemaRegistryError, match="cannot reach the schema registry"):
        framing_for(confluent_settings(), TOPICS.outputs, registry_of(FakeRegistry(down=True)))


def test_the_kafka_sink_frames_every_value() -> None:
    fake = FakeRegistry(first_id=300)
    framing = register_topics(registry_of(fake), TOPICS.outputs)
    run = Run()
    s = sample("openai/text_usage.sse")
    run.send_all(s)
    run.feed(Source.OPENAI, b"\xc3\x01garbage", 99, key=b"x")  # a dead letter too

    async def pending() -> dict[tuple[str, int], list[tuple[bytes | None, bytes]]]:
        sink = KafkaSink("127.0.0.1:1", TOPICS, framing)
        sink.add(run.out)
        await sink.stop()
        return sink._pending

    by_topic: dict[str, list[bytes]] = {}
    for (topic, _), messages in asyncio.run(pending()).items():
        by_topic.setdefault(topic, []).extend(value for _, value in messages)
    assert set(by_topic) == {t.name for t in TOPICS.outputs}
    for topic, values in by_topic.items():
        record = TOPICS.by_name(topic).value_schema
        for value in values:
            assert value[:1] == b"\x00"
            assert avro.known_ids()[avro.schema_id_in(value)].name == record
    assert [avro.decode_billing_event(v) for v in by_topic["unit.billing"]] == [
        d.billing for d in run.out.completed
    ]


# --------------------------------------------------------------------------- reading


def test_every_decoder_reads_both_framings() -> None:
    fake = FakeRegistry(first_id=40)
    registry = registry_of(fake)
    install_registry(registry)
    cases: list[tuple[str, Any, bytes]] = [
        ("Chunk", avro.decode_chunk, avro.encode_chunk(PINNED_CHUNK)),
        ("Tokens", avro.decode_tokens, avro.encode_tokens(TOKENS[0])),
        ("BillingEvent", avro.decode_billing_event, avro.encode_billing_event(BILLING)),
    ]
    for name, decode, single in cases:
        schema_id = fake.add(registered_schema(avro.current(name)))
        confluent = avro.to_confluent(single, schema_id)
        assert decode(confluent) == decode(single)
        assert avro.decode(name, confluent) == avro.decode(name, single)
    # Each id asked once, however often it is read.
    for name, decode, single in cases:
        decode(avro.to_confluent(single, fake.ids[registered_schema(avro.current(name))]))
    assert len(fake.calls("GET")) == len(cases)


def test_an_older_version_by_id_is_resolved_to_the_current() -> None:
    """An id of a released older version (another, older writer registered it)."""
    fake = FakeRegistry()
    install_registry(registry_of(fake))
    v1 = avro.history("BillingEvent")[0]
    old = avro.encode(
        "BillingEvent",
        avro.decode("BillingEvent", avro.encode_billing_event(BILLING)),
        version=1,
    )
    schema_id = fake.add((HISTORY / "BillingEvent" / "1.avsc").read_text(encoding="utf-8"))
    assert avro.writer_by_id(schema_id) is v1
    assert avro.decode_billing_event(avro.to_confluent(old, schema_id)) == (
        avro.decode_billing_event(old)
    )


def test_unknown_ids_and_foreign_schemas_are_refused_once() -> None:
    fake = FakeRegistry(first_id=1)
    install_registry(registry_of(fake))
    foreign = fake.add(json.dumps({"type": "record", "name": "Other", "fields": []}))
    value = avro.to_confluent(avro.encode_billing_event(BILLING), foreign)
    for _ in range(3):
        with pytest.raises(avro.AvroDecodeError, match="a schema this codec does not know"):
            avro.decode_billing_event(value)
    missing = avro.to_confluent(avro.encode_billing_event(BILLING), 77)
    for _ in range(2):
        with pytest.raises(avro.AvroDecodeError, match=r"BillingEvent: schema id 77 .*no such id"):
            avro.decode_billing_event(missing)
    assert fake.calls("GET") == [f"GET /schemas/ids/{foreign}", "GET /schemas/ids/77"]
    # A Chunk's id on the billing topic is another record's.
    chunk_id = fake.add(registered_schema(avro.current("Chunk")))
    wrong = avro.to_confluent(avro.encode_chunk(PINNED_CHUNK), chunk_id)
    with pytest.raises(avro.AvroDecodeError, match="expected a BillingEvent message, got a Chunk"):
        avro.decode_billing_event(wrong)


def test_without_a_registry_a_confluent_value_is_refused_with_the_setting_named() -> None:
    value = avro.to_confluent(avro.encode_billing_event(BILLING), 5)
    with pytest.raises(avro.AvroDecodeError, match="STREAMTALLY_SCHEMA_REGISTRY_URL"):
        avro.decode_billing_event(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"\x00\x00\x01", "3 bytes: too short for a Confluent-framed"),
        (
            b"\x01\x02" + bytes(20),
            "bad marker 0102: neither Avro single-object encoding (c301) nor",
        ),
        (b"", "too short"),
    ],
)
def test_bytes_of_neither_framing_are_refused(value: bytes, message: str) -> None:
    with pytest.raises(avro.AvroDecodeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        avro.decode_tokens(value)


def test_an_unreachable_registry_is_not_a_decode_error() -> None:
    """Not a dead letter: the worker stops and reads the record again later."""
    fake = FakeRegistry(down=True)
    install_registry(registry_of(fake))
    value = avro.to_confluent(avro.encode_billing_event(BILLING), 9)
    for _ in range(2):  # not remembered: asked again
        with pytest.raises(SchemaRegistryError):
            avro.decode_billing_event(value)
    assert len(fake.requests) == 2


def test_learn_ids_asks_for_a_batchs_unknown_ids_once() -> None:
    fake = FakeRegistry(first_id=20)
    install_registry(registry_of(fake))
    known = fake.add(registered_schema(avro.current("Tokens")))
    tokens = avro.encode_tokens(TOKENS[0])
    values: list[bytes | None] = [
        avro.to_confluent(tokens, known),
        None,
        tokens,
        avro.to_confluent(tokens, known),
        avro.to_confluent(tokens, 999),  # refused, remembered
        b"\x00\x00",
    ]
    asyncio.run(learn_ids(values))
    assert fake.calls() == [f"GET /schemas/ids/{known}", "GET /schemas/ids/999"]
    asyncio.run(learn_ids(values))
    assert len(fake.requests) == 2
    assert avro.decode_tokens(values[0] or b"") == avro.decode_tokens(tokens)


# --------------------------------------------------------------------------- the worker


def _without_sha(billing: Any) -> Any:
    return dataclasses.replace(billing, raw_sha256=None)


@pytest.mark.parametrize("file", sorted(MANIFEST))
def test_the_worker_reads_a_raw_topic_holding_both_framings(file: str) -> None:
    """Every other record Confluent-framed: the same chunks, Tokens and bills as from
    single-object records alone; the provenance hash is of the bytes as read."""
    fake = FakeRegistry(first_id=11)
    framing = register_topics(registry_of(fake), TOPICS.raw)
    avro.forget_ids()  # a worker that learns the ids as it reads, from the registry
    install_registry(registry_of(fake))
    fake.requests.clear()  # the writer's registration (and its check of each id) done
    s = sample(file)
    mixed = [framing.frame(v) if i % 2 else v for i, v in enumerate(s.records)]
    assert any(v[:1] == b"\x00" for v in mixed) or len(mixed) == 1
    plain, both = Run(), Run()
    plain.send_all(s)
    both.send_all(dataclasses.replace(s, records=mixed))
    assert both.out.chunks == plain.out.chunks
    assert both.out.dead_letters == plain.out.dead_letters == []
    assert [d.tokens for d in both.out.completed] == [d.tokens for d in plain.out.completed]
    assert [_without_sha(d.billing) for d in both.out.completed] == [
        _without_sha(d.billing) for d in plain.out.completed
    ]
    assert both.processor.counters == plain.processor.counters
    for done in both.out.completed:
        digest = hashlib.sha256()
        for value in mixed:
            digest.update(len(value).to_bytes(8, "big") + value)
        assert done.billing.raw_sha256 == digest.hexdigest()
    assert len(fake.calls("GET")) == 1  # the raw topic's one id, asked once


def test_the_worker_dead_letters_a_raw_record_of_an_unknown_id() -> None:
    fake = FakeRegistry()
    install_registry(registry_of(fake))
    s = sample("openai/text_usage.sse")
    run = Run()
    value = avro.to_confluent(s.records[0], 4242)
    (letter,) = run.feed(s.source, value, 0, key=s.key).dead_letters
    assert letter.error_type == "AvroDecodeError"
    assert "RawSseEvent: schema id 4242 (Confluent framing)" in letter.reason
    assert letter.value == value
    assert run.processor.counters.dead_lettered == 1
    # The rest of the request, single-object, is read as ever (seq 0 is missing: waits).
    run.send_all(s, list(range(1, len(s.records))), first=1)
    assert run.processor.counters.dead_lettered == 1


def test_the_framing_is_named() -> None:
    assert repr(SINGLE_OBJECT) == "Framing(single-object)"
    assert Framing({}).name == "confluent"


def test_an_id_no_registry_gives_is_refused_without_asking() -> None:
    """Garbage opening with 00 names an id above 2**31 - 1: a dead letter, never a question
    (Apicurio answers one with a 404 of no known error code, which would stop the worker)."""
    fake = FakeRegistry()
    install_registry(registry_of(fake))
    value = b"\x00\xffnot avro at all"
    with pytest.raises(avro.AvroDecodeError, match="above 2147483647"):
        avro.decode_raw_sse_event(value)
    assert fake.requests == []
