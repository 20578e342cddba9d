"""What the pipeline benchmark runs: its settings, its namespace and its requests.

`PipelineSettings` are the run's sizes and endpoints; `bench_names` the topics
and consumer group of the benchmark's worker; `RequestBuilder` builds the
requests from our own transcripts (mostly the ~200-event
`*/long_text_bench.sse` samples, generated ~200-line engine streams, the
small engine samples) and encodes them with `producers.raw_records` before
anything is timed; `interleave` orders their messages, `concurrency` requests
in flight at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from aiokafka import TopicPartition

from benchmarks.affinity import CpuSplit
from benchmarks.fold import engine_stream
from streamtally.connection import KafkaConnection
from streamtally.core.models import Source
from streamtally.producers import raw_records
from streamtally.settings import Settings
from streamtally.topics import DAY_MS, Topic, Topics, encode_key
from streamtally.wire.framing import SINGLE_OBJECT, Framing

__all__ = [
    "BENCH_NAMESPACE",
    "FRAMINGS",
    "TENANT",
    "BenchRequest",
    "Names",
    "PipelineSettings",
    "Progress",
    "RequestBuilder",
    "Send",
    "bench_names",
    "interleave",
    "scratch_names",
]

TENANT: Final = "bench"
#: The values of ``STREAMTALLY_AVRO_FRAMING`` the benchmark runs with.
FRAMINGS: Final = ("single-object", "confluent")
#: The namespace (topic prefix and consumer group) of the benchmark's worker, unless
#: STREAMTALLY_NAMESPACE names one: its own, so no other worker joins its group.
BENCH_NAMESPACE: Final = "streamtally-bench"
_LONG_SSE: Final = (Source.OPENAI, Source.ANTHROPIC, Source.OPENAI_RESPONSES, Source.GEMINI)
_ENGINES: Final = (Source.DYNAMO, Source.VLLM, Source.ATOMR)

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    #: Raw events of the throughput phase (whole requests: the figure is rounded up).
    events: int = 200_000
    #: Raw events per second of the latency phase.
    rate: float = 5000.0
    #: Length of the latency phase.
    seconds: float = 20.0
    #: Requests in flight (interleaved) at a time while producing.
    concurrency: int = 16
    #: One poison raw event per this many raw events of the throughput phase (0: none).
    poison_every: int = 0
    #: Worker processes in the consumer group (the raw topics have 6 partitions each).
    workers: int = 1
    #: Framing of every value, the raw records produced and the worker's outputs
    #: (``STREAMTALLY_AVRO_FRAMING``): ``single-object`` or ``confluent`` (a registry).
    framing: str = "single-object"
    #: The Kafka (with its security: `Settings.kafka`), or plain servers.
    bootstrap_servers: KafkaConnection | str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: CPUs of the workers' own (``--worker-cpus``): the benchmark and the local stack's
    #: processes run on the others (`benchmarks.affinity`); empty: nothing is pinned.
    worker_cpus: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.events < 1 or self.rate <= 0 or self.seconds <= 0 or self.concurrency < 1:
            raise ValueError("events, rate, seconds and concurrency must be positive")
        if self.poison_every < 0:
            raise ValueError("poison_every must be 0 (none) or positive")
        if not 1 <= self.workers <= 6:
            raise ValueError("workers must be 1 to 6 (the raw topics' partitions)")
        if self.framing not in FRAMINGS:
            raise ValueError(f"framing must be one of {', '.join(FRAMINGS)}")
        if self.worker_cpus:
            CpuSplit.of(self.worker_cpus)  # refused now, not after the encoding


@dataclass(frozen=True, slots=True)
class Names:
    """The topics and consumer group the benchmark's worker uses."""

    topics: Topics

    @property
    def namespace(self) -> str:
        """Topic prefix and consumer group (`STREAMTALLY_NAMESPACE` of the worker)."""
        return self.topics.namespace

    @property
    def group(self) -> str:
        return self.topics.processors_group

    def partitions(self, *used: Topic) -> list[Any]:
        return [TopicPartition(t.name, p) for t in used for p in range(t.partitions)]


def bench_names(settings: Settings) -> Names:
    """`STREAMTALLY_NAMESPACE` if set, else `BENCH_NAMESPACE` with one-day retention.

    Running the worker in a namespace of its own keeps other workers on the
    broker (tests, demos) out of its consumer group: they would share its
    partitions, and their rebalances would replay its requests.
    """
    if "namespace" in settings.model_fields_set:
        return Names(Topics.in_namespace(settings.namespace))
    return scratch_names(BENCH_NAMESPACE)


def scratch_names(namespace: str) -> Names:
    """The topics of `namespace` with one-day retention (those not compacted)."""
    scratch = Topics.in_namespace(namespace)
    one_day = [
        dataclasses.replace(t, retention_ms=DAY_MS) if t.cleanup_policy == "delete" else t
        for t in scratch.all
    ]
    return Names(Topics(namespace, *one_day))


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    source: Source
    topic: str
    #: Encoded raw records: the events, then the END marker.
    records: list[bytes]

    @property
    def events(self) -> int:
        return len(self.records) - 1


