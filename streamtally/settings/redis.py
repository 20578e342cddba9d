"""Redis: which one (one server or a Redis Cluster) and the CA of a ``rediss://`` one."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from streamtally.settings._base import env

__all__ = ["RedisSection"]


class RedisSection(BaseModel):
    """The Redis settings (a section of `Settings`)."""

    redis_url_setting: str | None = Field(
        None, validation_alias=env("REDIS_URL", "redis_url_setting")
    )
    #: The Redis at `redis_url` is a Redis Cluster: clients must use cluster mode
    #: (`streamtally stack up --redis-cluster` runs one and prints ``REDIS_CLUSTER=1``).
    redis_cluster: bool = Field(False, validation_alias=env("REDIS_CLUSTER", "redis_cluster"))
    #: The CA (PEM) a ``rediss://`` Redis's certificate must chain to (`redis_url` adds it
    #: to the URL as ``ssl_ca_certs``); None: the system's CAs.
    redis_ssl_cafile: Path | None = Field(
        None, validation_alias=env("REDIS_SSL_CAFILE", "redis_ssl_cafile")
    )
