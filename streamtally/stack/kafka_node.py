"""One node of the local Kafka (KRaft: broker and controller in one JVM): files and configs.

A single broker keeps its files in ``<state>/kafka`` itself; ``N`` brokers keep
theirs in ``<state>/kafka/brokers-N``, with the cluster id there and one folder
per node::

    cluster.id        KRaft cluster id, generated once per broker count
    node-1/           (the single broker: <state>/kafka itself)
      config/         server.properties and log4j2.xml, rewritten on every start
      data/           log.dirs (topics and the __cluster_metadata log)
      logs/           server.log, controller.log, state-change.log, kafka.out
      kafka.pid
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final
from xml.sax.saxutils import escape

from streamtally.stack import secure
from streamtally.stack.config import KafkaNode, StackConfig
from streamtally.topics import min_insync_for, replication_factor_for

__all__ = [
    "KAFKA_MAIN",
    "NodePaths",
    "log4j2_xml",
    "node_paths",
    "server_properties",
    "write_configs",
]

#: The broker's main class: also what tells our broker in a process list.
KAFKA_MAIN: Final = "kafka.Kafka"


@dataclass(frozen=True, slots=True)
class NodePaths:
    """The files of one Kafka node."""

    node: KafkaNode
    #: How the node is named in progress lines and `stack status`.
    name: str
    root: Path
    cluster_dir: Path

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def server_properties(self) -> Path:
        return self.config_dir / "server.properties"

    @property
    def log4j_config(self) -> Path:
        return self.config_dir / "log4j2.xml"

    @property
    def cluster_id_file(self) -> Path:
        return self.cluster_dir / "cluster.id"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def meta_properties(self) -> Path:
        return self.data_dir / "meta.properties"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def server_log(self) -> Path:
        return self.logs_dir / "server.log"

    @property
    def out_log(self) -> Path:
        return self.logs_dir / "kafka.out"

    @property
    def pid_file(self) -> Path:
        return self.root / "kafka.pid"

    @property
    def marker(self) -> str:
        """What the node's command line holds (its main class and its own config)."""
        return f"{KAFKA_MAIN} {self.server_properties}"


def node_paths(cfg: StackConfig) -> list[NodePaths]:
    """The nodes of `cfg`'s broker count, in node id order."""
    single = cfg.brokers == 1
    return [
        NodePaths(
            node=node,
            name="kafka" if single else f"kafka-{node.node_id}",
            root=cfg.kafka_node_dir(node),
            cluster_dir=cfg.kafka_cluster_dir,
        )
        for node in cfg.kafka_nodes
    ]


def server_properties(cfg: StackConfig, np: NodePaths) -> str:
    """The node's ``server.properties``: every node is a broker and a controller voter.

    The internal topics (consumer offsets, transactions, share groups) get the
    replication of streamtally's own topics on this many brokers
    (`replication_factor_for`), with 2 in-sync replicas once there are 3 copies.
    """
    host, node = cfg.host, np.node
    replication = replication_factor_for(cfg.brokers)
    min_isr = str(min_insync_for(replication))
    settings = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": cfg.controller_quorum_voters(),
        "listeners": f"PLAINTEXT://{host}:{node.port},CONTROLLER://{host}:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{node.port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(np.data_dir),
        "num.partitions": "1",
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": str(replication),
        "transaction.state.log.replication.factor": str(replication),
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": str(replication),
        "share.coordinator.state.topic.min.isr": min_isr,
        "group.initial.rebalance.delay.ms": "0",
    }
    if replication > 1:  # topics created without a replication factor (other tools)
        settings["default.replication.factor"] = str(replication)
    if cfg.secure:
        settings.update(_secure_listener(cfg, np))
    body = "\n".join(f"{key}={value}" for key, value in settings.items())
    return (
        "# Written by `streamtally stack up` on every start; edit "
        f"streamtally/stack/kafka_node.py.\n{body}\n"
    )


def _secure_listener(cfg: StackConfig, np: NodePaths) -> dict[str, str]:
    """The broker's listener as SASL_SSL with SCRAM-SHA-512 (the controller's stays
    plaintext on the loopback address): TLS from the local CA's certificate, and the
    broker's own SCRAM user for its connections to itself."""
    sf = secure.files(cfg)
    credentials = secure.load_credentials(cfg)
    host, node = cfg.host, np.node
    mechanism = secure.SCRAM_MECHANISM
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{secure.KAFKA_ADMIN_USER}" password="{credentials.kafka_admin}";'
    )
    return {
        "listeners": f"SASL_SSL://{host}:{node.port},CONTROLLER://{host}:{node.controller_port}",
        "advertised.listeners": f"SASL_SSL://{host}:{node.port}",
        "inter.broker.listener.name": "SASL_SSL",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL",
        "sasl.enabled.mechanisms": mechanism,
        "sasl.mechanism.inter.broker.protocol": mechanism,
        f"listener.name.sasl_ssl.{mechanism.lower()}.sasl.jaas.config": jaas,
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(sf.keystore),
        "ssl.keystore.password": credentials.keystore,
        "ssl.key.password": credentials.keystore,
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(sf.ca_cert),
        "ssl.client.auth": "none",
    }


_LOG4J2_XML = """\
<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by `streamtally stack up` on every start. -->
<Configuration status="WARN">
  <Properties>
    <Property name="logDir">@LOG_DIR@</Property>
    <Property name="pattern">[%d] %p %m (%c)%n</Property>
  </Properties>
  <Appenders>
    <RollingFile name="server" fileName="${logDir}/server.log"
                 filePattern="${logDir}/server.log.%i">
      <PatternLayout pattern="${pattern}"/>
      <SizeBasedTriggeringPolicy size="50MB"/>
      <DefaultRolloverStrategy max="5"/>
    </RollingFile>
    <RollingFile name="controller" fileName="${logDir}/controller.log"
                 filePattern="${logDir}/controller.log.%i">
      <PatternLayout pattern="${pattern}"/>
      <SizeBasedTriggeringPolicy size="50MB"/>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
    <RollingFile name="stateChange" fileName="${logDir}/state-change.log"
                 filePattern="${logDir}/state-change.log.%i">
      <PatternLayout pattern="${pattern}"/>
      <SizeBasedTriggeringPolicy size="50MB"/>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
  </Appenders>
  <Loggers>
    <Root level="INFO">
      <AppenderRef ref="server"/>
    </Root>
    <Logger name="org.apache.kafka.controller" level="INFO" additivity="false">
      <AppenderRef ref="controller"/>
    </Logger>
    <Logger name="kafka.controller" level="INFO" additivity="false">
      <AppenderRef ref="controller"/>
    </Logger>
    <Logger name="state.change.logger" level="INFO" additivity="false">
      <AppenderRef ref="stateChange"/>
    </Logger>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="kafka.log.LogCleaner" level="INFO"/>
  </Loggers>
</Configuration>
"""


def log4j2_xml(np: NodePaths) -> str:
    return _LOG4J2_XML.replace("@LOG_DIR@", escape(str(np.logs_dir)))


def write_configs(cfg: StackConfig, np: NodePaths) -> None:
    np.config_dir.mkdir(parents=True, exist_ok=True)
    np.logs_dir.mkdir(parents=True, exist_ok=True)
    # Mode 0600: the secured broker's holds its keystore's and its SCRAM user's passwords.
    np.server_properties.touch(mode=0o600)
    np.server_properties.chmod(0o600)
    np.server_properties.write_text(server_properties(cfg, np), encoding="utf-8")
    np.log4j_config.write_text(log4j2_xml(np), encoding="utf-8")
