"""Where the local development stack (Kafka in KRaft mode + Redis) lives and listens.

Built from the `Settings` (``STREAMTALLY_STATE_DIR``, ``STREAMTALLY_KAFKA_PORT``,
``STREAMTALLY_CONTROLLER_PORT``, ``STREAMTALLY_REDIS_PORT``; see
`streamtally.settings`), never from the environment directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from streamtally.errors import StackError
from streamtally.settings import LOCAL_HOST, Settings

__all__ = ["StackConfig"]


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Where the local stack lives and which loopback ports it uses."""

    state_dir: Path
    kafka_port: int = 9092
    controller_port: int = 9093
    redis_port: int = 6379
    host: str = LOCAL_HOST

    def __post_init__(self) -> None:
        ports = [self.kafka_port, self.controller_port, self.redis_port]
        if len(set(ports)) != len(ports):
            raise StackError(
                f"kafka ({self.kafka_port}), controller ({self.controller_port}) and "
                f"redis ({self.redis_port}) ports must differ: set STREAMTALLY_KAFKA_PORT, "
                "STREAMTALLY_CONTROLLER_PORT or STREAMTALLY_REDIS_PORT"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> StackConfig:
        return cls(
            state_dir=settings.state_dir.resolve(),
            kafka_port=settings.kafka_port,
            controller_port=settings.controller_port,
            redis_port=settings.redis_port,
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
