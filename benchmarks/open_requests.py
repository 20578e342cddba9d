"""Worker memory per open request: what `RequestProcessor` keeps for a request not yet ended.

Each sample transcript of the repo is cut after its first `--events` events (no
END marker: the request stays open) and fed, under `--requests` distinct
request ids, through the processor exactly as the worker feeds it (Avro raw
records, `handle_sse` / `handle_engine`).  Python's allocations are traced
(`tracemalloc`) before and after; the figure is the growth divided by the
open requests.  Kafka's and Redis's client buffers are not in it: they scale
with the batch, not with the open requests.

    python -m benchmarks.open_requests [--requests N] [--events K] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime

from streamtally.billing.pricing import PriceTable
from streamtally.core.models import Source
from streamtally.processors.outputs import Position
from streamtally.processors.requests import RequestProcessor
from streamtally.producers.raw import raw_records
from streamtally.settings import project_root
from streamtally.wire import avro

__all__ = ["OpenRequests", "main", "measure"]

_TOPIC = {True: "bench.raw.sse", False: "bench.raw.engine"}


@dataclass(frozen=True, slots=True)
class OpenRequests:
    requests: int
    events_per_request: float
    bytes_per_open_request: int
    raw_bytes_per_request: int


def measure(requests: int, events: int) -> OpenRequests:
    """Open `requests` requests of `events` events each and trace what stays allocated."""
    root = project_root()
    if root is None:
        raise SystemExit("run from a clone: the benchmark replays samples/")
    manifest = [json.loads(line) for line in (root / "samples" / "manifest.jsonl").open()]
    when = datetime(2026, 11, 24, tzinfo=UTC)
    shapes = []
    for row in manifest:
        source = Source(row["source"])
        data = (root / "samples" / row["file"]).read_bytes()
        _, records = raw_records(
            source, data, tenant="bench", request_id="open", model=row.get("model"),
            clock=lambda: when,
        )  # fmt: skip
        shapes.append((source, records[:-1][:events]))  # no END: the request stays open
    processor = RequestProcessor(PriceTable.load_or_default(None), timeout=86_400)
    encoded = []
    for i in range(requests):
        source, records = shapes[i % len(shapes)]
        rid = f"open-{i}"
        if source.is_sse:
            fresh = [
                avro.encode_raw_sse_event(replace(avro.decode_raw_sse_event(v), request_id=rid))
                for v in records
            ]
        else:
            fresh = [
                avro.encode_raw_engine_output(
                    replace(avro.decode_raw_engine_output(v), request_id=rid)
                )
                for v in records
            ]
        encoded.append((source, rid, fresh))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    offsets: dict[bool, int] = {True: 0, False: 0}
    fed_events = raw_bytes = 0
    for source, rid, records in encoded:
        sse = source.is_sse
        handle = processor.handle_sse if sse else processor.handle_engine
        key = rid.encode()
        for value in records:
            offset = offsets[sse]
            offsets[sse] += 1
            handle(key, value, Position(_TOPIC[sse], 0, offset, when.timestamp()))
            fed_events += 1
            raw_bytes += len(value)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    if processor.open_requests != requests:  # every request must still be open to count
        raise SystemExit(f"{processor.open_requests} of {requests} requests are open")
    return OpenRequests(
        requests=requests,
        events_per_request=round(fed_events / requests, 1),
        bytes_per_open_request=(after - before) // requests,
        raw_bytes_per_request=raw_bytes // requests,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000, help="open requests (20000)")
    parser.add_argument("--events", type=int, default=20, help="events fed to each (20)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure(args.requests, args.events)
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(
            f"{result.requests:,} open requests of {result.events_per_request:g} events "
            f"({result.raw_bytes_per_request:,} raw record bytes each): "
            f"{result.bytes_per_open_request:,} bytes of worker memory per open request"
        )


if __name__ == "__main__":
    main()
