"""`streamtally stack`'s arguments: which shape `up` starts, `down` and `status` handle."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamtally.cli import stack as cli
from streamtally.stack import ServiceState, ServiceStatus, StackConfig, kafka, redis
from streamtally.stack.config import StackShape, record_shape


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "REDIS_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STREAMTALLY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("STREAMTALLY_KAFKA_PORT", "19092")
    monkeypatch.setenv("STREAMTALLY_CONTROLLER_PORT", "19093")
    monkeypatch.setenv("STREAMTALLY_REDIS_PORT", "16379")
    return tmp_path


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, StackShape]]:
    """Stand-ins for the services: each call records which one and the shape it was given."""
    seen: list[tuple[str, StackShape]] = []

    def fake(name: str) -> object:
        def run(cfg: StackConfig, say: object, timeout: float) -> None:
            del say, timeout
            seen.append((name, cfg.shape))

        return run

    for module in (kafka, redis):
        for action in ("up", "down"):
            monkeypatch.setattr(module, action, fake(f"{module.__name__.rsplit('.')[-1]}.{action}"))
    return seen


def test_up_starts_one_broker_and_one_redis_by_default(
    state: Path, calls: list[tuple[str, StackShape]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["up"]) == 0
    assert calls == [("kafka.up", StackShape()), ("redis.up", StackShape())]
    out = capsys.readouterr().out
    assert out.splitlines()[-1].endswith(
        "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19092 REDIS_URL=redis://127.0.0.1:16379/0"
    )
    assert "REDIS_CLUSTER" not in out


def test_up_with_a_shape_then_down_and_up_use_it(
    state: Path, calls: list[tuple[str, StackShape]], capsys: pytest.CaptureFixture[str]
) -> None:
    wanted = StackShape(brokers=3, redis_cluster=True)
    assert cli.main(["up", "--brokers", "3", "--redis-cluster"]) == 0
    out = capsys.readouterr().out
    assert "stack: 3 Kafka brokers and a Redis Cluster of 3 masters" in out
    assert (
        "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096 "
        "REDIS_URL=redis://127.0.0.1:16379/0 REDIS_CLUSTER=1"
    ) in out
    assert "export REDIS_CLUSTER=1" in out
    # the services record the shape they start (the stand-ins do not): as `up` would
    record_shape(state, brokers=3, redis_cluster=True)
    calls.clear()
    assert cli.main(["down"]) == 0
    assert cli.main(["up"]) == 0
    assert cli.main(["up", "--no-redis-cluster"]) == 0
    assert calls == [
        ("kafka.down", wanted),
        ("redis.down", wanted),
        ("kafka.up", wanted),
        ("redis.up", wanted),
        ("kafka.up", StackShape(3, False)),
        ("redis.up", StackShape(3, False)),
    ]


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["up", "--brokers", "2"], "invalid choice: 2 (choose from 1, 3, 5)"),
        (["up", "--brokers", "three"], "invalid int value: 'three'"),
        (["down", "--brokers", "3"], "unrecognized arguments: --brokers 3"),
    ],
)
def test_bad_arguments_are_one_line(
    state: Path,
    calls: list[tuple[str, StackShape]],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    complaint: str,
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert complaint in err
    assert len(err.splitlines()) == 1
    assert calls == []


def test_ports_a_shape_cannot_have_are_an_error_saying_what_to_set(
    state: Path,
    calls: list[tuple[str, StackShape]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMTALLY_CONTROLLER_PORT", "19094")  # broker 2's port
    assert cli.main(["up", "--brokers", "3"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("stack up: error: kafka controller 1 and kafka broker 2 ports must")
    assert "STREAMTALLY_CONTROLLER_PORT" in err
    assert calls == []


def _status(name: str, running: bool, port: int) -> ServiceStatus:
    state = ServiceState.RUNNING if running else ServiceState.STOPPED
    return ServiceStatus(name, state, 4242 if running else None, port, Path(f"/x/{name}.pid"))


def test_status_lists_every_node(
    state: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    record_shape(state, brokers=3)
    seen: list[StackShape] = []

    def kafka_statuses(cfg: StackConfig) -> list[ServiceStatus]:
        seen.append(cfg.shape)
        return [_status(f"kafka-{n.node_id}", n.node_id != 2, n.port) for n in cfg.kafka_nodes]

    monkeypatch.setattr(kafka, "statuses", kafka_statuses)
    monkeypatch.setattr(redis, "statuses", lambda cfg: [_status("redis", True, cfg.redis_port)])
    assert cli.main(["status"]) == cli.EXIT_NOT_RUNNING
    out = capsys.readouterr().out.splitlines()
    assert seen == [StackShape(3, False)]
    assert out[:4] == [
        "kafka-1: running (pid 4242, port 19092)",
        "kafka-2: stopped",
        "kafka-3: running (pid 4242, port 19096)",
        "redis: running (pid 4242, port 16379)",
    ]
    assert out[4] == f"state dir: {state} (3 Kafka brokers and one Redis)"


def test_help_explains_the_ports_and_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "3 brokers: 9092/9093, 9094/9095, 9096/9097" in text
    assert "6379, 6380, 6381" in text
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--brokers N" in text
    assert "--redis-cluster, --no-redis-cluster" in text
    assert "replication factor 3, and min.insync.replicas 2" in text
