"""The proxy's Prometheus metrics, and its small HTTP server: /metrics, /health, /ready.

`streamtally proxy --metrics HOST:PORT` serves them on a port of their own
(the proxy's listening port forwards every path upstream, so it cannot carry
them).  Nothing is counted twice and the forwarding path stays cheap: every
figure is read at scrape time from the proxy's own `ProxyStats` and its
tap's `TapStats` (`ProxyCollector`).  Names are prefixed
``streamtally_proxy_`` and ``streamtally_tap_``; the only labels are the
reason of a refusal (a closed set) and the path of an unmetered call, which
`ProxyStats` keeps bounded (`streamtally.producers.proxy.server.unmetered_label`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from streamtally.producers import TapStats
from streamtally.producers.proxy.stats import ProxyStats
from streamtally.producers.proxy.tee import TeeStats

__all__ = ["ProxyCollector", "metrics_app"]


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _labelled(name: str, doc: str, label: str, values: Any) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


class ProxyCollector(Collector):
    """The proxy's and its tap's counts, read when scraped."""

    def __init__(
        self,
        stats: Callable[[], ProxyStats],
        tap: Callable[[], TapStats],
        in_flight: Callable[[], int],
        tees: Callable[[], TeeStats] | None = None,
    ) -> None:
        self._stats = stats
        self._tap = tap
        self._in_flight = in_flight
        self._tees = tees

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        p = "streamtally_proxy_"
        yield _counter(p + "calls_forwarded", "Calls forwarded upstream.", s.forwarded)
        yield _counter(p + "calls_tapped", "Calls whose answer was teed to the tap.", s.tapped)
        yield _labelled(
            p + "calls_refused",
            "Calls answered by the proxy itself, never forwarded, by reason.",
            "reason",
            s.refused,
        )
        yield _labelled(
            p + "calls_unmetered",
            "Calls to a path the proxy does not meter, by path (ids as {id}).",
            "path",
            s.unmetered,
        )
        yield _counter(
            p + "usage_asked",
            "Streamed calls whose usage the proxy asked the upstream for.",
            s.usage_asked,
        )
        yield _counter(
            p + "usage_chunks_held",
            "Usage-only chunks teed but held back from a client that had not asked.",
            s.usage_chunks_held,
        )
        yield _counter(
            p + "clients_gone", "Calls whose client went away before the end.", s.clients_gone
        )
        yield _counter(
            p + "drains_cut",
            "Calls whose upstream was cut at --drain-seconds after the client went away.",
            s.drains_cut,
        )
        yield _counter(
            p + "upstreams_broke", "Calls whose upstream broke off mid-answer.", s.upstream_broke
        )
        if self._tees is not None:
            tees = self._tees()
            yield _labelled(
                p + "calls_undecodable",
                "Metered calls not teed (whole or in part) for an encoding the tee could not "
                "decode, by route.",
                "path",
                tees.undecodable,
            )
            yield _counter(
                p + "bodies_oversize",
                "Non-streaming bodies over --max-body-bytes, teed as the usage found in them.",
                tees.oversize,
            )
            yield _counter(
                p + "background_repeats",
                "Background responses already teed to their end, seen again and not teed.",
                tees.repeats,
            )
        gauge = GaugeMetricFamily(p + "calls_in_flight", "Calls being served now.")
        gauge.add_metric([], self._in_flight())
        yield gauge
        tap = self._tap()
        t = "streamtally_tap_"
        yield _counter(t + "records_sent", "Raw records Kafka acknowledged.", tap.sent)
        yield _counter(
            t + "records_appended", "Raw records written to the tap's spool.", tap.appended
        )
        yield _counter(
            t + "keepalives",
            "Keep-alive records written to the spool for calls in flight that were silent.",
            tap.keepalives,
        )
        spool = GaugeMetricFamily(
            t + "spool_bytes", "Bytes in the tap's spool not yet acknowledged by Kafka."
        )
        spool.add_metric([], tap.spool_bytes)
        yield spool
        age = GaugeMetricFamily(
            t + "spool_oldest_unsent_seconds",
            "Age of the oldest record in the tap's spool not yet acknowledged (0: none).",
        )
        age.add_metric([], tap.oldest_unsent_age_s or 0.0)
        yield age
        yield _counter(
            t + "records_failed", "Raw records not encoded or refused by Kafka.", tap.failed
        )
        yield _counter(
            t + "sender_restarts",
            "Spool sender processes started again after one died.",
            tap.sender_restarts,
        )

    def describe(self) -> Iterable[Any]:
        return []


def metrics_app(
    collector: ProxyCollector, full: Callable[[], bool] = lambda: False
) -> web.Application:
    """/metrics (the Prometheus text exposition), /health (200 while the proxy runs) and
    /ready (200, or 503 while the tap's spool is full: new calls are refused)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    async def metrics_page(_request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(_request: web.Request) -> web.Response:
        if full():
            return web.json_response(
                {"ready": False, "reason": "the tap's spool is full: new calls are refused"},
                status=503,
            )
        return web.json_response({"ready": True})

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return app
