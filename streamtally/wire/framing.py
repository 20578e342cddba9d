"""Which framing the values a process writes get, and the registry its readers ask.

``STREAMTALLY_AVRO_FRAMING`` chooses the framing of every topic value the
project writes (docs/avro-framing.md):

- ``single-object`` (the default): ``C3 01`` + the writer schema's fingerprint,
  as the encoders of `streamtally.wire.avro` write it;
- ``confluent``: ``00`` + the schema id a registry gave the writer schema
  (``STREAMTALLY_SCHEMA_REGISTRY_URL``), the body unchanged.

Writers (the worker's Kafka sink, the tap and `RawProducer`, the audit's
corrections) encode single-object messages and hand each value to their
`Framing` just before it leaves: `frame` swaps the 10-byte header for the
5-byte one (same body).  `framing_for` makes it at the writer's start: with
``confluent`` it registers the current schema of each topic the writer writes
under ``<topic>-value`` (`register_topics`: idempotent, the subject's
compatibility set to BACKWARD), learns the ids (the process's table,
`streamtally.wire.avro.learn_id`) and refuses to start when the registry
cannot be reached or refuses.

Readers read both framings whatever the setting (the decoders dispatch on the
first byte); a Confluent value's schema id is looked up in the process's
table, and an id it does not hold is asked of the registry once
(`install_registry`: ``GET /schemas/ids/{id}``, matched to the project's known
versions by Parsing Canonical Form; an id whose schema the project does not
know is an `AvroDecodeError`, a dead letter in the worker).  Without
``STREAMTALLY_SCHEMA_REGISTRY_URL`` a Confluent value is refused as unknown.
`learn_ids` asks for a batch's unknown ids from a thread, so that the worker's
event loop does not wait on the registry while it decodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from streamtally.settings import Settings
from streamtally.topics import Topic
from streamtally.wire import avro
from streamtally.wire.avro import AvroDecodeError, AvroEncodeError, SchemaVersion
from streamtally.wire.registry import (
    SchemaNotFound,
    SchemaRegistry,
    SchemaRegistryError,
    subject_of,
)

__all__ = [
    "SINGLE_OBJECT",
    "Framing",
    "framing_for",
    "install_registry",
    "learn_ids",
    "register_topics",
    "registered_schema",
    "resolver",
]


class Framing:
    """How a writer frames its values: as encoded (single-object), or Confluent."""

    __slots__ = ("headers",)

    def __init__(self, headers: Mapping[bytes, bytes] | None = None) -> None:
        #: Writer schema fingerprint -> the Confluent header of its id; None: single-object.
        self.headers: Final = None if headers is None else dict(headers)

    @property
    def name(self) -> str:
        """``single-object`` or ``confluent`` (``STREAMTALLY_AVRO_FRAMING``)."""
        return "single-object" if self.headers is None else "confluent"

    def frame(self, message: bytes) -> bytes:
        """`message` (an encoder's single-object message) in this framing.

        `AvroEncodeError` for a message whose writer schema was not registered (no topic
        of the writer carries its record) or that is no single-object message.
        """
        headers = self.headers
        if headers is None:
            return message
        header = headers.get(message[2 : avro.HEADER_SIZE])
        if header is None or message[:2] != avro.MARKER:
            raise AvroEncodeError(
                f"no schema id for the writer schema of this value ({message[:10].hex()}): "
                "its record's topic was not registered at start"
            )
        return header + message[avro.HEADER_SIZE :]

    def __repr__(self) -> str:
        return f"Framing({self.name})"


#: Values as the encoders write them.
SINGLE_OBJECT: Final = Framing()


def registered_schema(version: SchemaVersion) -> str:
    """The text registered for a version: its self-contained schema (docs and defaults
    kept, which a registry's compatibility check needs), compact JSON."""
    return json.dumps(version.schema, separators=(",", ":"), ensure_ascii=False)


def register_topics(registry: SchemaRegistry, topics: Iterable[Topic]) -> Framing:
    """Register the current schema of each topic's values under ``<topic>-value``, set
    the subject's compatibility to BACKWARD, learn the ids; the Confluent `Framing`."""
    headers: dict[bytes, bytes] = {}
    for topic in topics:
        version = avro.current(topic.value_schema)
        subject = subject_of(topic.name)
        schema_id = registry.register(subject, registered_schema(version))
        _check_served(registry, subject, schema_id, version)
        registry.set_compatibility(subject)
        avro.learn_id(schema_id, version)
        headers[version.fingerprint] = avro.confluent_header(schema_id)
    return Framing(headers)


def _check_served(
    registry: SchemaRegistry, subject: str, schema_id: int, version: SchemaVersion
) -> None:
    """The schema the registry serves under `schema_id` must be `version` (same Parsing
    Canonical Form): a registry that deduplicates content by a form of its own (one that
    sorts a record's fields, say) could answer the id of another schema, and every value
    written with it would be misread.  `SchemaRegistryError` then: nothing is written."""
    served = registry.schema(schema_id)
    try:
        same = avro.known_version(served).fingerprint == version.fingerprint
    except AvroDecodeError:
        same = False
    if not same:
        raise SchemaRegistryError(
            f"the schema registry at {registry.shown} gave id {schema_id} to the schema of "
            f"subject {subject!r} but serves another schema under that id (its fields or "
            "types differ in order or form): values written with it would be misread; "
            "make the registry keep schemas as registered (no deduplication of content by a "
            "normalised form) or use a registry of its own for streamtally"
        )


def resolver(registry: SchemaRegistry) -> avro.Resolver:
    """Schema id -> known version, asking `registry` (`AvroDecodeError` for an id it does
    not have or whose schema is none of the project's versions)."""

    def resolve(schema_id: int) -> SchemaVersion:
        try:
            text = registry.schema(schema_id)
        except SchemaNotFound:
            raise AvroDecodeError(
                f"the schema registry at {registry.shown} has no such id"
            ) from None
        return avro.known_version(text)

    return resolve


def install_registry(registry: SchemaRegistry | None) -> None:
    """The readers of this process ask `registry` for the schema ids they do not know
    (None: they refuse them)."""
    avro.set_resolver(None if registry is None else resolver(registry))


def framing_for(
    settings: Settings, topics: Iterable[Topic], registry: SchemaRegistry | None = None
) -> Framing:
    """At a writer's start: the registry installed for reading (`install_registry`) and,
    with ``STREAMTALLY_AVRO_FRAMING=confluent``, the schemas of `topics` (those it
    writes) registered: the `Framing` of its values.

    `registry` defaults to the settings' (`SchemaRegistry.from_settings`).  Raises
    `SchemaRegistryError` when the registry is needed and cannot be reached or refuses.
    """
    if registry is None:
        registry = SchemaRegistry.from_settings(settings)
    install_registry(registry)
    if settings.avro_framing != "confluent":
        return SINGLE_OBJECT
    if registry is None:  # the settings refuse it; a Settings built in code may not
        raise AvroEncodeError(
            "STREAMTALLY_AVRO_FRAMING=confluent needs STREAMTALLY_SCHEMA_REGISTRY_URL"
        )
    return register_topics(registry, topics)


def _resolve(ids: Sequence[int]) -> None:
    for schema_id in ids:
        # A refused id is remembered (`avro.writer_by_id`): each of its records is then
        # refused as it is decoded.  A registry that cannot be reached raises.
        with contextlib.suppress(AvroDecodeError):
            avro.writer_by_id(schema_id)


async def learn_ids(values: Iterable[bytes | None]) -> None:
    """Ask the registry, from a thread, for the ids of the Confluent-framed `values` that
    the process does not know yet (none: nothing is asked)."""
    ids = avro.unknown_ids(list(values))
    if ids:
        await asyncio.to_thread(_resolve, ids)
