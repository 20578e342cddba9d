"""Avro on the wire: the schemas of every topic value, and their single-object framing.

Every schema in `schemas/*.avsc` (one top-level named type per file, namespace
`io.streamtally.v1`; a type named by a field with a default is defined inline
there, so that Avro Java loads the folder as a set: docs/avro-framing.md) is
read once at import, from the package data.  A record's file may name types of
other files; each record is then expanded into one self-contained schema (a
named type is defined where it first occurs and referred to by full name
after), which is what its Parsing Canonical Form and fingerprint are taken of
and what `schemas/history/<Name>/<n>.avsc` stores for each released version.

A message is Avro *single-object encoding*::

    C3 01 | CRC-64-AVRO fingerprint of the writer schema (8 bytes, little-endian) | Avro binary body

The encoders write it.  The Confluent wire format (``00``, a 4-byte schema
id, the same body) is the other framing: `streamtally.wire.framing` turns the
encoders' messages into it when ``STREAMTALLY_AVRO_FRAMING=confluent``.

Every decoder reads both framings, told apart by the first byte: `decode`
looks a single-object fingerprint up among the known versions of the record
(current and `schemas/history/`), a Confluent schema id up in the process's
table of ids (`_ids`: learnt at registration, or asked of the registry once
per id and matched to a known version by Parsing Canonical Form), and
resolves that writer schema to the current one.  Anything else raises
`AvroDecodeError` (an `InputError`: the processors dead-letter the record
with its message).

This package is the only place that imports fastavro.  Its modules, each
re-exported here (import from `streamtally.wire.avro`, not from them):

    _errors     the exceptions
    _framing    the 10-byte header: MARKER, HEADER_SIZE
    _names      named types in schema JSON, expansion into self-contained schemas
    _schemas    the schema registry: loading, fingerprints, current(), history(), writer_of()
    _codec      generic encode()/decode() of an Avro datum (a dict)
    _encoders   models and records to messages (encode_chunk, ...)
    _decoders   messages to models and records (decode_chunk, ...)
    _ids        the Confluent header (00 + schema id) and the process's table of ids
    _confluent  the Confluent wire format with explicit ids: to_confluent, decode_framed, ...
    _compat     compatibility_errors() and release() of schema versions
    __main__    `python -m streamtally.wire.avro fingerprints|release`
"""

from __future__ import annotations

from streamtally.errors import (
    AvroDecodeError,
    AvroEncodeError,
    AvroError,
    AvroSchemaError,
)
from streamtally.wire.avro._codec import decode, encode
from streamtally.wire.avro._compat import compatibility_errors
from streamtally.wire.avro._confluent import (
    FramingDecoders,
    SchemaIds,
    decode_framed,
    encode_confluent,
    to_confluent,
)
from streamtally.wire.avro._decoders import (
    decode_billing_correction,
    decode_billing_event,
    decode_chunk,
    decode_dead_letter,
    decode_model,
    decode_raw_engine_output,
    decode_raw_sse_event,
    decode_tokens,
)
from streamtally.wire.avro._encoders import (
    encode_billing_correction,
    encode_billing_event,
    encode_chunk,
    encode_dead_letter,
    encode_model,
    encode_raw_engine_output,
    encode_raw_sse_event,
    encode_tokens,
    raw_sse_writer,
)
from streamtally.wire.avro._framing import HEADER_SIZE, MARKER
from streamtally.wire.avro._ids import (
    CONFLUENT_HEADER_SIZE,
    CONFLUENT_MAGIC,
    MAX_SCHEMA_ID,
    Resolver,
    confluent_header,
    forget_ids,
    known_ids,
    learn_id,
    schema_id_in,
    set_resolver,
    unknown_ids,
    writer_by_id,
)
from streamtally.wire.avro._raw_writer import RawSseWriter, micros_of
from streamtally.wire.avro._schemas import (
    NAMESPACE,
    RECORD_NAMES,
    SCHEMA_DIR,
    SchemaVersion,
    canonical_form,
    current,
    fingerprint,
    history,
    known_version,
    schema_fingerprint,
    writer_of,
)

__all__ = [
    "CONFLUENT_HEADER_SIZE",
    "CONFLUENT_MAGIC",
    "HEADER_SIZE",
    "MARKER",
    "MAX_SCHEMA_ID",
    "NAMESPACE",
    "RECORD_NAMES",
    "SCHEMA_DIR",
    "AvroDecodeError",
    "AvroEncodeError",
    "AvroError",
    "AvroSchemaError",
    "FramingDecoders",
    "RawSseWriter",
    "Resolver",
    "SchemaIds",
    "SchemaVersion",
    "canonical_form",
    "compatibility_errors",
    "confluent_header",
    "current",
    "decode",
    "decode_billing_correction",
    "decode_billing_event",
    "decode_chunk",
    "decode_dead_letter",
    "decode_framed",
    "decode_model",
    "decode_raw_engine_output",
    "decode_raw_sse_event",
    "decode_tokens",
    "encode",
    "encode_billing_correction",
    "encode_billing_event",
    "encode_chunk",
    "encode_confluent",
    "encode_dead_letter",
    "encode_model",
    "encode_raw_engine_output",
    "encode_raw_sse_event",
    "encode_tokens",
    "fingerprint",
    "forget_ids",
    "history",
    "known_ids",
    "known_version",
    "learn_id",
    "micros_of",
    "raw_sse_writer",
    "schema_fingerprint",
    "schema_id_in",
    "set_resolver",
    "to_confluent",
    "unknown_ids",
    "writer_by_id",
    "writer_of",
]
