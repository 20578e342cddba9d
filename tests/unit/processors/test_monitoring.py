"""monitoring/ and docker-compose.yml's `prometheus`: they name only metrics the worker exports.

Docker does not run here: the compose file, Prometheus's config and rules and
the Grafana dashboard are loaded as data and checked against the worker's own
registry (`processors.metrics.WorkerMetrics`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from streamtally.processors.metrics import WorkerMetrics
from streamtally.processors.outputs import Counters
from streamtally.settings import Settings

REPO = Path(__file__).resolve().parents[3]
MONITORING = REPO / "monitoring"
METRIC = re.compile(r"\bstreamtally_[a-z_]+\b")
#: Sample names per TYPE line (a counter's TYPE line names it with its `_total`).
SUFFIXES = {"counter": ("",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return loaded


def _exported() -> set[str]:
    """Every sample name the worker's registry can expose."""
    text = WorkerMetrics(Counters, lambda: 0).exposition().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name + suffix for suffix in SUFFIXES[kind]}
    return names


def _proxy_exported() -> set[str]:
    """Every sample name the proxy's metrics can expose (`streamtally proxy --metrics`)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from streamtally.producers import TapStats
    from streamtally.producers.proxy.metrics import ProxyCollector
    from streamtally.producers.proxy.server import ProxyStats
    from streamtally.producers.proxy.tee import TeeStats

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(ProxyStats, TapStats, lambda: 0, TeeStats))
    names = set()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name + suffix for suffix in SUFFIXES[kind]}
    return names


def _rules(group: str = "streamtally-worker") -> list[dict[str, Any]]:
    doc = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return [rule for g in doc["groups"] if g["name"] == group for rule in g["rules"]]


def test_every_proxy_alert_names_only_metrics_the_proxy_exports() -> None:
    exported = _proxy_exported()
    rules = _rules("streamtally-proxy")
    assert {rule["alert"] for rule in rules} == {
        "StreamtallyTapSpoolBehind",
        "StreamtallyTapSpoolFull",
    }
    for rule in rules:
        used = set(METRIC.findall(rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)
        assert rule["labels"]["severity"] in {"warning", "critical"}


def test_every_alert_expression_names_only_metrics_the_worker_exports() -> None:
    exported = _exported()
    rules = _rules()
    names = {rule["alert"] for rule in rules}
    assert {
        "StreamtallyConsumerLagGrowing",
        "StreamtallyDeadLetterRate",
        "StreamtallyNoProgress",
    } <= names
    for rule in rules:
        used = set(METRIC.findall(rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]


def test_the_dashboard_plots_only_metrics_the_worker_exports() -> None:
    exported = _exported()
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used <= exported, used - exported
    # the list: records, dead letters, requests, billing, lag, latencies, errors, rebalances
    for wanted in (
        "streamtally_records_received_total",
        "streamtally_records_dead_lettered_total",
        "streamtally_requests_closed_total",
        "streamtally_requests_open",
        "streamtally_billing_events_total",
        "streamtally_consumer_lag",
        "streamtally_batch_seconds_bucket",
        "streamtally_close_seconds_bucket",
        "streamtally_sink_errors_total",
        "streamtally_sink_retries_total",
        "streamtally_rebalances_total",
    ):
        assert wanted in used, wanted


def test_compose_runs_prometheus_with_the_rules_scraping_the_worker() -> None:
    services = _compose()["services"]
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:")
    assert "profiles" not in prometheus  # `docker compose up` starts it
    mounts = {m.split(":")[0]: m.split(":")[1] for m in prometheus["volumes"]}
    assert mounts["./monitoring/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert mounts["./monitoring/alerts.yml"] == "/etc/prometheus/alerts.yml"

    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    port = Settings().web_port
    assert job["static_configs"][0]["targets"] == [f"worker:{port}"]

    worker = services["worker"]
    env = worker["environment"]
    assert env["STREAMTALLY_WEB_PORT"] == str(port)
    assert env["STREAMTALLY_WEB_HOST"] == "0.0.0.0"  # reachable from the prometheus container
    assert f"127.0.0.1:{port}:{port}" in worker["ports"]


def test_the_other_services_and_profiles_are_still_there() -> None:
    services = _compose()["services"]
    for name in ("kafka", "redis", "worker"):
        assert "profiles" not in services[name]
    for name in ("kafka-1", "kafka-2", "kafka-3"):
        assert services[name]["profiles"] == ["brokers3"]
    for name in ("redis-1", "redis-2", "redis-3", "redis-cluster-create"):
        assert services[name]["profiles"] == ["redis-cluster"]