#: One message to send: topic, key, value, and the request id when it is the END marker.
Send = tuple[str, bytes, bytes, str | None]


#: A poison request: one good event, then one whose JSON holds a lone surrogate (the
#: worker dead-letters that event and bills the request with what it had), then END.
POISON_STREAM: Final = (
    b'data: {"id":"p","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
    b'data: {"id":"p","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":"bad \\ud800 here"},"finish_reason":null}]}\n\n'
)


def _transcript_cycle(samples: Path) -> list[tuple[Source, bytes]]:
    """One cycle of the request mix: 8 long SSE streams, 3 long engine streams, 1 sample."""
    long_sse = [(s, (samples / s.value / "long_text_bench.sse").read_bytes()) for s in _LONG_SSE]
    engines = [(s, engine_stream(s, tokens=200)) for s in _ENGINES]
    return [*long_sse, *long_sse, *engines]


def _small_engine_samples(samples: Path) -> list[tuple[Source, bytes]]:
    return [
        (source, path.read_bytes())
        for source in _ENGINES
        for path in sorted((samples / source.value).glob("*.jsonl"))
    ]


class RequestBuilder:
    """Builds and encodes the benchmark's requests, numbering them `bench-<run>-<n>`."""

    def __init__(
        self,
        run_id: str,
        samples: Path,
        names: Names,
        framing: Framing = SINGLE_OBJECT,
        *,
        tenant: str = TENANT,
    ) -> None:
        self.run_id = run_id
        #: The tenant of every request (the pipeline benchmark's `TENANT` by default).
        self.tenant = tenant
        #: How each raw value is framed (the Confluent framing: registered at start).
        self.framing = framing
        self.names = names
        self.samples = samples
        self._cycle = _transcript_cycle(samples)
        self._small = itertools.cycle(_small_engine_samples(samples))
        self._next = 0
        self.encode_seconds = 0.0
        self.by_source: dict[str, int] = {}
        #: Poison events among the requests made (`requests` with `poison_every`).
        self.poison_events = 0

    def prefix(self) -> str:
        return f"bench-{self.run_id}-"

    def _encode(self, request_id: str, source: Source, data: bytes) -> BenchRequest:
        start = time.perf_counter()
        _, records = raw_records(source, data, tenant=self.tenant, request_id=request_id)
        records = [self.framing.frame(record) for record in records]
        self.encode_seconds += time.perf_counter() - start
        topic = (self.names.topics.raw_sse if source.is_sse else self.names.topics.raw_engine).name
        return BenchRequest(request_id, source, topic, records)

    def requests(self, min_events: int, poison_every: int = 0) -> list[BenchRequest]:
        """Whole requests of the mix, at least `min_events` raw events in all.

        With `poison_every`, a poison request (`POISON_STREAM`: one good
        event, one poison event) follows each `poison_every` raw events.
        """
        out: list[BenchRequest] = []
        events = since_poison = 0
        while events < min_events:
            for source, data in [*self._cycle, next(self._small)]:
                request = self._encode(f"{self.prefix()}{self._next}", source, data)
                self._next += 1
                self.by_source[source.value] = self.by_source.get(source.value, 0) + 1
                out.append(request)
                events += request.events
                since_poison += request.events
                while poison_every and since_poison >= poison_every:
                    poison = self._encode(
                        f"{self.prefix()}{self._next}", Source.OPENAI, POISON_STREAM
                    )
                    self._next += 1
                    self.poison_events += 1
                    out.append(poison)
                    events += poison.events
                    since_poison -= poison_every
                if events >= min_events:
                    break
        return out

    def warmup(self) -> list[BenchRequest]:
        """Every transcript of the manifest (short, all sources, both topics), once."""
        out = []
        for k, line in enumerate((self.samples / "manifest.jsonl").read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            data = (self.samples / row["file"]).read_bytes()
            out.append(self._encode(f"{self.prefix()}warm{k}", Source(row["source"]), data))
        return out


def interleave(requests: Sequence[BenchRequest], width: int) -> list[Send]:
    """The messages of `requests`, `width` requests in flight at a time, round robin."""
    out: list[Send] = []
    waiting = deque(requests)
    active: deque[tuple[BenchRequest, bytes, int]] = deque()
    while waiting or active:
        while waiting and len(active) < width:
            request = waiting.popleft()
            active.append((request, encode_key(request.request_id), 0))
        request, key, index = active.popleft()
        last = len(request.records) - 1
        out.append(
            (
                request.topic,
                key,
                request.records[index],
                request.request_id if index == last else None,
            )
        )
        if index < last:
            active.append((request, key, index + 1))
    return out
