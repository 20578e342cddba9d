"""Where the local development stack (Kafka in KRaft mode + Redis) lives and listens.

Built from the `Settings` (``STREAMTALLY_STATE_DIR``, ``STREAMTALLY_KAFKA_PORT``,
``STREAMTALLY_CONTROLLER_PORT``, ``STREAMTALLY_REDIS_PORT``,
``STREAMTALLY_REGISTRY_PORT``, ``STREAMTALLY_KAFKA_JVM_OPTS``, ``STREAMTALLY_STACK_CACHE``; see
`streamtally.settings`), never from the environment directly, and from the
stack's *shape*: how many Kafka brokers, and whether Redis is a 3-master Redis
Cluster.  ``stack up --brokers N`` / ``--redis-cluster`` choose the shape;
each ``up`` records it in ``<state>/stack.json``, so that later commands
(``status``, ``down``, a plain ``up``) handle the same nodes.

Ports, for node ``i`` (1-based) of ``N`` brokers and the Redis Cluster's
three masters:

==========================  ==============================================
Kafka broker ``i``          ``kafka_port + 2 (i - 1)``: 9092, 9094, 9096
Kafka controller ``i``      ``controller_port + 2 (i - 1)``: 9093, 9095, 9097
Redis (single)              ``redis_port``: 6379
Redis Cluster master ``i``  ``redis_port + (i - 1)``: 6379, 6380, 6381
its cluster bus             that port + 10000: 16379, 16380, 16381
schema registry             ``registry_port``: 8081 (``stack up --registry``)
==========================  ==============================================

The first broker and the first Redis keep the configured ports, so the
default ``KAFKA_BOOTSTRAP_SERVERS`` and ``REDIS_URL`` reach either shape.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from streamtally.errors import StackError
from streamtally.ops.build_cache import BuildCache
from streamtally.settings import LOCAL_HOST, Settings

__all__ = [
    "BROKER_COUNTS",
    "KAFKA_PORT_STEP",
    "REDIS_BUS_OFFSET",
    "REDIS_CLUSTER_MASTERS",
    "KafkaNode",
    "StackConfig",
    "StackShape",
    "read_shape",
    "record_shape",
]

#: The broker counts `stack up --brokers` takes: each node is also a KRaft controller,
#: and an odd quorum is the one a failure needs a majority of.
BROKER_COUNTS: Final = (1, 3, 5)
#: Node i's broker and controller ports are the configured ones + KAFKA_PORT_STEP * (i - 1).
KAFKA_PORT_STEP: Final = 2
#: Masters of the local Redis Cluster (no replicas: one machine).
REDIS_CLUSTER_MASTERS: Final = 3
#: A Redis Cluster node's bus port is its port + this (Redis' default).
REDIS_BUS_OFFSET: Final = 10000
_MAX_PORT: Final = 65535
_SHAPE_FILE: Final = "stack.json"
_PORT_SETTINGS: Final = (
    "set STREAMTALLY_KAFKA_PORT, STREAMTALLY_CONTROLLER_PORT, STREAMTALLY_REDIS_PORT or "
    "STREAMTALLY_REGISTRY_PORT apart "
    f"(broker i uses the kafka port + {KAFKA_PORT_STEP}(i-1), controller i the controller "
    f"port + {KAFKA_PORT_STEP}(i-1); Redis Cluster master i the redis port + (i-1) and that "
    f"+ {REDIS_BUS_OFFSET} for its bus)"
)


@dataclass(frozen=True, slots=True)
class StackShape:
    """How many Kafka brokers the stack runs, and whether its Redis is a Redis Cluster."""

    brokers: int = 1
    redis_cluster: bool = False
    #: Kafka on SASL_SSL (SCRAM) and Redis on TLS with an ACL user (`stack up --secure`).
    secure: bool = False

    def describe(self) -> str:
        kafka = "1 Kafka broker" if self.brokers == 1 else f"{self.brokers} Kafka brokers"
        redis = f"a Redis Cluster of {REDIS_CLUSTER_MASTERS} masters" if self.redis_cluster else ""
        tail = ", secured (Kafka SASL_SSL with SCRAM, Redis TLS with an ACL user)"
        return f"{kafka} and {redis or 'one Redis'}{tail if self.secure else ''}"


def _shape_file(state_dir: Path) -> Path:
    return state_dir / _SHAPE_FILE


def read_shape(state_dir: Path) -> StackShape:
    """The shape the stack under `state_dir` was last started with (one broker, one Redis
    if it never was, or if ``stack.json`` cannot be read).
    """
    try:
        data = json.loads(_shape_file(state_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return StackShape()
    if not isinstance(data, dict):
        return StackShape()
    brokers = data.get("brokers", 1)
    cluster = data.get("redis_cluster", False)
    secure = data.get("secure", False)
    return StackShape(
        brokers=brokers if brokers in BROKER_COUNTS else 1,
        redis_cluster=cluster if isinstance(cluster, bool) else False,
        secure=secure if isinstance(secure, bool) else False,
    )


def record_shape(
    state_dir: Path,
    *,
    brokers: int | None = None,
    redis_cluster: bool | None = None,
    secure: bool | None = None,
) -> None:
    """Remember the broker count, Redis mode and/or security the stack is started with."""
    current = read_shape(state_dir)
    shape = dataclasses.replace(
        current,
        brokers=current.brokers if brokers is None else brokers,
        redis_cluster=current.redis_cluster if redis_cluster is None else redis_cluster,
        secure=current.secure if secure is None else secure,
    )
    if shape == current and _shape_file(state_dir).exists():
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    target = _shape_file(state_dir)
    tmp = target.with_name(target.name + ".tmp")
    body = {"brokers": shape.brokers, "redis_cluster": shape.redis_cluster}
    if shape.secure:  # absent: plaintext, as every stack.json written before it says
        body["secure"] = True
    tmp.write_text(json.dumps(body) + "\n", encoding="utf-8")
    tmp.replace(target)


@dataclass(frozen=True, slots=True)
class KafkaNode:
    """One KRaft node of the local Kafka: a broker and a controller in one JVM."""

    node_id: int
    port: int
    controller_port: int


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Where the local stack lives, its shape, and which loopback ports it uses."""

    state_dir: Path
    kafka_port: int = 9092
    controller_port: int = 9093
    redis_port: int = 6379
    #: The schema registry's (`streamtally.stack.registry`); checked apart from the
    #: others whether or not the registry runs, so that `--registry` can always start.
    registry_port: int = 8081
    host: str = LOCAL_HOST
    #: Kafka nodes (each broker + controller; a KRaft quorum of all of them).
    brokers: int = 1
    #: Redis as a Redis Cluster of REDIS_CLUSTER_MASTERS masters instead of one server.
    redis_cluster: bool = False
    #: Kafka on SASL_SSL with SCRAM users, Redis on TLS with an ACL user
    #: (`streamtally.stack.secure`); one broker and one Redis only.
    secure: bool = False
    #: The Kafka JVM's options (heap aside); None: `streamtally.stack.kafka.JVM_OPTS`.
    kafka_jvm_opts: tuple[str, ...] | None = None
    #: Where assembled Kafka jars and registry builds are kept for other state dirs
    #: (`Settings.stack_cache`); None: nowhere.
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.brokers not in BROKER_COUNTS:
            allowed = ", ".join(map(str, BROKER_COUNTS))
            raise StackError(f"--brokers must be one of {allowed}, not {self.brokers}")
        if self.secure and (self.brokers != 1 or self.redis_cluster):
            raise StackError(
                "--secure runs one Kafka broker and one Redis: `streamtally stack down`, then "
                "`streamtally stack up --secure --brokers 1 --no-redis-cluster`"
            )
        ports = self.named_ports()
        single = self.brokers == 1 and not self.redis_cluster
        if single and len({port for _, port in ports}) != len(ports):  # the message it always had
            raise StackError(
                f"kafka ({self.kafka_port}), controller ({self.controller_port}), "
                f"redis ({self.redis_port}) and registry ({self.registry_port}) ports must "
                "differ: set STREAMTALLY_KAFKA_PORT, STREAMTALLY_CONTROLLER_PORT, "
                "STREAMTALLY_REDIS_PORT or STREAMTALLY_REGISTRY_PORT"
            )
        too_high = [f"{name} ({port})" for name, port in ports if port > _MAX_PORT]
        if too_high:
            raise StackError(
                f"{', '.join(too_high)}: past port {_MAX_PORT}; lower the ports: {_PORT_SETTINGS}"
            )
        uses = Counter(port for _, port in ports)
        clashes = sorted(port for port, n in uses.items() if n > 1)
        if clashes:
            port = clashes[0]
            names = " and ".join(name for name, p in ports if p == port)
            raise StackError(f"{names} ports must differ (both {port}): {_PORT_SETTINGS}")

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        brokers: int | None = None,
        redis_cluster: bool | None = None,
        secure: bool | None = None,
    ) -> StackConfig:
        """The stack of `settings`; a shape not given is the one it was last started with."""
        state_dir = settings.state_dir.resolve()
        shape = read_shape(state_dir)
        return cls(
            state_dir=state_dir,
            kafka_port=settings.kafka_port,
            controller_port=settings.controller_port,
            redis_port=settings.redis_port,
            registry_port=settings.registry_port,
            brokers=shape.brokers if brokers is None else brokers,
            redis_cluster=shape.redis_cluster if redis_cluster is None else redis_cluster,
            secure=shape.secure if secure is None else secure,
            kafka_jvm_opts=settings.kafka_jvm_opts,
            cache_dir=settings.stack_cache,
        )

    @property
    def shape(self) -> StackShape:
        return StackShape(self.brokers, self.redis_cluster, self.secure)

    def with_shape(self, shape: StackShape) -> StackConfig:
        return dataclasses.replace(
            self, brokers=shape.brokers, redis_cluster=shape.redis_cluster, secure=shape.secure
        )

    @property
    def secure_dir(self) -> Path:
        """The secured stack's CA, certificates and generated passwords (mode 0700)."""
        return self.state_dir / "secure"

    def cache(self, kind: str) -> BuildCache | None:
        """The kept builds of `kind` (``kafka-jars``, ``registry``), or None without a cache."""
        return None if self.cache_dir is None else BuildCache(self.cache_dir / kind, keep=2)

    # -- Kafka -----------------------------------------------------------------------

    @property
    def kafka_nodes(self) -> tuple[KafkaNode, ...]:
        return tuple(
            KafkaNode(
                node_id=i + 1,
                port=self.kafka_port + KAFKA_PORT_STEP * i,
                controller_port=self.controller_port + KAFKA_PORT_STEP * i,
            )
            for i in range(self.brokers)
        )

    @property
    def kafka_dir(self) -> Path:
        """The Kafka jars (``lib/``), and the single broker's files."""
        return self.state_dir / "kafka"

    @property
    def kafka_cluster_dir(self) -> Path:
        """Where this broker count keeps its cluster id and nodes (each count its own; the
        secured broker its own too: its storage holds the SCRAM users)."""
        if self.secure:
            return self.kafka_dir / "secure"
        if self.brokers == 1:
            return self.kafka_dir
        return self.kafka_dir / f"brokers-{self.brokers}"

    def kafka_node_dir(self, node: KafkaNode) -> Path:
        if self.brokers == 1:
            return self.kafka_cluster_dir
        return self.kafka_cluster_dir / f"node-{node.node_id}"

    def controller_quorum_voters(self) -> str:
        return ",".join(f"{n.node_id}@{self.host}:{n.controller_port}" for n in self.kafka_nodes)

    def local_bootstrap_servers(self) -> str:
        """The first broker: what the settings default to, enough to find the others."""
        return f"{self.host}:{self.kafka_port}"

    def all_bootstrap_servers(self) -> str:
        """Every broker, comma-separated (clients then start with any one of them down)."""
        return ",".join(f"{self.host}:{n.port}" for n in self.kafka_nodes)

    # -- Redis -----------------------------------------------------------------------

    @property
    def redis_dir(self) -> Path:
        return self.state_dir / ("redis-secure" if self.secure else "redis")

    @property
    def redis_cluster_dir(self) -> Path:
        return self.state_dir / "redis-cluster"

    @property
    def redis_cluster_ports(self) -> tuple[int, ...]:
        return tuple(self.redis_port + i for i in range(REDIS_CLUSTER_MASTERS))

    def local_redis_url(self) -> str:
        """The (first) Redis: in cluster mode a client finds the other masters from it."""
        scheme = "rediss" if self.secure else "redis"  # TLS; the user and password: `stack env`
        return f"{scheme}://{self.host}:{self.redis_port}/0"

    # -- schema registry -------------------------------------------------------------

    @property
    def registry_dir(self) -> Path:
        """The registry's build, its data (schemas and ids) and logs."""
        return self.state_dir / "registry"

    def local_registry_url(self) -> str:
        """Its Confluent-compatible API: what ``STREAMTALLY_SCHEMA_REGISTRY_URL`` names."""
        return f"http://{self.host}:{self.registry_port}/apis/ccompat/v7"

    # -- every port ------------------------------------------------------------------

    def named_ports(self) -> list[tuple[str, int]]:
        """Every port the stack listens on, with what it is for."""
        if self.brokers == 1:
            ports = [("kafka", self.kafka_port), ("controller", self.controller_port)]
        else:
            ports = []
            for n in self.kafka_nodes:
                ports += [(f"kafka broker {n.node_id}", n.port)]
                ports += [(f"kafka controller {n.node_id}", n.controller_port)]
        if not self.redis_cluster:
            ports += [("redis", self.redis_port)]
        else:
            for i, port in enumerate(self.redis_cluster_ports, start=1):
                ports += [(f"redis master {i}", port), (f"redis bus {i}", port + REDIS_BUS_OFFSET)]
        return [*ports, ("registry", self.registry_port)]
