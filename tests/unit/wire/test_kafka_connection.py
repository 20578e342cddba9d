"""Kafka security: the settings, `KafkaConnection`'s checks, and the clients' options."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest
from faust.auth import SASLCredentials, SSLCredentials
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from streamtally.cli._args import kafka_of
from streamtally.connection import (
    KafkaConnection,
    as_connection,
    client_options,
    faust_options,
    ssl_context,
)
from streamtally.errors import InputError
from streamtally.settings import Settings
from streamtally.stack import secure
from streamtally.stack.config import StackConfig

PASSWORD = "s3cr3t-sasl-password"
SASL_ENV = {
    "KAFKA_BOOTSTRAP_SERVERS": "k1:9093,k2:9093",
    "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "KAFKA_SASL_USERNAME": "worker",
    "KAFKA_SASL_PASSWORD": PASSWORD,
}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> secure.SecureFiles:
    """A CA and a certificate made by the secured stack's own code (openssl)."""
    cfg = StackConfig(tmp_path_factory.mktemp("state"), secure=True)
    secure.ensure_material(cfg, lambda line: None)
    return secure.files(cfg)


def test_plain_servers_are_a_plaintext_connection() -> None:
    assert client_options("h:9092") == {
        "bootstrap_servers": "h:9092",
        "security_protocol": "PLAINTEXT",
    }
    assert as_connection("h:9092") == KafkaConnection("h:9092")
    assert faust_options("h1:9092, h2:9092") == {
        "broker": "kafka://h1:9092;kafka://h2:9092",
        "broker_credentials": None,
    }


def test_sasl_ssl_gives_the_mechanism_the_user_and_a_verifying_context() -> None:
    conn = Settings.load(SASL_ENV).kafka
    options = client_options(conn)
    context = options.pop("ssl_context")
    assert options == {
        "bootstrap_servers": "k1:9093,k2:9093",
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "worker",
        "sasl_plain_password": PASSWORD,
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname


def test_sasl_plaintext_has_no_tls() -> None:
    env = {**SASL_ENV, "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAFKA_SASL_MECHANISM": "PLAIN"}
    options = client_options(Settings.load(env).kafka)
    assert options["security_protocol"] == "SASL_PLAINTEXT"
    assert options["sasl_mechanism"] == "PLAIN"
    assert "ssl_context" not in options


@pytest.mark.parametrize(
    "env",
    [
        SASL_ENV,
        {**SASL_ENV, "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"},
        {"KAFKA_SECURITY_PROTOCOL": "SSL"},
        {},
    ],
)
def test_faust_connects_exactly_as_the_other_clients(env: dict[str, str]) -> None:
    """faust's own translation of our credentials gives the protocol and user we give aiokafka."""
    conn = Settings.load(env).kafka
    ours = client_options(conn)
    theirs = credentials_to_aiokafka_auth(faust_options(conn)["broker_credentials"])
    assert theirs["security_protocol"] == ours["security_protocol"]
    assert theirs.get("sasl_mechanism") == ours.get("sasl_mechanism")
    assert theirs.get("sasl_plain_username") == ours.get("sasl_plain_username")
    assert theirs.get("sasl_plain_password") == ours.get("sasl_plain_password")
    assert (theirs.get("ssl_context") is None) == (ours.get("ssl_context") is None)


def test_faust_credentials_types() -> None:
    assert isinstance(
        faust_options(Settings.load(SASL_ENV).kafka)["broker_credentials"], SASLCredentials
    )
    ssl_only = Settings.load({"KAFKA_SECURITY_PROTOCOL": "SSL"}).kafka
    assert isinstance(faust_options(ssl_only)["broker_credentials"], SSLCredentials)


def test_mutual_tls_loads_the_client_certificate(tls: secure.SecureFiles) -> None:
    conn = KafkaConnection(
        "h:9093",
        security_protocol="SSL",
        ssl_cafile=tls.ca_cert,
        ssl_certfile=tls.server_cert,
        ssl_keyfile=tls.server_key,
    )
    context = ssl_context(conn)
    assert context is not None
    # The CA is the one trusted, not the system's bundle alone.
    assert any("streamtally local CA" in str(ca.get("subject")) for ca in context.get_ca_certs())


def test_a_key_that_is_not_a_key_is_one_clear_error(tls: secure.SecureFiles) -> None:
    conn = KafkaConnection(
        "h:9093", security_protocol="SSL", ssl_certfile=tls.server_cert, ssl_keyfile=tls.ca_cert
    )
    with pytest.raises(InputError, match="KAFKA_SSL_KEYFILE=") as caught:
        ssl_context(conn)
    assert "PRIVATE KEY" not in str(caught.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "PLAIN",
             "KAFKA_SASL_USERNAME": "u"},
            "KAFKA_SECURITY_PROTOCOL=SASL_SSL needs KAFKA_SASL_PASSWORD",
        ),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_PASSWORD": PASSWORD},
            "needs KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME",
        ),
        (
            {"KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": PASSWORD},
            "KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD set but KAFKA_SECURITY_PROTOCOL=PLAINTEXT "
            "uses no SASL",
        ),
        ({"KAFKA_SECURITY_PROTOCOL": "TLS"}, "KAFKA_SECURITY_PROTOCOL"),
        ({**SASL_ENV, "KAFKA_SASL_MECHANISM": "GSSAPI"}, "KAFKA_SASL_MECHANISM"),
        ({"KAFKA_SSL_CAFILE": "/etc/hostname"}, "KAFKA_SSL_CAFILE set but KAFKA_SECURITY_PROTOCOL"),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_KEYFILE": "/etc/hostname"},
            "KAFKA_SSL_KEYFILE needs KAFKA_SSL_CERTFILE",
        ),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": "/no/such/ca.pem"},
            "KAFKA_SSL_CAFILE=/no/such/ca.pem: no such file",
        ),
        ({"REDIS_SSL_CAFILE": "/no/such/ca.pem"}, "REDIS_SSL_CAFILE=/no/such/ca.pem: no such file"),
    ],
)  # fmt: skip
def test_contradicting_settings_are_one_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(InputError, match=r"^bad setting: ") as caught:
        Settings.load(env)
    assert message in str(caught.value)
    assert PASSWORD not in str(caught.value)


