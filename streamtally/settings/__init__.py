"""Every setting of streamtally, in one typed object read from the environment once.

The settings are declared by concern, one section per module (`kafka`, `redis`,
`registry`, `worker`, `content`, `tap`, `api`, `audit`, `stack`); `Settings` is all of
them in one frozen object, read as ``settings.<field>`` (the variable names below are
the fields' only spelling in the environment).  Checks that span sections (the Kafka
security against the servers, the files named) are made here.

`Settings.load()` is called by the entry point (`streamtally.cli.main`) and the
object is passed down; no other module reads the environment, and nothing
reads it at import time.  `Settings(...)` built in code reads nothing from the
environment: it is exactly what it is given (tests build it so).

==================================  ==============================================  =========
variable                            meaning                                         default
==================================  ==============================================  =========
*Kafka* (``kafka.py``)
``KAFKA_BOOTSTRAP_SERVERS``         Kafka to use                                    local stack
``STREAMTALLY_NAMESPACE``           prefix of topic names and the consumer group    ``streamtally``
``KAFKA_SECURITY_PROTOCOL``         PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL      PLAINTEXT
``KAFKA_SASL_MECHANISM``            PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512           none
``KAFKA_SASL_USERNAME``             the SASL user                                   none
``KAFKA_SASL_PASSWORD``             its password (never printed)                    none
``KAFKA_SSL_CAFILE``                CA (PEM) of the brokers' certificates           system CAs
``KAFKA_SSL_CERTFILE``              client certificate (PEM), for mutual TLS        none
``KAFKA_SSL_KEYFILE``               its private key (PEM)                           none
*Redis* (``redis.py``)
``REDIS_URL``                       Redis to use                                    local stack
``REDIS_CLUSTER``                   that Redis is a Redis Cluster (``1``/``0``)     ``0``
``REDIS_SSL_CAFILE``                CA (PEM) of a ``rediss://`` Redis               system CAs
*framing and schema registry* (``registry.py``)
``STREAMTALLY_AVRO_FRAMING``        values written: single-object or confluent      single-object
``STREAMTALLY_SCHEMA_REGISTRY_URL`` Confluent REST API of the schema registry       none
``..._REGISTRY_USERNAME``           its basic-auth user                             none
``..._REGISTRY_PASSWORD``           its password (never printed)                    none
``..._REGISTRY_CAFILE``             CA (PEM) of an ``https://`` registry            system CAs
``..._REGISTRY_CERTFILE``           client certificate (PEM), for mutual TLS        none
``..._REGISTRY_KEYFILE``            its private key (PEM)                           none
``..._REGISTRY_TIMEOUT``            seconds one registry request may take           ``10``
*worker* (``worker.py``)
``STREAMTALLY_PRICES``              price table (JSON)                              packaged
``STREAMTALLY_REQUEST_TIMEOUT``     seconds a request may stay quiet                ``300``
``STREAMTALLY_REQUEST_TIMEOUTS``    per source: ``anthropic=600,vllm=900``          none
``STREAMTALLY_BATCH_SIZE``          raw records per worker batch                    ``2000``
``STREAMTALLY_WORKER_INSTANCE_ID``  the worker's static group member id (Kafka's    none: dynamic
                                    ``group.instance.id``), one per worker
``STREAMTALLY_SESSION_TIMEOUT``     seconds the group waits for a silent worker     10; 45 static
``STREAMTALLY_WEB_HOST``            the worker's /metrics, /health, /ready address  ``127.0.0.1``
``STREAMTALLY_WEB_PORT``            their port (``0``: no server)                   ``6066``
``STREAMTALLY_TENANT_KEYS``         the worker's trust file (signed tenant claims)  none: trust all
*content* (``content.py``)
``STREAMTALLY_CONTENT``             text kept downstream: full, redacted or none    ``full``
``STREAMTALLY_CONTENT_KEY``         file holding the HMAC key of ``redacted``       none
``STREAMTALLY_CHUNKS``              write the chunks topic (``on``/``off``)         ``on``
*tap* (``tap.py``)
``STREAMTALLY_PRODUCER_KEY``        the key file ``produce`` signs records with     none: unsigned
*API* (``api.py``)
``STREAMTALLY_API_TOKENS``          ``streamtally api``'s tokens file (SHA-256s)    none
*local stack* (``stack.py``)
``STREAMTALLY_STATE_DIR``           the local stack's jars, data, logs              see below
``STREAMTALLY_KAFKA_PORT``          the local stack's Kafka listener                ``9092``
``STREAMTALLY_CONTROLLER_PORT``     the local stack's KRaft controller listener     ``9093``
``STREAMTALLY_REDIS_PORT``          the local stack's Redis                         ``6379``
``STREAMTALLY_REGISTRY_PORT``       the local stack's schema registry               ``8081``
``STREAMTALLY_REGISTRY_JAVA``       its JDK 17+ (``java`` or a Java home)           searched
``STREAMTALLY_KAFKA_JVM_OPTS``      its Kafka's JVM options (``lean``: less CPU)    see below
``STREAMTALLY_NATIVE_CACHE``        kept builds of the hot path (``off``: none)     see below
``STREAMTALLY_STACK_CACHE``         kept Kafka jars, registry (``off``: none)       see below
==================================  ==============================================  =========

The state directory defaults to ``.stack`` in the clone when streamtally runs
from one (an editable install), else ``$XDG_STATE_HOME/streamtally`` (or
``~/.local/state/streamtally``).  The Kafka JVM runs with the G1 collector and
both compilers unless ``STREAMTALLY_KAFKA_JVM_OPTS`` names other options; ``lean``
names the client compiler and the serial collector, for a stack that starts often
and carries little (a test run).  Builds of the compiled hot path are kept in
``$XDG_CACHE_HOME/streamtally/native`` (or ``~/.cache/streamtally/native``), the local
stack's Kafka jars and registry builds in ``$XDG_CACHE_HOME/streamtally/stack``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Final, Self
from urllib.parse import quote

from pydantic import AliasChoices, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from streamtally.connection import KafkaConnection
from streamtally.errors import InputError
from streamtally.redact import REDACTED, redact_servers, redact_text, redact_url
from streamtally.settings._base import LOCAL_HOST, expanded
from streamtally.settings.api import ApiSection
from streamtally.settings.audit import AuditSection
from streamtally.settings.content import ContentSection
from streamtally.settings.kafka import KafkaSection
from streamtally.settings.redis import RedisSection
from streamtally.settings.registry import AVRO_FRAMINGS, AvroFraming, RegistrySection
from streamtally.settings.stack import StackSection, project_root
from streamtally.settings.tap import TapSection
from streamtally.settings.worker import (
    DEFAULT_STATE_TTL_S,
    SOURCE_NAMES,
    WorkerSection,
    parse_request_timeouts,
)

__all__ = [
    "AVRO_FRAMINGS",
    "DEFAULT_STATE_TTL_S",
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

#: The variables that point every client at a stack of the user's own.
ENV_BOOTSTRAP_SERVERS: Final = "KAFKA_BOOTSTRAP_SERVERS"
ENV_REDIS_URL: Final = "REDIS_URL"
#: Says that the Redis of ``REDIS_URL`` (or the local stack's) is a Redis Cluster.
ENV_REDIS_CLUSTER: Final = "REDIS_CLUSTER"


class Settings(
    KafkaSection,
    RedisSection,
    RegistrySection,
    WorkerSection,
    ContentSection,
    TapSection,
    ApiSection,
    AuditSection,
    StackSection,
    BaseSettings,
):
    """The settings of every streamtally command and of the worker (frozen): every section."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)

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
    def _security_consistent(self) -> Self:
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

    def with_instance_id(self, instance_id: str) -> Settings:
        """These settings with `worker_instance_id` set (checked as the variable would be:
        `InputError` naming what is wrong)."""
        try:
            return type(self).model_validate({**dict(self), "worker_instance_id": instance_id})
        except ValidationError as exc:
            raise InputError(_explain(exc)) from None

    # -- derived values across sections ----------------------------------------------------

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
            ssl_cafile=expanded(self.kafka_ssl_cafile),
            ssl_certfile=expanded(self.kafka_ssl_certfile),
            ssl_keyfile=expanded(self.kafka_ssl_keyfile),
        )

    @property
    def redis_url(self) -> str:
        """``REDIS_URL`` if set, else the local stack's Redis.

        With ``REDIS_SSL_CAFILE``, a ``rediss://`` URL that names no CA of its own gets
        it as ``ssl_ca_certs`` (redis-py's URL parameter), so every client, one Redis
        or a Redis Cluster, verifies the server against it.
        """
        url = (self.redis_url_setting or "").strip() or self.local_redis_url
        cafile = expanded(self.redis_ssl_cafile)
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
