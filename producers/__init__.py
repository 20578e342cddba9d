"""The tap: raw provider SSE events and engine outputs onto their Kafka topics.

    async with RawProducer("localhost:9092") as producer:
        sent = await producer.send_transcript(Source.OPENAI, data, tenant="acme")

One Kafka message per raw event (an SSE event, or one engine output line),
keyed by the request id, with its sequence number, receive time and tenant,
then an end-of-stream marker.  The producer is idempotent (acks=all,
enable_idempotence), so its own retries never duplicate a record.

`raw_records` encodes a transcript without sending it; with ``strict=True``
and ``max_record_bytes`` it also refuses one that `streamtally fold` would
not take whole or whose event would make a record the worker refuses, as
`streamtally produce` does for every file before it sends anything.

`Tap` streams the raw events of live requests as they arrive (for gateways
and `streamtally proxy`) through a write-ahead spool on local disk that never
drops a record: a background sender produces from it to Kafka and a restart
sends what was left; see `streamtally.producers.tap` and
`streamtally.producers.spool`.  `streamtally.producers.proxy` is the reverse proxy that
taps the calls going through it.
"""

from streamtally.producers.raw import RawProducer, SentRequest, raw_records
from streamtally.producers.spool import Spool
from streamtally.producers.tap import Sender, Tap, TapRequest, TapStats

__all__ = [
    "RawProducer",
    "Sender",
    "SentRequest",
    "Spool",
    "Tap",
    "TapRequest",
    "TapStats",
    "raw_records",
]