def test_names_are_taken_in_any_case() -> None:
    env = {
        **SASL_ENV,
        "KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
        "KAFKA_SASL_MECHANISM": "scram-sha-256",
    }
    conn = Settings.load(env).kafka
    assert (conn.security_protocol, conn.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-256")


def test_the_password_is_never_in_a_repr_or_a_message() -> None:
    settings = Settings.load(SASL_ENV)
    conn = settings.kafka
    for shown in (repr(settings), str(settings), repr(conn), str(conn), conn.describe(),
                  conn.unreachable()):  # fmt: skip
        assert PASSWORD not in shown
    assert conn.describe() == "k1:9093,k2:9093 (SASL_SSL, SCRAM-SHA-512 as worker)"
    assert conn.secrets == {PASSWORD}
    assert KafkaConnection("h:1").unreachable() == "h:1"


def test_bootstrap_servers_argument_keeps_the_security_settings() -> None:
    settings = Settings.load(SASL_ENV)
    given = kafka_of(argparse.Namespace(bootstrap_servers="other:9093"), settings)
    assert given.servers == "other:9093"
    assert given.sasl_password == PASSWORD
    assert given.security_protocol == "SASL_SSL"
    assert kafka_of(argparse.Namespace(bootstrap_servers=None), settings) == settings.kafka


def test_redis_ca_file_is_added_to_a_tls_url_only(tmp_path: Path) -> None:
    ca = tmp_path / "my ca.pem"
    ca.write_text("-", encoding="ascii")
    tls = Settings.load({"REDIS_URL": "rediss://u:pw@h:6380/0", "REDIS_SSL_CAFILE": str(ca)})
    assert tls.redis_url == f"rediss://u:pw@h:6380/0?ssl_ca_certs={tmp_path}/my%20ca.pem"
    query = Settings.load({"REDIS_URL": "rediss://h/0?timeout=3", "REDIS_SSL_CAFILE": str(ca)})
    assert query.redis_url == f"rediss://h/0?timeout=3&ssl_ca_certs={tmp_path}/my%20ca.pem"
    plain = Settings.load({"REDIS_URL": "redis://h:6379/0", "REDIS_SSL_CAFILE": str(ca)})
    assert plain.redis_url == "redis://h:6379/0"
    own = "rediss://h/0?ssl_ca_certs=/other.pem"
    assert Settings.load({"REDIS_URL": own, "REDIS_SSL_CAFILE": str(ca)}).redis_url == own
