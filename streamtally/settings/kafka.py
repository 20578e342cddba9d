"""Kafka: where the brokers are, how a client connects to them, and the namespace of the
topics and the consumer group (`streamtally.connection`; docs/security.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, field_validator

from streamtally.connection import SaslMechanism, SecurityProtocol
from streamtally.settings._base import env

__all__ = ["KafkaSection"]


class KafkaSection(BaseModel):
    """The Kafka settings (a section of `Settings`)."""

    kafka_bootstrap_servers: str | None = Field(
        None, validation_alias=env("KAFKA_BOOTSTRAP_SERVERS", "kafka_bootstrap_servers")
    )
    namespace: str = Field(
        "streamtally",
        pattern=r"^[A-Za-z0-9._-]+$",
        validation_alias=env("STREAMTALLY_NAMESPACE", "namespace"),
    )
    kafka_security_protocol: SecurityProtocol = Field(
        "PLAINTEXT", validation_alias=env("KAFKA_SECURITY_PROTOCOL", "kafka_security_protocol")
    )
    kafka_sasl_mechanism: SaslMechanism | None = Field(
        None, validation_alias=env("KAFKA_SASL_MECHANISM", "kafka_sasl_mechanism")
    )
    kafka_sasl_username: str | None = Field(
        None, validation_alias=env("KAFKA_SASL_USERNAME", "kafka_sasl_username")
    )
    #: A `SecretStr`: its repr is ``**********``.
    kafka_sasl_password: SecretStr | None = Field(
        None, validation_alias=env("KAFKA_SASL_PASSWORD", "kafka_sasl_password")
    )
    kafka_ssl_cafile: Path | None = Field(
        None, validation_alias=env("KAFKA_SSL_CAFILE", "kafka_ssl_cafile")
    )
    kafka_ssl_certfile: Path | None = Field(
        None, validation_alias=env("KAFKA_SSL_CERTFILE", "kafka_ssl_certfile")
    )
    kafka_ssl_keyfile: Path | None = Field(
        None, validation_alias=env("KAFKA_SSL_KEYFILE", "kafka_ssl_keyfile")
    )

    @field_validator("kafka_security_protocol", "kafka_sasl_mechanism", mode="before")
    @classmethod
    def _upper_case(cls, value: object) -> object:
        """``sasl_ssl`` and ``scram-sha-512`` are taken as Kafka spells them."""
        return value.strip().upper() if isinstance(value, str) else value
