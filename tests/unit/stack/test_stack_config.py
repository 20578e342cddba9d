"""The local stack's shape and ports: 1/3/5 Kafka nodes, one Redis or a Redis Cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamtally.errors import InputError, StackError
from streamtally.settings import Settings
from streamtally.settings.stack import LEAN_JVM_OPTS
from streamtally.stack import kafka
from streamtally.stack.config import (
    KafkaNode,
    StackConfig,
    StackShape,
    read_shape,
    record_shape,
)
from streamtally.stack.kafka_node import KAFKA_MAIN, node_paths, server_properties
from streamtally.stack.redis_cluster import cluster_conf, nodes


def _properties(text: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def test_the_default_is_one_broker_and_one_redis(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path)
    assert cfg.shape == StackShape(brokers=1, redis_cluster=False)
    assert cfg.kafka_nodes == (KafkaNode(1, 9092, 9093),)
    assert cfg.local_bootstrap_servers() == cfg.all_bootstrap_servers() == "127.0.0.1:9092"
    assert cfg.local_redis_url() == "redis://127.0.0.1:6379/0"
    assert cfg.named_ports() == [
        ("kafka", 9092),
        ("controller", 9093),
        ("redis", 6379),
        ("registry", 8081),
    ]
    assert cfg.kafka_node_dir(cfg.kafka_nodes[0]) == cfg.kafka_dir == tmp_path / "kafka"


def test_three_brokers_take_consecutive_port_pairs(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, brokers=3)
    assert cfg.kafka_nodes == (
        KafkaNode(1, 9092, 9093),
        KafkaNode(2, 9094, 9095),
        KafkaNode(3, 9096, 9097),
    )
    # the first broker keeps the configured port: the default bootstrap still reaches it
    assert cfg.local_bootstrap_servers() == "127.0.0.1:9092"
    assert cfg.all_bootstrap_servers() == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert cfg.controller_quorum_voters() == "1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"
    assert [cfg.kafka_node_dir(n) for n in cfg.kafka_nodes] == [
        tmp_path / "kafka" / "brokers-3" / f"node-{i}" for i in (1, 2, 3)
    ]


def test_the_redis_cluster_takes_consecutive_ports_and_their_buses(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, redis_cluster=True)
    assert cfg.redis_cluster_ports == (6379, 6380, 6381)
    assert cfg.local_redis_url() == "redis://127.0.0.1:6379/0"
    ports = dict(cfg.named_ports())
    assert [ports[f"redis bus {i}"] for i in (1, 2, 3)] == [16379, 16380, 16381]


def test_ports_follow_the_settings(tmp_path: Path) -> None:
    settings = Settings(
        state_dir_setting=tmp_path, kafka_port=19092, controller_port=29093, redis_port=16379
    )
    cfg = StackConfig.from_settings(settings, brokers=3, redis_cluster=True)
    assert [(n.port, n.controller_port) for n in cfg.kafka_nodes] == [
        (19092, 29093),
        (19094, 29095),
        (19096, 29097),
    ]
    assert cfg.redis_cluster_ports == (16379, 16380, 16381)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", None),
        ("  ", None),
        ("lean", LEAN_JVM_OPTS),
        ("LEAN", LEAN_JVM_OPTS),
        ("-XX:+UseZGC '-Dname=a b'", ("-XX:+UseZGC", "-Dname=a b")),
    ],
)
def test_the_kafka_jvm_options_come_from_the_setting(
    tmp_path: Path, value: str, expected: tuple[str, ...] | None
) -> None:
    env = {"STREAMTALLY_STATE_DIR": str(tmp_path), "STREAMTALLY_KAFKA_JVM_OPTS": value}
    cfg = StackConfig.from_settings(Settings.load(env))
    assert cfg.kafka_jvm_opts == expected
    (np,) = node_paths(cfg)
    argv = kafka.broker_argv(cfg, "java", kafka.home(cfg), np)
    options = list(kafka.JVM_OPTS if expected is None else expected)
    after_heap = 1 + len(kafka.HEAP_OPTS)
    assert argv[:after_heap] == ["java", *kafka.HEAP_OPTS]
    assert argv[after_heap : after_heap + len(options)] == options
    assert argv[after_heap + len(options)].startswith("-Dlog4j2.configurationFile=")
    assert argv[-2:] == [KAFKA_MAIN, str(np.server_properties)]


def test_the_lean_broker_takes_one_compiler_and_the_serial_collector(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, kafka_jvm_opts=LEAN_JVM_OPTS)
    (np,) = node_paths(cfg)
    argv = kafka.broker_argv(cfg, "java", kafka.home(cfg), np)
    assert "-XX:TieredStopAtLevel=1" in argv
    assert "-XX:+UseSerialGC" in argv
    assert "-XX:+UseG1GC" not in argv
    default = kafka.broker_argv(StackConfig(tmp_path), "java", kafka.home(cfg), np)
    assert "-XX:+UseG1GC" in default
    assert "-XX:TieredStopAtLevel=1" not in default


def test_jvm_options_that_do_not_split_are_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="STREAMTALLY_KAFKA_JVM_OPTS: No closing quotation"):
        Settings.load({"STREAMTALLY_KAFKA_JVM_OPTS": "-Dname='a b"})


@pytest.mark.parametrize(
    ("ports", "shape", "message"),
    [
        ({"controller_port": 9094}, {"brokers": 3}, "kafka controller 1 and kafka broker 2"),
        ({"redis_port": 9100}, {"brokers": 5}, "kafka broker 5 and redis ports"),
        ({"redis_port": 9091}, {"redis_cluster": True}, "kafka and redis master 2 ports"),
        ({"redis_port": 9094}, {"redis_cluster": True}, None),  # next to one broker: fine
        ({"kafka_port": 65534, "controller_port": 65535}, {"brokers": 3}, "past port 65535"),
        ({"redis_port": 60000}, {"redis_cluster": True}, "past port 65535"),
    ],
)
def test_ports_that_clash_are_refused_with_what_to_set(
    tmp_path: Path, ports: dict[str, int], shape: dict[str, Any], message: str | None
) -> None:
    if message is None:
        StackConfig(tmp_path, **ports, **shape)
        return
    with pytest.raises(StackError, match=message) as error:
        StackConfig(tmp_path, **ports, **shape)
    assert "STREAMTALLY_KAFKA_PORT" in str(error.value)


def test_the_single_shape_keeps_its_message(tmp_path: Path) -> None:
    with pytest.raises(
        StackError,
        match=r"^kafka \(9092\), controller \(9093\), redis \(9092\) and registry \(8081\) ports",
    ):
        StackConfig(tmp_path, redis_port=9092)


@pytest.mark.parametrize("brokers", [0, 2, 4, 6])
def test_only_odd_quorums_up_to_five(tmp_path: Path, brokers: int) -> None:
    with pytest.raises(StackError, match=r"--brokers must be one of 1, 3, 5"):
        StackConfig(tmp_path, brokers=brokers)


def test_the_shape_is_remembered(tmp_path: Path) -> None:
    settings = Settings(state_dir_setting=tmp_path)
    assert read_shape(tmp_path) == StackShape()
    record_shape(tmp_path, brokers=3)
    record_shape(tmp_path, redis_cluster=True)
    assert json.loads((tmp_path / "stack.json").read_text()) == {
        "brokers": 3,
        "redis_cluster": True,
    }
    assert StackConfig.from_settings(settings).shape == StackShape(3, True)
    # what is given wins over what is remembered
    assert StackConfig.from_settings(settings, brokers=1).shape == StackShape(1, True)
    record_shape(tmp_path, brokers=1)
    assert read_shape(tmp_path) == StackShape(1, True)


@pytest.mark.parametrize(
    "text", ["", "not json", "[]", '{"brokers": 2}', '{"brokers": "3", "redis_cluster": 1}']
)
def test_an_unreadable_shape_is_the_default(tmp_path: Path, text: str) -> None:
    (tmp_path / "stack.json").write_text(text)
    assert read_shape(tmp_path) == StackShape()


def test_one_broker_keeps_its_layout_and_config(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path)
    (np,) = node_paths(cfg)
    assert np.name == "kafka"
    assert np.pid_file == tmp_path / "kafka" / "kafka.pid"
    assert np.data_dir == tmp_path / "kafka" / "data"
    assert np.cluster_id_file == tmp_path / "kafka" / "cluster.id"
    assert _properties(server_properties(cfg, np)) == {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": "1@127.0.0.1:9093",
        "listeners": "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093",
        "advertised.listeners": "PLAINTEXT://127.0.0.1:9092",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(tmp_path / "kafka" / "data"),
        "num.partitions": "1",
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }


def test_three_brokers_form_one_quorum_with_replicated_internal_topics(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, brokers=3)
    nps = node_paths(cfg)
    assert [np.name for np in nps] == ["kafka-1", "kafka-2", "kafka-3"]
    assert {np.cluster_id_file for np in nps} == {tmp_path / "kafka" / "brokers-3" / "cluster.id"}
    assert len({np.pid_file for np in nps}) == len({np.data_dir for np in nps}) == 3
    second = _properties(server_properties(cfg, nps[1]))
    assert second["node.id"] == "2"
    assert second["controller.quorum.voters"] == cfg.controller_quorum_voters()
    assert second["listeners"] == "PLAINTEXT://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095"
    assert second["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9094"
    assert second["log.dirs"] == str(nps[1].data_dir)
    assert second["offsets.topic.replication.factor"] == "3"
    assert second["transaction.state.log.replication.factor"] == "3"
    assert second["transaction.state.log.min.isr"] == "2"
    assert second["default.replication.factor"] == "3"
    # what tells this node's java process from another node's
    assert nps[1].marker == f"kafka.Kafka {nps[1].server_properties}"


def test_five_brokers_still_keep_three_copies(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, brokers=5)
    props = _properties(server_properties(cfg, node_paths(cfg)[4]))
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9100,CONTROLLER://127.0.0.1:9101"
    assert props["offsets.topic.replication.factor"] == "3"
    assert props["controller.quorum.voters"].count("@") == 5


def test_a_redis_cluster_node_config(tmp_path: Path) -> None:
    cfg = StackConfig(tmp_path, redis_port=16379, redis_cluster=True)
    second = nodes(cfg)[1]
    assert second.name == "redis-2"
    assert second.paths.root == tmp_path / "redis-cluster" / "node-2"
    lines = cluster_conf(cfg, second).splitlines()
    for expected in (
        "bind 127.0.0.1",
        "port 16380",
        "cluster-enabled yes",
        'cluster-config-file "nodes.conf"',
        "cluster-port 26380",
        "appendonly yes",
        f'dir "{second.paths.data_dir}"',
        f'pidfile "{second.paths.pid_file}"',
    ):
        assert expected in lines
