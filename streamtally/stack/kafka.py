"""The local Apache Kafka: 1, 3 or 5 KRaft nodes, each a broker and a controller voter.

The jars come from Maven Central (`streamtally.stack.kafka_jars`); each node
is one ``java`` process with its own config, data and logs
(`streamtally.stack.kafka_node` has the layout); node ``i`` listens on the
ports of `streamtally.stack.config` (9092/9093 for node 1, 9094/9095 for
node 2, ...).  Every node of a cluster shares one KRaft cluster id and a static
quorum of all the nodes; ``up`` starts the nodes that do not run and returns
once every node answers and lists all the brokers; ``down`` stops them together.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from streamtally.connection import KafkaConnection
from streamtally.errors import StackError
from streamtally.stack import (
    Say,
    ServiceStatus,
    already_running,
    indent,
    port_in_use,
    port_in_use_error,
    port_open,
    process_status,
    remove_pid_file,
    secure,
    spawn_detached,
    stop_services,
    tail,
    wait_answering,
)
from streamtally.stack.config import BROKER_COUNTS, StackConfig, read_shape, record_shape
from streamtally.stack.kafka_jars import (
    KafkaHome,
    find_java,
    kafka_version,
    resolve_jars,
)
from streamtally.stack.kafka_node import KAFKA_MAIN, NodePaths, node_paths, write_configs

__all__ = [
    "READY_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "broker_argv",
    "broker_count",
    "down",
    "kafka_version",
    "paths",
    "status",
    "statuses",
    "up",
    "wipe",
]

STORAGE_TOOL = "kafka.tools.StorageTool"
HEAP_OPTS = ("-Xms256m", "-Xmx1g")
JVM_OPTS = (
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
#: The storage tool's: a short-lived JVM starts fastest on the client compiler alone.
TOOL_JVM_OPTS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Djava.awt.headless=true")
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 5.0
_FORMAT_TIMEOUT_S = 300.0


def home(cfg: StackConfig) -> KafkaHome:
    return KafkaHome(cfg.kafka_dir)


def paths(cfg: StackConfig) -> list[NodePaths]:
    """The files of each node of `cfg`'s broker count."""
    return node_paths(cfg)


# --------------------------------------------------------------------------- storage


def broker_argv(cfg: StackConfig, java: str, kh: KafkaHome, np: NodePaths) -> list[str]:
    """The command line of node `np`'s broker: `JVM_OPTS` unless `cfg` names others."""
    jvm_opts = JVM_OPTS if cfg.kafka_jvm_opts is None else cfg.kafka_jvm_opts
    return _java_argv(java, kh, np, jvm_opts, KAFKA_MAIN, str(np.server_properties))


def _new_cluster_id() -> str:
    """A random Kafka Uuid (base64url, no padding) not starting with '-' (CLI-safe)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not cid.startswith("-"):
            return cid


def _formatted_cluster_id(np: NodePaths) -> str | None:
    try:
        lines = np.meta_properties.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "cluster.id":
            return value.strip()
    return None


def cluster_id(nodes: Sequence[NodePaths]) -> str:
    """The cluster id kept in ``cluster.id`` (taken from formatted storage if that exists)."""
    formatted = {cid for np in nodes if (cid := _formatted_cluster_id(np)) is not None}
    if len(formatted) > 1:
        raise StackError(
            f"the Kafka nodes under {nodes[0].cluster_dir} belong to different clusters "
            f"({', '.join(sorted(formatted))}): `streamtally stack down --wipe` resets them"
        )
    id_file = nodes[0].cluster_id_file
    cid = next(iter(formatted), None)
    if cid is None and id_file.exists():
        cid = id_file.read_text(encoding="ascii").strip() or None
    cid = cid or _new_cluster_id()
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(cid + "\n", encoding="ascii")
    return cid


def _java_argv(
    java: str, kh: KafkaHome, np: NodePaths, jvm_opts: Sequence[str], main: str, *args: str
) -> list[str]:
    return [
        java, *HEAP_OPTS, *jvm_opts,
        f"-Dlog4j2.configurationFile={np.log4j_config}",
        f"-Dkafka.logs.dir={np.logs_dir}",
        "-cp", str(kh.lib / "*"),
        main, *args,
    ]  # fmt: skip


def _scram_users(cfg: StackConfig) -> list[str]:
    """``--add-scram`` arguments creating the secured broker's SCRAM users (none otherwise)."""
    if not cfg.secure:
        return []
    credentials = secure.load_credentials(cfg)
    users = (
        (secure.KAFKA_ADMIN_USER, credentials.kafka_admin),
        (secure.KAFKA_CLIENT_USER, credentials.kafka_client),
    )
    arguments = []
    for name, password in users:
        arguments += ["--add-scram", f"{secure.SCRAM_MECHANISM}=[name={name},password={password}]"]
    return arguments


