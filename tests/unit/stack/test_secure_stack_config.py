"""`stack up --secure`: the broker's listener, Redis's TLS and ACL, the worker's ACL rule."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from streamtally.core.identity import RequestRef
from streamtally.errors import StackError
from streamtally.settings import Settings
from streamtally.stack import redis as stack_redis
from streamtally.stack import secure
from streamtally.stack.client_env import SECURITY_VARIABLES, client_environment
from streamtally.stack.config import StackConfig, StackShape, read_shape, record_shape
from streamtally.stack.kafka import _scram_users
from streamtally.stack.kafka_node import node_paths, server_properties
from streamtally.store import scripts
from streamtally.store.acl import WORKER_COMMANDS, WORKER_KEY_PATTERN, worker_acl_rule
from streamtally.store.layout import LAYOUT_KEY, closed_key, tokens_key


def _properties(text: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


@pytest.fixture
def cfg(tmp_path: Path) -> StackConfig:
    """A secured stack's config with its credentials file (no TLS files needed here)."""
    config = StackConfig(tmp_path, kafka_port=39100, controller_port=39101, redis_port=39102,
                         secure=True)  # fmt: skip
    config.secure_dir.mkdir()
    credentials = secure.Credentials.generate()
    secure._write_private(
        secure.files(config).credentials,
        json.dumps({name: getattr(credentials, name) for name in secure.Credentials.__slots__}),
    )
    return config


def test_the_secured_broker_listens_on_sasl_ssl_with_scram(cfg: StackConfig) -> None:
    np = node_paths(cfg)[0]
    props = _properties(server_properties(cfg, np))
    assert props["listeners"] == "SASL_SSL://127.0.0.1:39100,CONTROLLER://127.0.0.1:39101"
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:39100"
    assert props["listener.security.protocol.map"] == "CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["inter.broker.listener.name"] == "SASL_SSL"
    assert props["ssl.keystore.location"] == str(secure.files(cfg).keystore)
    # Its storage and config are its own: the plaintext broker's are left alone.
    assert np.root == cfg.kafka_dir / "secure"
    plain = node_paths(StackConfig(cfg.state_dir))[0]
    assert "SASL" not in server_properties(StackConfig(cfg.state_dir), plain)
    assert plain.root == cfg.kafka_dir


def test_both_scram_users_are_created_at_format(cfg: StackConfig) -> None:
    credentials = secure.load_credentials(cfg)
    assert _scram_users(cfg) == [
        "--add-scram", f"SCRAM-SHA-512=[name=admin,password={credentials.kafka_admin}]",
        "--add-scram", f"SCRAM-SHA-512=[name=streamtally,password={credentials.kafka_client}]",
    ]  # fmt: skip
    assert _scram_users(StackConfig(cfg.state_dir)) == []


def test_the_secured_redis_has_tls_only_no_default_user_and_the_worker_acl(
    cfg: StackConfig,
) -> None:
    conf = stack_redis.redis_conf(cfg, stack_redis.paths(cfg)).splitlines()
    assert "port 0" in conf
    assert "tls-port 39102" in conf
    assert "user default off" in conf
    credentials = secure.load_credentials(cfg)
    worker = f"user streamtally on >{credentials.redis_client} {worker_acl_rule()}"
    assert worker in conf
    assert stack_redis.paths(cfg).root == cfg.state_dir / "redis-secure"


def test_the_credentials_file_is_private_and_never_in_a_repr(cfg: StackConfig) -> None:
    path = secure.files(cfg).credentials
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    credentials = secure.load_credentials(cfg)
    assert all(secret not in repr(credentials) for secret in credentials.secrets)
    assert len(credentials.secrets) == 5


def test_missing_credentials_say_how_to_make_them(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="stack up --secure"):
        secure.load_credentials(StackConfig(tmp_path, secure=True))


def test_stack_env_of_the_secured_stack_is_what_settings_read(cfg: StackConfig) -> None:
    env = dict(client_environment(cfg))
    ca = str(secure.files(cfg).ca_cert)
    Path(ca).parent.mkdir(parents=True)
    Path(ca).write_text("-", encoding="ascii")
    settings = Settings.load(env)
    conn = settings.kafka
    credentials = secure.load_credentials(cfg)
    assert conn.servers == "127.0.0.1:39100"
    assert (conn.security_protocol, conn.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    assert (conn.sasl_username, conn.sasl_password) == ("streamtally", credentials.kafka_client)
    assert conn.ssl_cafile == Path(ca)
    assert settings.redis_url == (
        f"rediss://streamtally:{credentials.redis_client}@127.0.0.1:39102/0?ssl_ca_certs={ca}"
    )


def test_stack_env_of_the_plaintext_stack_has_no_security(tmp_path: Path) -> None:
    env = dict(client_environment(StackConfig(tmp_path)))
    assert env == {
        "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9092",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "REDIS_CLUSTER": "0",
    }
    assert not set(env) & set(SECURITY_VARIABLES)


def test_the_shape_remembers_security(tmp_path: Path) -> None:
    record_shape(tmp_path, secure=True)
    assert read_shape(tmp_path) == StackShape(brokers=1, redis_cluster=False, secure=True)
    record_shape(tmp_path, secure=False)
    assert read_shape(tmp_path) == StackShape()
    assert "secure" not in json.loads((tmp_path / "stack.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize(("brokers", "cluster"), [(3, False), (1, True)])
def test_secure_is_one_broker_and_one_redis(tmp_path: Path, brokers: int, cluster: bool) -> None:
    with pytest.raises(StackError, match="--secure runs one Kafka broker and one Redis"):
        StackConfig(tmp_path, brokers=brokers, redis_cluster=cluster, secure=True)


def test_every_command_the_scripts_call_is_in_the_worker_acl() -> None:
    """Redis checks a script's calls against the caller's ACL: a missing one fails a flush."""
    called = set()
    for name in dir(scripts):
        value = getattr(scripts, name)
        if name.endswith("_SCRIPT") and isinstance(value, str):
            called |= {c.lower() for c in re.findall(r"redis\.p?call\('([A-Za-z]+)'", value)}
    assert called  # the scripts were found
    assert called <= set(WORKER_COMMANDS)


def test_the_worker_keys_are_the_layout_keys() -> None:
    prefix = WORKER_KEY_PATTERN.removesuffix("*")
    ref = RequestRef("acme", "r1")
    assert all(key.startswith(prefix) for key in (LAYOUT_KEY, tokens_key(ref), closed_key(ref)))
    rule = worker_acl_rule()
    assert rule.startswith(f"~{WORKER_KEY_PATTERN} resetchannels -@all +ping ")
    assert "+flushall" not in rule
    assert "+config" not in rule
    assert "+eval" not in rule.split()  # only the registered scripts, by their SHA


def test_the_readme_shows_the_worker_acl_rule_as_it_is() -> None:
    root = Path(__file__).resolve().parents[3]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]  # docs/security.md has it
    text = "".join(page.read_text(encoding="utf-8") for page in pages)
    block = text.split("ACL SETUSER streamtally-worker on >PASSWORD ", 1)[1].split("```", 1)[0]
    assert block.split() == worker_acl_rule().split()
