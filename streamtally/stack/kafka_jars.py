"""The tools and jars of the local Kafka: ``java``, Maven, and Kafka from Maven Central.

Under ``<state>/kafka`` (shared by every broker count)::

    pom.xml           copy of streamtally/stack/pom.xml used to resolve the jars
    lib/              the broker's jars (mvn dependency:copy-dependencies), .resolved stamp;
                      or a copy of the jars another state dir resolved for the same pom
                      (the stack's cache, `StackConfig.cache`)
    logs/maven.log    Maven's output of the last resolution
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from streamtally.errors import StackError
from streamtally.ops.build_cache import BuildCache, install
from streamtally.stack import Say, indent, tail

__all__ = [
    "MIN_JAVA",
    "POM",
    "KafkaHome",
    "find_java",
    "find_maven",
    "jars_resolved",
    "kafka_version",
    "resolve_jars",
]

POM: Final = Path(__file__).with_name("pom.xml")
MIN_JAVA: Final = 17
_MAVEN_TIMEOUT_S: Final = 1800.0
_ANSI: Final = re.compile(r"\x1b\[[0-9;]*m")
_JAVA_INSTALL_HINT: Final = "install a JDK/JRE 17+ (apt-get install -y openjdk-17-jre-headless)"


@dataclass(frozen=True, slots=True)
class KafkaHome:
    """``<state>/kafka``: the jars every node of every broker count runs from."""

    root: Path

    @property
    def pom(self) -> Path:
        return self.root / "pom.xml"

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def stamp(self) -> Path:
        return self.lib / ".resolved"

    @property
    def maven_log(self) -> Path:
        return self.root / "logs" / "maven.log"


def kafka_version() -> str:
    """The Kafka version pinned in ``pom.xml`` (``kafka.version`` property)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(POM).getroot().find("m:properties/m:kafka.version", ns)
    if node is None or not node.text:
        raise StackError(f"{POM} has no <kafka.version> property")
    return node.text.strip()


def find_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError(f"java not found: {_JAVA_INSTALL_HINT}")
    result = subprocess.run(
        [java, "-version"], capture_output=True, text=True, check=False, timeout=60
    )
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if match is None:
        raise StackError(f"cannot tell the version of {java}: {result.stderr.strip()}")
    major = int(match.group(1))
    if major == 1:  # "1.8.0_x" style
        major = int(match.group(2) or 0)
    if major < MIN_JAVA:
        raise StackError(f"{java} is Java {major}; Kafka 4 needs {MIN_JAVA}+: {_JAVA_INSTALL_HINT}")
    return java


def find_maven() -> str:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError(
            "mvn not found: install maven (apt-get install -y maven); it downloads the "
            "Kafka jars from Maven Central once"
        )
    return mvn


def _pom_digest() -> str:
    return hashlib.sha256(POM.read_bytes()).hexdigest()


def jars_resolved(home: KafkaHome) -> bool:
    try:
        stamp = home.stamp.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return False
    return stamp == _pom_digest() and any(home.lib.glob("kafka_2.13-*.jar"))


def resolve_jars(home: KafkaHome, say: Say, cache: BuildCache | None = None) -> None:
    """Copy Kafka and its runtime dependencies into ``lib/``; no-op when already there.

    With a `cache`, jars resolved for this pom in another state dir are taken from it, and
    jars resolved here are kept in it."""
    version = kafka_version()
    if jars_resolved(home):
        say(f"kafka: jars for {version} already in {home.lib}")
        return
    home.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(POM, home.pom)
    staging = home.root / "lib.partial"
    shutil.rmtree(staging, ignore_errors=True)
    digest = _pom_digest()
    if cache is not None and cache.take(digest, staging):
        install(staging, home.lib)
        if jars_resolved(home):
            say(f"kafka: jars for {version} taken from {cache.entry(digest)}")
            return
        shutil.rmtree(staging, ignore_errors=True)  # (not what the stamp says: resolve anew)
    mvn = find_maven()
    say(f"kafka: resolving jars for kafka_2.13:{version} with Maven into {home.lib} ...")
    home.maven_log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    argv = [
        mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(home.pom),
        "dependency:copy-dependencies", "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]  # fmt: skip
    result = subprocess.run(
        argv, cwd=home.root, capture_output=True, text=True, check=False, timeout=_MAVEN_TIMEOUT_S
    )
    home.maven_log.write_text(_ANSI.sub("", result.stdout + result.stderr), encoding="utf-8")
    if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        raise StackError(
            f"Maven could not resolve the Kafka jars (exit {result.returncode}); Maven Central "
            f"must be reachable. Full output: {home.maven_log}\n{indent(tail(home.maven_log))}"
        )
    (staging / ".resolved").write_text(digest + "\n", encoding="ascii")
    if cache is not None:
        cache.store_or_say(staging, digest, say, "kafka: the jars")
    install(staging, home.lib)
    jars = sum(1 for _ in home.lib.glob("*.jar"))
    say(f"kafka: {jars} jars resolved in {time.monotonic() - start:.1f} s")
