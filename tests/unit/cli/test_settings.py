"""The one Settings object: every variable, its defaults, and clear errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from streamtally.errors import InputError
from streamtally.settings import Settings, project_root

ROOT = Path(__file__).resolve().parents[3]


def test_defaults_point_at_the_local_stack() -> None:
    settings = Settings.load({})
    assert settings.bootstrap_servers == "127.0.0.1:9092"
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.namespace == "streamtally"
    assert settings.prices_path is None  # the packaged price table
    assert settings.request_timeout == 300.0
    assert settings.batch_size == 2000
    assert not settings.uses_external_stack


def test_every_variable_is_read() -> None:
    settings = Settings.load(
        {
            "KAFKA_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
            "REDIS_URL": "redis://r:6380/3",
            "STREAMTALLY_NAMESPACE": "team-a",
            "STREAMTALLY_PRICES": "/etc/prices.json",
            "STREAMTALLY_REQUEST_TIMEOUT": "12.5",
            "STREAMTALLY_BATCH_SIZE": "10",
            "STREAMTALLY_STATE_DIR": "/tmp/st-state",
            "STREAMTALLY_KAFKA_PORT": "19092",
            "STREAMTALLY_CONTROLLER_PORT": "19093",
            "STREAMTALLY_REDIS_PORT": "16379",
            "UNRELATED": "ignored",
        }
    )
    assert settings.bootstrap_servers == "k1:9092,k2:9092"
    assert settings.redis_url == "redis://r:6380/3"
    assert settings.uses_external_stack
    assert settings.namespace == "team-a"
    assert settings.prices_path == Path("/etc/prices.json")
    assert settings.request_timeout == 12.5
    assert settings.batch_size == 10
    assert settings.state_dir == Path("/tmp/st-state")
    assert (settings.kafka_port, settings.controller_port, settings.redis_port) == (
        19092,
        19093,
        16379,
    )
    assert settings.local_bootstrap_servers == "127.0.0.1:19092"
    assert settings.local_redis_url == "redis://127.0.0.1:16379/0"


def test_blank_values_mean_unset() -> None:
    settings = Settings.load({"KAFKA_BOOTSTRAP_SERVERS": "  ", "STREAMTALLY_NAMESPACE": ""})
    assert settings.bootstrap_servers == "127.0.0.1:9092"
    assert settings.namespace == "streamtally"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("STREAMTALLY_REQUEST_TIMEOUT", "soon"),
        ("STREAMTALLY_REQUEST_TIMEOUT", "0"),
        ("STREAMTALLY_BATCH_SIZE", "-1"),
        ("STREAMTALLY_FETCH_MIN_BYTES", "0"),
        ("STREAMTALLY_FETCH_MIN_BYTES", str((8 << 20) + 1)),
        ("STREAMTALLY_FETCH_WAIT", "0"),
        ("STREAMTALLY_FETCH_WAIT", "0.6"),
        ("STREAMTALLY_KAFKA_PORT", "70000"),
        ("STREAMTALLY_NAMESPACE", "a b"),
    ],
)
def test_a_bad_value_names_its_variable(variable: str, value: str) -> None:
    with pytest.raises(InputError, match=rf"^bad setting: {variable}={re.escape(repr(value))}"):
        Settings.load({variable: value})


def test_ports_must_differ() -> None:
    with pytest.raises(InputError, match="ports must differ"):
        Settings.load({"STREAMTALLY_REDIS_PORT": "9092"})


def test_the_state_dir_is_the_clones_or_the_users() -> None:
    root = project_root()
    assert root == ROOT  # the tests run from an editable install of this clone
    assert Settings.load({}).state_dir == ROOT / ".stack"
    assert Settings.load({"XDG_STATE_HOME": "/x"}).state_dir == ROOT / ".stack"


def test_settings_built_in_code_ignore_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "from-env:1")
    monkeypatch.setenv("STREAMTALLY_BATCH_SIZE", "7")
    settings = Settings(namespace="x")
    assert settings.bootstrap_servers == "127.0.0.1:9092"
    assert settings.batch_size == 2000
    assert Settings.load().bootstrap_servers == "from-env:1"  # the entry point's reading


def test_settings_are_frozen() -> None:
    settings = Settings.load({})
    with pytest.raises(ValueError, match="frozen"):
        settings.batch_size = 5  # type: ignore[misc]


def test_only_the_settings_module_reads_the_environment() -> None:
    """No module reads the environment, at import or later, but `streamtally.settings`.

    (The local stack hands its own environment to the `apt-get` it runs and to the
    Maven that builds its schema registry (looking for a Java where Maven would:
    ``JAVA_HOME``, ``PATH``), and `streamtally._native` reads its one switch,
    ``STREAMTALLY_NATIVE``, when the package is imported: before any setting can be.)
    """
    reads = re.compile(r"os\.environ|os\.getenv|getenv\(")
    allowed = {
        "streamtally/settings/__init__.py",
        "streamtally/stack/redis_server.py",
        "streamtally/stack/registry.py",
        "streamtally/_native.py",
    }
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("streamtally", "topics", "processors", "producers")
        for path in sorted((ROOT / package).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in allowed and reads.search(path.read_text("utf-8"))
    ]
    assert offenders == []


def test_request_timeouts_per_source_override_the_default() -> None:
    settings = Settings.load(
        {
            "STREAMTALLY_REQUEST_TIMEOUT": "120",
            "STREAMTALLY_REQUEST_TIMEOUTS": " anthropic=600 , openai-responses=3600.5,",
        }
    )
    assert settings.request_timeouts == {"anthropic": 600.0, "openai-responses": 3600.5}
    assert settings.timeout_of("anthropic") == 600.0
    assert settings.timeout_of("openai") == 120.0
    assert settings.longest_request_timeout == 3600.5
    assert Settings.load({}).request_timeouts == {}
    assert Settings.load({}).longest_request_timeout == 300.0
    # Built in code: checked the same way.
    assert Settings(request_timeouts={"vllm": 5}).request_timeouts == {"vllm": 5.0}
    with pytest.raises(ValueError, match="unknown source 'claude'"):
        Settings(request_timeouts={"claude": 5})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("antropic=600", "unknown source 'antropic': one of openai, openai-responses,"),
        ("anthropic", "'anthropic' is not source=seconds"),
        ("anthropic=600,anthropic=700", "source 'anthropic' is given twice"),
        ("anthropic=0", "seconds must be a finite number > 0"),
        ("anthropic=-5", "seconds must be a finite number > 0"),
        ("anthropic=inf", "seconds must be a finite number > 0"),
        ("anthropic=ten", "seconds must be a finite number > 0"),
    ],
)
def test_a_bad_request_timeouts_value_says_what_is_wrong(value: str, says: str) -> None:
    with pytest.raises(InputError) as caught:
        Settings.load({"STREAMTALLY_REQUEST_TIMEOUTS": value})
    message = str(caught.value)
    assert message.startswith(f"bad setting: STREAMTALLY_REQUEST_TIMEOUTS={value!r}: ")
    assert says in message


def test_the_sources_a_timeout_is_set_for_are_the_sources() -> None:
    from streamtally.core.models import Source
    from streamtally.settings import SOURCE_NAMES

    assert tuple(source.value for source in Source) == SOURCE_NAMES


# --------------------------------------------------------------------------- Avro framing


def test_the_framing_and_the_registry_settings(tmp_path: Path) -> None:
    assert Settings.load({}).avro_framing == "single-object"
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    loaded = Settings.load(
        {
            "STREAMTALLY_AVRO_FRAMING": " Confluent ",
            "STREAMTALLY_SCHEMA_REGISTRY_URL": "https://svc:pw1234@registry:8081/apis/ccompat/v7",
            "STREAMTALLY_SCHEMA_REGISTRY_USERNAME": "svc",
            "STREAMTALLY_SCHEMA_REGISTRY_PASSWORD": "topsecret",
            "STREAMTALLY_SCHEMA_REGISTRY_CAFILE": str(ca),
            "STREAMTALLY_SCHEMA_REGISTRY_TIMEOUT": "2.5",
        }
    )
    assert loaded.avro_framing == "confluent"
    assert loaded.schema_registry_timeout == 2.5
    assert loaded.schema_registry_cafile == ca
    shown = repr(loaded) + str(loaded)
    assert "topsecret" not in shown
    assert "pw1234" not in shown
    bad = {
        "STREAMTALLY_AVRO_FRAMING=avro": ({"STREAMTALLY_AVRO_FRAMING": "avro"}, "AVRO_FRAMING"),
        "confluent without a registry": (
            {"STREAMTALLY_AVRO_FRAMING": "confluent"},
            "needs STREAMTALLY_SCHEMA_REGISTRY_URL",
        ),
        "not http": ({"STREAMTALLY_SCHEMA_REGISTRY_URL": "registry:8081"}, "not an http://"),
        "user without password": (
            {
                "STREAMTALLY_SCHEMA_REGISTRY_URL": "http://r:8081",
                "STREAMTALLY_SCHEMA_REGISTRY_USERNAME": "u",
            },
            "go together",
        ),
        "TLS files over http": (
            {
                "STREAMTALLY_SCHEMA_REGISTRY_URL": "http://r:8081",
                "STREAMTALLY_SCHEMA_REGISTRY_CAFILE": str(ca),
            },
            "need an https://",
        ),
        "missing CA": (
            {
                "STREAMTALLY_SCHEMA_REGISTRY_URL": "https://r:8081",
                "STREAMTALLY_SCHEMA_REGISTRY_CAFILE": str(tmp_path / "nope.pem"),
            },
            "no such file",
        ),
        "key without certificate": (
            {
                "STREAMTALLY_SCHEMA_REGISTRY_URL": "https://r:8081",
                "STREAMTALLY_SCHEMA_REGISTRY_KEYFILE": str(ca),
            },
            "KEYFILE needs STREAMTALLY_SCHEMA_REGISTRY_CERTFILE",
        ),
        "timeout": ({"STREAMTALLY_SCHEMA_REGISTRY_TIMEOUT": "0"}, "SCHEMA_REGISTRY_TIMEOUT"),
    }
    for case, (env, needle) in bad.items():
        with pytest.raises(InputError, match=re.escape(needle)) as raised:
            Settings.load(env)
        assert "Traceback" not in str(raised.value), case
    with pytest.raises(InputError, match="go together") as raised:
        Settings.load({"STREAMTALLY_SCHEMA_REGISTRY_PASSWORD": "pw-never-shown"})
    assert "pw-never-shown" not in str(raised.value)
    url = "http://u:pw5678@r:8081"
    with pytest.raises(InputError) as raised:
        Settings.load({"STREAMTALLY_SCHEMA_REGISTRY_URL": url, "STREAMTALLY_AVRO_FRAMING": "x"})
    assert "pw5678" not in str(raised.value)


def test_export_sets_the_children_environment_and_reads_the_settings_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from streamtally.settings import export

    # `export` sets os.environ itself: set, then delete, so that monkeypatch restores the
    # variable as it was (unset) and no later test in this process reads confluent framing.
    monkeypatch.setenv("STREAMTALLY_AVRO_FRAMING", "")
    monkeypatch.delenv("STREAMTALLY_AVRO_FRAMING")
    monkeypatch.setenv("STREAMTALLY_SCHEMA_REGISTRY_URL", "http://127.0.0.1:1/apis/ccompat/v7")
    settings = export({"STREAMTALLY_AVRO_FRAMING": "confluent"})
    assert settings.avro_framing == "confluent"
    assert os.environ["STREAMTALLY_AVRO_FRAMING"] == "confluent"
    with pytest.raises(ValueError, match="not streamtally settings: PATH"):
        export({"PATH": "/nowhere"})


def test_a_worker_is_a_dynamic_member_unless_given_an_instance_id() -> None:
    dynamic = Settings.load({})
    assert dynamic.worker_instance_id is None
    assert dynamic.session_timeout == 10.0
    static = Settings.load({"STREAMTALLY_WORKER_INSTANCE_ID": "billing-worker-0"})
    assert static.worker_instance_id == "billing-worker-0"
    assert static.session_timeout == 45.0  # outlasts a restart in place
    # a session of its own, either way
    assert Settings.load({"STREAMTALLY_SESSION_TIMEOUT": "20"}).session_timeout == 20.0
    both = {"STREAMTALLY_WORKER_INSTANCE_ID": "w.1", "STREAMTALLY_SESSION_TIMEOUT": "30"}
    assert Settings.load(both).session_timeout == 30.0


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("STREAMTALLY_WORKER_INSTANCE_ID", "worker 1", "should match pattern"),
        ("STREAMTALLY_WORKER_INSTANCE_ID", "pod/0", "should match pattern"),
        ("STREAMTALLY_WORKER_INSTANCE_ID", "w" * 250, "at most 249 characters"),
        # the broker's default group.min.session.timeout.ms and group.max.session.timeout.ms
        ("STREAMTALLY_SESSION_TIMEOUT", "5", "greater than or equal to 6"),
        ("STREAMTALLY_SESSION_TIMEOUT", "1801", "less than or equal to 1800"),
        ("STREAMTALLY_SESSION_TIMEOUT", "soon", "valid number"),
    ],
)
def test_a_bad_instance_id_or_session_timeout_says_what_is_wrong(
    variable: str, value: str, says: str
) -> None:
    with pytest.raises(InputError, match=rf"^bad setting: {variable}=.*{says}"):
        Settings.load({variable: value})


def test_a_static_members_session_must_outlast_its_restart() -> None:
    with pytest.raises(InputError, match="needs a session of at least 15 s"):
        Settings.load(
            {"STREAMTALLY_WORKER_INSTANCE_ID": "w-0", "STREAMTALLY_SESSION_TIMEOUT": "10"}
        )
    # the same session is fine for a dynamic member
    assert Settings.load({"STREAMTALLY_SESSION_TIMEOUT": "10"}).session_timeout == 10.0


def test_an_instance_id_given_on_the_command_line_is_checked_as_the_variable() -> None:
    settings = Settings.load({"STREAMTALLY_NAMESPACE": "team-a"})
    static = settings.with_instance_id("w-2")
    assert static.worker_instance_id == "w-2"
    assert static.session_timeout == 45.0
    assert static.namespace == "team-a"  # the rest as it was
    with pytest.raises(InputError, match="STREAMTALLY_WORKER_INSTANCE_ID='w 2'"):
        settings.with_instance_id("w 2")
    short = Settings.load({"STREAMTALLY_SESSION_TIMEOUT": "8"})
    with pytest.raises(InputError, match="at least 15 s"):
        short.with_instance_id("w-2")


def _sections() -> list[type]:
    return [
        base for base in Settings.__mro__[1:] if base.__module__.startswith("streamtally.settings.")
    ]


def test_every_setting_is_declared_in_exactly_one_section() -> None:
    owners: dict[str, list[str]] = {}
    for section in _sections():
        for field in section.__annotations__:
            owners.setdefault(field, []).append(section.__name__)
    assert {name: found for name, found in owners.items() if len(found) > 1} == {}
    assert set(owners) == set(Settings.model_fields)


def test_the_docstring_lists_each_variable_under_its_sections_module() -> None:
    """The table of `streamtally.settings` groups the variables as the sections do."""
    import streamtally.settings as module
    from streamtally.settings import _VARIABLES

    module_of = {
        field: section.__module__.rsplit(".", 1)[1]
        for section in _sections()
        for field in section.__annotations__
    }
    group = ""
    listed: dict[str, str] = {}
    for line in (module.__doc__ or "").splitlines():
        heading = re.match(r"^\*[^*]+\* \(``(\w+)\.py``\)$", line)
        if heading:
            group = heading.group(1)
            continue
        row = re.match(r"^``([A-Z_.]+)``", line)
        if row:
            shown = row.group(1)
            # "..._REGISTRY_USERNAME" abbreviates "STREAMTALLY_SCHEMA_REGISTRY_USERNAME".
            name = "STREAMTALLY_SCHEMA" + shown[3:] if shown.startswith("...") else shown
            listed[name] = group
    assert len(listed) >= 35  # the table was read
    misplaced = {
        name: (group, module_of[_VARIABLES[name]])
        for name, group in listed.items()
        if module_of[_VARIABLES[name]] != group
    }
    assert misplaced == {}
