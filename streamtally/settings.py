"""Every setting of streamtally, in one typed object read from the environment once.

`Settings.load()` is called by the entry point (`streamtally.cli.main`) and the
object is passed down; no other module reads the environment, and nothing
reads it at import time.  `Settings(...)` built in code reads nothing from the
environment: it is exactly what it is given (tests build it so).

==================================  ==============================================  =========
variable                            meaning                                         default
==================================  ==============================================  =========
``KAFKA_BOOTSTRAP_SERVERS``         Kafka to use                                    local stack
``REDIS_URL``                       Redis to use                                    local stack
``REDIS_CLUSTER``                   that Redis is a Redis Cluster (``1``/``0``)     ``0``
``STREAMTALLY_NAMESPACE``           prefix of topic names and the consumer group    ``streamtally``
``STREAMTALLY_PRICES``              price table (JSON)                              packaged
``STREAMTALLY_REQUEST_TIMEOUT``     seconds a request may stay quiet                ``300``
``STREAMTALLY_REQUEST_TIMEOUTS``    per source: ``anthropic=600,vllm=900``          none
``STREAMTALLY_BATCH_SIZE``          raw records per worker batch                    ``2000``
``STREAMTALLY_WORKER_INSTANCE_ID``  the worker's static group member id (Kafka's    none: dynamic
                                    ``group.instance.id``), one per worker
``STREAMTALLY_SESSION_TIMEOUT``     seconds the group waits for a silent worker     10; 45 static
``STREAMTALLY_WEB_HOST``            the worker's /metrics, /health, /ready address  ``127.0.0.1``
``STREAMTALLY_WEB_PORT``            their port (``0``: no server)                   ``6066``
``STREAMTALLY_CONTENT``             text kept downstream: full, redacted or none    ``full``
``STREAMTALLY_CONTENT_KEY``         file holding the HMAC key of ``redacted``       none
``STREAMTALLY_CHUNKS``              write the chunks topic (``on``/``off``)         ``on``
``STREAMTALLY_STATE_DIR``           the local stack's jars, data, logs              see below
``STREAMTALLY_KAFKA_PORT``          the local stack's Kafka listener                ``9092``
``STREAMTALLY_CONTROLLER_PORT``     the local stack's KRaft controller listener     ``9093``
``STREAMTALLY_REDIS_PORT``          the local stack's Redis                         ``6379``
``STREAMTALLY_REGISTRY_PORT``       the local stack's schema registry               ``8081``
``STREAMTALLY_REGISTRY_JAVA``       its JDK 17+ (``java`` or a Java home)           searched
``STREAMTALLY_TENANT_KEYS``         the worker's trust file (signed tenant claims)  none: trust all
``STREAMTALLY_PRODUCER_KEY``        the key file ``produce`` signs records with     none: unsigned
``STREAMTALLY_API_TOKENS``          ``streamtally api``'s tokens file (SHA-256s)    none
``KAFKA_SECURITY_PROTOCOL``         PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL      PLAINTEXT
``KAFKA_SASL_MECHANISM``            PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512           none
``KAFKA_SASL_USERNAME``             the SASL user                                   none
``KAFKA_SASL_PASSWORD``             its password (never printed)                    none
``KAFKA_SSL_CAFILE``                CA (PEM) of the brokers' certificates           system CAs
``KAFKA_SSL_CERTFILE``              client certificate (PEM), for mutual TLS        none
``KAFKA_SSL_KEYFILE``               its private key (PEM)                           none
``REDIS_SSL_CAFILE``                CA (PEM) of a ``rediss://`` Redis               system CAs
``STREAMTALLY_AVRO_FRAMING``        values written: single-object or confluent      single-object
``STREAMTALLY_SCHEMA_REGISTRY_URL`` Confluent REST API of the schema registry       none
``..._REGISTRY_USERNAME``           its basic-auth user                             none
``..._REGISTRY_PASSWORD``           its password (never printed)                    none
``..._REGISTRY_CAFILE``             CA (PEM) of an ``https://`` registry            system CAs
``..._REGISTRY_CERTFILE``           client certificate (PEM), for mutual TLS        none
``..._REGISTRY_KEYFILE``            its private key (PEM)                           none
``..._REGISTRY_TIMEOUT``            seconds one registry request may take           ``10``
==================================  ==============================================  =========

The state directory defaults to ``.stack`` in the clone when streamtally runs
from one (an editable install), else ``$XDG_STATE_HOME/streamtally`` (or
``~/.local/state/streamtally``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal, get_args
from urllib.parse import quote

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from streamtally.connection import KafkaConnection, SaslMechanism, SecurityProtocol
from streamtally.errors import InputError
from streamtally.redact import REDACTED, redact_servers, redact_text, redact_url

__all__ = [
    "AVRO_FRAMINGS",
    "ENV_BOOTSTRAP_SERVERS",
    "ENV_REDIS_CLUSTER",
    "ENV_REDIS_URL",
    "LOCAL_HOST",
    "SOURCE_NAMES",
    "VARIABLES",
    "AvroFraming",
    "Settings",
    "export",
    "parse_request_timeouts",
    "project_root",
]

LOCAL_HOST: Final = "127.0.0.1"
#: ``STREAMTALLY_AVRO_FRAMING``: how the values written are framed (docs/avro-framing.md).
AvroFraming = Literal["single-object", "confluent"]
AVRO_FRAMINGS: Final[tuple[str, ...]] = get_args(AvroFraming)
#: The variables that point every client at a stack of the user's own.
ENV_BOOTSTRAP_SERVERS: Final = "KAFKA_BOOTSTRAP_SERVERS"
ENV_REDIS_URL: Final = "REDIS_URL"
#: Says that the Redis of ``REDIS_URL`` (or the local stack's) is a Redis Cluster.
ENV_REDIS_CLUSTER: Final = "REDIS_CLUSTER"


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


def project_root() -> Path | None:
    """The clone streamtally runs from (an editable install), or None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent
    marker = root / "pyproject.toml"
    if marker.is_file() and (root / "topics").is_dir() and (root / "processors").is_dir():
        return root
    return None


