"""The stack's schema registry without running it: Java found, command line, ports, CLI, compose.

`tests/integration/test_schema_registry.py` runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streamtally.cli import stack as cli
from streamtally.errors import InputError, StackError
from streamtally.settings import Settings
from streamtally.stack import ServiceState, ServiceStatus, StackConfig, kafka, redis, registry
from streamtally.stack.java import Java, candidates, find_java, parse_major

ROOT = Path(__file__).resolve().parents[3]

# --------------------------------------------------------------------------- Java


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment', 17),
        ('openjdk version "25" 2025-09-16 LTS', 25),
        ('java version "1.8.0_292"', 8),
        ("Error: could not find libjava.so", None),
    ],
)
def test_the_major_version_is_read_from_java_version(output: str, major: int | None) -> None:
    assert parse_major(output) == major


def _jdk(root: Path, name: str, *, javac: bool = True) -> Path:
    """A fake Java home `root/name` (``bin/java``, and ``bin/javac`` for a JDK)."""
    bin_dir = root / name / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "java").write_text("#!/bin/sh\n")
    (bin_dir / "java").chmod(0o755)
    if javac:
        (bin_dir / "javac").write_text("#!/bin/sh\n")
    return root / name


def _versions(**by_home: int) -> object:
    """A stand-in of `java_major`: the version of each fake home by its folder name."""

    def version_of(java: Path) -> int | None:
        return by_home.get(java.parent.parent.name)

    return version_of


@pytest.fixture
def jvm(tmp_path: Path) -> Path:
    root = tmp_path / "jvm"
    _jdk(root, "java-17-openjdk-amd64")
    _jdk(root, "temurin-25-jdk-amd64")
    _jdk(root, "java-21-openjdk-amd64", javac=False)  # a runtime only
    return root


def _find(jvm: Path, minimum: int, **kwargs: object) -> Java:
    return find_java(
        minimum,
        what="the thing",
        hint="install one",
        environ={"PATH": str(jvm / "nowhere")},
        jvm_dir=jvm,
        version_of=_versions(
            **{"java-17-openjdk-amd64": 17, "temurin-25-jdk-amd64": 25, "java-21-openjdk-amd64": 21}
        ),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def test_the_jvm_folder_is_searched_newest_first(jvm: Path) -> None:
    assert [p.parent.parent.name for p in candidates({"PATH": "/nowhere"}, jvm)] == [
        "temurin-25-jdk-amd64",
        "java-21-openjdk-amd64",
        "java-17-openjdk-amd64",
    ]


def test_java_home_and_path_come_before_the_jvm_folder(jvm: Path, tmp_path: Path) -> None:
    other = _jdk(tmp_path / "opt", "jdk-22")
    path_java = _jdk(tmp_path / "usr", "local")
    environ = {"JAVA_HOME": str(other), "PATH": str(path_java / "bin")}
    found = candidates(environ, jvm)
    assert found[:2] == [other / "bin" / "java", path_java / "bin" / "java"]
    assert len(found) == 5


def test_the_first_java_new_enough_wins(jvm: Path) -> None:
    found = _find(jvm, 17)
    assert (found.major, found.home) == (25, jvm / "temurin-25-jdk-amd64")
    # a runtime without javac serves to run, not to build
    assert _find(jvm, 21).major == 25
    assert _find(jvm, 21, need_compiler=False).major == 25


def test_a_runtime_only_is_passed_over_when_maven_must_compile(jvm: Path) -> None:
    import shutil

    shutil.rmtree(jvm / "temurin-25-jdk-amd64")
    assert _find(jvm, 21, need_compiler=False).home == jvm / "java-21-openjdk-amd64"
    with pytest.raises(StackError, match=r"needs a JDK 21\+; found .*\(21\), .*\(17\): install"):
        _find(jvm, 21, need_compiler=True)


def test_none_new_enough_says_what_to_install(jvm: Path) -> None:
    with pytest.raises(StackError) as error:
        _find(jvm, 26, override_name="STREAMTALLY_REGISTRY_JAVA")
    message = str(error.value)
    assert message.startswith("the thing needs a Java 26+; found ")
    assert message.endswith("install one, or point STREAMTALLY_REGISTRY_JAVA at one")


def test_an_explicit_java_is_the_only_candidate(jvm: Path) -> None:
    home = jvm / "java-17-openjdk-amd64"
    assert _find(jvm, 17, override=home).java == home / "bin" / "java"
    assert _find(jvm, 17, override=home / "bin" / "java").major == 17
    with pytest.raises(StackError, match=r"^X=.*17-openjdk-amd64 is Java 17; the thing needs 21\+"):
        _find(jvm, 21, override=home, override_name="X")
    with pytest.raises(StackError, match=r"^X=/nope: no java runs there"):
        _find(jvm, 17, override=Path("/nope"), override_name="X")
    with pytest.raises(StackError, match="a Java runtime without javac"):
        _find(jvm, 17, override=jvm / "java-21-openjdk-amd64", need_compiler=True)


def test_the_registry_needs_java_17() -> None:
    assert registry.MIN_JAVA == 17


# --------------------------------------------------------------------------- command line


def test_the_command_line_binds_loopback_keeps_ids_in_a_file_and_stays_small(
    tmp_path: Path,
) -> None:
    home = registry.RegistryHome(tmp_path / "home")
    rp = registry.RegistryPaths(tmp_path / "run")
    argv = registry.java_argv(Path("/jdk/bin/java"), home, rp, "127.0.0.1", 18081)
    assert argv[0] == "/jdk/bin/java"
    assert argv[-2:] == ["-jar", str(tmp_path / "home" / "app" / "quarkus-run.jar")]
    options = dict(a.removeprefix("-D").split("=", 1) for a in argv if a.startswith("-D"))
    assert options["quarkus.http.host"] == "127.0.0.1"
    assert options["quarkus.http.port"] == "18081"
    url = f"jdbc:h2:file:{tmp_path / 'run' / 'data' / 'registry'};WRITE_DELAY=0"
    assert options["quarkus.datasource.jdbc.url"] == url
    assert options["registry.auth.enabled"] == "false"
    assert options["registry.ccompat.legacy-id-mode.enabled"] == "false"
    # on, Apicurio 2.4 returns schemas with their fields sorted: another binary layout
    assert options["registry.ccompat.use-canonical-hash"] == "false"
    assert "-Xmx256m" in argv
    assert "-XX:+UseSerialGC" in argv
    assert rp.marker in argv  # how `status` tells this registry from another process


def test_the_build_is_reused_only_for_the_same_project(tmp_path: Path) -> None:
    home = registry.RegistryHome(tmp_path)
    assert not registry.app_built(home)
    home.app_dir.mkdir()
    home.run_jar.write_bytes(b"jar")
    home.stamp.write_text("another project\n")
    assert not registry.app_built(home)
    home.stamp.write_text(registry.project_digest() + "\n")
    assert registry.app_built(home)


def test_maven_builds_a_fast_jar() -> None:
    argv = registry.maven_argv("mvn", Path("/b"))
    assert argv[:2] == ["mvn", "-B"]
    assert "-Dquarkus.package.type=fast-jar" in argv
    assert argv[-1] == "package"


# --------------------------------------------------------------------------- ports


def test_the_registry_port_is_a_setting_apart_from_the_others(tmp_path: Path) -> None:
    settings = Settings.load({"STREAMTALLY_STATE_DIR": str(tmp_path)})
    assert settings.registry_port == 8081
    assert settings.registry_java is None
    cfg = StackConfig.from_settings(settings)
    assert cfg.local_registry_url() == "http://127.0.0.1:8081/apis/ccompat/v7"
    assert cfg.registry_dir == tmp_path.resolve() / "registry"
    assert ("registry", 8081) in cfg.named_ports()
    moved = Settings.load({"STREAMTALLY_REGISTRY_PORT": "18081", "STREAMTALLY_REGISTRY_JAVA": "/j"})
    assert (moved.registry_port, moved.registry_java) == (18081, Path("/j"))
    with pytest.raises(InputError, match=r"registry \(9092\) ports must differ.*REGISTRY_PORT"):
        Settings.load({"STREAMTALLY_REGISTRY_PORT": "9092"})
    with pytest.raises(StackError, match=r"registry \(6379\) ports must differ"):
        StackConfig(tmp_path, registry_port=6379)
    with pytest.raises(StackError, match="redis master 2 and registry ports must differ"):
        StackConfig(tmp_path, redis_cluster=True, registry_port=6380)


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "REDIS_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STREAMTALLY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("STREAMTALLY_REGISTRY_PORT", "18081")
    monkeypatch.setenv("STREAMTALLY_REGISTRY_JAVA", "/some/jdk")
    for module in (kafka, redis):
        monkeypatch.setattr(module, "up", lambda cfg, say, timeout: None)
        monkeypatch.setattr(module, "down", lambda cfg, say, timeout: None)
        monkeypatch.setattr(
            module, "statuses", lambda cfg: [_running("kafka-or-redis", cfg.kafka_port)]
        )
    return tmp_path


def _running(name: str, port: int) -> ServiceStatus:
    return ServiceStatus(name, ServiceState.RUNNING, 4242, port, Path(f"/x/{name}.pid"))


def _fake_registry(monkeypatch: pytest.MonkeyPatch, state: Path) -> list[Path | None]:
    """`registry.up` records the Java it was given and leaves a pid file; `status`: running
    while that file is there."""
    javas: list[Path | None] = []

    def up(cfg: StackConfig, say: object, *, java_override: Path | None, timeout: float) -> None:
        del say, timeout
        javas.append(java_override)
        registry.paths(cfg).pid_file.parent.mkdir(parents=True, exist_ok=True)
        registry.paths(cfg).pid_file.write_text("4242\n")

    def status(cfg: StackConfig) -> ServiceStatus:
        pid_file = registry.paths(cfg).pid_file
        if pid_file.exists():
            return ServiceStatus("registry", ServiceState.RUNNING, 4242, 18081, pid_file)
        return ServiceStatus("registry", ServiceState.STOPPED, None, 18081, pid_file)

    monkeypatch.setattr(registry, "up", up)
    monkeypatch.setattr(registry, "status", status)
    return javas


def test_up_starts_the_registry_only_when_asked(
    state: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    javas = _fake_registry(monkeypatch, state)
    assert cli.main(["up"]) == 0
    assert javas == []
    assert "SCHEMA_REGISTRY" not in capsys.readouterr().out
    assert cli.main(["up", "--registry"]) == 0
    assert javas == [Path("/some/jdk")]
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(" STREAMTALLY_SCHEMA_REGISTRY_URL=http://127.0.0.1:18081/apis/ccompat/v7")


def test_status_and_env_cover_a_started_registry(
    state: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status"]) == 0
    assert "registry" not in capsys.readouterr().out  # never started: not part of the stack
    _fake_registry(monkeypatch, state)
    assert cli.main(["up", "--registry"]) == 0
    capsys.readouterr()
    assert cli.main(["status"]) == 0
    assert "registry: running (pid 4242, port 18081)" in capsys.readouterr().out.splitlines()
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "export STREAMTALLY_SCHEMA_REGISTRY_URL=http://127.0.0.1:18081/apis/ccompat/v7" in out
    # died since: status says so and fails
    monkeypatch.setattr(
        registry,
        "status",
        lambda cfg: ServiceStatus(
            "registry", ServiceState.STOPPED, None, 18081, registry.paths(cfg).pid_file
        ),
    )
    assert cli.main(["status"]) == cli.EXIT_NOT_RUNNING
    assert "registry: stopped" in capsys.readouterr().out


def test_down_wipe_deletes_the_registrys_data_and_keeps_its_build(state: Path) -> None:
    rp = registry.paths(StackConfig(state.resolve()))
    for folder in (rp.data_dir, rp.out_log.parent, rp.root / "app"):
        folder.mkdir(parents=True)
        (folder / "file").write_text("x")
    assert cli.main(["down", "--wipe"]) == 0
    assert not rp.data_dir.exists()
    assert not rp.out_log.parent.exists()
    assert (rp.root / "app" / "file").exists()


# --------------------------------------------------------------------------- compose


def test_compose_runs_the_same_registry_version_port_and_storage() -> None:
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["registry"]
    assert service["image"] == f"apicurio/apicurio-registry-mem:{registry.apicurio_version()}"
    assert "profiles" not in service  # a new deployment runs it, and its worker uses it
    worker = compose["services"]["worker"]["environment"]
    assert worker["STREAMTALLY_AVRO_FRAMING"] == "confluent"
    assert (
        worker["STREAMTALLY_SCHEMA_REGISTRY_URL"] == f"http://registry:8080{registry.CCOMPAT_PATH}"
    )
    assert service["ports"] == [f"127.0.0.1:{StackConfig(Path('/x')).registry_port}:8080"]
    env = service["environment"]
    assert env["REGISTRY_DATASOURCE_URL"] == "jdbc:h2:file:/data/registry;WRITE_DELAY=0"
    argv = registry.java_argv(
        Path("java"), registry.RegistryHome(Path("/h")), registry.RegistryPaths(Path("/r")), "h", 1
    )
    options = dict(a.removeprefix("-D").split("=", 1) for a in argv if a.startswith("-D"))
    assert (
        env["ENABLE_CCOMPAT_LEGACY_ID_MODE"] == options["registry.ccompat.legacy-id-mode.enabled"]
    )
    assert (
        env["ENABLE_CCOMPAT_CANONICAL_HASH_MODE"] == options["registry.ccompat.use-canonical-hash"]
    )
    assert "registry-data:/data" in service["volumes"]


def test_a_build_is_not_replaced_under_the_registry_running_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = registry.RegistryHome(tmp_path)
    monkeypatch.setattr(
        registry,
        "process_status",
        lambda name, pid_file, marker, port: ServiceStatus(
            name, ServiceState.RUNNING, 4242, port, pid_file
        ),
    )
    monkeypatch.setattr(registry, "find_maven", lambda: pytest.fail("must not build"))
    java = Java(Path("/jdk/bin/java"), 17)
    with pytest.raises(StackError, match=r"registry \(pid 4242\) runs from the build.*stack down"):
        registry.ensure_built(home, java, print)