def _format_one(cfg: StackConfig, java: str, kh: KafkaHome, np: NodePaths, cid: str) -> None:
    np.data_dir.mkdir(parents=True, exist_ok=True)
    argv = _java_argv(
        java, kh, np, TOOL_JVM_OPTS, STORAGE_TOOL,
        "format", "--cluster-id", cid, "--config", str(np.server_properties),
        "--ignore-formatted", *_scram_users(cfg),
    )  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=_FORMAT_TIMEOUT_S
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        if cfg.secure:  # the tool may quote its arguments
            output = secure.scrubbed(output, secure.load_credentials(cfg))
        raise StackError(
            f"formatting {np.name} storage failed (exit {result.returncode}):\n{indent(output)}\n"
            f"If {np.data_dir} is from another cluster, `streamtally stack down --wipe` resets it."
        )


def format_storage(
    cfg: StackConfig, java: str, kh: KafkaHome, nodes: Sequence[NodePaths], say: Say
) -> None:
    """``StorageTool format`` of the nodes not formatted yet (at once); others are left alone."""
    cid = cluster_id(nodes)
    todo = [np for np in nodes if _formatted_cluster_id(np) is None]
    if not todo:
        say(f"kafka: storage already formatted (cluster id {cid})")
        return
    where = ", ".join(str(np.data_dir) for np in todo)
    users = " with its SCRAM users" if cfg.secure else ""
    say(f"kafka: formatting storage in {where} (cluster id {cid}){users} ...")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        for future in [pool.submit(_format_one, cfg, java, kh, np, cid) for np in todo]:
            future.result()
    say(f"kafka: formatted in {time.monotonic() - start:.1f} s")


# --------------------------------------------------------------------------- readiness


