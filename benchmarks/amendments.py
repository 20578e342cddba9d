"""What keeping closed requests amendable costs: bytes per timed-out request, CPU per amendment.

For each of our sample transcripts (``samples/``, every source), `--copies`
requests of it go through a pure `RequestProcessor` (no broker, no Redis):
their first third, a timeout (revision 0, kept amendable), then the rest
(revision 1).  Reported, per transcript and in total:

* bytes kept per timed-out request: the encoded `Amendable` the store keeps
  under ``st:{T}:amend:{ref}`` (zlib) against the raw values it holds;
* CPU per amendment: the time to open the request again (its kept records
  decoded and applied again) and close it with the rest, against the time the
  same records take as one stream that never went quiet (what an amendment
  costs over a request without one);
* the records an open request keeps referenced for that (its raw values).

    python -m benchmarks.amendments [--copies N] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamtally.billing.pricing import PriceTable
from streamtally.core.models import Source
from streamtally.processors.requests import Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key

__all__ = ["AmendFigures", "main", "measure"]

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
TOPICS = Topics.in_namespace()


@dataclass(frozen=True, slots=True)
class AmendFigures:
    transcript: str
    records: int
    raw_bytes: int
    kept_bytes: int
    plain_us: float
    amended_us: float


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _feed(processor: RequestProcessor, source: Source, rid: str, value: bytes, offset: int) -> Any:
    handle = processor.handle_sse if source.is_sse else processor.handle_engine
    topic = TOPICS.raw_sse.name if source.is_sse else TOPICS.raw_engine.name
    return handle(encode_key(rid), value, Position(topic, 0, offset, None))


def measure(path: Path, copies: int) -> AmendFigures:
    """Figures of `copies` requests of the transcript at `path`."""
    row = next(
        json.loads(line)
        for line in (SAMPLES / "manifest.jsonl").read_text().splitlines()
        if json.loads(line)["file"] == str(path.relative_to(SAMPLES))
    )
    source = Source(row["source"])
    data = path.read_bytes()
    requests = [
        raw_records(source, data, tenant="bench", request_id=f"r{i}", model=row.get("model"))[1]
        for i in range(copies)
    ]
    first = max(1, len(requests[0]) // 3)
    prices = PriceTable.default()

    plain = RequestProcessor(prices, timeout=60.0)
    started = time.process_time()
    offset = 0
    for i, records in enumerate(requests):
        for value in records:
            _feed(plain, source, f"r{i}", value, offset)
            offset += 1
    plain_s = time.process_time() - started

    clock = _Clock()
    amended = RequestProcessor(prices, timeout=60.0, clock=clock)
    offset = 0
    for i, records in enumerate(requests):
        for value in records[:first]:
            _feed(amended, source, f"r{i}", value, offset)
            offset += 1
    clock.now += 120.0
    closed = amended.expire().completed
    kept = [done.amendable for done in closed if done.amendable is not None]
    assert len(kept) == copies, "every request closed at its timeout, kept amendable"
    started = time.process_time()
    for i, records in enumerate(requests):
        for value in records[first:]:  # the first third was applied above: not timed here
            _feed(amended, source, f"r{i}", value, offset)
            offset += 1
    rest_s = time.process_time() - started
    # The first third's own cost, measured as the plain run's share of it.
    share = first / len(requests[0])
    raw = sum(len(v) for v in requests[0][:first])
    return AmendFigures(
        transcript=str(path.relative_to(SAMPLES)),
        records=len(requests[0]),
        raw_bytes=raw,
        kept_bytes=sum(len(k) for k in kept) // copies,
        plain_us=plain_s / copies * 1e6,
        amended_us=(rest_s / copies + plain_s / copies * share) * 1e6,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.amendments", description=__doc__)
    parser.add_argument("--copies", type=int, default=200, help="requests per transcript")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    files = sorted(
        p for p in SAMPLES.rglob("*") if p.suffix in (".sse", ".jsonl") and p.parent != SAMPLES
    )
    figures = [measure(path, args.copies) for path in files]
    if args.json:
        print(json.dumps([asdict(f) for f in figures], indent=1))
        return 0
    header = ("transcript", "records", "raw B", "kept B", "plain µs", "amended µs")
    print("{:48} {:>7} {:>8} {:>7} {:>9} {:>10}".format(*header))
    for f in figures:
        print(
            f"{f.transcript:48} {f.records:7} {f.raw_bytes:8} {f.kept_bytes:7} "
            f"{f.plain_us:9.0f} {f.amended_us:10.0f}"
        )
    raw = sum(f.raw_bytes for f in figures)
    kept = sum(f.kept_bytes for f in figures)
    plain = sum(f.plain_us for f in figures)
    amended = sum(f.amended_us for f in figures)
    print(
        f"total: kept {kept:,} B for {raw:,} B of raw values ({kept / raw:.2f}x); "
        f"an amendment costs {amended / plain:.2f}x the CPU of the same request never quiet "
        f"({(amended - plain) / len(figures):.0f} µs more per request, on average)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