def _env(name: str, field: str) -> AliasChoices:
    """Read from the environment variable `name`; built in code by the field's own name."""
    return AliasChoices(field, name)


class Settings(BaseSettings):
    """The settings of every streamtally command and of the worker (frozen)."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    kafka_bootstrap_servers: str | None = Field(
        None, validation_alias=_env("KAFKA_BOOTSTRAP_SERVERS", "kafka_bootstrap_servers")
    )
    redis_url_setting: str | None = Field(
        None, validation_alias=_env("REDIS_URL", "redis_url_setting")
    )
    #: The Redis at `redis_url` is a Redis Cluster: clients must use cluster mode
    #: (`streamtally stack up --redis-cluster` runs one and prints ``REDIS_CLUSTER=1``).
    redis_cluster: bool = Field(False, validation_alias=_env("REDIS_CLUSTER", "redis_cluster"))
    namespace: str = Field(
        "streamtally",
        pattern=r"^[A-Za-z0-9._-]+$",
        validation_alias=_env("STREAMTALLY_NAMESPACE", "namespace"),
    )
    prices_path: Path | None = Field(
        None, validation_alias=_env("STREAMTALLY_PRICES", "prices_path")
    )
    #: Seconds a request may stay quiet before it is closed as `error`.
    request_timeout: float = Field(
        300.0, gt=0, validation_alias=_env("STREAMTALLY_REQUEST_TIMEOUT", "request_timeout")
    )
    #: Seconds a request of a source may stay quiet, over `request_timeout`, by source name:
    #: ``anthropic=600,openai-responses=3600`` (`parse_request_timeouts`).
    request_timeouts: dict[str, float] = Field(
        default_factory=dict,
        validation_alias=_env("STREAMTALLY_REQUEST_TIMEOUTS", "request_timeouts"),
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
        2000, ge=1, le=100_000, validation_alias=_env("STREAMTALLY_BATCH_SIZE", "batch_size")
    )
    #: Records one request may have; more are dead-lettered (its end marker is always taken).
    max_records_per_request: int = Field(
        100_000,
        ge=1,
        validation_alias=_env("STREAMTALLY_MAX_RECORDS_PER_REQUEST", "max_records_per_request"),
    )
    #: Requests a worker holds open at once; a new one past it is dead-lettered.
    max_open_requests: int = Field(
        100_000, ge=1, validation_alias=_env("STREAMTALLY_MAX_OPEN_REQUESTS", "max_open_requests")
    )
    #: Requests one tenant may have open at once in a worker.
    max_open_per_tenant: int = Field(
        20_000,
        ge=1,
        validation_alias=_env("STREAMTALLY_MAX_OPEN_PER_TENANT", "max_open_per_tenant"),
    )
    #: UTF-8 bytes of text, reasoning and tool arguments one request keeps (a prefix beyond).
    max_text_bytes: int = Field(
        4 << 20,
        ge=0,
        le=6 << 20,  # the Tokens record must fit the tokens topic's 8 MiB
        validation_alias=_env("STREAMTALLY_MAX_TEXT_BYTES", "max_text_bytes"),
    )
    #: UTF-8 bytes one SSE event sent in parts may have once joined (`PART_EVENT`); the
    #: part that passes it is dead-lettered and its request closed (a record limit).
    max_event_bytes: int = Field(
        64 << 20,
        ge=1,
        validation_alias=_env("STREAMTALLY_MAX_EVENT_BYTES", "max_event_bytes"),
    )
    #: Seconds Redis keeps a request's Tokens, its close marker and dead-letter marks after
    #: they are written (0: for ever).  The default, 8 days, is the raw topics' retention
    #: (7 days) plus their segment roll (1 day): the longest a raw record can be read again,
    #: so no replay finds a request whose marker is gone (tests/unit/cli/test_settings.py).
    state_ttl: int = Field(
        DEFAULT_STATE_TTL_S, ge=0, validation_alias=_env("STREAMTALLY_STATE_TTL", "state_ttl")
    )
    # -- content policy (`streamtally.core.content`; docs/content-policy.md) --------------------
    #: What the worker keeps of text, reasoning and tool arguments in Redis and on the
    #: chunks, Tokens and dead-letter topics: ``full``, ``redacted`` (length and keyed
    #: hash) or ``none`` (length only).  Billing is the same under every policy.
    content: str = Field(
        "full",
        pattern=r"^(full|redacted|none)$",
        validation_alias=_env("STREAMTALLY_CONTENT", "content"),
    )
    #: The file holding the HMAC key of ``redacted`` (hex or base64, at least 32 bytes;
    #: read by the worker, never printed).  Required with ``redacted``.
    content_key_path: Path | None = Field(
        None, validation_alias=_env("STREAMTALLY_CONTENT_KEY", "content_key_path")
    )
    #: Whether the worker writes the chunks topic (``off``: no chunk leaves the worker).
    chunks_topic: bool = Field(True, validation_alias=_env("STREAMTALLY_CHUNKS", "chunks_topic"))

    @model_validator(mode="after")
    def _content_key_given(self) -> Settings:
        if self.content == "redacted" and self.content_key_path is None:
            raise ValueError(
                "STREAMTALLY_CONTENT=redacted needs STREAMTALLY_CONTENT_KEY, "
                "the file holding the key of its HMAC"
            )
        return self

    #: Seconds to wait for a batch to fill.
    batch_within: float = Field(0.05, gt=0)
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
        validation_alias=_env("STREAMTALLY_WORKER_INSTANCE_ID", "worker_instance_id"),
    )
    #: Seconds without heartbeats before the group gives a worker's partitions away (None:
    #: `DYNAMIC_SESSION_TIMEOUT_S`, or `STATIC_SESSION_TIMEOUT_S` with an instance id); read
    #: it as `session_timeout`.  Within the broker's default bounds, and for a static member
    #: at least `MIN_STATIC_SESSION_TIMEOUT_S`.
    session_timeout_setting: float | None = Field(
        None,
        ge=MIN_SESSION_TIMEOUT_S,
        le=MAX_SESSION_TIMEOUT_S,
        validation_alias=_env("STREAMTALLY_SESSION_TIMEOUT", "session_timeout_setting"),
    )

    @model_validator(mode="after")
    def _static_session_outlasts_a_restart(self) -> Settings:
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

    def with_instance_id(self, instance_id: str) -> Settings:
        """These settings with `worker_instance_id` set (checked as the variable would be:
        `InputError` naming what is wrong)."""
        try:
            return type(self).model_validate({**dict(self), "worker_instance_id": instance_id})
        except ValidationError as exc:
            raise InputError(_explain(exc)) from None

    #: Where the worker serves /metrics, /health and /ready (`processors.metrics`).
    web_host: str = Field(
        LOCAL_HOST, min_length=1, validation_alias=_env("STREAMTALLY_WEB_HOST", "web_host")
    )
    #: Their port; 0: the worker serves none of them.
    web_port: int = Field(
        6066, ge=0, le=65535, validation_alias=_env("STREAMTALLY_WEB_PORT", "web_port")
    )
    #: The worker's trust file (`streamtally.wire.tenant_keys`): with one, a raw record
    #: bills its tenant only when signed by a key that may claim it; without, every
    #: producer is trusted.
    tenant_keys_path: Path | None = Field(
        None, validation_alias=_env("STREAMTALLY_TENANT_KEYS", "tenant_keys_path")
    )
    #: The key file `streamtally produce` signs its records with (``--key-file`` wins).
    producer_key_path: Path | None = Field(
        None, validation_alias=_env("STREAMTALLY_PRODUCER_KEY", "producer_key_path")
    )
    # -- Kafka and Redis security (`streamtally.connection`; docs/security.md) -------------
    kafka_security_protocol: SecurityProtocol = Field(
        "PLAINTEXT", validation_alias=_env("KAFKA_SECURITY_PROTOCOL", "kafka_security_protocol")
    )
    kafka_sasl_mechanism: SaslMechanism | None = Field(
        None, validation_alias=_env("KAFKA_SASL_MECHANISM", "kafka_sasl_mechanism")
    )
    kafka_sasl_username: str | None = Field(
        None, validation_alias=_env("KAFKA_SASL_USERNAME", "kafka_sasl_username")
    )
    #: A `SecretStr`: its repr is ``**********``.
    kafka_sasl_password: SecretStr | None = Field(
        None, validation_alias=_env("KAFKA_SASL_PASSWORD", "kafka_sasl_password")
    )
    kafka_ssl_cafile: Path | None = Field(
        None, validation_alias=_env("KAFKA_SSL_CAFILE", "kafka_ssl_cafile")
    )
    kafka_ssl_certfile: Path | None = Field(
        None, validation_alias=_env("KAFKA_SSL_CERTFILE", "kafka_ssl_certfile")
    )
    kafka_ssl_keyfile: Path | None = Field(
        None, validation_alias=_env("KAFKA_SSL_KEYFILE", "kafka_ssl_keyfile")
    )
    #: The CA (PEM) a ``rediss://`` Redis's certificate must chain to (`redis_url` adds it
    #: to the URL as ``ssl_ca_certs``); None: the system's CAs.
    redis_ssl_cafile: Path | None = Field(
        None, validation_alias=_env("REDIS_SSL_CAFILE", "redis_ssl_cafile")
    )
    # -- Avro framing and the schema registry (`streamtally.wire.framing`, docs/avro-framing.md)
    #: How the values of every topic the project writes are framed: ``single-object``
    #: (``C3 01`` + fingerprint) or ``confluent`` (``00`` + a registry's schema id, the
    #: schemas registered at start under ``<topic>-value``).  Readers read both either way.
    avro_framing: AvroFraming = Field(
        "single-object", validation_alias=_env("STREAMTALLY_AVRO_FRAMING", "avro_framing")
    )
    #: The schema registry's Confluent REST API (Confluent Schema Registry, Karapace,
    #: Apicurio's ``<base>/apis/ccompat/v7``).  Needed to write ``confluent``, and to read
    #: Confluent-framed values.
    schema_registry_url: str | None = Field(
        None, validation_alias=_env("STREAMTALLY_SCHEMA_REGISTRY_URL", "schema_registry_url")
    )
    schema_registry_username: str | None = Field(
        None,
        validation_alias=_env("STREAMTALLY_SCHEMA_REGISTRY_USERNAME", "schema_registry_username"),
    )
    #: A `SecretStr`: its repr is ``**********``.
    schema_registry_password: SecretStr | None = Field(
        None,
        validation_alias=_env("STREAMTALLY_SCHEMA_REGISTRY_PASSWORD", "schema_registry_password"),
    )
    schema_registry_cafile: Path | None = Field(
        None,
        validation_alias=_env("STREAMTALLY_SCHEMA_REGISTRY_CAFILE", "schema_registry_cafile"),
    )
    schema_registry_certfile: Path | None = Field(
        None,
        validation_alias=_env("STREAMTALLY_SCHEMA_REGISTRY_CERTFILE", "schema_registry_certfile"),
    )
    schema_registry_keyfile: Path | None = Field(
        None,
        validation_alias=_env("STREAMTALLY_SCHEMA_REGISTRY_KEYFILE", "schema_registry_keyfile"),
    )
    #: Seconds one request to the registry may take (connect and answer).
    schema_registry_timeout: float = Field(
        10.0,
        gt=0,
        le=300,
        validation_alias=_env("STREAMTALLY_SCHEMA_REGISTRY_TIMEOUT", "schema_registry_timeout"),
    )

    @field_validator("avro_framing", mode="before")
    @classmethod
    def _lower_case(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _registry_consistent(self) -> Settings:
        """The registry settings agree with each other and with the framing."""
        url = (self.schema_registry_url or "").strip()
        if self.avro_framing == "confluent" and not url:
            raise ValueError(
                "STREAMTALLY_AVRO_FRAMING=confluent needs STREAMTALLY_SCHEMA_REGISTRY_URL, "
                "the schema registry the schemas are registered with"
            )
        if url and not url.lower().startswith(("http://", "https://")):
            raise ValueError(
                f"STREAMTALLY_SCHEMA_REGISTRY_URL={redact_url(url)!r}: not an http:// or "
                "https:// URL"
            )
        if (self.schema_registry_username is None) != (self.schema_registry_password is None):
            raise ValueError(
                "STREAMTALLY_SCHEMA_REGISTRY_USERNAME and STREAMTALLY_SCHEMA_REGISTRY_PASSWORD "
                "go together (basic auth)"
            )
        tls = {
            "STREAMTALLY_SCHEMA_REGISTRY_CAFILE": self.schema_registry_cafile,
            "STREAMTALLY_SCHEMA_REGISTRY_CERTFILE": self.schema_registry_certfile,
            "STREAMTALLY_SCHEMA_REGISTRY_KEYFILE": self.schema_registry_keyfile,
        }
        given = [name for name, path in tls.items() if path is not None]
        if given and not url.lower().startswith("https://"):
            raise ValueError(f"{', '.join(given)} need an https:// STREAMTALLY_SCHEMA_REGISTRY_URL")
        if self.schema_registry_keyfile is not None and self.schema_registry_certfile is None:
            raise ValueError(
                "STREAMTALLY_SCHEMA_REGISTRY_KEYFILE needs STREAMTALLY_SCHEMA_REGISTRY_CERTFILE"
            )
        for name, path in tls.items():
            if path is not None and not path.expanduser().is_file():
                raise ValueError(f"{name}={path}: no such file")
        return self

    #: The tokens file of `streamtally api` (`streamtally.api.auth`): each bearer token's
    #: SHA-256 and the tenant it reads, or the operator role (``--tokens`` wins).
    api_tokens_path: Path | None = Field(
        None, validation_alias=_env("STREAMTALLY_API_TOKENS", "api_tokens_path")
    )
    #: ``audit --provider-usage``: how far the provider's counts and the ledger's may differ
    #: and still match, ``rel=0.001,tokens=2000,requests=2`` (``--provider-tolerance``
    #: wins; `streamtally.audit.provider_usage.Tolerance`); none: exact.
    provider_tolerance: str | None = Field(
        None, validation_alias=_env("STREAMTALLY_PROVIDER_TOLERANCE", "provider_tolerance")
    )
    state_dir_setting: Path | None = Field(
        None, validation_alias=_env("STREAMTALLY_STATE_DIR", "state_dir_setting")
    )
    xdg_state_home: Path | None = Field(
        None, validation_alias=_env("XDG_STATE_HOME", "xdg_state_home")
    )
    kafka_port: int = Field(
        9092, ge=1, le=65535, validation_alias=_env("STREAMTALLY_KAFKA_PORT", "kafka_port")
    )
    controller_port: int = Field(
        9093,
        ge=1,
        le=65535,
        validation_alias=_env("STREAMTALLY_CONTROLLER_PORT", "controller_port"),
    )
    redis_port: int = Field(
        6379, ge=1, le=65535, validation_alias=_env("STREAMTALLY_REDIS_PORT", "redis_port")
    )
    #: The schema registry of `stack up --registry` (Confluent's usual port).
    registry_port: int = Field(
        8081,
        ge=1,
        le=65535,
        validation_alias=_env("STREAMTALLY_REGISTRY_PORT", "registry_port"),
    )
    #: The Java that builds and runs that registry (a ``java`` binary or a Java home);
    #: None: the first JDK 17+ of ``JAVA_HOME``, ``PATH`` and ``/usr/lib/jvm``.
    registry_java: Path | None = Field(
        None, validation_alias=_env("STREAMTALLY_REGISTRY_JAVA", "registry_java")
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only what is passed in: `Settings.load` is the one reader of the environment."""
        del settings_cls, env_settings, dotenv_settings, file_secret_settings
        return (init_settings,)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """The fields `repr` and `str` show, with the credentials of the endpoints hidden."""
        for name, value in super().__repr_args__():
            shown = _shown(name, value) if name is not None and isinstance(value, str) else value
            yield name, shown

    @model_validator(mode="after")
    def _ports_differ(self) -> Settings:
        ports = [self.kafka_port, self.controller_port, self.redis_port, self.registry_port]
        if len(set(ports)) != len(ports):
            raise ValueError(
                f"kafka ({self.kafka_port}), controller ({self.controller_port}), redis "
                f"({self.redis_port}) and registry ({self.registry_port}) ports must differ: "
                "set STREAMTALLY_KAFKA_PORT, STREAMTALLY_CONTROLLER_PORT, STREAMTALLY_REDIS_PORT "
                "or STREAMTALLY_REGISTRY_PORT"
            )
        return self

    @field_validator("kafka_security_protocol", "kafka_sasl_mechanism", mode="before")
    @classmethod
    def _upper_case(cls, value: object) -> object:
        """``sasl_ssl`` and ``scram-sha-512`` are taken as Kafka spells them."""
        return value.strip().upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _security_consistent(self) -> Settings:
        """The Kafka security settings agree (`KafkaConnection`) and their files exist."""
        _ = self.kafka  # builds the connection: a ValueError names the variables
        for name, path in (
            ("KAFKA_SSL_CAFILE", self.kafka_ssl_cafile),
            ("KAFKA_SSL_CERTFILE", self.kafka_ssl_certfile),
            ("KAFKA_SSL_KEYFILE", self.kafka_ssl_keyfile),
            ("REDIS_SSL_CAFILE", self.redis_ssl_cafile),
        ):
            if path is not None and not path.expanduser().is_file():
                raise ValueError(f"{name}={path}: no such file")
        return self

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings from `environ` (default: the process environment).

        Raises `InputError` naming the variable and what is wrong with it.
        """
        env = os.environ if environ is None else environ
        # Blank values mean "not set", as they always have for these variables.
        given = {k: v for k, v in env.items() if v.strip()}
        try:
            return cls.model_validate(_from_environment(given))
        except ValidationError as exc:
            raise InputError(_explain(exc)) from None

    # -- derived values ----------------------------------------------------------------

    @property
    def local_bootstrap_servers(self) -> str:
        return f"{LOCAL_HOST}:{self.kafka_port}"

    @property
    def local_redis_url(self) -> str:
        return f"redis://{LOCAL_HOST}:{self.redis_port}/0"

    @property
    def bootstrap_servers(self) -> str:
        """``KAFKA_BOOTSTRAP_SERVERS`` if set, else the local stack's Kafka."""
        return (self.kafka_bootstrap_servers or "").strip() or self.local_bootstrap_servers

    @property
    def kafka(self) -> KafkaConnection:
        """The Kafka every client connects to: `bootstrap_servers` with the security settings."""
        password = self.kafka_sasl_password
        return KafkaConnection(
            servers=self.bootstrap_servers,
            security_protocol=self.kafka_security_protocol,
            sasl_mechanism=self.kafka_sasl_mechanism,
            sasl_username=self.kafka_sasl_username,
            sasl_password=None if password is None else password.get_secret_value(),
            ssl_cafile=_expanded(self.kafka_ssl_cafile),
            ssl_certfile=_expanded(self.kafka_ssl_certfile),
            ssl_keyfile=_expanded(self.kafka_ssl_keyfile),
        )

    @property
    def redis_url(self) -> str:
        """``REDIS_URL`` if set, else the local stack's Redis.

        With ``REDIS_SSL_CAFILE``, a ``rediss://`` URL that names no CA of its own gets
        it as ``ssl_ca_certs`` (redis-py's URL parameter), so every client, one Redis
        or a Redis Cluster, verifies the server against it.
        """
        url = (self.redis_url_setting or "").strip() or self.local_redis_url
        cafile = _expanded(self.redis_ssl_cafile)
        if cafile is None or not url.lower().startswith("rediss://") or "ssl_ca_certs=" in url:
            return url
        base, _, fragment = url.partition("#")
        joiner = "&" if "?" in base else "?"
        tail = f"#{fragment}" if fragment else ""
        return f"{base}{joiner}ssl_ca_certs={quote(str(cafile), safe='/')}{tail}"

    @property
    def uses_external_stack(self) -> bool:
        """Whether KAFKA_BOOTSTRAP_SERVERS or REDIS_URL names a stack of the user's own."""
        return bool(self.kafka_bootstrap_servers or self.redis_url_setting)

    @property
    def state_dir(self) -> Path:
        if self.state_dir_setting is not None:
            return self.state_dir_setting.expanduser().resolve()
        root = project_root()
        if root is not None:
            return root / ".stack"
        base = self.xdg_state_home or Path.home() / ".local" / "state"
        return base / "streamtally"


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


