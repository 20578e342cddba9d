"""Every exception streamtally raises on purpose, in one tree.

    StreamtallyError
    ├── InputError                 bad input: the caller, producer or operator must fix it
    │   ├── InvalidEvent           one raw event is not valid for its source
    │   ├── NotAStream             a whole input holds no event of the named source
    │   ├── PriceTableError        a price table file that cannot be read or is not valid
    │   ├── AvroError              the Avro codec refused a value
    │   │   ├── AvroDecodeError    bytes that are not a message of the expected record
    │   │   └── AvroEncodeError    a record that does not fit its schema
    │   └── UntrustedRecord        the trust file does not let a raw record bill its tenant
    │       ├── UnsignedRecord     no ``st-auth`` header
    │       ├── BadSignature       a malformed header, an unknown key, a MAC that differs
    │       └── TenantNotAllowed   a valid signature by a key that may not bill that tenant
    ├── AvroSchemaError            the schema files themselves are wrong
    ├── SchemaRegistryError        the schema registry unreachable, or refusing a request
    │   └── SchemaNotFound         no schema of that id (or under that subject)
    ├── LayoutError                Redis holds another layout version: migrate it
    ├── MigrateError               ``streamtally migrate`` refuses to go on
    ├── ShardMigrateError          the move to layout 3 stopped
    ├── SpoolError                 the tap's spool cannot do what was asked
    │   ├── SpoolLocked            another process has the spool directory open
    │   ├── SpoolCorrupt           a record that cannot be read where one must be
    │   └── SpoolClosed            the spool was closed
    ├── NativeBuildError           the compiled modules could not be built
    └── StackError                 the local Kafka/Redis stack cannot be managed or reached
        └── WorkerError            a worker subprocess exited, or was not ready in time

What becomes of them: every `StreamtallyError` that reaches the CLI is one line on stderr
and exit status 2, never a traceback (`streamtally.cli.main`); an exception of any other
kind is a bug and shows its traceback.  Everything raised for bad input is an
`InputError`: the processors send the event to the dead-letter topic with ``str(exc)``
as the reason.  The modules that raise them import them from here and hand them on by
name (``streamtally.producers.spool.SpoolLocked`` is this `SpoolLocked`).

Not in the tree, on purpose, because they never leave their module's caller:
`streamtally.api.query.BadQuery` and ``Forbidden`` (answered 400 and 403), the proxy tee's
``UndecodableEncoding`` and ``DecodeError`` (a response left untapped, counted),
`streamtally.processors.source.MembershipLost` (a rebalance), and `CommitOrderError` (a
bug: committing out of order), defined here beside the tree for
`streamtally.processors.commits`, which is compiled and whose name it keeps.
"""

from __future__ import annotations

__all__ = [
    "AvroDecodeError",
    "AvroEncodeError",
    "AvroError",
    "AvroSchemaError",
    "BadSignature",
    "InputError",
    "InvalidEvent",
    "LayoutError",
    "MigrateError",
    "NativeBuildError",
    "NotAStream",
    "PriceTableError",
    "SchemaNotFound",
    "SchemaRegistryError",
    "ShardMigrateError",
    "SpoolClosed",
    "SpoolCorrupt",
    "SpoolError",
    "SpoolLocked",
    "StackError",
    "StreamtallyError",
    "TenantNotAllowed",
    "UnsignedRecord",
    "UntrustedRecord",
    "WorkerError",
]


class StreamtallyError(Exception):
    """Base of every streamtally exception."""


class InputError(StreamtallyError):
    """Input that cannot be normalised."""


class InvalidEvent(InputError):
    """A raw event that is not valid for its source."""


class NotAStream(InputError):
    """An input that holds no event of the named source at all."""


class PriceTableError(InputError):
    """A price table file that cannot be read or is not valid; the message says where."""


class AvroError(InputError):
    """Base of the Avro codec errors."""


class AvroDecodeError(AvroError):
    """Bytes that are not a decodable single-object message of the expected record."""


class AvroEncodeError(AvroError):
    """A record that does not fit its schema."""


class UntrustedRecord(InputError):
    """A raw record the worker's trust file does not let bill its tenant (dead-lettered)."""


class UnsignedRecord(UntrustedRecord):
    """No ``st-auth`` header."""


class BadSignature(UntrustedRecord):
    """A malformed header, a key the trust file does not hold, or a MAC that does not match."""


class TenantNotAllowed(UntrustedRecord):
    """A valid signature by a key that may not bill the record's tenant."""


class AvroSchemaError(StreamtallyError):
    """The schema files themselves are wrong (raised at import or by the tooling)."""


class SchemaRegistryError(StreamtallyError):
    """The schema registry could not be reached, or refused a request."""


class SchemaNotFound(SchemaRegistryError):
    """The registry has no schema of that id (or none such under that subject)."""


class LayoutError(StreamtallyError):
    """Redis holds data of another layout version: migrate it (the message says how)."""


class MigrateError(StreamtallyError):
    """The migration refuses to go on: another layout, or Redis changed under it."""


class ShardMigrateError(StreamtallyError):
    """The move to layout 3 stopped; the message says why and what to do."""


class SpoolError(StreamtallyError):
    """The spool cannot do what was asked (see the subclasses)."""


class SpoolLocked(SpoolError):
    """Another process has the spool directory open."""


class SpoolCorrupt(SpoolError):
    """A record that cannot be read where one must be: the spool refuses to open."""


class SpoolClosed(SpoolError):
    """The spool was closed."""


class NativeBuildError(StreamtallyError):
    """The compiled modules could not be built; the package still runs as plain Python."""


class StackError(StreamtallyError):
    """The local stack (Kafka, Redis) could not be started, stopped or reached."""


class WorkerError(StackError):
    """The worker exited, or did not get ready in time; the message carries its log."""


class CommitOrderError(RuntimeError):
    """A record was held out of its partition's order: the gate would commit past records
    it never held.  Raised, never worked around: a stalled partition loses no money, a
    commit past an open request does (its start is never read again, it is never billed).
    Not a `StreamtallyError`: a bug, not bad input (`streamtally.processors.commits`).
    """
