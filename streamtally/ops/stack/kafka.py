"""Single-node Apache Kafka (KRaft: broker and controller in one JVM) for local work.

Layout under ``<state>/kafka``::

    pom.xml           copy of streamtally/stack/pom.xml used to resolve the jars
    lib/              the broker's jars (mvn dependency:copy-dependencies), .resolved stamp
    config/           server.properties and log4j2.xml, rewritten on every start
    cluster.id        KRaft cluster id, generated once
    data/             log.dirs (topics and the __cluster_metadata log)
    logs/             server.log, controller.log, state-change.log, kafka.out, maven.log
    kafka.pid
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
import shutil
import subprocess
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from streamtally.errors import StackError
from streamtally.ops.stack import (
    Say,
    ServiceStatus,
    already_running,
    indent,
    port_in_use,
    port_in_use_error,
    port_open,
    process_status,
    spawn_detached,
    stop_service,
    tail,
    wait_answering,
)
from streamtally.ops.stack.config import StackConfig

POM = Path(__file__).with_name("pom.xml")
KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"
NODE_ID = 1
MIN_JAVA = 17
HEAP_OPTS = ("-Xms256m", "-Xmx1g")
JVM_OPTS = (
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 5.0
_MAVEN_TIMEOUT_S = 1800.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_JAVA_INSTALL_HINT = "install a JDK/JRE 17+ (apt-get install -y openjdk-17-jre-headless)"


@dataclass(frozen=True, slots=True)
class KafkaPaths:
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
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def server_properties(self) -> Path:
        return self.config_dir / "server.properties"

    @property
    def log4j_config(self) -> Path:
        return self.config_dir / "log4j2.xml"

    @property
    def cluster_id_file(self) -> Path:
        return self.root / "cluster.id"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def server_log(self) -> Path:
        return self.logs_dir / "server.log"

    @property
    def out_log(self) -> Path:
        return self.logs_dir / "kafka.out"

    @property
    def maven_log(self) -> Path:
        return self.logs_dir / "maven.log"

    @property
    def pid_file(self) -> Path:
        return self.root / "kafka.pid"


def paths(cfg: StackConfig) -> KafkaPaths:
    return KafkaPaths(cfg.kafka_dir)


def kafka_version() -> str:
    """The Kafka version pinned in ``pom.xml`` (``kafka.version`` property)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(POM).getroot().find("m:properties/m:kafka.version", ns)
    if node is None or not node.text:
        raise StackError(f"{POM} has no <kafka.version> property")
    return node.text.strip()


# --------------------------------------------------------------------------- tools


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


# --------------------------------------------------------------------------- jars


def _pom_digest() -> str:
    return hashlib.sha256(POM.read_bytes()).hexdigest()


def jars_resolved(kp: KafkaPaths) -> bool:
    try:
        stamp = kp.stamp.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return False
    return stamp == _pom_digest() and any(kp.lib.glob("kafka_2.13-*.jar"))


