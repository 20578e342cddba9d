"""The local schema registry: Apicurio Registry, built from Maven Central, on a loopback port.

``streamtally stack up --registry`` starts it beside Kafka and Redis.  Clients
use its Confluent-compatible API (``ccompat``) at
``http://127.0.0.1:8081/apis/ccompat/v7``, the value ``stack up`` prints as
``STREAMTALLY_SCHEMA_REGISTRY_URL``.

The application: Maven builds the project in ``streamtally/stack/registry_app``
(Apicurio's application jar packaged by Quarkus; its ``pom.xml`` says why the
version is 2.4.2.Final) once per state dir, under a JDK 17+ (`find_registry_java`).
The first build downloads ~220 MB of jars into ``~/.m2`` (about 1 min here);
with them there it takes 20-30 s.  Later ``up`` calls reuse the built application
until the project's files change.

Its storage: Apicurio's SQL storage on an H2 database file in the state dir,
each commit written through (``WRITE_DELAY=0``), so schema ids survive a
restart and a kill: records framed with an id stay readable.  No
authentication; the ``ccompat`` API gives a schema the id of its content
(``legacy-id-mode`` off): registering the same schema text again, under any
subject, returns the same id.  ``use-canonical-hash`` stays off: in Apicurio
2.4 it makes ``GET /schemas/ids/{id}`` return the schema with its record
fields sorted by name, another schema in Avro's binary encoding (a reader
would decode garbage); so a schema spelled differently (key order,
whitespace) is a new version, where Confluent's registry would match it.
The project registers its schemas from the same text each time.

Layout under ``<state>/registry``::

    app/              the built application (quarkus-run.jar, lib/, ...), .built stamp;
                      or a copy of the build another state dir made of the same project
                      (the stack's cache, `StackConfig.cache`)
    build/            the Maven project while it builds (removed after)
    logs/maven.log    Maven's output of the last build
    data/             registry.mv.db: the H2 database (schemas, ids, rules)
    logs/registry.out the registry's log (stdout and stderr)
    registry.pid

`up`, `down`, `status` and `wipe` handle the stack's registry; `ensure_built`,
`start` and `RegistryPaths` also run one elsewhere (a test's own, on its own
port and data).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from streamtally.errors import StackError
from streamtally.ops.build_cache import BuildCache, install
from streamtally.stack import (
    Say,
    ServiceStatus,
    already_running,
    indent,
    port_in_use,
    port_in_use_error,
    process_status,
    spawn_detached,
    stop_services,
    tail,
    wait_answering,
)
from streamtally.stack.config import StackConfig
from streamtally.stack.java import Java, find_java
from streamtally.stack.kafka_jars import find_maven

__all__ = [
    "APP_PROJECT",
    "CCOMPAT_PATH",
    "ENV_SCHEMA_REGISTRY_URL",
    "MIN_JAVA",
    "READY_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "RegistryHome",
    "RegistryPaths",
    "answers",
    "apicurio_version",
    "app_built",
    "down",
    "ensure_built",
    "find_registry_java",
    "home",
    "java_argv",
    "jdbc_url",
    "paths",
    "start",
    "started",
    "status",
    "stop",
    "up",
    "wipe",
]

#: The Maven project that builds the registry (its pom.xml pins Apicurio and Quarkus).
APP_PROJECT: Final = Path(__file__).with_name("registry_app")
#: The Confluent-compatible API under the registry's address.
CCOMPAT_PATH: Final = "/apis/ccompat/v7"
#: Where clients find the registry (`stack up --registry` prints it; the registry
#: client of the wire format reads it).
ENV_SCHEMA_REGISTRY_URL: Final = "STREAMTALLY_SCHEMA_REGISTRY_URL"
#: Quarkus 2.16 (Apicurio 2.4) runs on Java 11+; 17 is what the stack's Kafka needs too.
MIN_JAVA: Final = 17
READY_TIMEOUT_S: Final = 120.0
STOP_TIMEOUT_S: Final = 30.0
HEAP_OPTS: Final = ("-Xms32m", "-Xmx256m")
JVM_OPTS: Final = (
    "-XX:+UseSerialGC",  # one GC thread: the machine's cores are shared
    "-XX:TieredStopAtLevel=1",  # C1 only: a faster start, little CPU for a local registry
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
    "-Dfile.encoding=UTF-8",
)
_JAVA_HINT: Final = (
    "install a JDK 17 or later (Debian: apt-get install -y openjdk-17-jdk-headless, or "
    "openjdk-21-jdk-headless where the release has it)"
)
_MAVEN_TIMEOUT_S: Final = 1800.0
_PROGRESS_EVERY_S: Final = 15.0
_PROBE_TIMEOUT_S: Final = 2.0
_STAMP: Final = ".built"


@dataclass(frozen=True, slots=True)
class RegistryHome:
    """Where the registry application is built and kept (``<state>/registry``)."""

    root: Path

    @property
    def app_dir(self) -> Path:
        return self.root / "app"

    @property
    def run_jar(self) -> Path:
        return self.app_dir / "quarkus-run.jar"

    @property
    def stamp(self) -> Path:
        return self.app_dir / _STAMP

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def maven_log(self) -> Path:
        return self.root / "logs" / "maven.log"


@dataclass(frozen=True, slots=True)
class RegistryPaths:
    """The files of one running registry: its database, log and pid file."""

    root: Path

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def database(self) -> Path:
        """The H2 database's path without its ``.mv.db`` suffix, as its JDBC URL names it."""
        return self.data_dir / "registry"

    @property
    def out_log(self) -> Path:
        return self.root / "logs" / "registry.out"

    @property
    def pid_file(self) -> Path:
        return self.root / "registry.pid"

    @property
    def marker(self) -> str:
        """What this registry's command line holds: its own database."""
        return f"-Dquarkus.datasource.jdbc.url={jdbc_url(self)}"


