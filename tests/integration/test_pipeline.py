"""The pipeline end to end: transcripts through Kafka and the worker into Redis and billing.

One worker runs for the module.  The `run` fixture produces, with ``streamtally
produce``, every public transcript (``../shared/fixtures/providers``, 68) and
every own sample (``samples/manifest.jsonl``, 44) under request ids and tenants
unique to this run, and two namesakes (one transcript under ONE request id of
two tenants: two requests), and waits for their Tokens in Redis.  The tests then
compare what the read commands print with what ``streamtally fold`` prints for
the same file: Tokens, usage rows and billing events; and a garbage message
must end on the dead-letter topic without stopping the worker.

The read commands run in-process (`tests.integration.worker.cli`: the very code
of the command; ~0.5 s a process would make 224 of them too slow here), and a
sample of them as real processes, which must print the same bytes.

The tests at the top, on the stack selection, are plain unit tests (no Docker,
no stack).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from streamtally.billing.events import bill, event_id
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import USAGE_FIELDS, Source, Tokens
from streamtally.producers import RawProducer
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.avro import AvroDecodeError, decode_dead_letter
from streamtally.wire.kafka import read_topic
from streamtally.wire.records import DeadLetter
from tests.conftest import PROVIDER_FIXTURES, require_public_transcripts
from tests.integration.worker import (
    KAFKA_IMAGE,
    PROBE_FILE,
    PROBE_SOURCE,
    SAMPLES,
    CliResult,
    Endpoints,
    StackMode,
    WorkerProcess,
    choose_stack_mode,
    cli,
    docker_answers,
    forget_usage,
    kafka_container,
    run_streamtally,
    wait_for_tokens,
    write_manifest,
)

EXPECTATIONS = Path(__file__).resolve().parents[1] / "expectations"
#: Seconds the worker gets to put all of the run's requests into Redis.
PIPELINE_TIMEOUT_S = 150.0
COST_TEXT = re.compile(r"-?\d+\.\d{12}")


# --------------------------------------------------------------------------- stack selection


@pytest.mark.parametrize(
    ("env", "docker", "expected"),
    [
        ({"KAFKA_BOOTSTRAP_SERVERS": "kafka:9092"}, True, StackMode.EXTERNAL),
        ({"REDIS_URL": "redis://cache:6379/0"}, False, StackMode.EXTERNAL),
        ({"KAFKA_BOOTSTRAP_SERVERS": "k:1", "REDIS_URL": "redis://r/0"}, True, StackMode.EXTERNAL),
        ({}, True, StackMode.CONTAINERS),
        ({"KAFKA_BOOTSTRAP_SERVERS": "  ", "REDIS_URL": ""}, True, StackMode.CONTAINERS),
        ({}, False, StackMode.LOCAL),
        ({"REDIS_URL": " "}, False, StackMode.LOCAL),
    ],
)
def test_stack_mode_selection(env: dict[str, str], docker: bool, expected: StackMode) -> None:
    asked: list[bool] = []

    def probe() -> bool:
        asked.append(docker)
        return docker

    assert choose_stack_mode(env, probe) is expected
    # Docker is probed once, and only when no cluster is given
    assert len(asked) == (0 if expected is StackMode.EXTERNAL else 1)


def test_docker_probe_says_no_without_an_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `docker` command
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such-docker.sock")
    start = time.monotonic()
    assert docker_answers(timeout=3) is False
    assert time.monotonic() - start < 10


def test_kafka_container_runs_apache_kafka_in_kraft_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The container path's Kafka, configured without Docker (its client is stubbed)."""
    import testcontainers.core.container as tc_container

    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:  # testcontainers < 4.14
        from testcontainers.kafka import KafkaContainer

    class NoDocker:
        def __init__(self, **_: Any) -> None:
            pass

    monkeypatch.setattr(tc_container, "DockerClient", NoDocker)
    kafka = kafka_container(KAFKA_IMAGE)
    with pytest.raises(ValueError, match="not supported in Kraft mode"):
        KafkaContainer(KAFKA_IMAGE).with_kraft()  # why the adapter exists
    kafka.configure()
    assert kafka.image.endswith(KAFKA_IMAGE)
    assert kafka.env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert kafka.env["KAFKA_CONTROLLER_LISTENER_NAMES"] == "CONTROLLER"
    assert str(kafka.env["KAFKA_NODE_ID"]) == "1"
    assert kafka.env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@localhost:9094"
    assert "CONTROLLER://0.0.0.0:9094" in kafka.env["KAFKA_LISTENERS"]
    assert "KAFKA_BROKER_ID" not in kafka.env
    assert kafka.env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    written: dict[str, bytes] = {}
    monkeypatch.setattr(kafka, "get_container_host_ip", lambda: "localhost")
    monkeypatch.setattr(kafka, "get_exposed_port", lambda port: 55093 if port == 9093 else None)
    monkeypatch.setattr(kafka, "create_file", lambda data, path: written.update({path: data}))
    kafka.tc_start()
    script = written[kafka.TC_START_SCRIPT].decode()
    assert "export KAFKA_ADVERTISED_LISTENERS=PLAINTEXT://localhost:55093,BROKER://" in script
    assert script.rstrip().endswith("exec /etc/kafka/docker/run")
    assert "confluent" not in script


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class Req:
    """One produced request: which file, under which id and tenant."""

    label: str
    path: Path
    source: str
    request_id: str
    tenant: str

    @property
    def ref(self) -> RequestRef:
        return RequestRef(self.tenant, self.request_id)


