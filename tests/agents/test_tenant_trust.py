"""Agent tier: a worker with a trust file (STREAMTALLY_TENANT_KEYS), driven with `test_context()`.

The agent gets batches as `RawSource` hands them over, Kafka headers included:
records signed by a key for a tenant it may bill are folded and billed; the
others (unsigned, signed for a tenant the key may not claim, signed by an
unknown key) are dead-lettered with their reason, and every record is counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import faust
import pytest

from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.errors import InputError
from streamtally.processors.app import Pipeline, create_app
from streamtally.processors.metrics import dead_letter_reason
from streamtally.processors.requests import Outputs
from streamtally.processors.sinks import Sinks
from streamtally.processors.source import RawMessage
from streamtally.producers import raw_records
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.tenant_keys import HEADER, ProducerKey

TOPICS = Topics.in_namespace()
SAMPLES = Path(__file__).resolve().parents[2] / "samples"
KEY_A = ProducerKey("gw-a", bytes(range(32)))
STRANGER = ProducerKey("gw-stranger", bytes(range(1, 33)))


class RecordingSink:
    def __init__(self) -> None:
        self.outputs = Outputs()

    async def begin(self, outputs: Outputs) -> None:
        return None

    def add(self, outputs: Outputs) -> None:
        self.outputs.extend(outputs)

    async def flush(self) -> None:
        return None


def _settings(tmp_path: Path, trust: object) -> Settings:
    path = tmp_path / "trust.json"
    path.write_text(json.dumps(trust))
    return Settings(
        kafka_bootstrap_servers="127.0.0.1:1",  # never contacted: test_context() needs no broker
        redis_url_setting="redis://127.0.0.1:1/0",
        state_dir_setting=tmp_path,
        tenant_keys_path=path,
    )


@pytest.fixture
def recording() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def pipeline(tmp_path: Path, recording: RecordingSink) -> Pipeline:
    trust = {"keys": {"gw-a": {"secret": bytes(range(32)).hex(), "tenants": ["acme"]}}}

    def make_sinks(app: faust.App) -> Sinks:
        return Sinks(recording)

    return create_app(_settings(tmp_path, trust), make_sinks, consume=False)


def _messages(
    request_id: str, tenant: str, key: ProducerKey | None, first_offset: int
) -> list[RawMessage]:
    _, records = raw_records(
        Source.OPENAI,
        (SAMPLES / "openai/text_usage.sse").read_bytes(),
        tenant=tenant,
        request_id=request_id,
    )
    messages = []
    for seq, value in enumerate(records):
        headers: tuple[tuple[str, bytes], ...] = (("traceparent", b"00-1"),)
        if key is not None:
            auth = key.sign(tenant=tenant, request_id=request_id, seq=seq, value=value)
            headers = (*headers, (HEADER, auth))
        messages.append(
            RawMessage(
                TOPICS.raw_sse.name,
                0,
                first_offset + seq,
                1_790_000_000.0,
                request_id.encode(),
                value,
                headers,
            )
        )
    return messages


async def test_only_records_signed_for_a_tenant_the_key_may_bill_are_billed(
    pipeline: Pipeline, recording: RecordingSink
) -> None:
    acme = _messages("req-acme", "acme", KEY_A, 0)
    claim = _messages("req-globex", "globex", KEY_A, len(acme))
    unsigned = _messages("req-unsigned", "acme", None, 2 * len(acme))
    stranger = _messages("req-stranger", "acme", STRANGER, 3 * len(acme))
    async with pipeline.agents["process-raw"].test_context() as agent:
        # interleaved in one batch, as one partition would deliver them
        batch = [m for group in zip(acme, claim, unsigned, stranger, strict=True) for m in group]
        batch.sort(key=lambda m: m.offset)
        await agent.put(tuple(batch))
    out = recording.outputs
    assert [done.ref for done in out.completed] == [RequestRef("acme", "req-acme")]
    assert {done.billing.tenant for done in out.completed} == {"acme"}
    by_request: dict[str | None, set[str]] = {}
    for letter in out.dead_letters:
        by_request.setdefault(letter.request_id, set()).add(dead_letter_reason(letter))
    assert by_request == {
        "req-globex": {"tenant_not_allowed"},
        "req-unsigned": {"unsigned"},
        "req-stranger": {"bad_signature"},
    }
    assert len(out.dead_letters) == 3 * len(acme)
    reasons = {letter.reason for letter in out.dead_letters}
    assert "st-auth key 'gw-a' may not bill tenant 'globex'" in reasons
    assert "st-auth key 'gw-stranger' is not in the worker's trust file" in reasons
    counters = pipeline.processor.counters
    assert counters.received == 4 * len(acme)
    assert counters.received == counters.applied + counters.duplicates + counters.dead_lettered
    assert counters.applied == len(acme)
    # Every record is done: the refused ones hold nothing back from the commit.
    assert pipeline.processor.open_requests == 0
    assert set(pipeline.gate.committable().values()) == {4 * len(acme)}


def test_a_bad_trust_file_stops_the_worker_with_one_line(tmp_path: Path) -> None:
    bad = {"keys": {"gw-a": {"secret": "0011", "tenants": ["acme"]}}}
    with pytest.raises(InputError, match="fewer than 32") as refused:
        create_app(_settings(tmp_path, bad), consume=False)
    assert "0011" not in str(refused.value)
