"""How values are framed on the topics, and the schema registry of the Confluent framing
(`streamtally.wire.framing`; docs/avro-framing.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal, Self, get_args

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from streamtally.redact import redact_url
from streamtally.settings._base import env

__all__ = ["AVRO_FRAMINGS", "AvroFraming", "RegistrySection"]

#: ``STREAMTALLY_AVRO_FRAMING``: how the values written are framed (docs/avro-framing.md).
AvroFraming = Literal["single-object", "confluent"]
AVRO_FRAMINGS: Final[tuple[str, ...]] = get_args(AvroFraming)


class RegistrySection(BaseModel):
    """The framing and schema registry settings (a section of `Settings`)."""

    # -- Avro framing and the schema registry (`streamtally.wire.framing`, docs/avro-framing.md)
    #: How the values of every topic the project writes are framed: ``single-object``
    #: (``C3 01`` + fingerprint) or ``confluent`` (``00`` + a registry's schema id, the
    #: schemas registered at start under ``<topic>-value``).  Readers read both either way.
    avro_framing: AvroFraming = Field(
        "single-object", validation_alias=env("STREAMTALLY_AVRO_FRAMING", "avro_framing")
    )
    #: The schema registry's Confluent REST API (Confluent Schema Registry, Karapace,
    #: Apicurio's ``<base>/apis/ccompat/v7``).  Needed to write ``confluent``, and to read
    #: Confluent-framed values.
    schema_registry_url: str | None = Field(
        None, validation_alias=env("STREAMTALLY_SCHEMA_REGISTRY_URL", "schema_registry_url")
    )
    schema_registry_username: str | None = Field(
        None,
        validation_alias=env("STREAMTALLY_SCHEMA_REGISTRY_USERNAME", "schema_registry_username"),
    )
    #: A `SecretStr`: its repr is ``**********``.
    schema_registry_password: SecretStr | None = Field(
        None,
        validation_alias=env("STREAMTALLY_SCHEMA_REGISTRY_PASSWORD", "schema_registry_password"),
    )
    schema_registry_cafile: Path | None = Field(
        None,
        validation_alias=env("STREAMTALLY_SCHEMA_REGISTRY_CAFILE", "schema_registry_cafile"),
    )
    schema_registry_certfile: Path | None = Field(
        None,
        validation_alias=env("STREAMTALLY_SCHEMA_REGISTRY_CERTFILE", "schema_registry_certfile"),
    )
    schema_registry_keyfile: Path | None = Field(
        None,
        validation_alias=env("STREAMTALLY_SCHEMA_REGISTRY_KEYFILE", "schema_registry_keyfile"),
    )
    #: Seconds one request to the registry may take (connect and answer).
    schema_registry_timeout: float = Field(
        10.0,
        gt=0,
        le=300,
        validation_alias=env("STREAMTALLY_SCHEMA_REGISTRY_TIMEOUT", "schema_registry_timeout"),
    )

    @field_validator("avro_framing", mode="before")
    @classmethod
    def _lower_case(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _registry_consistent(self) -> Self:
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
