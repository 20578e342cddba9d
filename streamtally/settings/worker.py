"""The worker: its prices, timeouts, limits, batches, group membership, web server and trust
file (docs/operations.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Self

from pydantic import BaseModel, Field, field_validator, model_validator

from streamtally.settings._base import LOCAL_HOST, env

__all__ = ["DEFAULT_STATE_TTL_S", "SOURCE_NAMES", "WorkerSection", "parse_request_timeouts"]

#: `Settings.session_timeout` unless set (seconds): a dynamic member's, and a static one's.
#: A dynamic member that stops heartbeating is given up after 10 s; a static member keeps
#: its partitions through a restart, so its session must outlast one (Kafka's own default
#: for its Java consumer is 45 s since 3.0).
DYNAMIC_SESSION_TIMEOUT_S: Final = 10.0
STATIC_SESSION_TIMEOUT_S: Final = 45.0
#: The session timeouts a broker accepts by default (``group.min.session.timeout.ms``,
#: ``group.max.session.timeout.ms``: 6 s and 30 min; the local stack keeps them).
MIN_SESSION_TIMEOUT_S: Final = 6.0
MAX_SESSION_TIMEOUT_S: Final = 1800.0
#: The shortest session a static member may have: a restart in place takes 2-4 s on the
#: development machine (docs/scaling.md, "Restarts"); a session that ends before the
#: worker is back gives its partitions away after all (two rebalances instead of none).
MIN_STATIC_SESSION_TIMEOUT_S: Final = 15.0

#: `Settings.state_ttl` unless set: 8 days, in seconds.
DEFAULT_STATE_TTL_S: Final = 8 * 24 * 3600


class WorkerSection(BaseModel):
    """The worker's settings (a section of `Settings`)."""

    prices_path: Path | None = Field(
        None, validation_alias=env("STREAMTALLY_PRICES", "prices_path")
    )
    #: Seconds a request may stay quiet before it is closed as `error`.
    request_timeout: float = Field(
        300.0, gt=0, validation_alias=env("STREAMTALLY_REQUEST_TIMEOUT", "request_timeout")
    )
    #: Seconds a request of a source may stay quiet, over `request_timeout`, by source name:
    #: ``anthropic=600,openai-responses=3600`` (`parse_request_timeouts`).
    request_timeouts: dict[str, float] = Field(
        default_factory=dict,
        validation_alias=env("STREAMTALLY_REQUEST_TIMEOUTS", "request_timeouts"),
    )

    @field_validator("request_timeouts", mode="before")
    @classmethod
    def _timeouts_parsed(cls, value: object) -> object:
        """The variable's text parsed; a mapping (built in code) checked the same way."""
        if isinstance(value, str):
            return parse_request_timeouts(value)
        if isinstance(value, Mapping):
            return parse_request_timeouts(
                ",".join(f"{name}={seconds}" for name, seconds in value.items())
            )
        return value

    def timeout_of(self, source: str) -> float:
        """Seconds a request of `source` (its name) may stay quiet before it closes."""
        return self.request_timeouts.get(source, self.request_timeout)

    @property
    def longest_request_timeout(self) -> float:
        """The longest of `request_timeout` and the per-source ones."""
        return max([self.request_timeout, *self.request_timeouts.values()])

    #: Raw records taken per batch (one Redis round trip and one produce flush each).
    batch_size: int = Field(
        2000, ge=1, le=100_000, validation_alias=env("STREAMTALLY_BATCH_SIZE", "batch_size")
    )
    #: Records one request may have; more are dead-lettered (its end marker is always taken).
    max_records_per_request: int = Field(
        100_000,
        ge=1,
        validation_alias=env("STREAMTALLY_MAX_RECORDS_PER_REQUEST", "max_records_per_request"),
    )
    #: Requests a worker holds open at once; a new one past it is dead-lettered.
    max_open_requests: int = Field(
        100_000,
        ge=1,
        validation_alias=env("STREAMTALLY_MAX_OPEN_REQUESTS", "max_open_requests"),
    )
    #: Requests one tenant may have open at once in a worker.
    max_open_per_tenant: int = Field(
        20_000,
        ge=1,
        validation_alias=env("STREAMTALLY_MAX_OPEN_PER_TENANT", "max_open_per_tenant"),
    )
    #: UTF-8 bytes of text, reasoning and tool arguments one request keeps (a prefix beyond).
    max_text_bytes: int = Field(
        4 << 20,
        ge=0,
        le=6 << 20,  # the Tokens record must fit the tokens topic's 8 MiB
        validation_alias=env("STREAMTALLY_MAX_TEXT_BYTES", "max_text_bytes"),
    )
    #: UTF-8 bytes one SSE event sent in parts may have once joined (`PART_EVENT`); the
    #: part that passes it is dead-lettered and its request closed (a record limit).
    max_event_bytes: int = Field(
        64 << 20,
        ge=1,
        validation_alias=env("STREAMTALLY_MAX_EVENT_BYTES", "max_event_bytes"),
    )
    #: Seconds Redis keeps a request's Tokens, its close marker and dead-letter marks after
    #: they are written (0: for ever).  The default, 8 days, is the raw topics' retention
    #: (7 days) plus their segment roll (1 day): the longest a raw record can be read again,
    #: so no replay finds a request whose marker is gone (tests/unit/cli/test_settings.py).
    state_ttl: int = Field(
        DEFAULT_STATE_TTL_S, ge=0, validation_alias=env("STREAMTALLY_STATE_TTL", "state_ttl")
    )
    #: Seconds to wait for a batch to fill.
    batch_within: float = Field(0.05, gt=0)
    #: Bytes of raw records the broker gathers before it answers the worker's fetch
    #: (Kafka's ``fetch.min.bytes``), unless `fetch_wait` passes first: fewer, fuller
    #: batches under load, each paying the batch's fixed costs once (docs/scaling.md).
    fetch_min_bytes: int = Field(
        32 << 10,
        ge=1,
        le=8 << 20,  # at most a partition's fetch (`processors.source.PARTITION_FETCH_BYTES`)
        validation_alias=env("STREAMTALLY_FETCH_MIN_BYTES", "fetch_min_bytes"),
    )
    #: Seconds the broker holds a fetch for `fetch_min_bytes` (``fetch.max.wait.ms``): the
    #: longest a record waits at the broker for the ones after it, also when records are
    #: scarce, and how often an idle worker asks.
    fetch_wait: float = Field(
        0.01, ge=0.001, le=0.5, validation_alias=env("STREAMTALLY_FETCH_WAIT", "fetch_wait")
    )
    #: The worker's static member id in the processors' group (Kafka's
    #: ``group.instance.id``; ``streamtally worker --instance-id`` wins): a worker that
    #: restarts with the same id within its session gets its partitions back without a
    #: rebalance.  One id per worker (a systemd unit's instance, a StatefulSet pod's name),
    #: never two live workers with one: the later fences the earlier, which stops
    #: (`streamtally.processors.source.MembershipLost`).  None: a dynamic member, each
    #: start a new one.
    worker_instance_id: str | None = Field(
        None,
        min_length=1,
        max_length=249,
        pattern=r"^[A-Za-z0-9._-]+$",
        validation_alias=env("STREAMTALLY_WORKER_INSTANCE_ID", "worker_instance_id"),
    )
    #: Seconds without heartbeats before the group gives a worker's partitions away (None:
    #: `DYNAMIC_SESSION_TIMEOUT_S`, or `STATIC_SESSION_TIMEOUT_S` with an instance id); read
    #: it as `session_timeout`.  Within the broker's default bounds, and for a static member
    #: at least `MIN_STATIC_SESSION_TIMEOUT_S`.
    session_timeout_setting: float | None = Field(
        None,
        ge=MIN_SESSION_TIMEOUT_S,
        le=MAX_SESSION_TIMEOUT_S,
        validation_alias=env("STREAMTALLY_SESSION_TIMEOUT", "session_timeout_setting"),
    )

    @model_validator(mode="after")
    def _static_session_outlasts_a_restart(self) -> Self:
        given = self.session_timeout_setting
        if (
            self.worker_instance_id is not None
            and given is not None
            and given < MIN_STATIC_SESSION_TIMEOUT_S
        ):
            raise ValueError(
                f"STREAMTALLY_SESSION_TIMEOUT={given:g}: a worker with an instance id "
                f"(STREAMTALLY_WORKER_INSTANCE_ID) needs a session of at least "
                f"{MIN_STATIC_SESSION_TIMEOUT_S:g} s, to outlast its restart"
            )
        return self

    @property
    def session_timeout(self) -> float:
        """Seconds without heartbeats before the group gives a worker's partitions away."""
        if self.session_timeout_setting is not None:
            return self.session_timeout_setting
        if self.worker_instance_id is not None:
            return STATIC_SESSION_TIMEOUT_S
        return DYNAMIC_SESSION_TIMEOUT_S

    #: Where the worker serves /metrics, /health and /ready (`processors.metrics`).
    web_host: str = Field(
        LOCAL_HOST, min_length=1, validation_alias=env("STREAMTALLY_WEB_HOST", "web_host")
    )
    #: Their port; 0: the worker serves none of them.
    web_port: int = Field(
        6066, ge=0, le=65535, validation_alias=env("STREAMTALLY_WEB_PORT", "web_port")
    )
    #: The worker's trust file (`streamtally.wire.tenant_keys`): with one, a raw record
    #: bills its tenant only when signed by a key that may claim it; without, every
    #: producer is trusted.
    tenant_keys_path: Path | None = Field(
        None, validation_alias=env("STREAMTALLY_TENANT_KEYS", "tenant_keys_path")
    )


