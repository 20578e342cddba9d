"""The Confluent wire format, beside single-object encoding: the codec with explicit ids.

A Confluent-framed value (what Schema Registry serializers, ClickHouse's
`AvroConfluent`, Kafka Connect's `AvroConverter` read and write)::

    00 | schema id (4 bytes, big-endian) | Avro binary body

The id is the one a schema registry gave the writer schema; this module does
not talk to a registry.  `decode_framed` and `FramingDecoders` take a mapping
`SchemaIds`, schema id -> `SchemaVersion` (`known_version` turns the schema a
registry returns into this codec's version of it, or refuses one it does not
know, as `writer_of` refuses an unknown fingerprint), and fall back on the
process's table of ids (`_ids`: what the registration at start learnt and the
installed registry resolves).  The plain `decode_*` functions read both
framings through that table alone (`_codec.read`).

The body is the same in both framings (the same writer schema writes the same
bytes), so a Confluent value is a single-object message with its 10-byte
header swapped for the 5-byte one (`to_confluent`).  Readers read both
framings: the first byte tells them apart (`C3` single-object, `00`
Confluent).  `decode_framed` decodes a datum, `FramingDecoders` the typed
values.  Anything else raises
`AvroDecodeError` (an `InputError`: the processors dead-letter the record).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

from streamtally.core.models import Chunk, Tokens
from streamtally.errors import AvroDecodeError
from streamtally.wire.avro._codec import encode, read, read_body
from streamtally.wire.avro._decoders import (
    billing_correction_of,
    billing_event_of,
    chunk_of,
    dead_letter_of,
    model_of,
    model_record,
    raw_engine_output_of,
    raw_sse_event_of,
    tokens_of,
)
from streamtally.wire.avro._framing import HEADER_SIZE, MARKER
from streamtally.wire.avro._ids import (
    CONFLUENT_HEADER_SIZE,
    CONFLUENT_MAGIC,
    MAX_SCHEMA_ID,
    confluent_header,
    schema_id_in,
    writer_by_id,
)
from streamtally.wire.avro._schemas import SchemaVersion, writer_of
from streamtally.wire.records import (
    BillingCorrection,
    BillingEvent,
    DeadLetter,
    RawEngineOutput,
    RawSseEvent,
)

if TYPE_CHECKING:
    from streamtally.wire.avro._encoders import Model

__all__ = [
    "CONFLUENT_HEADER_SIZE",
    "CONFLUENT_MAGIC",
    "MAX_SCHEMA_ID",
    "FramingDecoders",
    "SchemaIds",
    "confluent_header",
    "decode_framed",
    "encode_confluent",
    "schema_id_in",
    "to_confluent",
]

#: Schema id -> the writer schema the registry holds under it, as this codec's version.
SchemaIds = Mapping[int, SchemaVersion]

M = TypeVar("M", bound="Model")


def to_confluent(message: bytes, schema_id: int) -> bytes:
    """A single-object message (any encoder's) in Confluent framing, with `schema_id`.

    `schema_id` must be the registry's id of the message's writer schema
    (`writer_of(message)`, the current schema of its record for the typed encoders).
    """
    writer_of(message)  # a single-object message of a known schema, or AvroDecodeError
    return confluent_header(schema_id) + message[HEADER_SIZE:]


def encode_confluent(
    name: str, record: Mapping[str, Any], schema_id: int, *, version: int | None = None
) -> bytes:
    """`encode` (a datum of record `name`) in Confluent framing, with `schema_id`."""
    header = confluent_header(schema_id)  # checked before the record is written
    return header + encode(name, record, version=version)[HEADER_SIZE:]


def _framed_writer(name: str, data: bytes, ids: SchemaIds) -> SchemaVersion:
    schema_id = schema_id_in(data)
    writer = ids.get(schema_id)
    if writer is not None:
        return writer
    try:  # the process's table (`_ids`), and its registry
        return writer_by_id(schema_id)
    except AvroDecodeError as exc:
        raise AvroDecodeError(f"{name}: {exc}") from None


def decode_framed(
    name: str, data: bytes, ids: SchemaIds, *, record_names: bool = False
) -> dict[str, Any]:
    """The datum of a value of record `name` in either framing (fastavro's form).

    Single-object messages are read as `decode` reads them; a Confluent-framed value
    with the writer schema `ids` gives its id.  Raises `AvroDecodeError` for a value
    in neither framing, an unknown fingerprint or schema id, a value of another
    record, or a truncated or malformed body.
    """
    if data[:1] != CONFLUENT_MAGIC:
        if data[:2] != MARKER and len(data) >= 2:
            raise AvroDecodeError(
                f"{name}: bad marker {bytes(data[:2]).hex()}: neither Avro single-object "
                f"encoding (c301) nor the Confluent wire format (00)"
            )
        return read(name, data, record_names=record_names)
    writer = _framed_writer(name, data, ids)
    return read_body(name, writer, data, CONFLUENT_HEADER_SIZE, record_names)


class FramingDecoders:
    """The typed decoders, for values in either framing (Confluent ids looked up in `ids`).

    Each method builds what the `decode_*` function of the same record builds
    (`decode_billing_event`, ...), refusing the same values, and refuses a
    Confluent-framed value whose schema id `ids` does not hold.
    """

    __slots__ = ("ids",)

    def __init__(self, ids: SchemaIds) -> None:
        self.ids: Final = dict(ids)

    def read(self, name: str, data: bytes, *, record_names: bool = False) -> dict[str, Any]:
        return decode_framed(name, data, self.ids, record_names=record_names)

    def model(self, cls: type[M], data: bytes) -> M:
        """A model (`Usage`, `ToolCall`, ..., `Chunk`, `Tokens`), as `decode_model`."""
        return model_of(cls, self.read(model_record(cls), data))

    def chunk(self, data: bytes) -> Chunk:
        return chunk_of(self.read("Chunk", data))

    def tokens(self, data: bytes) -> Tokens:
        return tokens_of(self.read("Tokens", data))

    def raw_sse_event(self, data: bytes) -> RawSseEvent:
        return raw_sse_event_of(self.read("RawSseEvent", data))

    def raw_engine_output(self, data: bytes) -> RawEngineOutput:
        return raw_engine_output_of(self.read("RawEngineOutput", data, record_names=True))

    def billing_event(self, data: bytes) -> BillingEvent:
        return billing_event_of(self.read("BillingEvent", data))

    def billing_correction(self, data: bytes) -> BillingCorrection:
        return billing_correction_of(self.read("BillingCorrection", data))

    def dead_letter(self, data: bytes) -> DeadLetter:
        return dead_letter_of(self.read("DeadLetter", data))