def fold_argv(req: Req) -> tuple[str, ...]:
    return ("fold", "--source", req.source, "--request-id", req.request_id, str(req.path))


def tokens_argv(req: Req, redis_url: str) -> tuple[str, ...]:
    return ("tokens", "get", req.request_id, "--tenant", req.tenant, "--redis-url", redis_url)


@dataclass
class Run:
    tag: str
    endpoints: Endpoints
    worker: WorkerProcess
    public: list[Req]
    samples: list[Req]
    #: One transcript under one request id of two tenants (two requests).
    namesakes: list[Req]
    #: Requests whose Tokens never reached Redis.
    missing: set[RequestRef]
    #: Tenants whose usage rows to delete once the worker has stopped.
    tenants: set[str] = field(default_factory=set)
    _folds: dict[RequestRef, CliResult] = field(default_factory=dict)

    @property
    def requests(self) -> list[Req]:
        return self.public + self.samples + self.namesakes

    def fold_result(self, req: Req) -> CliResult:
        """What ``streamtally fold`` prints for the request (cached)."""
        if req.ref not in self._folds:
            self._folds[req.ref] = cli(*fold_argv(req))
        return self._folds[req.ref]

    def fold(self, req: Req) -> dict[str, Any]:
        """The fold of the request as JSON."""
        result = self.fold_result(req)
        assert result.code == 0, f"{req.label}: fold exited {result.code}: {result.err}"
        parsed: dict[str, Any] = json.loads(result.out)
        return parsed

    def remember(self, *reqs: Req) -> None:
        self.tenants.update(r.tenant for r in reqs)


def _public_requests(tag: str) -> list[Req]:
    if not PROVIDER_FIXTURES.is_dir():
        return []  # test_public_transcripts_* skips (fails on CI)
    out = []
    for expectations in sorted(EXPECTATIONS.glob("*.json")):
        if expectations.stem == "samples":
            continue
        for name, expected in sorted(json.loads(expectations.read_text()).items()):
            folder = expectations.stem
            out.append(
                Req(
                    label=f"{folder}/{name}",
                    path=PROVIDER_FIXTURES / folder / name,
                    source=expected["source"],
                    request_id=f"pub-{tag}-{folder}-{name}",
                    tenant=f"pub-{tag}",
                )
            )
    return out


