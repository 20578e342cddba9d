"""`streamtally billing export --ledger`: the bills as they stand, one per request (the highest
revision, the corrections applied), read from stand-in topics (no Kafka)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, Mapping
from decimal import Decimal
from typing import Any

import pytest

from streamtally.cli import main
from streamtally.core.identity import RequestRef
from streamtally.errors import StackError
from streamtally.topics import Topics, output_key
from streamtally.wire import kafka
from streamtally.wire.avro import encode_billing_correction, encode_billing_event
from streamtally.wire.kafka import TopicRecord
from streamtally.wire.records import BillingCorrection, BillingEvent
from tests.unit.billing.test_ledger import correction, revision

NAMESPACE = "ledgertest"
TOPICS = Topics.in_namespace(NAMESPACE)


class FakeTopics:
    """Topic name -> its records as (partition, key, value); offsets count per partition."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[int, bytes, bytes | None]]] = {}

    def append(self, topic: str, key: bytes, value: bytes | None, partition: int = 0) -> None:
        self.records.setdefault(topic, []).append((partition, key, value))

    def bill(self, *events: BillingEvent, partition: int = 0) -> None:
        for e in events:
            key = output_key(RequestRef(e.tenant, e.request_id))
            self.append(TOPICS.billing.name, key, encode_billing_event(e), partition)

    def correct(self, *corrections: BillingCorrection) -> None:
        for c in corrections:
            self.append(TOPICS.corrections.name, b"k", encode_billing_correction(c))

    async def read_topic(
        self,
        servers: object,
        topic: str,
        *,
        start: Mapping[int, int] | None = None,
        end: Mapping[int, int] | None = None,
        missing_hint: str = "",
        missing_ok: bool = False,
        **_: Any,
    ) -> AsyncGenerator[TopicRecord, None]:
        if topic not in self.records:
            if missing_ok:
                return
            raise StackError(f"topic {topic} does not exist: {missing_hint}")
        offsets: dict[int, int] = {}
        for partition, key, value in self.records[topic]:
            offset = offsets.get(partition, 0)
            offsets[partition] = offset + 1
            yield TopicRecord(topic, partition, offset, key, value, 1000)


@pytest.fixture
def topics(monkeypatch: pytest.MonkeyPatch) -> FakeTopics:
    fake = FakeTopics()
    monkeypatch.setattr(kafka, "read_topic", fake.read_topic)
    monkeypatch.setenv("STREAMTALLY_NAMESPACE", NAMESPACE)
    return fake


def export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[Any], str]:
    """`billing export ARGS`: its exit status, its --json lines (or table lines), stderr."""
    code = main(["billing", "export", *args])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    return code, [json.loads(line) for line in lines] if "--json" in args else lines, err


def test_the_ledger_prints_one_bill_per_request_every_record_by_default(
    topics: FakeTopics, capsys: pytest.CaptureFixture[str]
) -> None:
    other = revision(0, request_id="r2", input_tokens=5, output_tokens=6)
    topics.bill(revision(0), other, revision(0), revision(1))  # a replay of revision 0 too
    code, records, _ = export(capsys, "--json")
    assert code == 0
    assert [(r["request_id"], r["revision"]) for r in records] == [("r1", 0), ("r2", 0), ("r1", 1)]
    code, bills, err = export(capsys, "--json", "--ledger")
    assert code == 0, err
    assert [(b["request_id"], b["revision"]) for b in bills] == [("r2", 0), ("r1", 1)]
    [amended] = [b for b in bills if b["request_id"] == "r1"]
    assert amended["supersedes"] == revision(0).event_id
    assert amended["output_tokens"] == 100  # the whole usage, not a difference
    assert {b["correction_id"] for b in bills} == {None}
    assert "2 bills stand for 2 requests, from 4 billing records (1 replays, 1 superseded" in err
    # what a consumer sums: the standing bills' usage and cost
    assert sum(b["output_tokens"] for b in bills) == 106
    assert sum(Decimal(b["cost"]) for b in bills) == revision(1).cost + other.cost


