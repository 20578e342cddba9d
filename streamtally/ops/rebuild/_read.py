"""The Kafka side of a rebuild: the Tokens and billing topics read to their end, decoded.

`read_inputs` returns the `Inputs` that `join` matches: each Tokens record
with its key as text, the bills that stand, and the records that did not
decode.  The bills that stand are the billing topic and the corrections topic
(``streamtally audit --correct``) settled by the one rule of every billing
consumer (`streamtally.billing.ledger.BillingLedger`): one bill per request, its
highest revision (an amended request's revision 0 is left out), as corrected.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from streamtally.billing.corrections import CorrectionLog
from streamtally.billing.ledger import BillingLedger
from streamtally.billing.reading import read_corrections
from streamtally.connection import KafkaConnection
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError
from streamtally.ops.rebuild._records import Skipped, SkipReason, TokensRecord
from streamtally.topics import decode_key
from streamtally.wire.avro import AvroDecodeError, decode_billing_event, decode_tokens
from streamtally.wire.kafka import read_topic
from streamtally.wire.records import BillingEvent


@dataclass(slots=True)
class Inputs:
    """What the two topics hold, decoded, in topic order."""

    tokens: list[TokensRecord] = field(default_factory=list)
    #: The bills that stand (`BillingLedger.settle`): one per request, but for a request
    #: with several bills at its highest revision (`join` skips it as a conflict).
    billing: list[BillingEvent] = field(default_factory=list)
    #: Billing records that did not decode, and Tokens records without a usable key.
    bad: list[Skipped] = field(default_factory=list)
    #: Billing records read (decoded), and of those the replays of an event id's bill.
    billing_records: int = 0
    replays: int = 0
    #: Billing events that differ from the first record of their event id, which stands.
    conflicts: list[tuple[BillingEvent, BillingEvent]] = field(default_factory=list)
    #: Bills left out because a later revision of their request supersedes them.
    revised: int = 0
    #: Bills a correction replaced or withdrew, and the corrections read (those that did
    #: not decode are in `bad`).
    superseded: int = 0
    corrections: int = 0


def _where(topic: str, partition: int, offset: int) -> str:
    return f"{topic}[{partition}]@{offset}"


async def read_inputs(
    servers: KafkaConnection | str,
    *,
    tokens_topic: str,
    billing_topic: str,
    corrections_topic: str | None = None,
) -> Inputs:
    """Both topics from their beginning to their current end (`streamtally.wire.kafka.read_topic`).

    A Tokens record is kept with its key as text (`TokensRecord`; which
    request it is of is for `join` to say); the billing and corrections topics
    are settled into the bills that stand (`BillingLedger`).  Raises
    `StackError` when Kafka cannot be reached or a topic is missing.
    """
    inputs = Inputs()
    corrections = CorrectionLog()
    if corrections_topic is not None:  # a deployment of before it has none: no correction
        bad: list[tuple[int, int, str]] = []
        corrections = await read_corrections(servers, corrections_topic, bad, missing_ok=True)
        inputs.corrections = corrections.records
        inputs.bad.extend(
            Skipped(None, SkipReason.UNDECODABLE, f"{_where(corrections_topic, p, o)}: {why}")
            for p, o, why in bad
        )
    async with contextlib.aclosing(read_topic(servers, tokens_topic)) as records:
        async for record in records:
            where = _where(record.topic, record.partition, record.offset)
            try:
                key = decode_key(record.key)
            except InputError as exc:
                inputs.bad.append(Skipped(None, SkipReason.UNDECODABLE, f"{where}: {exc}"))
                continue
            if record.value is None:
                inputs.tokens.append(TokensRecord(key, where=where))
                continue
            try:
                tokens = decode_tokens(record.value)
            except AvroDecodeError as exc:
                inputs.tokens.append(TokensRecord(key, error=f"{where}: {exc}", where=where))
                continue
            inputs.tokens.append(TokensRecord(key, tokens, where=where))
    ledger = BillingLedger(corrections)
    async with contextlib.aclosing(read_topic(servers, billing_topic)) as records:
        async for record in records:
            where = _where(record.topic, record.partition, record.offset)
            if record.value is None:
                inputs.bad.append(_bad_billing(record.key, f"{where}: no value (tombstone)"))
                continue
            try:
                event = decode_billing_event(record.value)
            except AvroDecodeError as exc:
                inputs.bad.append(_bad_billing(record.key, f"{where}: {exc}"))
                continue
            ledger.add(event, record.partition, record.offset)
    settled = ledger.settle()
    inputs.billing = settled.events()
    inputs.billing_records, inputs.replays = ledger.records, ledger.replays
    inputs.conflicts = list(ledger.conflicts)
    inputs.revised, inputs.superseded = settled.revised, settled.corrected
    return inputs


def _bad_billing(key: bytes | None, detail: str) -> Skipped:
    """An undecodable billing record, of the request its key names (`RequestRef.text`, or v1
    the request id alone) when it has a key."""
    try:
        text = decode_key(key)
    except InputError:
        return Skipped(None, SkipReason.UNDECODABLE, detail)
    try:
        return Skipped.of(RequestRef.parse(text), SkipReason.UNDECODABLE, detail)
    except ValueError:
        return Skipped(text, SkipReason.UNDECODABLE, detail)