def _variables() -> dict[str, str]:
    """Environment variable -> field, from each field's `_env` alias (its one spelling)."""
    found: dict[str, str] = {}
    for field, info in Settings.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            name = alias.choices[1]
            if isinstance(name, str):
                found[name] = field
    return found


#: Environment variable -> field, for `Settings.load`.
_VARIABLES: Final = _variables()
_FIELDS: Final = {field: name for name, field in _VARIABLES.items()}
#: Every environment variable `Settings.load` reads.
VARIABLES: Final = tuple(_VARIABLES)


def export(values: Mapping[str, str]) -> Settings:
    """Set `values` (variables of `VARIABLES`) in this process's environment, which the
    commands it starts inherit, and the settings read again with them."""
    unknown = sorted(set(values) - set(_VARIABLES))
    if unknown:
        raise ValueError(f"not streamtally settings: {', '.join(unknown)}")
    os.environ.update(values)
    return Settings.load()


def _expanded(path: Path | None) -> Path | None:
    return None if path is None else path.expanduser()


def _from_environment(env: Mapping[str, str]) -> dict[str, str]:
    return {field: env[name].strip() for name, field in _VARIABLES.items() if name in env}


def _shown(field: str, value: str) -> str:
    """A field's value as printed: the endpoints' credentials hidden (`streamtally.redact`)."""
    if field in ("kafka_sasl_password", "schema_registry_password"):
        return REDACTED
    if field in ("redis_url_setting", "schema_registry_url"):
        return redact_url(value)
    if field == "kafka_bootstrap_servers":
        return redact_servers(value)
    return redact_text(value)


def _explain(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        name = _FIELDS.get(field, field)
        value = error.get("input")
        shown = f"={_shown(field, value)!r}" if name and isinstance(value, str) else ""
        prefix = f"{name}{shown}: " if name else ""
        parts.append(f"{prefix}{error['msg']}")
    return "bad setting: " + "; ".join(parts)
