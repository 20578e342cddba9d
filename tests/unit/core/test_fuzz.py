"""A deterministic fuzzer over every sample transcript: corrupted input never crashes anything.

Each transcript of `samples/*/*` is corrupted in every way below, with
`random.Random` and fixed seeds (so every failure reproduces), and each
corrupted input goes down both paths:

* `streamtally fold --source S FILE` exits 0 with one JSON object of the
  contract's keys, or exits 2 with a one-line message on stderr; nothing else;
* the pipeline: `producers.raw_records` encodes its events (an `InputError`
  is the producer refusing the file, which is fine), a few encoded records
  get bytes flipped, re-sent or swapped, and a `RequestProcessor` takes them
  all: no exception escapes, every record is accounted for (applied,
  duplicate, dead-lettered, replayed), and the request completes exactly once
  with a valid `Tokens`.

Corruptions: truncation at a random byte offset, 1-10 random byte flips,
dropped lines, duplicated lines, two transcripts interleaved line by line (of
the same source, and of different sources), and garbage appended.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from streamtally.billing.pricing import PriceTable
from streamtally.cli import main
from streamtally.core.models import FinishReason, Source, Tokens
from streamtally.errors import InputError
from streamtally.processors.requests import Completed, Outputs, Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key
from streamtally.wire import avro
from streamtally.wire.records import EventKind

TOPICS = Topics.in_namespace()

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "samples"
PRICES = PriceTable.default()
FILES = sorted(
    str(p.relative_to(SAMPLES)) for p in SAMPLES.glob("*/*") if p.suffix in {".sse", ".jsonl"}
)
MODELS = {
    row["file"]: row.get("model")
    for row in map(json.loads, (SAMPLES / "manifest.jsonl").read_text().splitlines())
}
FINISH_REASONS = {f.value for f in FinishReason}
assert len(FINISH_REASONS) == 6

SPEC_KEYS = {
    "request_id",
    "source",
    "model",
    "text",
    "reasoning",
    "tool_calls",
    "usage",
    "finish_reason",
    "finish_reason_raw",
    "error",
    "chunks",
}
USAGE_KEYS = {
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cached_tokens",
    "cache_write_tokens",
}
#: Corrupted inputs per transcript and corruption.
ROUNDS = 3
#: Record sets fed to the pipeline per corrupted input: as produced, then mangled ones.
VARIANTS = 4
TIMEOUT = 30.0
T0 = datetime(2026, 5, 1, tzinfo=UTC)

#: Garbage that looks almost right, besides random bytes.
GARBAGE = [
    b"null\n",
    b"[1, 2, 3]\n",
    b'"a string"\n',
    b"42\n",
    b"{}\n",
    b'{"choices": 5, "usage": "many"}\n',
    b'{"token_ids": "abc", "finish_reason": 7}\n',
    b'{"outputs": [{"index": -1, "text": null}]}\n',
    b'{"request_id": 1, "text_delta": []}\n',
    b'data: {"choices":[{"index":"0","delta":7}]}\n\n',
    b'data: {"type":"message_delta","usage":{"output_tokens":-1}}\n\n',
    b'event: error\ndata: {"error": {"message": 5}}\n\n',
    b"data: [1]\n\n",
    b"data: {\n\n",
    b": comment only\n\n",
    b"\xff\xfe\x00\x00",
    b"\r\r\n\n\r",
]


def source_of(file: str) -> Source:
    return Source(file.split("/", 1)[0])


def read(file: str) -> bytes:
    return (SAMPLES / file).read_bytes()


# --------------------------------------------------------------------------- corruptions


def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


def flip_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 10)):
        if out:
            out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
    return bytes(out)


def drop_lines(rng: random.Random, data: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    for _ in range(rng.randint(1, max(1, len(lines) // 4))):
        if lines:
            del lines[rng.randrange(len(lines))]
    return b"".join(lines)


def duplicate_lines(rng: random.Random, data: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    for _ in range(rng.randint(1, max(1, len(lines) // 4))):
        if lines:
            i = rng.randrange(len(lines))
            lines.insert(i + rng.randint(0, 3), lines[i])
    return b"".join(lines)


def interleave(a: bytes, b: bytes) -> bytes:
    """The lines of `a` and `b`, one of each in turn (the rest of the longer at the end)."""
    lines_a, lines_b = a.splitlines(keepends=True), b.splitlines(keepends=True)
    out: list[bytes] = []
    for i in range(max(len(lines_a), len(lines_b))):
        out.extend(lines[i] for lines in (lines_a, lines_b) if i < len(lines))
    return b"".join(out)


def interleave_same_source(rng: random.Random, data: bytes, file: str) -> bytes:
    others = [f for f in FILES if source_of(f) is source_of(file) and f != file]
    return interleave(data, read(rng.choice(others)))


def interleave_other_source(rng: random.Random, data: bytes, file: str) -> bytes:
    others = [f for f in FILES if source_of(f) is not source_of(file)]
    other = read(rng.choice(others))
    return interleave(other, data) if rng.random() < 0.5 else interleave(data, other)


def append_garbage(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:
        tail = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == 1:
        tail = bytes(rng.randrange(32, 127) for _ in range(rng.randint(1, 64)))
    else:
        tail = b"".join(rng.choice(GARBAGE) for _ in range(rng.randint(1, 3)))
    return data + tail


CORRUPTIONS: dict[str, Callable[[random.Random, bytes, str], bytes]] = {
    "truncate": lambda rng, data, _: truncate(rng, data),
    "flip": lambda rng, data, _: flip_bytes(rng, data),
    "drop-lines": lambda rng, data, _: drop_lines(rng, data),
    "duplicate-lines": lambda rng, data, _: duplicate_lines(rng, data),
    "interleave-same": interleave_same_source,
    "interleave-other": interleave_other_source,
    "garbage": lambda rng, data, _: append_garbage(rng, data),
}


@dataclass(frozen=True)
class Case:
    file: str
    corruption: str
    round: int
    data: bytes

    @property
    def source(self) -> Source:
        return source_of(self.file)

    @property
    def seed(self) -> str:
        return f"{self.file}:{self.corruption}:{self.round}"

    def rng(self, purpose: str) -> random.Random:
        return random.Random(f"{self.seed}:{purpose}")

    def __repr__(self) -> str:  # short, for assertion messages
        return f"Case({self.seed}, {len(self.data)} bytes)"


@functools.cache
def cases(file: str) -> tuple[Case, ...]:
    data = read(file)
    out = []
    for name, corrupt in CORRUPTIONS.items():
        for n in range(ROUNDS):
            rng = random.Random(f"{file}:{name}:{n}")
            out.append(Case(file, name, n, corrupt(rng, data, file)))
    return tuple(out)


def note(case: Case) -> contextlib.AbstractContextManager[None]:
    """Re-raise whatever escapes with the case that caused it."""

    @contextlib.contextmanager
    def noted() -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            exc.add_note(f"fuzz case: {case!r}; input: {case.data[:300]!r}")
            raise

    return noted()


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class FoldRun:
    case: Case
    code: int
    stdout: str
    stderr: str


@functools.cache
def fold_runs(file: str) -> tuple[FoldRun, ...]:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(file):
            path = Path(tmp) / f"{case.corruption}-{case.round}{Path(file).suffix}"
            path.write_bytes(case.data)
            out, err = io.StringIO(), io.StringIO()
            with note(case), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                argv = ["fold", "--source", case.source.value, str(path)]
                if MODELS.get(file):  # engine outputs do not name their model
                    argv[1:1] = ["--model", str(MODELS[file])]
                try:
                    code = main(argv)
                except SystemExit as exc:  # argparse only: our arguments are always valid
                    pytest.fail(f"{case!r}: argparse exited with {exc.code}: {err.getvalue()}")
            runs.append(FoldRun(case, code, out.getvalue(), err.getvalue()))
    return tuple(runs)


@pytest.mark.parametrize("file", FILES)
def test_fold_exits_0_with_the_spec_json_or_2_with_one_line(file: str) -> None:
    for run in fold_runs(file):
        case = run.case
        assert run.code in (0, 2), (case, run.code, run.stderr)
        if run.code == 2:
            assert run.stdout == "", case
            assert run.stderr.endswith("\n"), (case, run.stderr)
            assert run.stderr.count("\n") == 1, (case, run.stderr)
            assert run.stderr.startswith("streamtally fold: "), (case, run.stderr)
            assert len(run.stderr.strip()) > len("streamtally fold: "), case
            continue
        assert run.stdout.endswith("\n"), case
        assert run.stdout.count("\n") == 1, case
        got = json.loads(run.stdout)
        assert isinstance(got, dict), case
        assert set(got) in (SPEC_KEYS, SPEC_KEYS | {"choices"}), (case, sorted(got))
        assert set(got["usage"]) == USAGE_KEYS, case
        assert all(isinstance(v, int) and v >= 0 for v in got["usage"].values()), case
        assert got["finish_reason"] in FINISH_REASONS, case
        assert got["source"] == case.source.value, case
        assert isinstance(got["request_id"], str), case
        assert got["request_id"], case
        Tokens.model_validate(got)
        for line in run.stderr.splitlines():  # warnings only: events skipped
            assert line.startswith("streamtally fold: skipped event "), (case, line)


# --------------------------------------------------------------------------- the pipeline


@dataclass
class PipelineRun:
    case: Case
    #: 0: the records as produced; 1 and up: some flipped, re-sent or swapped.
    variant: int = 0
    refused: str | None = None
    request_id: str = ""
    fed: list[bytes] = field(default_factory=list)
    flipped: int = 0
    out: Outputs = field(default_factory=Outputs)
    counters: dict[str, int] = field(default_factory=dict)
    #: The tenants of the records fed that decode as ones of this request id (each opens
    #: a request of its own: a flipped tenant is another request; an end marker that
    #: is its first record, seq 0, opens nothing).
    opens: set[str] = field(default_factory=set)
    #: Steps after which the counters did not add up.
    unbalanced: list[str] = field(default_factory=list)

    @property
    def completed(self) -> list[Completed]:
        return self.out.completed

    def __repr__(self) -> str:
        return f"PipelineRun({self.case!r}, variant {self.variant})"


def ticker() -> Callable[[], datetime]:
    n = iter(range(1 << 30))
    return lambda: T0 + timedelta(milliseconds=100 * next(n))


def mangle(rng: random.Random, records: list[bytes]) -> tuple[list[bytes], int]:
    """Some records with flipped bytes, re-sent or swapped with their neighbour.

    Half the flips hit the record's envelope (request id, seq, source, tenant,
    kind come first after the header), the others anywhere past the header,
    and a few the header itself.
    """
    records = list(records)
    flipped = 0
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(records))
        value = bytearray(records[i])
        for _ in range(rng.randint(1, 4)):
            where = rng.random()
            if where < 0.5:
                pos = rng.randrange(avro.HEADER_SIZE, min(len(value), avro.HEADER_SIZE + 48))
            elif where < 0.9:
                pos = rng.randrange(avro.HEADER_SIZE, len(value))
            else:
                pos = rng.randrange(avro.HEADER_SIZE)
            value[pos] ^= rng.randrange(1, 256)
        records[i] = bytes(value)
        flipped += 1
    if rng.random() < 0.4:
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(len(records))
            records.insert(rng.randrange(i, len(records) + 1), records[i])
    if rng.random() < 0.4 and len(records) > 1:
        i = rng.randrange(len(records) - 1)
        records[i], records[i + 1] = records[i + 1], records[i]
    return records, flipped


def opened_by(source: Source, value: bytes, request_id: str) -> str | None:
    """The tenant whose request (of `request_id`) `value` opens, if it opens one."""
    try:
        record = (
            avro.decode_raw_sse_event(value)
            if source.is_sse
            else avro.decode_raw_engine_output(value)
        )
    except InputError:
        return None
    if record.request_id != request_id or (record.kind is EventKind.END and record.seq == 0):
        return None
    return record.tenant


def check_counters(processor: RequestProcessor, run: PipelineRun, step: str) -> None:
    """Note (for the test to report) a step after which the counters do not add up."""
    c = processor.counters
    waiting = sum(len(s.waiting) for s in processor.table.open.values())
    if c.received != c.applied + c.duplicates + c.dead_lettered + c.replayed + waiting:
        run.unbalanced.append(f"after {step}: {c}, {waiting} waiting")


def run_pipeline(run: PipelineRun) -> PipelineRun:
    """Feed `run.fed` (all records of one request, END included), then let it time out."""
    source = run.case.source
    run.opens = {t for v in run.fed if (t := opened_by(source, v, run.request_id)) is not None}
    clock = [1_000.0]
    processor = RequestProcessor(PRICES, timeout=TIMEOUT, clock=lambda: clock[0])
    handle = processor.handle_sse if source.is_sse else processor.handle_engine
    topic = TOPICS.raw_sse.name if source.is_sse else TOPICS.raw_engine.name
    key = encode_key(run.request_id)
    for offset, value in enumerate(run.fed):
        run.out.extend(handle(key, value, Position(topic, 3, offset, 1_777_000_000.0 + offset)))
        check_counters(processor, run, f"record {offset}")
        clock[0] += 0.01
    clock[0] += TIMEOUT + 1
    run.out.extend(processor.expire())
    check_counters(processor, run, "expire")
    assert processor.open_requests == 0, run
    c = processor.counters
    run.counters = {
        "received": c.received,
        "applied": c.applied,
        "duplicates": c.duplicates,
        "dead_lettered": c.dead_lettered,
        "replayed": c.replayed,
        "requests_completed": c.requests_completed,
    }
    return run


@functools.cache
def pipeline_runs(file: str) -> tuple[PipelineRun, ...]:
    runs = []
    for case in cases(file):
        with note(case):
            try:
                rid, records = raw_records(
                    case.source,
                    case.data,
                    tenant="fuzz",
                    clock=ticker(),
                    model=MODELS.get(file),
                )
            except InputError as exc:  # the producer refusing the file
                runs.append(PipelineRun(case, refused=f"{type(exc).__name__}: {exc}"))
                continue
            for variant in range(VARIANTS):
                fed, flipped = (
                    (records, 0) if variant == 0 else mangle(case.rng(f"mangle-{variant}"), records)
                )
                run = PipelineRun(case, variant, request_id=rid, fed=fed, flipped=flipped)
                runs.append(run_pipeline(run))
    return tuple(runs)


def check_tokens(done: Completed, run: PipelineRun) -> None:
    tokens = done.tokens
    assert tokens.request_id == run.request_id, run
    assert tokens.finish_reason.value in FINISH_REASONS, run
    assert all(c.finish_reason.value in FINISH_REASONS for c in tokens.choices), run
    assert Tokens.model_validate(tokens.model_dump()) == tokens, run
    assert avro.decode_tokens(avro.encode_tokens(tokens)) == tokens, run
    billing = done.billing
    assert billing.request_id == run.request_id, run
    assert billing.finish_reason is tokens.finish_reason, run
    assert billing.usage == tokens.usage, run
    assert billing.cost >= 0, run
    assert avro.decode_billing_event(avro.encode_billing_event(billing)) == billing, run


@pytest.mark.parametrize("file", FILES)
def test_the_pipeline_accounts_for_every_record_and_completes_once(file: str) -> None:
    for run in pipeline_runs(file):
        if run.refused is not None:
            continue
        c = run.counters
        assert run.unbalanced == [], run
        assert c["received"] == len(run.fed), run
        assert c["received"] == (
            c["applied"] + c["duplicates"] + c["dead_lettered"] + c["replayed"]
        ), (run, c)
        assert c["replayed"] == 0, run  # nothing was learned as closed
        assert c["dead_lettered"] == len(run.out.dead_letters), run
        # Exactly one completion per request (tenant, id) a record opened: a record whose
        # tenant was flipped is a request of that tenant, never part of the other's.
        assert sorted(d.billing.tenant for d in run.completed) == sorted(run.opens), (run, c)
        assert c["requests_completed"] == len(run.completed), run
        assert sum(d.records + d.duplicates for d in run.completed) == (
            c["applied"] + c["duplicates"]
        ), run
        for done in run.completed:
            check_tokens(done, run)
        for chunk in run.out.chunks:
            assert chunk.request_id == run.request_id, run
            avro.encode_chunk(chunk)
        assert len(run.out.chunk_refs) == len(run.out.chunks), run
        for done in run.completed:
            seqs = [
                c.seq
                for c, r in zip(run.out.chunks, run.out.chunk_refs, strict=True)
                if r == done.ref
            ]
            assert seqs == list(range(len(seqs))), run
            assert done.tokens.chunks == len(seqs), run
        for letter in run.out.dead_letters:
            assert letter.reason, run
            assert avro.decode_dead_letter(avro.encode_dead_letter(letter)) == letter, run


@pytest.mark.parametrize("file", FILES)
def test_dead_letters_carry_the_original_bytes_of_their_record(file: str) -> None:
    for run in pipeline_runs(file):
        for letter in run.out.dead_letters:
            assert letter.value == run.fed[letter.offset], (run, letter.reason)


@pytest.mark.parametrize("file", FILES)
def test_the_pipeline_and_fold_agree_on_what_they_both_take(file: str) -> None:
    """Records as produced give the Tokens `streamtally fold` prints for the same input.

    The contract: "the same fold runs inside the stream processors, so the
    command and the pipeline can never disagree".
    """
    produced = {run.case: run for run in pipeline_runs(file) if run.variant == 0}
    for fold_run in fold_runs(file):
        run = produced[fold_run.case]
        if fold_run.code != 0 or run.refused is not None:
            continue
        assert len(run.completed) == 1, run
        got = run.completed[0].tokens.to_json_dict()
        assert got == json.loads(fold_run.stdout), run


def test_the_fuzzer_exercises_both_paths_and_every_outcome() -> None:
    folds = Counter(run.code for f in FILES for run in fold_runs(f))
    assert folds[0] > 0
    assert folds[2] > 0
    outcomes: Counter[str] = Counter()
    for f in FILES:
        for run in pipeline_runs(f):
            if run.refused is not None:
                outcomes["refused by the producer"] += 1
                continue
            outcomes["pipeline runs"] += 1
            outcomes["records applied"] += run.counters["applied"]
            outcomes["records dead-lettered"] += run.counters["dead_lettered"]
            outcomes["duplicates"] += run.counters["duplicates"]
            outcomes["completed"] += len(run.completed)
            outcomes["flipped records"] += run.flipped
            outcomes["inputs with dead letters"] += bool(run.out.dead_letters)
            outcomes["inputs without dead letters"] += not run.out.dead_letters
            for done in run.completed:
                outcomes[f"finish {done.tokens.finish_reason.value}"] += 1
                outcomes[f"closed at {done.closed.reason.value}"] += 1
    for what in (
        *(f"finish {reason}" for reason in sorted(FINISH_REASONS)),
        "closed at end",
        "closed at gap",
        "closed at timeout",
        "refused by the producer",
        "pipeline runs",
        "records applied",
        "records dead-lettered",
        "duplicates",
        "completed",
        "flipped records",
        "inputs with dead letters",
        "inputs without dead letters",
    ):
        assert outcomes[what] > 0, (what, outcomes)
    assert sum(len(cases(f)) for f in FILES) == len(FILES) * len(CORRUPTIONS) * ROUNDS
