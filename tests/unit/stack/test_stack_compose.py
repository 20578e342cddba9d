"""docker-compose.yml's profiles give the shapes of `stack up` on the same ports and settings.

Docker does not run here: the file is checked as text against the stack's config.
"""

from __future__ import annotations

from pathlib import Path

from streamtally.stack.config import StackConfig
from streamtally.stack.kafka_node import node_paths, server_properties

COMPOSE = (Path(__file__).resolve().parents[3] / "docker-compose.yml").read_text()


def _service(name: str) -> str:
    """The text of one service of the compose file (up to the next service or section)."""
    start = COMPOSE.index(f"\n  {name}:\n")
    ends = [
        i
        for marker in ("\n  # ---", "\n\n  ", "\nvolumes:")
        if (i := COMPOSE.find(marker, start + 1)) != -1
    ]
    return COMPOSE[start : min(ends)]


def test_brokers3_profile_has_the_stacks_ports_and_quorum(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, brokers=3)
    voters = cfg.controller_quorum_voters().replace("127.0.0.1", "localhost")
    assert f'KAFKA_CONTROLLER_QUORUM_VOTERS: "{voters}"' in COMPOSE
    first = _service("kafka-1")
    assert "profiles: [brokers3]" in COMPOSE
    for node in cfg.kafka_nodes:
        text = _service(f"kafka-{node.node_id}")
        assert f'KAFKA_NODE_ID: "{node.node_id}"' in text
        assert f'"PLAINTEXT://:{node.port},CONTROLLER://:{node.controller_port}"' in text
        assert f'KAFKA_ADVERTISED_LISTENERS: "PLAINTEXT://localhost:{node.port}"' in text
        assert f'"127.0.0.1:{node.port}:{node.port}"' in first  # published by the first node
        if node.node_id > 1:
            assert 'network_mode: "service:kafka-1"' in text


def test_brokers3_profile_replicates_the_internal_topics_as_the_stack_does(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, brokers=3)
    props = dict(
        line.split("=", 1)
        for line in server_properties(cfg, node_paths(cfg)[0]).splitlines()
        if "=" in line and not line.startswith("#")
    )
    for key in (
        "default.replication.factor",
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.replication.factor",
        "share.coordinator.state.topic.min.isr",
        "auto.create.topics.enable",
        "num.partitions",
    ):
        variable = "KAFKA_" + key.upper().replace(".", "_")
        assert f'{variable}: "{props[key]}"' in COMPOSE, variable


def test_redis_cluster_profile_has_the_stacks_ports(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, redis_cluster=True)
    first = _service("redis-1")
    assert "profiles: [redis-cluster]" in COMPOSE
    for i, port in enumerate(cfg.redis_cluster_ports, start=1):
        text = _service(f"redis-{i}")
        assert f'--port, "{port}", --cluster-enabled, "yes"' in text
        assert f'"127.0.0.1:{port}:{port}"' in first
    create = _service("redis-cluster-create")
    addresses = " ".join(f"127.0.0.1:{port}" for port in cfg.redis_cluster_ports)
    assert f"--cluster create {addresses}" in create
    assert "--cluster-replicas 0 --cluster-yes" in create


def test_the_default_services_have_no_profile() -> None:
    for name in ("kafka", "redis", "worker"):
        assert "profiles:" not in _service(name)


def test_the_nightly_audit_runs_the_worker_image_and_installs_nothing() -> None:
    """The audit replays with the worker's compiled hot path: the image the Dockerfile
    builds, not a bare Python that pip-installs the clone at every run."""
    audit, worker = _service("audit-nightly"), _service("worker")
    assert "image: streamtally-worker" in worker
    assert "image: streamtally-worker" in audit
    assert "build: ." in audit
    assert "pip install" not in audit
    assert "profiles: [nightly]" in audit
