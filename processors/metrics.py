"""The worker's Prometheus metrics and its small HTTP server: /metrics, /health, /ready.

`WorkerMetrics` holds every metric (prometheus-client, in a registry of its
own, names prefixed ``streamtally_``).  The hot path stays cheap: the record
counts are not counted twice but read from the processor's own `Counters` at
scrape time, and the rest is updated once per written batch (`written`: dead
letters by reason, closed requests by finish reason, billing events), per
timer pass, per rebalance, per sink error (requests closed cancelled before any usage,
`usage_source` aborted, are counted by source in ``streamtally_requests_aborted_total``).
Consumer lag per partition (highwater minus position) is read from the consumer when
scraped.

`serve` runs an aiohttp server inside the worker's event loop on
``STREAMTALLY_WEB_HOST:STREAMTALLY_WEB_PORT`` (127.0.0.1:6066 by default;
port 0: no server):

- ``/metrics``: the Prometheus text exposition;
- ``/stages``: where the requests' close latency went, per stage, as JSON
  (`processors.stages`: fine buckets, for a benchmark to difference);
- ``/health``: 200 while the process and its event loop run;
- ``/ready``: 200 once the consumer group gave this worker its partitions (an
  empty assignment counts: more workers than partitions) and Kafka and Redis
  both answered within `READY_WINDOW_S`; else 503 with a JSON reason.

A port already taken (another worker on the host) is logged and the worker
runs on without the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from streamtally.processors.outputs import Counters, Outputs
from streamtally.processors.stages import Stages
from streamtally.wire.records import DeadLetter, UsageSource

__all__ = [
    "READY_WINDOW_S",
    "Health",
    "WorkerMetrics",
    "dead_letter_reason",
    "serve",
    "web_app",
]

log = logging.getLogger(__name__)

#: Kafka and Redis must have answered within this many seconds for /ready.
READY_WINDOW_S: Final = 5.0
#: How often the server's watcher asks the consumer and the sinks how they are.
WATCH_INTERVAL_S: Final = 1.0
#: Batch and close-pass latency buckets (seconds).
LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

#: Dead-letter reason (free text, naming requests) -> a label of bounded cardinality.
_REASONS: Final = (
    ("a tombstone", "tombstone"),
    ("record has no key", "no_key"),
    ("-byte limit", "oversized"),
    ("is not the record's request id", "key_mismatch"),
    ("which is already closed", "late"),
    ("after its end marker", "late"),
    ("which has no events", "lone_end"),
    ("STREAMTALLY_MAX_OPEN_REQUESTS", "open_limit"),
    ("STREAMTALLY_MAX_OPEN_PER_TENANT", "tenant_limit"),
    ("STREAMTALLY_MAX_RECORDS_PER_REQUEST", "record_limit"),
    ("changed source mid-stream", "source_switch"),
)


#: Refused tenant claims (`streamtally.wire.tenant_keys`), by exception type: the reason
#: text names the tenant and the request, which the sender chose.
_UNTRUSTED: Final = {
    "UnsignedRecord": "unsigned",
    "BadSignature": "bad_signature",
    "TenantNotAllowed": "tenant_not_allowed",
}


def dead_letter_reason(letter: DeadLetter) -> str:
    """The reason label of a dead letter: one of a few words, never the request's id."""
    untrusted = _UNTRUSTED.get(letter.error_type)
    if untrusted is not None:
        return untrusted
    for marker, label in _REASONS:
        if marker in letter.reason:
            return label
    if letter.error_type == "AvroDecodeError":
        return "undecodable"
    return "invalid_event"


