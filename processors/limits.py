"""What a worker refuses, and holds at most: each refusal is a dead letter with its reason.

Raw messages are refused at the edge, before they are decoded, when they have
no key, no value (a tombstone) or more than `MAX_RECORD_BYTES`; a record
fails permanently with one of `PERMANENT_ERRORS`; `Limits` bounds what one
worker holds (records per request, open requests per worker and per tenant, the
bytes of an event sent in parts).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamtally.errors import InputError
from streamtally.settings import Settings
from streamtally.topics import RAW_RECORD_BYTES

__all__ = [
    "CHUNK_CONTENT_BYTES",
    "MAX_RECORD_BYTES",
    "PERMANENT_ERRORS",
    "TOMBSTONE",
    "Limits",
    "refused_at_the_edge",
]

#: Raw records larger than this are dead-lettered (the raw topics take a little more, so
#: that such a record is refused here, with its reason, not by Kafka).
MAX_RECORD_BYTES = RAW_RECORD_BYTES
#: UTF-8 bytes of text, reasoning and tool arguments one chunk carries to the chunks topic
#: (a prefix beyond: `streamtally.core.content.capped_chunk`), so that the chunk of an
#: event of many MB (joined from part records) fits the topic's 8 MiB records.
CHUNK_CONTENT_BYTES = RAW_RECORD_BYTES
#: What one record can fail with that no retry cures: it is dead-lettered with the reason.
#: (InputError covers decoding and validation, Avro encoding included; ValueError covers
#: pydantic's ValidationError; the rest are what hostile JSON can make Python raise.)
PERMANENT_ERRORS: tuple[type[Exception], ...] = (
    InputError,
    ValueError,
    TypeError,
    ArithmeticError,
    RecursionError,
    UnicodeError,
)


def _default(field: str) -> int:
    value = Settings.model_fields[field].default
    if not isinstance(value, int):
        raise TypeError(f"Settings.{field} has no integer default")
    return value


@dataclass(frozen=True, slots=True)
class Limits:
    """What one worker holds at most; each limit dead-letters what passes it, with the reason.

    The defaults are the settings' own (`STREAMTALLY_MAX_RECORDS_PER_REQUEST`,
    `STREAMTALLY_MAX_OPEN_REQUESTS`, `STREAMTALLY_MAX_OPEN_PER_TENANT`,
    `STREAMTALLY_MAX_TEXT_BYTES`, `STREAMTALLY_MAX_EVENT_BYTES`: see `streamtally.settings`).
    """

    #: Records one request may have (its end marker is always taken, so it still closes).
    records_per_request: int = _default("max_records_per_request")
    #: Requests open at once in this worker: a new one past it is refused.
    open_requests: int = _default("max_open_requests")
    #: Requests open at once for one tenant: one tenant cannot take every slot.
    open_per_tenant: int = _default("max_open_per_tenant")
    #: UTF-8 bytes of text, reasoning and tool arguments one request keeps (a prefix beyond).
    text_bytes: int = _default("max_text_bytes")
    #: UTF-8 bytes of data of one event sent in parts, joined: the part past it is
    #: dead-lettered and its request closed with what it had (`CloseReason.LIMIT`).
    event_bytes: int = _default("max_event_bytes")

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            records_per_request=settings.max_records_per_request,
            open_requests=settings.max_open_requests,
            open_per_tenant=settings.max_open_per_tenant,
            text_bytes=settings.max_text_bytes,
            event_bytes=settings.max_event_bytes,
        )


TOMBSTONE = InputError("a tombstone (a record with no value) on a raw topic")


def refused_at_the_edge(key: bytes | None, value: bytes | None) -> InputError | None:
    """Why a raw message is refused before it is decoded; None when it is not.

    No key: the commit gate holds a record by its key, so a keyless record of
    an open request would be committed before the request closes (and lost on
    a restart); every producer keys a raw record by its request id.  No value:
    a tombstone; raw records are never deleted, and counting it keeps
    in = applied + duplicates + dead-lettered exact.
    """
    if value is None:
        return TOMBSTONE
    if not key:
        return InputError("record has no key: a raw record is keyed by its request id")
    if len(value) > MAX_RECORD_BYTES:
        return _oversized(value)
    return None


def _oversized(value: bytes) -> InputError:
    return InputError(f"record of {len(value)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