#: The sources a request timeout can be set for: `streamtally.core.models.Source`'s values
#: (settings sit below core; tests/unit/cli/test_settings.py checks that they agree).
SOURCE_NAMES: Final = (
    "openai",
    "openai-responses",
    "anthropic",
    "gemini",
    "dynamo",
    "vllm",
    "atomr",
)


def parse_request_timeouts(text: str) -> dict[str, float]:
    """``STREAMTALLY_REQUEST_TIMEOUTS``: comma-separated ``source=seconds`` pairs (blank:
    none); a `ValueError` names what is wrong: a pair without ``=``, an unknown source, one
    given twice, seconds that are not a finite number > 0."""
    found: dict[str, float] = {}
    for item in text.split(","):
        pair = item.strip()
        if not pair:
            continue
        name, sep, number = (part.strip() for part in pair.partition("="))
        if not sep:
            raise ValueError(f"{pair!r} is not source=seconds (e.g. anthropic=600)")
        if name not in SOURCE_NAMES:
            raise ValueError(f"unknown source {name!r}: one of {', '.join(SOURCE_NAMES)}")
        if name in found:
            raise ValueError(f"source {name!r} is given twice")
        try:
            seconds = float(number)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"{name}={number!r}: seconds must be a finite number > 0")
        found[name] = seconds
    return found