class Health:
    """What /ready judges: the assignment, and when Kafka and Redis last answered."""

    def __init__(
        self, window: float = READY_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self.clock = clock
        #: The partitions the group gave this worker; None until the first assignment.
        self.partitions: frozenset[tuple[str, int]] | None = None
        self.kafka_at: float | None = None
        self.redis_at: float | None = None

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether the worker is ready, and why (a JSON-able document)."""
        now = self.clock()
        reasons = []
        if self.partitions is None:
            reasons.append("no partition assignment from the consumer group yet")
        for name, at in (("kafka", self.kafka_at), ("redis", self.redis_at)):
            if at is None:
                reasons.append(f"{name} has not answered yet")
            elif now - at > self.window:
                reasons.append(f"{name} has not answered for {now - at:.1f}s")
        doc: dict[str, Any] = {
            "ready": not reasons,
            "partitions": None if self.partitions is None else len(self.partitions),
            "kafka_answered_s_ago": None
            if self.kafka_at is None
            else round(now - self.kafka_at, 3),
            "redis_answered_s_ago": None
            if self.redis_at is None
            else round(now - self.redis_at, 3),
        }
        if reasons:
            doc["reason"] = "; ".join(reasons)
        return not reasons, doc


class _CountersCollector(Collector):
    """The processor's `Counters`, read at scrape time (no second count on the hot path)."""

    def __init__(self, counters: Callable[[], Counters], open_requests: Callable[[], int]) -> None:
        self._counters = counters
        self._open = open_requests

    def collect(self) -> Iterator[Any]:
        c = self._counters()
        for name, value, doc in (
            ("records_received", c.received, "Raw records read from the raw topics."),
            ("records_applied", c.applied, "Raw records applied to their request."),
            ("records_duplicate", c.duplicates, "Raw records dropped as re-sent duplicates."),
            ("records_replayed", c.replayed, "Raw records of requests an earlier run closed."),
            ("records_revoked", c.revoked, "Waiting records forgotten at a rebalance."),
            ("requests_unpriced", c.unpriced, "Requests billed at 0 as unpriced."),
        ):
            yield CounterMetricFamily(f"streamtally_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "streamtally_requests_open", "Requests this worker holds open.", value=self._open()
        )

    def describe(self) -> Iterable[Any]:
        return []


class WorkerMetrics:
    """Every metric of one worker process, in a registry of its own."""

    def __init__(
        self,
        counters: Callable[[], Counters] | None = None,
        open_requests: Callable[[], int] | None = None,
        *,
        health: Health | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.health = Health() if health is None else health
        r = self.registry
        if counters is not None:
            opened = open_requests if open_requests is not None else (lambda: 0)
            r.register(_CountersCollector(counters, opened))
        self.dead_lettered = Counter(
            "streamtally_records_dead_lettered",
            "Raw records written to the dead-letter topic, by reason.",
            ["reason"],
            registry=r,
        )
        self.requests_closed = Counter(
            "streamtally_requests_closed",
            "Requests closed and written, by finish reason and by what closed them.",
            ["finish_reason", "closed_by"],
            registry=r,
        )
        self.requests_aborted = Counter(
            "streamtally_requests_aborted",
            "Requests closed cancelled before the provider reported usage (billing events "
            "with usage_source aborted: billed with the counts they had), by source.",
            ["source"],
            registry=r,
        )
        self.billing_events = Counter(
            "streamtally_billing_events",
            "Billing events written to the billing topic.",
            ["priced"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            "streamtally_batch_seconds",
            "Seconds to apply one raw-record batch (waiting for the write of the batch before "
            "it, if still in flight; its own write goes on behind).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.close_seconds = Histogram(
            "streamtally_close_seconds",
            "Seconds of one timer pass closing quiet requests (expire, write, commit).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.sink_errors = Counter(
            "streamtally_sink_errors",
            "Failed Kafka and Redis operations, by store and exception type.",
            ["store", "error"],
            registry=r,
        )
        self.sink_retries = Counter(
            "streamtally_sink_retries",
            "Kafka and Redis writes or lookups retried after a transient failure, by store.",
            ["store"],
            registry=r,
        )
        self.rebalances = Counter(
            "streamtally_rebalances",
            "Consumer-group rebalances seen by this worker: partitions assigned or revoked.",
            ["event"],
            registry=r,
        )
        self.partitions = Gauge(
            "streamtally_partitions_assigned", "Raw partitions assigned to this worker.", registry=r
        )
        self.lag = Gauge(
            "streamtally_consumer_lag",
            "Records on a raw partition not yet fetched: highwater minus position.",
            ["topic", "partition"],
            registry=r,
        )
        self.up = Gauge("streamtally_ready", "1 when /ready answers 200, else 0.", registry=r)
        self.stage_seconds = Histogram(
            "streamtally_stage_seconds",
            "Seconds each closed request spent in each stage of the worker, from its END "
            "marker's Kafka timestamp to its Tokens in Redis (processors.stages).",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        #: The same spans in fine buckets (served on /stages).
        self.stages = Stages()
        self.stages.on_observe = self._stage_observed

    def _stage_observed(self, stage: str, seconds: float, requests: int) -> None:
        histogram = self.stage_seconds.labels(stage)
        for _ in range(requests):
            histogram.observe(seconds)

    # -- recorded by the worker ---------------------------------------------------------

    def written(self, outputs: Outputs) -> None:
        """One batch's (or timer pass's) outputs are durable: count them, per batch."""
        for letter in outputs.dead_letters:
            self.dead_lettered.labels(dead_letter_reason(letter)).inc()
        if outputs.completed:
            closed: dict[tuple[str, str], int] = {}
            aborted: dict[str, int] = {}
            priced = unpriced = 0
            for done in outputs.completed:
                if done.billing.usage_source is UsageSource.ABORTED:
                    source = done.billing.source.value
                    aborted[source] = aborted.get(source, 0) + 1
                finish = done.tokens.finish_reason
                key = (finish.value if finish is not None else "none", done.closed.reason.value)
                closed[key] = closed.get(key, 0) + 1
                if done.billing.priced:
                    priced += 1
                else:
                    unpriced += 1
            for (finish_reason, by), n in closed.items():
                self.requests_closed.labels(finish_reason, by).inc(n)
            for source, n in aborted.items():
                self.requests_aborted.labels(source).inc(n)
            if priced:
                self.billing_events.labels("true").inc(priced)
            if unpriced:
                self.billing_events.labels("false").inc(unpriced)

    def sink_error(self, store: str, exc: BaseException, retried: bool) -> None:
        self.sink_errors.labels(store, type(exc).__name__).inc()
        if retried:
            self.sink_retries.labels(store).inc()

    def assigned(self, tps: Iterable[tuple[str, int]]) -> None:
        self.health.partitions = frozenset(tps)
        self.partitions.set(len(self.health.partitions))
        self.rebalances.labels("assigned").inc()

    def revoked(self) -> None:
        self.rebalances.labels("revoked").inc()

    def set_lag(self, lag: Mapping[tuple[str, int], int]) -> None:
        self.lag.clear()
        for (topic, partition), n in lag.items():
            self.lag.labels(topic, str(partition)).set(n)

    def exposition(self) -> bytes:
        ready, _ = self.health.ready()
        self.up.set(1 if ready else 0)
        return bytes(generate_latest(self.registry))


# -- the server ---------------------------------------------------------------------------


class Source(Protocol):
    """What the watcher asks of the raw-topic consumer (`RawSource`)."""

    def fetch_age(self) -> float | None: ...

    async def ping(self) -> None: ...

    async def lag(self) -> dict[tuple[str, int], int]: ...


class Stores(Protocol):
    """What the watcher asks of the sinks (`Sinks`)."""

    answered_at: float | None


async def _watch(
    metrics: WorkerMetrics,
    source: Callable[[], Source | None],
    sinks: Callable[[], Stores | None],
) -> None:
    """Once a second: when Kafka and Redis last answered, and the consumer lag."""
    health = metrics.health
    while True:
        stores = sinks()
        if stores is not None and stores.answered_at is not None:
            health.redis_at = stores.answered_at
        consumer = source()
        if consumer is not None:
            age = consumer.fetch_age()
            if age is not None and age < WATCH_INTERVAL_S:
                health.kafka_at = health.clock() - age
            else:  # no partition, or no fetch answered lately: ask the cluster itself
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer.ping(), timeout=2.0)
                    health.kafka_at = health.clock()
            with contextlib.suppress(Exception):
                metrics.set_lag(await asyncio.wait_for(consumer.lag(), timeout=2.0))
        await asyncio.sleep(WATCH_INTERVAL_S)


def web_app(metrics: WorkerMetrics) -> web.Application:
    """The aiohttp application of /metrics, /stages, /health and /ready."""

    async def metrics_page(request: web.Request) -> web.Response:
        del request
        body = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stages(request: web.Request) -> web.Response:
        del request
        return web.json_response(metrics.stages.snapshot())

    async def health(request: web.Request) -> web.Response:
        del request
        return web.json_response({"alive": True})

    async def ready(request: web.Request) -> web.Response:
        del request
        ok, doc = metrics.health.ready()
        return web.json_response(doc, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/stages", stages)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return app


async def serve(
    metrics: WorkerMetrics,
    host: str,
    port: int,
    source: Callable[[], Source | None],
    sinks: Callable[[], Stores | None],
) -> None:
    """Serve the endpoints (and watch the stores) until cancelled; port 0: nothing."""
    if port == 0:
        return
    runner = web.AppRunner(web_app(metrics), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            log.warning(
                "metrics server not started on %s:%d (%s): set STREAMTALLY_WEB_PORT",
                host,
                port,
                exc,
            )
            return
        log.info("metrics, health and readiness on http://%s:%d/", host, port)
        await _watch(metrics, source, sinks)
    finally:
        await runner.cleanup()
