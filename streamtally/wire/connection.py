"""A `KafkaConnection` as the options of the Kafka clients: aiokafka's and faust's.

`client_options` gives the keyword arguments every aiokafka client takes
(``AIOKafkaProducer``, ``AIOKafkaConsumer``, ``AIOKafkaAdminClient``,
``AIOKafkaClient``): the servers, the security protocol, the SASL mechanism
and credentials, and an ``ssl.SSLContext`` built from the CA, certificate and
key files (aiokafka takes a context, not file names).  `faust_options` gives
the ``broker`` URL and ``broker_credentials`` of a faust app for the same
connection.  Both are the only places that translate the settings into a
client's vocabulary, so the worker, the producers and the read commands
cannot differ in how they connect.
"""

from __future__ import annotations

import ssl
from typing import Any

from aiokafka.helpers import create_ssl_context

from streamtally.connection import KafkaConnection, as_connection
from streamtally.errors import InputError

__all__ = ["client_options", "faust_options", "ssl_context"]


def ssl_context(conn: KafkaConnection) -> ssl.SSLContext | None:
    """The TLS context of `conn` (None without TLS): verifies the brokers' certificates
    and host names against ``KAFKA_SSL_CAFILE`` (else the system's CAs), and presents
    the client certificate when one is given (mutual TLS).

    Raises `InputError` when a file cannot be read as PEM (naming the variable,
    never a key's content).
    """
    if not conn.uses_tls:
        return None
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=None if conn.ssl_cafile is None else str(conn.ssl_cafile),
            certfile=None if conn.ssl_certfile is None else str(conn.ssl_certfile),
            keyfile=None if conn.ssl_keyfile is None else str(conn.ssl_keyfile),
        )
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(
            f"{name}={path}"
            for name, path in (
                ("KAFKA_SSL_CAFILE", conn.ssl_cafile),
                ("KAFKA_SSL_CERTFILE", conn.ssl_certfile),
                ("KAFKA_SSL_KEYFILE", conn.ssl_keyfile),
            )
            if path is not None
        )
        raise InputError(f"cannot use the Kafka TLS files ({files or 'none'}): {exc}") from None
    return context


def client_options(kafka: KafkaConnection | str) -> dict[str, Any]:
    """The keyword arguments that point an aiokafka client at `kafka`, securely as it says."""
    conn = as_connection(kafka)
    options: dict[str, Any] = {
        "bootstrap_servers": conn.servers,
        "security_protocol": conn.security_protocol,
    }
    if conn.uses_sasl:
        options["sasl_mechanism"] = conn.sasl_mechanism
        options["sasl_plain_username"] = conn.sasl_username
        options["sasl_plain_password"] = conn.sasl_password
    context = ssl_context(conn)
    if context is not None:
        options["ssl_context"] = context
    return options


def faust_options(kafka: KafkaConnection | str) -> dict[str, Any]:
    """``broker`` and ``broker_credentials`` of a faust app that reaches `kafka`.

    faust spells a list of servers as ``kafka://h1:9092;kafka://h2:9092``; its
    credentials objects carry the SASL mechanism and the TLS context
    (``SASLCredentials`` with a context is SASL_SSL, without SASL_PLAINTEXT).
    """
    from faust.auth import SASLCredentials, SSLCredentials

    conn = as_connection(kafka)
    broker = ";".join(f"kafka://{server.strip()}" for server in conn.servers.split(","))
    context = ssl_context(conn)
    credentials: object | None = None
    if conn.uses_sasl:
        credentials = SASLCredentials(
            username=conn.sasl_username,
            password=conn.sasl_password,
            ssl_context=context,
            mechanism=conn.sasl_mechanism,
        )
    elif context is not None:
        credentials = SSLCredentials(context)
    return {"broker": broker, "broker_credentials": credentials}
