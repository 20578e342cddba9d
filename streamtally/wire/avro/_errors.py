"""The exceptions of the Avro codec."""

from __future__ import annotations

from streamtally.errors import InputError, StreamtallyError

__all__ = ["AvroDecodeError", "AvroEncodeError", "AvroError", "AvroSchemaError"]


class AvroError(InputError):
    """Base of the Avro codec errors."""


class AvroDecodeError(AvroError):
    """Bytes that are not a decodable single-object message of the expected record."""


class AvroEncodeError(AvroError):
    """A record that does not fit its schema."""


class AvroSchemaError(StreamtallyError):
    """The schema files themselves are wrong (raised at import or by the tooling)."""