def _sample_requests(tag: str) -> list[Req]:
    out = []
    for line in (SAMPLES / "manifest.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        out.append(
            Req(
                label=f"samples/{row['file']}",
                path=SAMPLES / row["file"],
                source=row["source"],
                request_id=f"smp-{tag}-{row['file'].replace('/', '-')}",
                tenant=f"{row['tenant']}-{tag}",
            )
        )
    return out


def _namesake_requests(tag: str) -> list[Req]:
    """The probe transcript under one request id of two tenants, one of them with a ``:``."""
    return [
        Req(f"namesake of {tenant}", PROBE_FILE, PROBE_SOURCE, f"twin-{tag}", tenant)
        for tenant in (f"twin-{tag}", f"twin:{tag}")
    ]


@pytest.fixture(scope="module")
def forget_after(stack_endpoints: Endpoints) -> Iterator[dict[str, Run]]:
    """Set up before the worker, torn down after it stopped: the run's usage rows go."""
    holder: dict[str, Run] = {}
    yield holder
    run = holder.get("run")
    if run is not None:
        forget_usage(stack_endpoints.redis_url, run.tenants)


@pytest.fixture(scope="module")
def run(
    forget_after: dict[str, Run],
    stack_endpoints: Endpoints,
    worker: WorkerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    """All public and sample transcripts produced under fresh ids, waited for in Redis."""
    tag = uuid.uuid4().hex
    result = Run(
        tag,
        stack_endpoints,
        worker,
        _public_requests(tag),
        _sample_requests(tag),
        _namesake_requests(tag),
        set(),
    )
    forget_after["run"] = result
    result.remember(*result.requests)
    manifest = write_manifest(
        tmp_path_factory.mktemp("run") / "manifest.jsonl",
        (
            {
                "file": str(r.path),
                "source": r.source,
                "request_id": r.request_id,
                "tenant": r.tenant,
            }
            for r in result.requests
        ),
    )
    produced = run_streamtally("produce", "--manifest", str(manifest), env=stack_endpoints.env())
    assert produced.returncode == 0, produced.stderr.decode(errors="replace")
    refs = [r.ref for r in result.requests]
    result.missing = wait_for_tokens(stack_endpoints.redis_url, refs, PIPELINE_TIMEOUT_S, worker)
    return result


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 160 else text[:157] + "..."


def _compare_tokens(run: Run, reqs: Iterable[Req]) -> list[str]:
    """Every way the stored Tokens of `reqs` differ from their fold (empty: none)."""
    problems = []
    for req in reqs:
        if req.ref in run.missing:
            problems.append(f"{req.label}: not in Redis (waited up to {PIPELINE_TIMEOUT_S:g} s)")
            continue
        folded = run.fold_result(req)
        if folded.code != 0:
            problems.append(f"{req.label}: fold exited {folded.code}: {folded.err.strip()}")
            continue
        expected = json.loads(folded.out)
        got = cli(*tokens_argv(req, run.endpoints.redis_url))
        if got.code != 0:
            problems.append(f"{req.label}: tokens get exited {got.code}: {got.err.strip()}")
            continue
        try:
            stored = json.loads(got.out)
        except ValueError:
            problems.append(f"{req.label}: tokens get printed no JSON: {got.out[:160]!r}")
            continue
        if stored != expected:
            keys = [
                k for k in dict.fromkeys([*expected, *stored]) if expected.get(k) != stored.get(k)
            ]
            details = "; ".join(
                f"{k}: stored {_short(stored.get(k))} != fold {_short(expected.get(k))}"
                for k in keys
            )
            problems.append(f"{req.label}: {details}")
            continue
        layout = json.dumps(expected, ensure_ascii=False, separators=(",", ":"))
        if got.out != layout.encode() + b"\n":
            problems.append(f"{req.label}: same JSON, not stored as compact UTF-8 JSON")
    return problems


def _report(run: Run, problems: list[str], total: int) -> str:
    return (
        f"{len(problems)} of {total} requests differ:\n"
        + "\n".join(problems)
        + (f"\n{run.worker.describe()}" if problems else "")
    )


# --------------------------------------------------------------------------- Tokens


@pytest.mark.integration
def test_every_public_transcript_ends_in_redis_as_fold_prints_it(run: Run) -> None:
    root = require_public_transcripts()
    on_disk = {f"{p.parent.name}/{p.name}" for p in root.glob("*/*.sse")}
    assert {r.label for r in run.public} == on_disk
    assert len(run.public) == 68
    assert len({r.request_id for r in run.public}) == 68
    problems = _compare_tokens(run, run.public)
    assert not problems, _report(run, problems, len(run.public))


@pytest.mark.integration
def test_every_sample_ends_in_redis_as_fold_prints_it(run: Run) -> None:
    assert len(run.samples) == 44
    assert {r.source for r in run.samples} == {s.value for s in Source}  # engines included
    problems = _compare_tokens(run, run.samples)
    assert not problems, _report(run, problems, len(run.samples))


@pytest.mark.integration
def test_the_commands_as_processes_print_the_same_bytes(run: Run) -> None:
    """One request per source: `fold` and `tokens get` as real processes, as in-process."""
    chosen = list({r.source: r for r in reversed(run.requests)}.values())
    chosen = [r for r in chosen if r.ref not in run.missing]
    assert len(chosen) >= 7, f"{len(chosen)} sources reached Redis"
    url, env = run.endpoints.redis_url, run.endpoints.env()
    jobs = [argv for r in chosen for argv in (fold_argv(r), tokens_argv(r, url))]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda argv: run_streamtally(*argv, env=env), jobs))
    problems = []
    for argv, proc in zip(jobs, results, strict=True):
        inline = cli(*argv)
        if (proc.returncode, proc.stdout) != (inline.code, inline.out):
            problems.append(
                f"streamtally {' '.join(argv[:3])}: process exited {proc.returncode} printing "
                f"{proc.stdout[:120]!r}, in-process {inline.code} {inline.out[:120]!r} "
                f"{proc.stderr.decode(errors='replace')}"
            )
    for n in range(0, len(results), 2):
        folded, stored = json.loads(results[n].stdout), json.loads(results[n + 1].stdout)
        if folded != stored:
            problems.append(f"{jobs[n][4]}: `tokens get` != `fold` (as processes)")
    assert not problems, "\n".join(problems)


