"""Apache Avro Java for the tests: its jars from Maven Central, and a small schema checker.

`tests/java/avro/pom.xml` names the Avro release; Maven copies it and its runtime
dependencies (jackson, ...) into ``<state>/avro-java/lib`` once, the way
`streamtally.stack.kafka_jars` fetches Kafka's, and ``javac`` compiles
`tests/java/avro/AvroSchemaSet.java` into ``<state>/avro-java/classes`` once.  Both are
redone when the pom or the source change (a stamp holds their digest).  ``<state>`` is the
project's state directory (`Settings.state_dir`: ``.stack/`` in a checkout).  Processes that
need it at once (pytest-xdist's workers) take turns on a lock file there, and the later ones
find it built.

`avro_java()` returns the checker ready to run, or raises `AvroJavaUnavailable` saying
why (no java, javac or mvn; Maven Central unreachable); the tests skip on that
locally and fail in CI.
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from streamtally.settings import Settings
from streamtally.stack import indent, tail

__all__ = ["POM", "SOURCE", "AvroJava", "AvroJavaUnavailable", "avro_java"]

HERE: Final = Path(__file__).resolve().parent / "java" / "avro"
POM: Final = HERE / "pom.xml"
SOURCE: Final = HERE / "AvroSchemaSet.java"
MAIN: Final = "AvroSchemaSet"
_MAVEN_TIMEOUT_S: Final = 600.0
_ANSI: Final = re.compile(r"\x1b\[[0-9;]*m")


class AvroJavaUnavailable(Exception):
    """Avro Java cannot be run here (a tool missing, or its jars not downloadable)."""


@dataclass(frozen=True, slots=True)
class AvroJava:
    """The compiled checker: ``java -cp <classpath> AvroSchemaSet``."""

    java: str
    classpath: str

    def run(self, jobs: Sequence[Sequence[str]], timeout: float = 120.0) -> list[str]:
        """One output line per job (``mode``, then paths: see AvroSchemaSet.java), one JVM."""
        text = "".join("\t".join(job) + "\n" for job in jobs)
        result = subprocess.run(
            [self.java, "-cp", self.classpath, MAIN],
            input=text,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{MAIN} exited {result.returncode}:\n{result.stderr}")
        lines = result.stdout.splitlines()
        if len(lines) != len(jobs):
            raise RuntimeError(f"{MAIN}: {len(jobs)} jobs, {len(lines)} answers:\n{result.stderr}")
        return lines


def _tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AvroJavaUnavailable(f"{name} not found: {hint}")
    return path


def _digest() -> str:
    return hashlib.sha256(POM.read_bytes() + b"\0" + SOURCE.read_bytes()).hexdigest()


def _resolve(root: Path, mvn: str, javac: str) -> None:
    """Copy the jars into ``root/lib`` and compile the checker into ``root/classes``."""
    root.mkdir(parents=True, exist_ok=True)
    log = root / "logs" / "maven.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    staging = root / "build.partial"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "classes").mkdir(parents=True)
    pom = staging / "pom.xml"
    shutil.copyfile(POM, pom)
    argv = [
        mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(pom),
        "dependency:copy-dependencies", "-DincludeScope=runtime",
        f"-DoutputDirectory={staging / 'lib'}",
    ]  # fmt: skip
    try:
        result = subprocess.run(
            argv, cwd=staging, capture_output=True, text=True, check=False,
            timeout=_MAVEN_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AvroJavaUnavailable(f"Maven did not finish in {exc.timeout:.0f} s") from exc
    log.write_text(_ANSI.sub("", result.stdout + result.stderr), encoding="utf-8")
    if result.returncode != 0 or not any((staging / "lib").glob("avro-*.jar")):
        raise AvroJavaUnavailable(
            f"Maven could not fetch the Avro jars of {POM} (exit {result.returncode}); "
            f"Maven Central must be reachable. Full output: {log}\n{indent(tail(log))}"
        )
    compiled = subprocess.run(
        [javac, "-d", str(staging / "classes"), "-cp", str(staging / "lib" / "*"), str(SOURCE)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    if compiled.returncode != 0:  # a defect of the checker itself, not of the machine
        raise RuntimeError(f"javac {SOURCE} failed:\n{compiled.stdout}{compiled.stderr}")
    (staging / ".resolved").write_text(_digest() + "\n", encoding="ascii")
    build = root / "build"
    shutil.rmtree(build, ignore_errors=True)
    staging.replace(build)


def avro_java(state_dir: Path | None = None) -> AvroJava:
    """The checker, built under ``<state>/avro-java`` on first use (`AvroJavaUnavailable`)."""
    java = _tool("java", "install a JDK 17+ (apt-get install -y openjdk-17-jdk-headless)")
    javac = _tool("javac", "install a JDK 17+, not only a JRE (openjdk-17-jdk-headless)")
    root = (state_dir or Settings.load().state_dir) / "avro-java"
    build = root / "build"
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; released when closed
        try:
            fresh = (build / ".resolved").read_text(encoding="ascii").strip() == _digest()
        except FileNotFoundError:
            fresh = False
        if not fresh:
            mvn = _tool("mvn", "install maven (apt-get install -y maven)")
            _resolve(root, mvn, javac)
    classpath = f"{build / 'classes'}:{build / 'lib' / '*'}"
    return AvroJava(java, classpath)
