"""The environment a client needs for the local stack: what ``streamtally stack env`` prints.

For the plaintext stack, the servers and the Redis URL (and ``REDIS_CLUSTER``);
for the secured one (``stack up --secure``) also the SASL_SSL settings with the
client user's password, the local CA for Kafka and Redis, and the Redis URL of
the worker's ACL user with its password.  The names are those
`streamtally.settings.Settings` reads, so ``eval "$(streamtally stack env)"``
points every command, the worker and a user's own code at the stack.
"""

from __future__ import annotations

from typing import Final

from streamtally.stack import secure
from streamtally.stack.config import StackConfig

__all__ = ["SECURITY_VARIABLES", "client_environment"]

#: The variables of a secured connection: the plaintext stack's environment has none.
SECURITY_VARIABLES: Final = (
    "KAFKA_SECURITY_PROTOCOL",
    "KAFKA_SASL_MECHANISM",
    "KAFKA_SASL_USERNAME",
    "KAFKA_SASL_PASSWORD",
    "KAFKA_SSL_CAFILE",
    "KAFKA_SSL_CERTFILE",
    "KAFKA_SSL_KEYFILE",
    "REDIS_SSL_CAFILE",
)


def client_environment(cfg: StackConfig) -> list[tuple[str, str]]:
    """``(variable, value)`` pairs for a client of the stack `cfg` describes, secrets included.

    The secured stack's passwords come from its credentials file (`StackError`
    when it has none).  Print them only where they are asked for.
    """
    env = [
        ("KAFKA_BOOTSTRAP_SERVERS", cfg.all_bootstrap_servers()),
        ("REDIS_URL", cfg.local_redis_url()),
        ("REDIS_CLUSTER", "1" if cfg.redis_cluster else "0"),
    ]
    if not cfg.secure:
        return env
    credentials = secure.load_credentials(cfg)
    conn = secure.client_connection(cfg, credentials)
    ca = str(secure.files(cfg).ca_cert)
    return [
        ("KAFKA_BOOTSTRAP_SERVERS", conn.servers),
        ("KAFKA_SECURITY_PROTOCOL", conn.security_protocol),
        ("KAFKA_SASL_MECHANISM", str(conn.sasl_mechanism)),
        ("KAFKA_SASL_USERNAME", str(conn.sasl_username)),
        ("KAFKA_SASL_PASSWORD", credentials.kafka_client),
        ("KAFKA_SSL_CAFILE", ca),
        ("REDIS_URL", secure.redis_client_url(cfg, credentials)),
        ("REDIS_SSL_CAFILE", ca),
        ("REDIS_CLUSTER", "0"),
    ]
