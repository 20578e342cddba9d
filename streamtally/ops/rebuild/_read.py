"""The Kafka side of a rebuild: the Tokens and billing topics read to their end, decoded.

`read_inputs` returns the `Inputs` that `join` matches: each Tokens record
with its key as text, each billing event, and the records that did not
decode.  The billing events are the bills as corrected: with the corrections
topic (``streamtally audit --correct``), read first, a billing event a correction
supersedes is left out and the bill the correction stands is taken instead
(`streamtally.wire.corrections.CorrectionLog`, as any billing consumer applies them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from streamtally.connection import KafkaConnection
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError
from streamtally.ops.corrections import read_corrections
from streamtally.ops.rebuild._records import Skipped, SkipReason, TokensRecord
from streamtally.topics import decode_key
from streamtally.wire.avro import AvroDecodeError, decode_billing_event, decode_tokens
from streamtally.wire.corrections import CorrectionLog
from streamtally.wire.kafka import read_topic
from streamtally.wire.records import BillingEvent


@dataclass(slots=True)
class Inputs:
    """What the two topics hold, decoded, in topic order."""

    tokens: list[TokensRecord] = field(default_factory=list)
    billing: list[BillingEvent] = field(default_factory=list)
    #: Billing records that did not decode, and Tokens records without a usable key.
    bad: list[Skipped] = field(default_factory=list)
    #: Billing events left out because a correction supersedes them, and the corrections
    #: read (those that did not decode are in `bad`).
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
    request it is of is for `join` to say).  Raises `StackError` when Kafka
    cannot be reached or a topic is missing.
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
            if corrections.superseded(event, record.partition, record.offset):
                inputs.superseded += 1
            else:
                inputs.billing.append(event)
    inputs.billing.extend(corrections.standing())
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