@pytest.mark.integration
def test_one_request_id_of_two_tenants_is_two_requests(run: Run) -> None:
    """Both namesakes are stored (as fold prints them); `tokens get` needs --tenant for them."""
    first, second = run.namesakes
    assert first.request_id == second.request_id
    assert first.tenant != second.tenant
    problems = _compare_tokens(run, run.namesakes)  # each read with its --tenant
    assert not problems, _report(run, problems, len(run.namesakes))
    url = run.endpoints.redis_url
    ambiguous = cli("tokens", "get", first.request_id, "--redis-url", url)
    assert ambiguous.code == 2, ambiguous
    assert ambiguous.out == b""
    assert "2 tenants" in ambiguous.err, ambiguous.err
    assert "pass --tenant" in ambiguous.err, ambiguous.err
    other = cli(
        "tokens", "get", first.request_id, "--tenant", f"none-{run.tag}", "--redis-url", url
    )
    assert other.code == 2, other  # the id of a tenant that never sent it is unknown
    assert event_id(first.tenant, first.request_id) != event_id(second.tenant, second.request_id)


# --------------------------------------------------------------------------- usage and billing


@pytest.fixture(scope="module")
def billing_events(run: Run) -> dict[RequestRef, list[dict[str, Any]]]:
    """``streamtally billing export --json``: the run's events, by request (tenant, id)."""
    exported = run_streamtally("billing", "export", "--json", env=run.endpoints.env())
    assert exported.returncode == 0, exported.stderr.decode(errors="replace")[-4000:]
    refs = {r.ref for r in run.requests}
    events: dict[RequestRef, list[dict[str, Any]]] = defaultdict(list)
    for line in exported.stdout.decode().splitlines():
        event = json.loads(line)
        ref = RequestRef(event["tenant"], event["request_id"])
        if ref in refs:
            events[ref].append(event)
    return events


