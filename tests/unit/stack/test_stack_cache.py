"""The local stack's cache: Kafka jars and registry builds made in one state dir are taken
by another instead of running Maven again (`StackConfig.cache`)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from streamtally.ops.build_cache import BuildCache
from streamtally.settings import Settings
from streamtally.stack import kafka_jars, registry
from streamtally.stack.config import StackConfig
from streamtally.stack.java import Java

#: A stand-in for Maven: writes a Kafka jar into ``-DoutputDirectory=``, or builds the
#: registry's ``target/quarkus-app`` in its working directory; counts its runs.
FAKE_MVN = """#!/bin/sh
echo run >> "{runs}"
for arg in "$@"; do
  case "$arg" in
    -DoutputDirectory=*)
      out="${{arg#-DoutputDirectory=}}"; mkdir -p "$out"; echo jar > "$out/kafka_2.13-x.jar";;
  esac
done
case "$*" in
  *quarkus*) mkdir -p target/quarkus-app && echo jar > target/quarkus-app/quarkus-run.jar;;
esac
"""


@pytest.fixture
def maven_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake Maven of `FAKE_MVN` put in place; the file that counts its runs."""
    runs = tmp_path / "maven-runs"
    runs.touch()
    mvn = tmp_path / "mvn"
    mvn.write_text(FAKE_MVN.format(runs=runs))
    mvn.chmod(mvn.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(kafka_jars, "find_maven", lambda: str(mvn))
    monkeypatch.setattr(registry, "find_maven", lambda: str(mvn))
    return runs


def _runs(runs: Path) -> int:
    return len(runs.read_text().splitlines())


def test_jars_resolved_in_one_state_dir_are_taken_by_the_next(
    tmp_path: Path, maven_runs: Path
) -> None:
    cache = BuildCache(tmp_path / "cache")
    first = kafka_jars.KafkaHome(tmp_path / "one" / "kafka")
    kafka_jars.resolve_jars(first, print, cache)
    assert _runs(maven_runs) == 1
    assert kafka_jars.jars_resolved(first)
    said: list[str] = []
    second = kafka_jars.KafkaHome(tmp_path / "two" / "kafka")
    kafka_jars.resolve_jars(second, said.append, cache)
    assert _runs(maven_runs) == 1  # no Maven the second time
    assert kafka_jars.jars_resolved(second)
    assert (second.lib / "kafka_2.13-x.jar").read_text() == "jar\n"
    entry = cache.entry(kafka_jars._pom_digest())
    assert said == [f"kafka: jars for {kafka_jars.kafka_version()} taken from {entry}"]
    kafka_jars.resolve_jars(kafka_jars.KafkaHome(tmp_path / "three" / "kafka"), print, None)
    assert _runs(maven_runs) == 2  # no cache: Maven


def test_a_cached_entry_that_is_not_a_resolution_is_resolved_anew(
    tmp_path: Path, maven_runs: Path
) -> None:
    cache = BuildCache(tmp_path / "cache")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "notes.txt").write_text("no jars, no stamp\n")
    cache.store(broken, kafka_jars._pom_digest())
    home = kafka_jars.KafkaHome(tmp_path / "one" / "kafka")
    kafka_jars.resolve_jars(home, print, cache)
    assert _runs(maven_runs) == 1
    assert kafka_jars.jars_resolved(home)


def test_a_registry_built_in_one_state_dir_is_taken_by_the_next(
    tmp_path: Path, maven_runs: Path
) -> None:
    cache = BuildCache(tmp_path / "cache")
    java = Java(Path("/jdk/bin/java"), 17)
    first = registry.RegistryHome(tmp_path / "one" / "registry")
    registry.ensure_built(first, java, print, cache)
    assert _runs(maven_runs) == 1
    assert registry.app_built(first)
    second = registry.RegistryHome(tmp_path / "two" / "registry")
    registry.ensure_built(second, java, print, cache)
    assert _runs(maven_runs) == 1
    assert registry.app_built(second)
    assert second.run_jar.read_text() == "jar\n"


def test_the_stack_cache_is_under_the_cache_home_or_set_or_off(tmp_path: Path) -> None:
    def cfg(**env: str) -> StackConfig:
        return StackConfig.from_settings(Settings.load({"STREAMTALLY_STATE_DIR": "/s", **env}))

    default = cfg(XDG_CACHE_HOME=str(tmp_path))
    assert default.cache_dir == tmp_path / "streamtally" / "stack"
    jars = default.cache("kafka-jars")
    assert jars is not None
    assert jars.root == tmp_path / "streamtally" / "stack" / "kafka-jars"
    assert cfg(STREAMTALLY_STACK_CACHE=str(tmp_path / "c")).cache_dir == tmp_path / "c"
    off = cfg(STREAMTALLY_STACK_CACHE="off")
    assert off.cache_dir is None
    assert off.cache("registry") is None
