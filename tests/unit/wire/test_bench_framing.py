"""The pipeline benchmark's framing option: raw records framed as the worker will read them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.pipeline_workload import (
    PipelineSettings,
    RequestBuilder,
    bench_names,
)
from streamtally.settings import Settings
from streamtally.wire import avro
from streamtally.wire.framing import register_topics
from streamtally.wire.registry import SchemaRegistry, subject_of
from tests.fake_registry import FakeRegistry

SAMPLES = Path(__file__).resolve().parents[3] / "samples"


def test_a_framing_outside_the_settings_values_is_refused() -> None:
    with pytest.raises(ValueError, match="framing must be one of single-object, confluent"):
        PipelineSettings(framing="confluent-ish")


def test_confluent_requests_carry_the_raw_topics_ids_and_the_same_bodies() -> None:
    names = bench_names(Settings(namespace="unit-bench"))
    fake = FakeRegistry()
    framing = register_topics(
        SchemaRegistry(fake.base, transport=fake), [names.topics.raw_sse, names.topics.raw_engine]
    )
    plain = RequestBuilder("r1", SAMPLES, names).warmup()
    framed = RequestBuilder("r1", SAMPLES, names, framing).warmup()
    ids = {
        subject_of(topic.name): fake.ids[fake.subjects[subject_of(topic.name)][0]]
        for topic in (names.topics.raw_sse, names.topics.raw_engine)
    }
    assert len(plain) == len(framed) > 0
    for single, confluent in zip(plain, framed, strict=True):
        assert confluent.topic == single.topic
        for a, b in zip(single.records, confluent.records, strict=True):
            assert b[:1] == b"\x00"
            assert int.from_bytes(b[1:5], "big") == ids[subject_of(single.topic)]
            read = (
                avro.decode_raw_sse_event if single.source.is_sse else avro.decode_raw_engine_output
            )
            # The same record but for its receive time (stamped as it is encoded).
            framed_record, plain_record = read(b), read(a)
            assert replace(framed_record, received_at=plain_record.received_at) == plain_record