def home(cfg: StackConfig) -> RegistryHome:
    return RegistryHome(cfg.registry_dir)


def paths(cfg: StackConfig) -> RegistryPaths:
    return RegistryPaths(cfg.registry_dir)


# --------------------------------------------------------------------------- build


def apicurio_version() -> str:
    """The Apicurio Registry version pinned in the project's ``pom.xml``."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(APP_PROJECT / "pom.xml").getroot().find("m:properties/m:apicurio.version", ns)
    if node is None or not node.text:
        raise StackError(f"{APP_PROJECT / 'pom.xml'} has no <apicurio.version> property")
    return node.text.strip()


def _project_files() -> list[Path]:
    return sorted(p for p in APP_PROJECT.rglob("*") if p.is_file() and "target" not in p.parts)


def project_digest() -> str:
    """A digest of the Maven project's files: a built application of another is rebuilt."""
    digest = hashlib.sha256()
    for path in _project_files():
        digest.update(path.relative_to(APP_PROJECT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def app_built(home: RegistryHome) -> bool:
    try:
        stamp = home.stamp.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return False
    return stamp == project_digest() and home.run_jar.is_file()


def find_registry_java(override: Path | None, *, need_compiler: bool) -> Java:
    """The Java of the registry: a JDK to build it (Maven compiles a class), any Java 17+
    to run it; `override` is ``STREAMTALLY_REGISTRY_JAVA``."""
    return find_java(
        MIN_JAVA,
        what=f"the schema registry (Apicurio Registry {apicurio_version()})",
        hint=_JAVA_HINT,
        override=override,
        override_name="STREAMTALLY_REGISTRY_JAVA",
        environ=os.environ,  # JAVA_HOME and PATH, as Maven itself reads them
        need_compiler=need_compiler,
    )


def maven_argv(mvn: str, project: Path) -> list[str]:
    return [
        mvn, "-B", "-Dstyle.color=never", "-f", str(project / "pom.xml"),
        "-Dquarkus.package.type=fast-jar", "-DskipTests", "package",
    ]  # fmt: skip


def _last_step(log: Path) -> str:
    """The Maven step under way (``maven-compiler-plugin:3.13.0:compile``), '' if none yet."""
    for line in reversed(tail(log, 200).splitlines()):
        if line.startswith("[INFO] --- "):
            return line.removeprefix("[INFO] --- ").split(" (", 1)[0].split(" @ ", 1)[0]
    return ""


def ensure_built(home: RegistryHome, java: Java, say: Say, cache: BuildCache | None = None) -> None:
    """Build the application into ``app/`` with Maven under `java` (a JDK); no-op when built.

    With a `cache`, a build of this project made in another state dir is taken from it, and
    a build made here is kept in it."""
    version = apicurio_version()
    if app_built(home):
        say(f"registry: Apicurio Registry {version} already built in {home.app_dir}")
        return
    stacks = RegistryPaths(home.root)
    running = process_status("registry", stacks.pid_file, stacks.marker, 0)
    if running.running:  # the stack's registry runs from the build about to be replaced
        raise StackError(
            f"the registry (pid {running.pid}) runs from the build in {home.app_dir}, which "
            "must be rebuilt for the changed registry_app project: `streamtally stack down` first"
        )
    digest = project_digest()
    taken = home.root / "app.partial"
    shutil.rmtree(taken, ignore_errors=True)
    if cache is not None and cache.take(digest, taken):
        install(taken, home.app_dir)
        if app_built(home):
            say(f"registry: Apicurio Registry {version} taken from {cache.entry(digest)}")
            return
    mvn = find_maven()
    say(
        f"registry: building Apicurio Registry {version} with Maven under Java {java.major} "
        f"({java.home}) into {home.app_dir}; the first time it downloads ~220 MB of jars "
        "into ~/.m2 (about a minute), later builds take 20-30 s ..."
    )
    start = time.monotonic()
    shutil.rmtree(home.build_dir, ignore_errors=True)
    shutil.copytree(APP_PROJECT, home.build_dir, ignore=shutil.ignore_patterns("target"))
    home.maven_log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAVA_HOME": str(java.home)}
    with home.maven_log.open("wb") as log:
        proc = subprocess.Popen(
            maven_argv(mvn, home.build_dir),
            cwd=home.build_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for_maven(proc, home, say, start)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    built = home.build_dir / "target" / "quarkus-app"
    if proc.returncode != 0 or not (built / "quarkus-run.jar").is_file():
        raise StackError(
            f"Maven could not build the schema registry (exit {proc.returncode}); Maven Central "
            f"must be reachable. Full output: {home.maven_log}\n"
            f"{indent(tail(home.maven_log, 15))}"
        )
    (built / _STAMP).write_text(digest + "\n", encoding="ascii")
    if cache is not None:
        cache.store_or_say(built, digest, say, "registry: the build")
    install(built, home.app_dir)
    shutil.rmtree(home.build_dir, ignore_errors=True)
    say(f"registry: built in {time.monotonic() - start:.1f} s")


def _wait_for_maven(
    proc: subprocess.Popen[bytes], home: RegistryHome, say: Say, start: float
) -> None:
    """Wait for Maven, saying every 15 s how long it has run and at which step."""
    deadline = start + _MAVEN_TIMEOUT_S
    next_note = start + _PROGRESS_EVERY_S
    while proc.poll() is None:
        now = time.monotonic()
        if now >= deadline:
            raise StackError(
                f"Maven did not finish building the schema registry within "
                f"{_MAVEN_TIMEOUT_S:.0f} s; its output: {home.maven_log}"
            )
        if now >= next_note:
            step = _last_step(home.maven_log)
            say(f"registry: still building ({now - start:.0f} s){': ' + step if step else ''}")
            next_note += _PROGRESS_EVERY_S
        time.sleep(0.5)


# --------------------------------------------------------------------------- run


def jdbc_url(rp: RegistryPaths) -> str:
    """The H2 file database of `rp`, each commit written to disk before it returns."""
    return f"jdbc:h2:file:{rp.database};WRITE_DELAY=0"


def java_argv(java: Path, home: RegistryHome, rp: RegistryPaths, host: str, port: int) -> list[str]:
    """The registry's command line: its JVM, its address and storage, the ccompat modes."""
    return [
        str(java), *HEAP_OPTS, *JVM_OPTS,
        f"-Dquarkus.http.host={host}",
        f"-Dquarkus.http.port={port}",
        rp.marker,
        "-Dregistry.sql.init=true",
        "-Dquarkus.datasource.jdbc.min-size=1",
        "-Dquarkus.datasource.jdbc.initial-size=1",
        "-Dregistry.auth.enabled=false",
        "-Dregistry.ccompat.legacy-id-mode.enabled=false",
        "-Dregistry.ccompat.use-canonical-hash=false",
        "-Dquarkus.log.console.color=false",
        "-jar", str(home.run_jar),
    ]  # fmt: skip


def base_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def answers(host: str, port: int, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """True if the registry at `host`:`port` says it is ready (its storage reachable)."""
    try:
        with urllib.request.urlopen(
            f"{base_url(host, port)}/health/ready", timeout=timeout
        ) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _startup_failure(rp: RegistryPaths, what: str, hint: str) -> StackError:
    last = tail(rp.out_log, 15)
    return StackError(
        f"registry {what}. Log: {rp.out_log}"
        + (f"; last lines:\n{indent(last)}" if last else "")
        + f"\n{hint}"
    )


def start(
    java: Java,
    home: RegistryHome,
    rp: RegistryPaths,
    address: tuple[str, int],
    say: Say,
    *,
    timeout: float = READY_TIMEOUT_S,
) -> tuple[int, float]:
    """Start the built registry on `address` (host, port) with its files in `rp`; its pid
    and the seconds until it answered."""
    host, port = address
    if port_in_use(host, port):
        raise port_in_use_error(
            host, port, "pick another with STREAMTALLY_REGISTRY_PORT", what=" (registry)"
        )
    rp.data_dir.mkdir(parents=True, exist_ok=True)
    say(
        f"registry: starting Apicurio Registry {apicurio_version()} on {host}:{port} under Java "
        f"{java.major} (data in {rp.data_dir}) ..."
    )
    argv = java_argv(java.java, home, rp, host, port)
    proc = spawn_detached(argv, cwd=rp.root, log_file=rp.out_log, pid_file=rp.pid_file)

    def timed_out() -> StackError:
        return _startup_failure(
            rp,
            f"did not answer on {host}:{port} within {timeout:g} s",
            "It may still be starting: `streamtally stack up --registry` again waits for it; "
            "`streamtally stack down` stops it.",
        )

    def exited(code: int) -> StackError:
        return _startup_failure(
            rp,
            f"exited with code {code} while starting",
            "Fix the cause above; `streamtally stack down --wipe` deletes its data and logs.",
        )

    waited = wait_answering(
        lambda: answers(host, port),
        timeout=timeout,
        every=0.25,
        timed_out=timed_out,
        proc=proc,
        pid_file=rp.pid_file,
        exited=exited,
    )
    return proc.pid, waited


def stop(rp: RegistryPaths, say: Say, port: int, timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop the registry of `rp` if it runs (SIGTERM, SIGKILL after `timeout`)."""
    current = process_status("registry", rp.pid_file, rp.marker, port)
    if current.pid_file.exists():
        stop_services([current], say, timeout)


# --------------------------------------------------------------------------- the stack's


def status(cfg: StackConfig) -> ServiceStatus:
    rp = paths(cfg)
    return process_status("registry", rp.pid_file, rp.marker, cfg.registry_port)


def started(cfg: StackConfig) -> bool:
    """True if the stack's registry was started and not stopped since (it may have died)."""
    return paths(cfg).pid_file.exists()


def up(
    cfg: StackConfig,
    say: Say,
    *,
    java_override: Path | None = None,
    timeout: float = READY_TIMEOUT_S,
) -> None:
    """Build the registry if needed, start it unless it runs, and wait until it answers."""
    rp = paths(cfg)
    address = f"{cfg.host}:{cfg.registry_port}"
    if already_running("registry", status(cfg), address, say):
        wait_answering(
            lambda: answers(cfg.host, cfg.registry_port),
            timeout=timeout,
            every=0.25,
            timed_out=lambda: _startup_failure(
                rp, f"runs but does not answer on {address}", "`streamtally stack down` stops it."
            ),
        )
        return
    rh = home(cfg)
    java = find_registry_java(java_override, need_compiler=not app_built(rh))
    ensure_built(rh, java, say, cfg.cache("registry"))
    pid, waited = start(java, rh, rp, (cfg.host, cfg.registry_port), say, timeout=timeout)
    say(f"registry: ready in {waited:.1f} s (pid {pid}, {cfg.local_registry_url()})")


def down(cfg: StackConfig, say: Say, timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop the stack's registry; says nothing when it was never started."""
    stop(paths(cfg), say, cfg.registry_port, timeout)


def wipe(cfg: StackConfig, say: Say) -> None:
    """Delete the registry's schemas, ids and logs; keep the built application."""
    rp = paths(cfg)
    removed = [p for p in (rp.data_dir, rp.out_log.parent) if p.exists()]
    for target in removed:
        shutil.rmtree(target)
    if removed:
        say(f"registry: wiped data and logs under {cfg.registry_dir} (application kept)")
