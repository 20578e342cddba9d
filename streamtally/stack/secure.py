"""The secured local stack's material: a CA, the server certificate, the generated passwords.

``streamtally stack up --secure`` runs the broker with a SASL_SSL listener
(SCRAM-SHA-512) and Redis on TLS only, with an ACL user; what they need is
made here, once, under ``<state>/secure`` (mode 0700)::

    tls/ca.pem, ca.key          a local CA (EC P-256, openssl), 825 days
    tls/server.pem, server.key  the certificate of 127.0.0.1 / localhost, signed by it
    tls/broker.p12              the same as the broker's PKCS#12 keystore
    credentials.json            generated passwords (mode 0600): the Kafka users
                                ``admin`` (between the broker and itself) and
                                ``streamtally`` (every client), the keystore's, and
                                the Redis users ``streamtally`` (the worker's ACL) and
                                ``st-admin`` (everything: ``migrate``, ``redis-cli``)

The Kafka users are created when the broker's storage is formatted
(``StorageTool format --add-scram``), so the passwords are made before it and
never change while that storage lives (``stack down --wipe`` deletes both).
Secrets never go to a progress line or an error: `secrets` lists them for
scrubbing, and the clients get them from `client_connection` and
`redis_client_url`, which ``stack env`` prints on purpose.
"""

from __future__ import annotations

import json
import os
import secrets as random_secrets
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from streamtally.connection import KafkaConnection
from streamtally.errors import StackError
from streamtally.redact import scrub
from streamtally.stack import Say, indent
from streamtally.stack.config import StackConfig

__all__ = [
    "KAFKA_ADMIN_USER",
    "KAFKA_CLIENT_USER",
    "REDIS_ADMIN_USER",
    "REDIS_CLIENT_USER",
    "SCRAM_MECHANISM",
    "Credentials",
    "SecureFiles",
    "client_connection",
    "ensure_material",
    "files",
    "load_credentials",
    "redis_client_url",
    "scrubbed",
    "wipe",
]

#: The one SASL mechanism the secured broker enables.
SCRAM_MECHANISM: Final = "SCRAM-SHA-512"
#: The broker's own user (inter-broker listener) and every client's.
KAFKA_ADMIN_USER: Final = "admin"
KAFKA_CLIENT_USER: Final = "streamtally"
#: Redis: the worker's ACL user, and an administrator for what the worker may not do.
REDIS_CLIENT_USER: Final = "streamtally"
REDIS_ADMIN_USER: Final = "st-admin"
_DAYS: Final = "825"
_OPENSSL_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class SecureFiles:
    """Where the secured stack's material lives."""

    root: Path

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    @property
    def ca_cert(self) -> Path:
        return self.tls_dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.tls_dir / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.tls_dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.tls_dir / "server.key"

    @property
    def keystore(self) -> Path:
        return self.tls_dir / "broker.p12"

    @property
    def credentials(self) -> Path:
        return self.root / "credentials.json"


@dataclass(frozen=True, slots=True)
class Credentials:
    """The generated passwords (32 URL-safe characters each: no quoting anywhere)."""

    kafka_admin: str
    kafka_client: str
    keystore: str
    redis_client: str
    redis_admin: str

    @classmethod
    def generate(cls) -> Credentials:
        return cls(*(random_secrets.token_urlsafe(24) for _ in range(5)))

    def __repr__(self) -> str:
        return "Credentials(***)"

    @property
    def secrets(self) -> frozenset[str]:
        """Every password, for `streamtally.redact.scrub`."""
        return frozenset(asdict(self).values())


def files(cfg: StackConfig) -> SecureFiles:
    return SecureFiles(cfg.secure_dir)


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only from the first byte."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    tmp.replace(path)