def test_the_ledger_table_names_each_bills_revision(
    topics: FakeTopics, capsys: pytest.CaptureFixture[str]
) -> None:
    topics.bill(revision(0), revision(1))
    code, lines, _ = export(capsys, "--ledger")
    assert code == 0
    assert lines[0].split() == [
        "EVENT_TIME",
        "TENANT",
        "MODEL",
        "REQUEST_ID",
        "REV",
        "INPUT",
        "OUTPUT",
        "COST",
    ]
    assert lines[1].split()[3:7] == ["r1", "1", "1520", "100"]
    assert lines[-1] == "1 standing bill, one per request"
    code, lines, _ = export(capsys)
    assert [line.split()[4] for line in lines[1:-1]] == ["0", "1"]
    assert lines[-1] == "2 billing events"


def test_the_ledger_applies_the_corrections_topic(
    topics: FakeTopics, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = revision(0, request_id="r2", output_tokens=999)
    right = revision(0, request_id="r2")
    audited_r0 = dataclasses.replace(revision(0), input_tokens=7)
    topics.bill(revision(0), wrong)  # offsets 0, 1: what the audit saw
    topics.correct(
        correction(wrong, right, before=2, correction_id="a" * 32),
        correction(revision(0), audited_r0, before=2, correction_id="b" * 32),
    )
    topics.bill(revision(1))  # the worker amends r1 after the audit (offset 2)
    code, bills, err = export(capsys, "--json", "--ledger")
    assert code == 0, err
    by_request = {b["request_id"]: b for b in bills}
    assert (by_request["r2"]["output_tokens"], by_request["r2"]["correction_id"]) == (0, "a" * 32)
    assert (by_request["r1"]["revision"], by_request["r1"]["correction_id"]) == (1, None)
    assert "and 2 corrections (2 bills corrected)" in err
    # the default export prints the billing topic as written
    code, records, _ = export(capsys, "--json")
    assert [r["output_tokens"] for r in records] == [0, 999, 100]


def test_a_conflict_is_reported_and_the_first_stands(
    topics: FakeTopics, capsys: pytest.CaptureFixture[str]
) -> None:
    first = revision(0)
    topics.bill(first, dataclasses.replace(first, output_tokens=3))
    code, bills, err = export(capsys, "--json", "--ledger")
    assert code == 1
    assert [b["output_tokens"] for b in bills] == [0]
    assert f"CONFLICT: two different billing events {first.event_id}" in err
    assert "the first stands" in err
    code, records, err = export(capsys, "--json")
    assert (code, len(records)) == (1, 2)
    assert "both printed" in err


def test_a_request_with_two_bills_at_its_highest_revision_is_reported(
    topics: FakeTopics, capsys: pytest.CaptureFixture[str]
) -> None:
    topics.bill(revision(0), revision(0, event_id="0" * 32))
    code, bills, err = export(capsys, "--json", "--ledger")
    assert code == 1
    assert len(bills) == 2
    assert "request r1 (tenant acme) has 2 bills at its highest revision" in err


def test_an_undecodable_correction_is_reported(
    topics: FakeTopics, capsys: pytest.CaptureFixture[str]
) -> None:
    topics.bill(revision(0))
    topics.append(TOPICS.corrections.name, b"k", b"not avro")
    code, bills, err = export(capsys, "--json", "--ledger")
    assert code == 1
    assert len(bills) == 1
    assert f"{TOPICS.corrections.name}[0]@0 is not a correction" in err


def test_without_a_billing_topic_the_ledger_fails_with_the_hint(
    topics: FakeTopics, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = export(capsys, "--ledger")
    assert code == 2
    assert "nothing was billed there yet" in err


def test_ledger_and_keep_replays_are_refused_together(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["billing", "export", "--ledger", "--keep-replays"])
    assert exit_.value.code == 2
    assert "not allowed with" in capsys.readouterr().err