async def _probe_async(bootstrap: KafkaConnection | str, timeout: float) -> int:
    from aiokafka import AIOKafkaClient  # heavy import, only needed here

    from streamtally.connection import client_options

    client = AIOKafkaClient(**client_options(bootstrap), request_timeout_ms=int(timeout * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout)
        return len(client.cluster.brokers())
    finally:
        await client.close()


def broker_count(bootstrap: KafkaConnection | str, timeout: float = PROBE_TIMEOUT_S) -> int:
    """The brokers a metadata request to ``bootstrap`` lists (0: no answer)."""
    from aiokafka.errors import KafkaError

    aiokafka_log = logging.getLogger("aiokafka")
    previous = aiokafka_log.level
    aiokafka_log.setLevel(logging.CRITICAL)  # connection refusals while starting are expected
    try:
        return asyncio.run(_probe_async(bootstrap, timeout))
    except (OSError, KafkaError):  # OSError covers refused connections and timeouts
        return 0
    finally:
        aiokafka_log.setLevel(previous)


def broker_answers(bootstrap: KafkaConnection | str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True if a metadata request to ``bootstrap`` lists at least one broker."""
    return broker_count(bootstrap, timeout) > 0


def _startup_failure(np: NodePaths, what: str, hint: str) -> StackError:
    details = [
        f"  {log.name}:\n{indent(text, '    ')}"
        for log, lines in ((np.server_log, 15), (np.out_log, 10))
        if (text := tail(log, lines))
    ]
    return StackError(
        f"{np.name} {what}. Logs: {np.server_log}, {np.out_log}"
        + ("; last lines:\n" + "\n".join(details) if details else "")
        + f"\n{hint}"
    )


def wait_ready(
    cfg: StackConfig,
    nodes: Sequence[NodePaths],
    started: Sequence[tuple[NodePaths, subprocess.Popen[bytes]]],
    timeout: float,
) -> float:
    """Poll until every node answers metadata listing all the brokers; the seconds waited.

    A node of `started` (the processes just started) that exits first fails it.
    """
    pending = list(nodes)

    def probe(np: NodePaths) -> KafkaConnection:
        """How the stack itself asks node `np` (the client user on the secured broker)."""
        address = f"{cfg.host}:{np.node.port}"
        if not cfg.secure:
            return KafkaConnection(address)
        conn = secure.client_connection(cfg, secure.load_credentials(cfg))
        return dataclasses.replace(conn, servers=address)

    def answers() -> bool:
        for np, proc in started:
            if proc.poll() is not None:
                remove_pid_file(np.pid_file)
                raise _startup_failure(
                    np,
                    f"exited with code {proc.returncode} while starting",
                    "Fix the cause above; `streamtally stack down --wipe` resets data and logs.",
                )
        pending[:] = [
            np
            for np in pending
            if not (port_open(cfg.host, np.node.port) and broker_count(probe(np)) >= cfg.brokers)
        ]
        return not pending

    def timed_out() -> StackError:
        late = pending[0]
        many = "" if cfg.brokers == 1 else f" with all {cfg.brokers} brokers"
        return _startup_failure(
            late,
            f"did not answer on {cfg.host}:{late.node.port}{many} within {timeout:g} s",
            "It may still be starting: `streamtally stack up` again waits for it; "
            "`streamtally stack down` stops it.",
        )

    return wait_answering(answers, timeout=timeout, every=0.25, timed_out=timed_out)


# --------------------------------------------------------------------------- lifecycle


def _status(np: NodePaths) -> ServiceStatus:
    return process_status(np.name, np.pid_file, np.marker, np.node.port)


def statuses(cfg: StackConfig) -> list[ServiceStatus]:
    """Each node's status, in node id order."""
    return [_status(np) for np in paths(cfg)]


def status(cfg: StackConfig) -> ServiceStatus:
    """The status of the first node (the only one of a single broker)."""
    return statuses(cfg)[0]


def _brokers(count: int) -> str:
    return "1 broker" if count == 1 else f"{count} brokers"


def _refuse_other_counts(cfg: StackConfig) -> None:
    """A `StackError` if nodes of another broker count run in this state dir."""
    remembered = read_shape(cfg.state_dir).brokers
    for count in sorted(BROKER_COUNTS, key=lambda n: n != remembered):
        if count == cfg.brokers:
            continue
        try:
            other = dataclasses.replace(cfg, brokers=count, secure=False)
        except StackError:  # ports this count cannot have: it cannot run with them
            continue
        running = [st for st in statuses(other) if st.running]
        if running:
            pids = ", ".join(str(st.pid) for st in running)
            raise StackError(
                f"kafka runs as {_brokers(count)} (pid {pids}): stop it with `streamtally stack "
                f"down`, then `streamtally stack up --brokers {cfg.brokers}` (each broker count "
                f"keeps its own topics, under {other.kafka_cluster_dir} and "
                f"{cfg.kafka_cluster_dir})"
            )
    _refuse_other_security(cfg)


def _refuse_other_security(cfg: StackConfig) -> None:
    """A `StackError` if the single broker runs secured while a plaintext one is wanted, or
    the other way round (each keeps its own storage: the secured one holds SCRAM users)."""
    try:
        other = dataclasses.replace(cfg, brokers=1, redis_cluster=False, secure=not cfg.secure)
    except StackError:
        return
    running = [st for st in statuses(other) if st.running]
    if running:
        now, wanted = ("secured", "") if other.secure else ("plaintext", " --secure")
        raise StackError(
            f"kafka runs {now} (pid {running[0].pid}): stop it with `streamtally stack down`, "
            f"then `streamtally stack up{wanted}`"
        )


def _check_ports_free(cfg: StackConfig, nodes: Sequence[NodePaths]) -> None:
    for np in nodes:
        node = np.node
        for what, port in (("kafka", node.port), ("controller", node.controller_port)):
            if port_in_use(cfg.host, port):
                label = what if cfg.brokers == 1 else f"{np.name} {what}"
                raise port_in_use_error(
                    cfg.host,
                    port,
                    "pick other ports with STREAMTALLY_KAFKA_PORT / STREAMTALLY_CONTROLLER_PORT",
                    what=f" ({label})",
                )


def _address(cfg: StackConfig, np: NodePaths) -> str:
    return f"{cfg.host}:{np.node.port}"


def up(cfg: StackConfig, say: Say, timeout: float = READY_TIMEOUT_S) -> None:
    """Start the nodes that do not run; return once every node answers metadata requests."""
    _refuse_other_counts(cfg)
    record_shape(cfg.state_dir, brokers=cfg.brokers, secure=cfg.secure)
    nodes = paths(cfg)
    missing = [
        np for np in nodes if not already_running(np.name, _status(np), _address(cfg, np), say)
    ]
    if not missing:
        wait_ready(cfg, nodes, [], timeout)
        return
    java = find_java()
    kh = home(cfg)
    resolve_jars(kh, say, cfg.cache("kafka-jars"))
    _check_ports_free(cfg, missing)
    if cfg.secure:
        secure.ensure_material(cfg, say)
    for np in nodes:
        write_configs(cfg, np)
    format_storage(cfg, java, kh, nodes, say)
    started = []
    for np in missing:
        controller = "" if cfg.brokers == 1 else f" (controller {np.node.controller_port})"
        say(f"{np.name}: starting kafka {kafka_version()} on {_address(cfg, np)}{controller} ...")
        argv = broker_argv(cfg, java, kh, np)
        proc = spawn_detached(argv, cwd=np.root, log_file=np.out_log, pid_file=np.pid_file)
        started.append((np, proc))
    try:
        waited = wait_ready(cfg, nodes, started, timeout)
    except BaseException:
        if cfg.brokers > 1:
            say("kafka: not ready; the nodes started stay up (`streamtally stack down` stops them)")
        raise
    if cfg.brokers == 1:
        say(f"kafka: ready in {waited:.1f} s (pid {started[0][1].pid}, {_address(cfg, nodes[0])})")
    else:
        pids = ", ".join(str(_status(np).pid) for np in nodes)
        say(
            f"kafka: {cfg.brokers} brokers ready in {waited:.1f} s (pids {pids}; "
            f"{cfg.all_bootstrap_servers()})"
        )


def down(cfg: StackConfig, say: Say, timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop every node (at once: a node stops cleanly only while a quorum answers)."""
    stop_services(statuses(cfg), say, timeout)


def wipe(cfg: StackConfig, say: Say) -> None:
    """Remove the topics, metadata, cluster ids and logs of every broker count; keep the jars."""
    np = paths(dataclasses.replace(cfg, brokers=1, secure=False))[0]
    secured = cfg.kafka_dir / "secure"
    for target in (
        np.data_dir,
        np.logs_dir,
        np.config_dir,
        secured,
        *cfg.kafka_dir.glob("brokers-*"),
    ):
        if target.exists():
            shutil.rmtree(target)
    np.cluster_id_file.unlink(missing_ok=True)
    say(f"kafka: wiped data, logs and cluster ids under {cfg.kafka_dir} (jars kept)")
