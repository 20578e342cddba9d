"""Configuration of the local development stack (Kafka in KRaft mode + Redis).

Everything comes from the environment, read once into a frozen dataclass:

==============================  =====================================  =========
variable                        meaning                                default
==============================  =====================================  =========
``STREAMTALLY_STATE_DIR``       jars, configs, data, logs, pid files   ``<repo>/.stack``
``STREAMTALLY_KAFKA_PORT``      Kafka client listener (PLAINTEXT)      ``9092``
``STREAMTALLY_CONTROLLER_PORT`` KRaft controller listener              ``9093``
``STREAMTALLY_REDIS_PORT``      Redis                                  ``6379``
``KAFKA_BOOTSTRAP_SERVERS``     use an existing cluster instead        (unset)
``REDIS_URL``                   use an existing Redis instead          (unset)
==============================  =====================================  =========

The project is always installed editable from its clone, so the repo root is
two levels above this package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from streamtally.errors import StackError

ENV_STATE_DIR = "STREAMTALLY_STATE_DIR"
ENV_KAFKA_PORT = "STREAMTALLY_KAFKA_PORT"
ENV_CONTROLLER_PORT = "STREAMTALLY_CONTROLLER_PORT"
ENV_REDIS_PORT = "STREAMTALLY_REDIS_PORT"
ENV_BOOTSTRAP_SERVERS = "KAFKA_BOOTSTRAP_SERVERS"
ENV_REDIS_URL = "REDIS_URL"

DEFAULT_KAFKA_PORT = 9092
DEFAULT_CONTROLLER_PORT = 9093
DEFAULT_REDIS_PORT = 6379
LOCAL_HOST = "127.0.0.1"


def repo_root() -> Path:
    """The clone this package is installed (editable) from."""
    return Path(__file__).resolve().parents[3]


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise StackError(f"{name}={raw!r} is not a port number (1-65535)") from None
    if not 1 <= value <= 65535:
        raise StackError(f"{name}={raw!r} is not a port number (1-65535)")
    return value


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Where the local stack lives and which loopback ports it uses."""

    state_dir: Path
    kafka_port: int = DEFAULT_KAFKA_PORT
    controller_port: int = DEFAULT_CONTROLLER_PORT
    redis_port: int = DEFAULT_REDIS_PORT
    host: str = LOCAL_HOST

    def __post_init__(self) -> None:
        ports = [self.kafka_port, self.controller_port, self.redis_port]
        if len(set(ports)) != len(ports):
            raise StackError(
                f"kafka ({self.kafka_port}), controller ({self.controller_port}) and "
                f"redis ({self.redis_port}) ports must differ: set {ENV_KAFKA_PORT}, "
                f"{ENV_CONTROLLER_PORT} or {ENV_REDIS_PORT}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StackConfig:
        env = os.environ if environ is None else environ
        raw_state = env.get(ENV_STATE_DIR, "").strip()
        state_dir = Path(raw_state).expanduser() if raw_state else repo_root() / ".stack"
        return cls(
            state_dir=state_dir.resolve(),
            kafka_port=_port(env, ENV_KAFKA_PORT, DEFAULT_KAFKA_PORT),
            controller_port=_port(env, ENV_CONTROLLER_PORT, DEFAULT_CONTROLLER_PORT),
            redis_port=_port(env, ENV_REDIS_PORT, DEFAULT_REDIS_PORT),
        )

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir / "kafka"

    @property
    def redis_dir(self) -> Path:
        return self.state_dir / "redis"

    def local_bootstrap_servers(self) -> str:
        return f"{self.host}:{self.kafka_port}"

    def local_redis_url(self) -> str:
        return f"redis://{self.host}:{self.redis_port}/0"


def bootstrap_servers(environ: Mapping[str, str] | None = None) -> str:
    """Kafka bootstrap servers: ``$KAFKA_BOOTSTRAP_SERVERS`` if set, else the local stack."""
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_BOOTSTRAP_SERVERS, "").strip()
    return explicit or StackConfig.from_env(env).local_bootstrap_servers()


def redis_url(environ: Mapping[str, str] | None = None) -> str:
    """Redis URL: ``$REDIS_URL`` if set, else the local stack."""
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_REDIS_URL, "").strip()
    return explicit or StackConfig.from_env(env).local_redis_url()