def _day(event: dict[str, Any]) -> str:
    return datetime.fromisoformat(event["event_time"]).astimezone(UTC).date().isoformat()


def _prices() -> PriceTable:
    return PriceTable.load_or_default(Settings.load().prices_path)


@pytest.mark.integration
def test_billing_export_has_one_right_event_per_request(
    run: Run, billing_events: dict[RequestRef, list[dict[str, Any]]]
) -> None:
    prices = _prices()
    problems = []
    for req in run.requests:
        events = billing_events.get(req.ref, [])
        if len(events) != 1:
            problems.append(f"{req.label}: {len(events)} billing events")
            continue
        [event] = events
        folded = run.fold(req)
        expected = {
            "event_id": event_id(req.tenant, req.request_id),
            "tenant": req.tenant,
            "model": folded["model"],
            "source": folded["source"],
            "finish_reason": folded["finish_reason"],
            **{name: folded["usage"][name] for name in USAGE_FIELDS},
            "currency": prices.currency,
            "price_table_version": prices.version,
        }
        got = {key: event.get(key) for key in expected}
        if got != expected:
            problems.append(f"{req.label}: {got} != {expected}")
        cost = event["cost"]
        if not (isinstance(cost, str) and COST_TEXT.fullmatch(cost)):
            problems.append(f"{req.label}: cost {cost!r} is not a 12-place decimal string")
            continue
        tokens = Tokens.model_validate(folded)  # priced as `streamtally fold` printed it
        when = datetime.fromisoformat(event["event_time"])
        priced = bill(tokens, req.tenant, when, prices).cost
        if Decimal(cost) != priced:
            problems.append(f"{req.label}: cost {cost} != {priced} from the price table")
    assert not problems, _report(run, problems, len(run.requests))


@pytest.mark.integration
def test_usage_rows_sum_the_folds_and_the_billed_costs(
    run: Run, billing_events: dict[RequestRef, list[dict[str, Any]]]
) -> None:
    by_tenant: dict[str, list[Req]] = defaultdict(list)
    for req in run.requests:
        by_tenant[req.tenant].append(req)
    assert len(by_tenant) >= 3
    unbilled = [r.label for r in run.requests if len(billing_events.get(r.ref, [])) != 1]
    if unbilled:
        pytest.fail(f"{len(unbilled)} requests without exactly one billing event: {unbilled}")
    expected: dict[str, list[dict[str, Any]]] = {}
    for tenant, reqs in by_tenant.items():
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for req in reqs:
            [event] = billing_events[req.ref]
            folded = run.fold(req)
            key = (_day(event), folded["model"] or "unknown")
            row = rows.setdefault(
                key,
                {"tenant": tenant, "model": key[1], "day": key[0], "requests": 0}
                | {"unpriced_requests": 0}
                | dict.fromkeys(USAGE_FIELDS, 0)
                | {"cost": Decimal(0)},
            )
            row["requests"] += 1
            if not _prices().is_priced(folded["model"]):
                row["unpriced_requests"] += 1  # billed at 0, marked, counted
            for name in USAGE_FIELDS:
                row[name] += folded["usage"][name]
            row["cost"] += Decimal(event["cost"])
        expected[tenant] = [
            {**row, "cost": f"{row['cost']:.12f}"} for _, row in sorted(rows.items())
        ]
    env = run.endpoints.env()

    def usage(tenant: str) -> Any:
        proc = run_streamtally("usage", "--tenant", tenant, "--json", env=env)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        return json.loads(proc.stdout)

    with ThreadPoolExecutor(max_workers=4) as pool:
        got = dict(zip(expected, pool.map(usage, expected), strict=True))
    problems = []
    for tenant, want in expected.items():
        have = {(r["day"], r["model"]): r for r in got[tenant]}
        for row in want:
            key = (row["day"], row["model"])
            found = have.pop(key, None)
            if found is None:
                problems.append(f"{tenant} {key}: no usage row; expected {row}")
            elif found != row:
                fields = [k for k in dict.fromkeys([*row, *found]) if found.get(k) != row.get(k)]
                diff = ", ".join(f"{k} {found.get(k)!r} != {row.get(k)!r}" for k in fields)
                problems.append(f"{tenant} {key}: usage {diff} (sum of folds / billing)")
        problems += [f"{tenant} {key}: unexpected usage row {row}" for key, row in have.items()]
        if not problems and got[tenant] != want:
            problems.append(f"{tenant}: rows not in (day, tenant, model) order")
    assert not problems, f"{len(problems)} usage rows differ:\n" + "\n".join(problems)
    everything = sum((r["requests"] for rows in got.values() for r in rows), 0)
    assert everything == len(run.requests)


