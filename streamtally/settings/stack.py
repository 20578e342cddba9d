"""The local stack: its ports, its state directory and the Java of its registry
(`streamtally.stack`; docs/operations.md); and where this machine keeps builds of the
compiled hot path (`streamtally.ops.native`)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Final, Self

from pydantic import BaseModel, Field, field_validator, model_validator

from streamtally._native import OFF_WORDS
from streamtally.settings._base import LOCAL_HOST, env

__all__ = ["LEAN_JVM_OPTS", "StackSection", "project_root"]

#: ``STREAMTALLY_KAFKA_JVM_OPTS=lean``: for a stack that starts often and carries little (a
#: test run, a laptop): the client compiler only and the serial collector, about half the
#: CPU of the defaults to start a broker and to carry a load (docs/operations.md).
LEAN_JVM_OPTS: Final = (
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)


def project_root() -> Path | None:
    """The clone streamtally runs from (an editable install), or None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    marker = root / "pyproject.toml"
    if marker.is_file() and (root / "topics").is_dir() and (root / "processors").is_dir():
        return root
    return None


class StackSection(BaseModel):
    """The local stack's settings (a section of `Settings`)."""

    state_dir_setting: Path | None = Field(
        None, validation_alias=env("STREAMTALLY_STATE_DIR", "state_dir_setting")
    )
    xdg_state_home: Path | None = Field(
        None, validation_alias=env("XDG_STATE_HOME", "xdg_state_home")
    )
    kafka_port: int = Field(
        9092, ge=1, le=65535, validation_alias=env("STREAMTALLY_KAFKA_PORT", "kafka_port")
    )
    controller_port: int = Field(
        9093,
        ge=1,
        le=65535,
        validation_alias=env("STREAMTALLY_CONTROLLER_PORT", "controller_port"),
    )
    redis_port: int = Field(
        6379, ge=1, le=65535, validation_alias=env("STREAMTALLY_REDIS_PORT", "redis_port")
    )
    #: The schema registry of `stack up --registry` (Confluent's usual port).
    registry_port: int = Field(
        8081,
        ge=1,
        le=65535,
        validation_alias=env("STREAMTALLY_REGISTRY_PORT", "registry_port"),
    )
    #: The Java that builds and runs that registry (a ``java`` binary or a Java home);
    #: None: the first JDK 17+ of ``JAVA_HOME``, ``PATH`` and ``/usr/lib/jvm``.
    registry_java: Path | None = Field(
        None, validation_alias=env("STREAMTALLY_REGISTRY_JAVA", "registry_java")
    )

    #: The Kafka JVM's GC and compiler options (heap aside): empty for the defaults
    #: (`streamtally.stack.kafka.JVM_OPTS`), ``lean`` for `LEAN_JVM_OPTS`, or the options
    #: themselves, split as a shell would.
    kafka_jvm_opts_setting: str = Field(
        "", validation_alias=env("STREAMTALLY_KAFKA_JVM_OPTS", "kafka_jvm_opts_setting")
    )

    #: Where finished builds of the compiled hot path are kept for reuse; ``off``: nowhere.
    native_cache_setting: str = Field(
        "", validation_alias=env("STREAMTALLY_NATIVE_CACHE", "native_cache_setting")
    )
    #: Where the local stack keeps the Kafka jars and registry builds it assembled, for other
    #: state dirs and clones; ``off``: nowhere.
    stack_cache_setting: str = Field(
        "", validation_alias=env("STREAMTALLY_STACK_CACHE", "stack_cache_setting")
    )
    xdg_cache_home: Path | None = Field(
        None, validation_alias=env("XDG_CACHE_HOME", "xdg_cache_home")
    )

    @field_validator("kafka_jvm_opts_setting")
    @classmethod
    def _splits(cls, value: str) -> str:
        try:
            shlex.split(value)
        except ValueError as exc:  # an unclosed quote
            raise ValueError(f"STREAMTALLY_KAFKA_JVM_OPTS: {exc} in {value!r}") from exc
        return value

    @model_validator(mode="after")
    def _ports_differ(self) -> Self:
        ports = [self.kafka_port, self.controller_port, self.redis_port, self.registry_port]
        if len(set(ports)) != len(ports):
            raise ValueError(
                f"kafka ({self.kafka_port}), controller ({self.controller_port}), redis "
                f"({self.redis_port}) and registry ({self.registry_port}) ports must differ: "
                "set STREAMTALLY_KAFKA_PORT, STREAMTALLY_CONTROLLER_PORT, STREAMTALLY_REDIS_PORT "
                "or STREAMTALLY_REGISTRY_PORT"
            )
        return self

    @property
    def local_bootstrap_servers(self) -> str:
        return f"{LOCAL_HOST}:{self.kafka_port}"

    @property
    def local_redis_url(self) -> str:
        return f"redis://{LOCAL_HOST}:{self.redis_port}/0"

    @property
    def kafka_jvm_opts(self) -> tuple[str, ...] | None:
        """The Kafka JVM options set (``lean`` expanded), or None for the defaults."""
        value = self.kafka_jvm_opts_setting.strip()
        if not value:
            return None
        if value.lower() == "lean":
            return LEAN_JVM_OPTS
        return tuple(shlex.split(value))

    def _cache_folder(self, setting: str, name: str) -> Path | None:
        value = setting.strip()
        if value.lower() in OFF_WORDS:
            return None
        if value:
            return Path(value).expanduser()
        return (self.xdg_cache_home or Path.home() / ".cache") / "streamtally" / name

    @property
    def native_cache(self) -> Path | None:
        """The build cache's folder (``$XDG_CACHE_HOME/streamtally/native`` unless set), or
        None when it is off."""
        return self._cache_folder(self.native_cache_setting, "native")

    @property
    def stack_cache(self) -> Path | None:
        """The local stack's cache of assembled jars and builds
        (``$XDG_CACHE_HOME/streamtally/stack`` unless set), or None when it is off."""
        return self._cache_folder(self.stack_cache_setting, "stack")

    @property
    def state_dir(self) -> Path:
        if self.state_dir_setting is not None:
            return self.state_dir_setting.expanduser().resolve()
        root = project_root()
        if root is not None:
            return root / ".stack"
        base = self.xdg_state_home or Path.home() / ".local" / "state"
        return base / "streamtally"
