"""Worker settings, read once from the environment into frozen data."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from streamtally.errors import InputError
from streamtally.ops.stack.config import bootstrap_servers, redis_url, repo_root

__all__ = ["WorkerSettings"]


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    bootstrap_servers: str
    redis_url: str
    prices: Path
    #: Seconds a request may stay quiet before it is closed as `error`.
    request_timeout: float = 300.0
    #: Raw records taken per batch (one Redis round trip and one produce flush each).
    batch_size: int = 2000
    #: Seconds to wait for a batch to fill (one Kafka flush and one Redis call per batch).
    batch_within: float = 0.05
    #: Seconds without heartbeats before the group gives a dead worker's partitions away.
    session_timeout: float = 10.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        env = os.environ if environ is None else environ
        try:
            timeout = float(env.get("STREAMTALLY_REQUEST_TIMEOUT", "300"))
            batch = int(env.get("STREAMTALLY_BATCH_SIZE", "2000"))
        except ValueError as exc:
            raise InputError(f"bad worker setting: {exc}") from exc
        return cls(
            bootstrap_servers=bootstrap_servers(),
            redis_url=redis_url(),
            prices=Path(
                env.get("STREAMTALLY_PRICES", str(repo_root() / "samples" / "prices.json"))
            ),
            request_timeout=timeout,
            batch_size=batch,
        )
