"""How a client reaches Kafka: the servers and the security of the connection, as one value.

Every Kafka client streamtally creates (the worker's consumer and producer,
``produce``, the read commands, the audit, the benchmarks, the local stack's
probe) is built from one `KafkaConnection`, which `Settings.kafka` makes from
the environment (``KAFKA_BOOTSTRAP_SERVERS``, ``KAFKA_SECURITY_PROTOCOL``,
``KAFKA_SASL_MECHANISM``, ``KAFKA_SASL_USERNAME``, ``KAFKA_SASL_PASSWORD``,
``KAFKA_SSL_CAFILE``, ``KAFKA_SSL_CERTFILE``, ``KAFKA_SSL_KEYFILE``: the names
Kafka's own clients and most deployments use).  One value, so that no client
can be built with the servers but without their credentials.

The value is pure data, checked when it is made: a combination that a client
would silently ignore or fail on later (SASL settings on a protocol without
SASL, a client certificate without TLS, SASL without a password) is refused
here, with a message naming the variables.  Its ``repr`` and ``str`` never show
the password.

The value as a client's options, the only places that translate it into a client's
vocabulary, so the worker, the producers and the read commands cannot differ in how
they connect: `client_options` gives the keyword arguments every aiokafka client takes
(``AIOKafkaProducer``, ``AIOKafkaConsumer``, ``AIOKafkaAdminClient``,
``AIOKafkaClient``), with an ``ssl.SSLContext`` built from the CA, certificate and key
files (`ssl_context`: aiokafka takes a context, not file names); `faust_options` gives
the ``broker`` URL and ``broker_credentials`` of a faust app.  aiokafka and faust are
imported only when those are called, so the settings can hold a connection without them.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args

from streamtally.errors import InputError
from streamtally.redact import redact_servers

__all__ = [
    "SASL_MECHANISMS",
    "SECURITY_PROTOCOLS",
    "KafkaConnection",
    "SaslMechanism",
    "SecurityProtocol",
    "as_connection",
    "client_options",
    "faust_options",
    "ssl_context",
]

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

#: ``KAFKA_SECURITY_PROTOCOL`` values, as Kafka spells them.
SECURITY_PROTOCOLS: Final[tuple[str, ...]] = get_args(SecurityProtocol)
#: ``KAFKA_SASL_MECHANISM`` values streamtally's clients (aiokafka) support with a password.
SASL_MECHANISMS: Final[tuple[str, ...]] = get_args(SaslMechanism)


@dataclass(frozen=True, slots=True)
class KafkaConnection:
    """The Kafka servers and how to authenticate to them and encrypt the connection.

    Raises `ValueError` (naming the environment variables) when the fields
    contradict each other.  The files are not opened here: the client opens
    them when it is built (`Settings.load` checks that they exist).
    """

    #: ``host:port[,host:port...]``.
    servers: str
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    #: Never part of ``repr`` or ``str``.
    sasl_password: str | None = field(default=None, repr=False)
    #: CA certificates (PEM) the brokers' certificates must chain to; None: the system's.
    ssl_cafile: Path | None = None
    #: The client's certificate (PEM) for mutual TLS; may hold the key too.
    ssl_certfile: Path | None = None
    #: The client certificate's private key (PEM, unencrypted).
    ssl_keyfile: Path | None = None

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem is not None:
            raise ValueError(problem)

    def __str__(self) -> str:
        """The servers as printed in messages (any credentials pasted into them hidden)."""
        return redact_servers(self.servers)

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def secrets(self) -> frozenset[str]:
        """What must never be printed (for `streamtally.redact.scrub`)."""
        return frozenset({self.sasl_password} if self.sasl_password else ())

    def unreachable(self) -> str:
        """How messages name this Kafka when a client could not connect: the servers, and
        on a secured connection the security settings a broker may have refused (aiokafka
        reports a refused password or handshake as a failed connection)."""
        if self.security_protocol == "PLAINTEXT":
            return str(self)
        return (
            f"{self.describe()} (down, or it refused these credentials or TLS settings: "
            "check KAFKA_SECURITY_PROTOCOL, KAFKA_SASL_*, KAFKA_SSL_*)"
        )

    def describe(self) -> str:
        """The servers and the security, without secrets: ``h:9092 (SASL_SSL, SCRAM-SHA-512)``."""
        if self.security_protocol == "PLAINTEXT":
            return str(self)
        how: list[str] = [self.security_protocol]
        if self.uses_sasl:
            how.append(f"{self.sasl_mechanism} as {self.sasl_username}")
        if self.ssl_certfile is not None:
            how.append("client certificate")
        return f"{self} ({', '.join(how)})"


def _problem(conn: KafkaConnection) -> str | None:
    """What is wrong with `conn`'s fields, in the words of the environment variables."""
    protocol = conn.security_protocol
    if protocol not in SECURITY_PROTOCOLS:
        return f"KAFKA_SECURITY_PROTOCOL must be one of {', '.join(SECURITY_PROTOCOLS)}"
    sasl_given = [
        name
        for name, value in (
            ("KAFKA_SASL_MECHANISM", conn.sasl_mechanism),
            ("KAFKA_SASL_USERNAME", conn.sasl_username),
            ("KAFKA_SASL_PASSWORD", conn.sasl_password),
        )
        if value
    ]
    if conn.uses_sasl:
        missing = [
            name
            for name in ("KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME", "KAFKA_SASL_PASSWORD")
            if name not in sasl_given
        ]
        if missing:
            return f"KAFKA_SECURITY_PROTOCOL={protocol} needs {', '.join(missing)}"
        if conn.sasl_mechanism not in SASL_MECHANISMS:
            return f"KAFKA_SASL_MECHANISM must be one of {', '.join(SASL_MECHANISMS)}"
    elif sasl_given:
        return (
            f"{', '.join(sasl_given)} set but KAFKA_SECURITY_PROTOCOL={protocol} uses no SASL "
            "(SASL_SSL or SASL_PLAINTEXT does)"
        )
    tls_given = [
        name
        for name, value in (
            ("KAFKA_SSL_CAFILE", conn.ssl_cafile),
            ("KAFKA_SSL_CERTFILE", conn.ssl_certfile),
            ("KAFKA_SSL_KEYFILE", conn.ssl_keyfile),
        )
        if value is not None
    ]
    if tls_given and not conn.uses_tls:
        return (
            f"{', '.join(tls_given)} set but KAFKA_SECURITY_PROTOCOL={protocol} uses no TLS "
            "(SSL or SASL_SSL does)"
        )
    if conn.ssl_keyfile is not None and conn.ssl_certfile is None:
        return "KAFKA_SSL_KEYFILE needs KAFKA_SSL_CERTFILE (the certificate of that key)"
    return None


def as_connection(kafka: KafkaConnection | str) -> KafkaConnection:
    """`kafka` itself, or a plaintext connection to the servers `kafka` names.

    The functions that create clients take either, so that code and tests
    that only know servers keep working against a plaintext Kafka.
    """
    return kafka if isinstance(kafka, KafkaConnection) else KafkaConnection(kafka)


def ssl_context(conn: KafkaConnection) -> ssl.SSLContext | None:
    """The TLS context of `conn` (None without TLS): verifies the brokers' certificates
    and host names against ``KAFKA_SSL_CAFILE`` (else the system's CAs), and presents
    the client certificate when one is given (mutual TLS).

    Raises `InputError` when a file cannot be read as PEM (naming the variable,
    never a key's content).
    """
    if not conn.uses_tls:
        return None
    from aiokafka.helpers import create_ssl_context  # only a client needs aiokafka

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