# --------------------------------------------------------------------------- dead letters


def _topics() -> Topics:
    """The topics of this process's namespace (its module worker's)."""
    return Topics.in_namespace(Settings.load().namespace)


async def _send_garbage_then(
    servers: str, key: bytes, garbage: bytes, follower: Req
) -> tuple[int, int]:
    """Garbage on the partition `follower` will use, then `follower`: (partition, offset)."""
    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
    await producer.start()
    try:
        partitions = sorted(await producer.partitions_for(_topics().raw_sse.name))
        partition = DefaultPartitioner()(follower.request_id.encode(), partitions, partitions)
        sent = await producer.send_and_wait(
            _topics().raw_sse.name, garbage, key=key, partition=partition
        )
    finally:
        await producer.stop()
    async with RawProducer(servers, namespace=Settings.load().namespace) as raw:
        await raw.send_transcript(
            Source(follower.source),
            follower.path.read_bytes(),
            tenant=follower.tenant,
            request_id=follower.request_id,
        )
    return partition, sent.offset


async def _find_dead_letter(
    servers: str, match: Callable[[DeadLetter], bool], timeout: float
) -> DeadLetter | None:
    """The first dead letter that matches, waiting up to `timeout` s for it to be written.

    Reads the dead-letter topic to its current end, then again from where
    the last read stopped, every half second.
    """
    start: dict[int, int] = {}  # partition → next offset to read
    deadline = time.monotonic() + timeout
    while True:
        async with contextlib.aclosing(
            read_topic(servers, _topics().deadletter.name, start=start)
        ) as records:
            async for record in records:
                start[record.partition] = record.offset + 1
                if record.value is None:
                    continue
                with contextlib.suppress(AvroDecodeError):
                    letter = decode_dead_letter(record.value)
                    if match(letter):
                        return letter
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.5)


@pytest.mark.integration
def test_garbage_is_dead_lettered_and_the_worker_goes_on(run: Run) -> None:
    servers = run.endpoints.bootstrap_servers
    key = f"dl-{run.tag}-garbage".encode()
    garbage = b"\x00\xffnot avro at all " + run.tag.encode()
    follower = Req("the request after the garbage", PROBE_FILE, PROBE_SOURCE,
                   f"dl-{run.tag}-next", f"dl-{run.tag}")  # fmt: skip
    run.remember(follower)
    partition, offset = asyncio.run(_send_garbage_then(servers, key, garbage, follower))

    letter = asyncio.run(_find_dead_letter(servers, lambda d: d.value == garbage, timeout=30))
    assert letter is not None, f"no dead letter in 30 s\n{run.worker.describe()}"
    assert (letter.topic, letter.partition, letter.offset) == (
        _topics().raw_sse.name,
        partition,
        offset,
    )
    assert (letter.key, letter.value) == (key, garbage)
    assert letter.reason.strip(), letter
    assert letter.error_type, letter

    run.missing |= wait_for_tokens(run.endpoints.redis_url, [follower.ref], 30, run.worker)
    assert run.worker.returncode is None, run.worker.describe()
    problems = _compare_tokens(run, [follower])
    assert not problems, _report(run, problems, 1)