def resolve_jars(kp: KafkaPaths, say: Say) -> None:
    """Copy Kafka and its runtime dependencies into ``lib/``; no-op when already there."""
    version = kafka_version()
    if jars_resolved(kp):
        say(f"kafka: jars for {version} already in {kp.lib}")
        return
    mvn = find_maven()
    say(f"kafka: resolving jars for kafka_2.13:{version} with Maven into {kp.lib} ...")
    kp.root.mkdir(parents=True, exist_ok=True)
    kp.logs_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(POM, kp.pom)
    start = time.monotonic()
    staging = kp.root / "lib.partial"
    shutil.rmtree(staging, ignore_errors=True)
    argv = [
        mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(kp.pom),
        "dependency:copy-dependencies", "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]  # fmt: skip
    result = subprocess.run(
        argv, cwd=kp.root, capture_output=True, text=True, check=False, timeout=_MAVEN_TIMEOUT_S
    )
    kp.maven_log.write_text(_ANSI.sub("", result.stdout + result.stderr), encoding="utf-8")
    if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        raise StackError(
            f"Maven could not resolve the Kafka jars (exit {result.returncode}); Maven Central "
            f"must be reachable. Full output: {kp.maven_log}\n{indent(tail(kp.maven_log))}"
        )
    (staging / ".resolved").write_text(_pom_digest() + "\n", encoding="ascii")
    shutil.rmtree(kp.lib, ignore_errors=True)
    staging.replace(kp.lib)
    jars = sum(1 for _ in kp.lib.glob("*.jar"))
    say(f"kafka: {jars} jars resolved in {time.monotonic() - start:.1f} s")


# --------------------------------------------------------------------------- configs


def server_properties(cfg: StackConfig, kp: KafkaPaths) -> str:
    host, port, cport = cfg.host, cfg.kafka_port, cfg.controller_port
    settings = {
        "process.roles": "broker,controller",
        "node.id": str(NODE_ID),
        "controller.quorum.voters": f"{NODE_ID}@{host}:{cport}",
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(kp.data_dir),
        "num.partitions": "1",
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }
    body = "\n".join(f"{key}={value}" for key, value in settings.items())
    return f"# Written by `streamtally stack up` on every start; edit config.py/kafka.py.\n{body}\n"


_LOG4J2_XML = """\
<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by `streamtally stack up` on every start. -->
<Configuration status="WARN">
  <Properties>
    <Property name="logDir">@LOG_DIR@</Property>
    <Property name="pattern">[%d] %p %m (%c)%n</Property>
  </Properties>
  <Appenders>
    <RollingFile name="server" fileName="${logDir}/server.log"
                 filePattern="${logDir}/server.log.%i">
      <PatternLayout pattern="${pattern}"/>
      <SizeBasedTriggeringPolicy size="50MB"/>
      <DefaultRolloverStrategy max="5"/>
    </RollingFile>
    <RollingFile name="controller" fileName="${logDir}/controller.log"
                 filePattern="${logDir}/controller.log.%i">
      <PatternLayout pattern="${pattern}"/>
      <SizeBasedTriggeringPolicy size="50MB"/>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
    <RollingFile name="stateChange" fileName="${logDir}/state-change.log"
                 filePattern="${logDir}/state-change.log.%i">
      <PatternLayout pattern="${pattern}"/>
      <SizeBasedTriggeringPolicy size="50MB"/>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
  </Appenders>
  <Loggers>
    <Root level="INFO">
      <AppenderRef ref="server"/>
    </Root>
    <Logger name="org.apache.kafka.controller" level="INFO" additivity="false">
      <AppenderRef ref="controller"/>
    </Logger>
    <Logger name="kafka.controller" level="INFO" additivity="false">
      <AppenderRef ref="controller"/>
    </Logger>
    <Logger name="state.change.logger" level="INFO" additivity="false">
      <AppenderRef ref="stateChange"/>
    </Logger>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="kafka.log.LogCleaner" level="INFO"/>
  </Loggers>
</Configuration>
"""


def log4j2_xml(kp: KafkaPaths) -> str:
    return _LOG4J2_XML.replace("@LOG_DIR@", escape(str(kp.logs_dir)))


def write_configs(cfg: StackConfig, kp: KafkaPaths) -> None:
    kp.config_dir.mkdir(parents=True, exist_ok=True)
    kp.logs_dir.mkdir(parents=True, exist_ok=True)
    kp.server_properties.write_text(server_properties(cfg, kp), encoding="utf-8")
    kp.log4j_config.write_text(log4j2_xml(kp), encoding="utf-8")


# --------------------------------------------------------------------------- storage


def _new_cluster_id() -> str:
    """A random Kafka Uuid (base64url, no padding) not starting with '-' (CLI-safe)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not cid.startswith("-"):
            return cid


def _formatted_cluster_id(kp: KafkaPaths) -> str | None:
    meta = kp.data_dir / "meta.properties"
    try:
        lines = meta.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "cluster.id":
            return value.strip()
    return None


def cluster_id(kp: KafkaPaths) -> str:
    """The cluster id kept in ``cluster.id`` (taken from formatted storage if that exists)."""
    cid = _formatted_cluster_id(kp)
    if cid is None and kp.cluster_id_file.exists():
        cid = kp.cluster_id_file.read_text(encoding="ascii").strip() or None
    cid = cid or _new_cluster_id()
    kp.cluster_id_file.write_text(cid + "\n", encoding="ascii")
    return cid


def _java_argv(java: str, kp: KafkaPaths, main: str, *args: str) -> list[str]:
    return [
        java, *HEAP_OPTS, *JVM_OPTS,
        f"-Dlog4j2.configurationFile={kp.log4j_config}",
        f"-Dkafka.logs.dir={kp.logs_dir}",
        "-cp", str(kp.lib / "*"),
        main, *args,
    ]  # fmt: skip


def format_storage(java: str, kp: KafkaPaths, say: Say) -> None:
    """``StorageTool format`` once; an already formatted ``data/`` is left alone."""
    cid = cluster_id(kp)
    if _formatted_cluster_id(kp) is not None:
        say(f"kafka: storage already formatted (cluster id {cid})")
        return
    say(f"kafka: formatting storage in {kp.data_dir} (cluster id {cid}) ...")
    kp.data_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    argv = _java_argv(
        java, kp, STORAGE_TOOL,
        "format", "--cluster-id", cid, "--config", str(kp.server_properties),
        "--ignore-formatted",
    )  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise StackError(
            f"formatting Kafka storage failed (exit {result.returncode}):\n{indent(output)}\n"
            f"If {kp.data_dir} is from another cluster, `streamtally stack down --wipe` resets it."
        )
    say(f"kafka: formatted in {time.monotonic() - start:.1f} s")


# --------------------------------------------------------------------------- readiness


async def _probe_async(bootstrap: str, timeout: float) -> int:
    from aiokafka import AIOKafkaClient  # heavy import, only needed here

    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout)
        return len(client.cluster.brokers())
    finally:
        await client.close()


def broker_answers(bootstrap: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True if a metadata request to ``bootstrap`` lists at least one broker."""
    from aiokafka.errors import KafkaError

    aiokafka_log = logging.getLogger("aiokafka")
    previous = aiokafka_log.level
    aiokafka_log.setLevel(logging.CRITICAL)  # connection refusals while starting are expected
    try:
        return asyncio.run(_probe_async(bootstrap, timeout)) > 0
    except (OSError, KafkaError):  # OSError covers refused connections and timeouts
        return False
    finally:
        aiokafka_log.setLevel(previous)


def _startup_failure(kp: KafkaPaths, what: str, hint: str) -> StackError:
    details = [
        f"  {log.name}:\n{indent(text, '    ')}"
        for log, lines in ((kp.server_log, 15), (kp.out_log, 10))
        if (text := tail(log, lines))
    ]
    return StackError(
        f"kafka {what}. Logs: {kp.server_log}, {kp.out_log}"
        + ("; last lines:\n" + "\n".join(details) if details else "")
        + f"\n{hint}"
    )


def wait_ready(
    cfg: StackConfig, kp: KafkaPaths, proc: subprocess.Popen[bytes] | None, timeout: float
) -> float:
    """Poll until the broker answers metadata; returns the seconds waited."""
    return wait_answering(
        lambda: (
            port_open(cfg.host, cfg.kafka_port) and broker_answers(cfg.local_bootstrap_servers())
        ),
        proc=proc,
        pid_file=kp.pid_file,
        timeout=timeout,
        every=0.25,
        exited=lambda code: _startup_failure(
            kp,
            f"exited with code {code} while starting",
            "Fix the cause above; `streamtally stack down --wipe` resets data and logs.",
        ),
        timed_out=lambda: _startup_failure(
            kp,
            f"did not answer on {cfg.local_bootstrap_servers()} within {timeout:g} s",
            "It may still be starting: `streamtally stack up` again waits for it; "
            "`streamtally stack down` stops it.",
        ),
    )


# --------------------------------------------------------------------------- lifecycle


def status(cfg: StackConfig) -> ServiceStatus:
    kp = paths(cfg)
    return process_status("kafka", kp.pid_file, KAFKA_MAIN, cfg.kafka_port)


def _check_ports_free(cfg: StackConfig) -> None:
    for name, port in (("kafka", cfg.kafka_port), ("controller", cfg.controller_port)):
        if port_in_use(cfg.host, port):
            raise port_in_use_error(
                cfg.host,
                port,
                "pick other ports with STREAMTALLY_KAFKA_PORT / STREAMTALLY_CONTROLLER_PORT",
                what=f" ({name})",
            )


def up(cfg: StackConfig, say: Say, timeout: float = READY_TIMEOUT_S) -> None:
    """Start the broker unless it runs already; return once it answers metadata requests."""
    kp = paths(cfg)
    if already_running("kafka", status(cfg), cfg.local_bootstrap_servers(), say):
        wait_ready(cfg, kp, None, timeout)
        return
    java = find_java()
    resolve_jars(kp, say)
    _check_ports_free(cfg)
    write_configs(cfg, kp)
    format_storage(java, kp, say)
    say(f"kafka: starting kafka {kafka_version()} on {cfg.local_bootstrap_servers()} ...")
    argv = _java_argv(java, kp, KAFKA_MAIN, str(kp.server_properties))
    proc = spawn_detached(argv, cwd=kp.root, log_file=kp.out_log, pid_file=kp.pid_file)
    waited = wait_ready(cfg, kp, proc, timeout)
    say(f"kafka: ready in {waited:.1f} s (pid {proc.pid}, {cfg.local_bootstrap_servers()})")


def down(cfg: StackConfig, say: Say, timeout: float = STOP_TIMEOUT_S) -> None:
    stop_service("kafka", status(cfg), say, timeout)


def wipe(cfg: StackConfig, say: Say) -> None:
    """Remove topics, metadata, cluster id and logs; keep the resolved jars."""
    kp = paths(cfg)
    for target in (kp.data_dir, kp.logs_dir, kp.config_dir):
        if target.exists():
            shutil.rmtree(target)
    kp.cluster_id_file.unlink(missing_ok=True)
    say(f"kafka: wiped data, logs and cluster id under {kp.root} (jars kept)")