def load_credentials(cfg: StackConfig) -> Credentials:
    """The secured stack's passwords (`StackError` when `stack up --secure` never made them)."""
    path = files(cfg).credentials
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Credentials(**{name: str(data[name]) for name in Credentials.__slots__})
    except FileNotFoundError:
        raise StackError(
            f"no credentials in {path}: start the secured stack with `streamtally stack up "
            "--secure`"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise StackError(
            f"{path} is not the secured stack's credentials file: `streamtally stack down "
            "--wipe` resets it"
        ) from None


def _openssl(argv: list[str], stdin: str | None = None) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise StackError("openssl not found: install it (`apt-get install openssl`)")
    result = subprocess.run(
        [openssl, *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=_OPENSSL_TIMEOUT_S,
        input=stdin or "",  # never the terminal: openssl must not prompt
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise StackError(
            f"`openssl {argv[0]}` failed (exit {result.returncode}):\n{indent(output)}"
        )


def _make_tls(sf: SecureFiles, host: str, keystore_password: str, say: Say) -> None:
    """The CA, the server certificate for `host` and localhost, and the broker's keystore."""
    sf.tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    say(f"secure: making a local CA and a certificate for {host} in {sf.tls_dir} (openssl) ...")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        ["req", "-x509", *ec, "-keyout", str(sf.ca_key), "-out", str(sf.ca_cert),
         "-days", _DAYS, "-subj", "/CN=streamtally local CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    )  # fmt: skip
    request = sf.tls_dir / "server.csr"
    extensions = sf.tls_dir / "server.ext"
    extensions.write_text(
        f"subjectAltName=IP:{host},DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n",
        encoding="ascii",
    )
    _openssl(
        ["req", *ec, "-keyout", str(sf.server_key), "-out", str(request), "-subj", f"/CN={host}"]
    )
    _openssl(
        ["x509", "-req", "-in", str(request), "-CA", str(sf.ca_cert), "-CAkey", str(sf.ca_key),
         "-set_serial", str(int.from_bytes(random_secrets.token_bytes(8), "big")),
         "-days", _DAYS, "-extfile", str(extensions), "-out", str(sf.server_cert)]
    )  # fmt: skip
    # The keystore's password goes through stdin, not the command line.
    _openssl(
        ["pkcs12", "-export", "-in", str(sf.server_cert), "-inkey", str(sf.server_key),
         "-certfile", str(sf.ca_cert), "-name", "broker", "-out", str(sf.keystore),
         "-passout", "stdin"],
        stdin=keystore_password + "\n",
    )  # fmt: skip
    request.unlink(missing_ok=True)
    extensions.unlink(missing_ok=True)
    for private in (sf.ca_key, sf.server_key, sf.keystore):
        private.chmod(0o600)


def ensure_material(cfg: StackConfig, say: Say) -> Credentials:
    """The passwords and the TLS files of the secured stack, made once; returns the passwords."""
    sf = files(cfg)
    sf.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    sf.root.chmod(0o700)
    if not sf.credentials.exists():
        say(f"secure: generating passwords into {sf.credentials} (mode 0600)")
        _write_private(sf.credentials, json.dumps(asdict(Credentials.generate()), indent=2))
    credentials = load_credentials(cfg)
    needed = (sf.ca_cert, sf.server_cert, sf.server_key, sf.keystore)
    if not all(path.exists() for path in needed):
        _make_tls(sf, cfg.host, credentials.keystore, say)
    return credentials


def client_connection(cfg: StackConfig, credentials: Credentials) -> KafkaConnection:
    """How a client reaches the secured broker: SASL_SSL, SCRAM-SHA-512, the local CA."""
    return KafkaConnection(
        servers=cfg.all_bootstrap_servers(),
        security_protocol="SASL_SSL",
        sasl_mechanism=SCRAM_MECHANISM,
        sasl_username=KAFKA_CLIENT_USER,
        sasl_password=credentials.kafka_client,
        ssl_cafile=files(cfg).ca_cert,
    )


def redis_client_url(cfg: StackConfig, credentials: Credentials) -> str:
    """The secured Redis as its ACL user over TLS (the CA: ``REDIS_SSL_CAFILE``)."""
    return f"rediss://{REDIS_CLIENT_USER}:{credentials.redis_client}@{cfg.host}:{cfg.redis_port}/0"


def scrubbed(text: str, credentials: Credentials) -> str:
    """`text` (a tool's output) with every generated password as ``***``."""
    return scrub(text, credentials.secrets)


def wipe(cfg: StackConfig, say: Say) -> None:
    """Delete the CA, the certificates and the passwords (with the data that used them)."""
    if cfg.secure_dir.exists():
        shutil.rmtree(cfg.secure_dir)
        say(f"secure: wiped the CA, certificates and passwords under {cfg.secure_dir}")
