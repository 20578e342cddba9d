"""``--log-format text|json``: log records on stderr that no value can forge.

Text: one line per record, the message's control characters escaped, a
traceback indented under it.  JSON: one object per record and line, with
``time`` (RFC 3339, UTC), ``level``, ``logger``, ``message`` and
``exception``.  The worker hands the same set-up to faust, whose records
(and mode's and aiokafka's) then go through it too.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import faust
import pytest

from streamtally.cli import COMMANDS, build_parser, main
from streamtally.settings import Settings

HOSTILE = 'x\n[2026-01-01T00:00:00Z] [1] [ERROR] forged: {"level": "ERROR"}\x1b[2J\u2028\x85'
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
TEXT_HEAD = re.compile(r"^\[\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\] \[\d+\] \[[A-Z]+\] ")


def record(message: str, *, exc: bool = False, name: str = "aiokafka.conn") -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError(f"bad value {message}")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord(name, logging.ERROR, __file__, 1, "%s", (message,), exc_info)


def test_text_format_is_one_escaped_line_per_record_and_indents_tracebacks() -> None:
    from streamtally.cli._logging import TextFormatter

    plain = TextFormatter().format(record(HOSTILE))
    assert "\n" not in plain
    assert "\x1b" not in plain
    assert "\u2028" not in plain
    assert TEXT_HEAD.match(plain)
    assert plain.endswith(
        "[ERROR] aiokafka.conn: x\\n[2026-01-01T00:00:00Z] [1] [ERROR] forged: "
        '{"level": "ERROR"}\\x1b[2J\\u2028\\x85'
    )

    with_traceback = TextFormatter().format(record(HOSTILE, exc=True)).split("\n")
    assert TEXT_HEAD.match(with_traceback[0])
    assert with_traceback[1] == "    Traceback (most recent call last):"
    # every further line is indented: none can pass for a record of its own
    assert all(line.startswith("    ") for line in with_traceback[1:])
    assert not any("\x1b" in line for line in with_traceback)


def test_json_format_is_one_object_per_line() -> None:
    from streamtally.cli._logging import JsonFormatter

    line = JsonFormatter().format(record(HOSTILE, exc=True))
    assert len(line.splitlines()) == 1
    assert "\x1b" not in line
    assert "\u2028" not in line
    assert "\x85" not in line
    got = json.loads(line)
    assert set(got) == {"time", "level", "logger", "message", "exception"}
    assert RFC3339_UTC.match(got["time"])
    assert (got["level"], got["logger"], got["message"]) == ("ERROR", "aiokafka.conn", HOSTILE)
    assert got["exception"].startswith("Traceback (most recent call last):")
    assert got["exception"].endswith(f"ValueError: bad value {HOSTILE}")
    plain = json.loads(JsonFormatter().format(record("ok")))
    assert set(plain) == {"time", "level", "logger", "message"}


#: A valid command line of every command (and subcommand).
EVERY_COMMAND = [
    ["fold", "--source", "openai", "f.sse"],
    ["produce", "--source", "openai", "f.sse"],
    ["proxy", "--upstream", "http://127.0.0.1:9"],
    ["worker"],
    ["tokens", "get", "r1"],
    ["usage"],
    ["api"],
    ["billing", "export"],
    ["audit"],
    ["deadletter"],
    ["rebuild"],
    ["migrate"],
    ["demo"],
    ["bench", "fold"],
    ["bench", "pipeline"],
    ["stack", "up"],
    ["stack", "down"],
    ["stack", "status"],
    ["native", "build"],
    ["native", "status"],
]


def test_every_command_takes_log_format() -> None:
    assert {argv[0] for argv in EVERY_COMMAND} == set(COMMANDS)
    parser = build_parser()
    for argv in EVERY_COMMAND:
        assert parser.parse_args(argv).log_format == "text", argv
        assert parser.parse_args([*argv, "--log-format", "json"]).log_format == "json", argv


class Store:
    """A `RedisStore` stand-in whose read logs a warning, as a library would."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Store:
        return cls()

    async def usage_rows(self, **filters: Any) -> list[Any]:
        logging.getLogger("redis.connection").warning("slow reply from %s", HOSTILE)
        return []

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_command_logs_in_the_format_asked(
    log_format: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import streamtally.cli.tokens

    monkeypatch.setattr(streamtally.cli.tokens, "RedisStore", Store)
    assert main(["usage", "--log-format", log_format]) == 0
    out, err = capsys.readouterr()
    assert out == "no usage recorded\n"
    assert err.count("\n") == 1, err
    if log_format == "json":
        got = json.loads(err)
        assert (got["level"], got["logger"]) == ("WARNING", "redis.connection")
        assert got["message"] == f"slow reply from {HOSTILE}"
    else:
        assert TEXT_HEAD.match(err)
        assert "[WARNING] redis.connection: slow reply from x\\n[2026" in err
    # the set-up is the command's only: afterwards the root logger is as it was
    assert not any(type(h).__name__ == "_StderrHandler" for h in logging.getLogger().handlers)


# --------------------------------------------------------------------------- the worker


@pytest.fixture
def root_logging() -> Iterator[None]:
    """mode's logging set-up replaces the root logger's handlers: put them back."""
    root, status = logging.getLogger(), logging.getLogger("streamtally.cli")
    handlers, level, status_level = root.handlers[:], root.level, status.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        status.setLevel(status_level)


REAL_WORKER = faust.Worker


class FakeWorker:
    """`faust.Worker` that records how it was made and does not run."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, app: Any, **options: Any) -> None:
        self.made.append(options)
        self.spinner = object()

    def execute_from_commandline(self) -> None:
        pass


@pytest.mark.usefixtures("root_logging")
def test_the_worker_gives_faust_its_log_format(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import streamtally.cli.worker
    import streamtally.processors.app

    async def ensure_topics(servers: str, topics: Any) -> list[str]:
        return []

    # No schema registry for this worker, whatever the environment names.
    monkeypatch.delenv("STREAMTALLY_SCHEMA_REGISTRY_URL", raising=False)
    made: ClassVar[list[dict[str, Any]]] = []
    monkeypatch.setattr(FakeWorker, "made", made)
    monkeypatch.setattr(faust, "Worker", FakeWorker)
    monkeypatch.setattr(streamtally.cli.worker, "ensure_topics", ensure_topics)

    async def check_layout(url: str, *, cluster: bool) -> None:
        return None

    monkeypatch.setattr(streamtally.cli.worker, "_check_layout", check_layout)
    real_create_app = streamtally.processors.app.create_app
    monkeypatch.setattr(
        streamtally.processors.app,
        "create_app",
        lambda settings, sinks, **kwargs: real_create_app(settings, sinks, consume=False, **kwargs),
    )
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    main(["worker", "--log-format", "json", "--loglevel", "info"])
    err = capsys.readouterr().err
    # the start line is a record of the chosen format too, as are the trust-everyone warning
    # and the content policy, the framing, the group membership and the fetches
    start, framing, membership, fetches, trust, content = map(json.loads, err.splitlines())
    assert (framing["level"], framing["logger"]) == ("INFO", "streamtally.cli")
    assert framing["message"] == (
        "avro framing: single-object (STREAMTALLY_AVRO_FRAMING), schema registry none "
        "(Confluent-framed values refused)"
    )
    assert (membership["level"], membership["logger"]) == ("INFO", "streamtally.cli")
    assert membership["message"] == (
        "group membership: dynamic (no STREAMTALLY_WORKER_INSTANCE_ID), session timeout 10 s "
        "(STREAMTALLY_SESSION_TIMEOUT)"
    )
    assert (fetches["level"], fetches["logger"]) == ("INFO", "streamtally.cli")
    assert fetches["message"] == (
        "fetches: the broker answers at 32768 bytes of raw records or after 0.01 s "
        "(STREAMTALLY_FETCH_MIN_BYTES, STREAMTALLY_FETCH_WAIT), batches of at most 2000 records; "
        "while idle, at the first record or after 0.5 s"
    )
    assert (content["level"], content["logger"]) == ("INFO", "streamtally.cli")
    assert content["message"] == (
        "content policy: full (STREAMTALLY_CONTENT), chunks topic on (STREAMTALLY_CHUNKS)"
    )
    assert (trust["level"], trust["logger"]) == ("WARNING", "streamtally.cli")
    assert "every producer is trusted" in trust["message"]
    assert (start["level"], start["logger"]) == ("INFO", "streamtally.cli")
    assert start["message"].startswith("streamtally worker: kafka 127.0.0.1:1, redis ")
    (options,) = made
    assert options["loglevel"] == "INFO"
    assert options["logging_config"]["root"]["level"] == "INFO"

    # What faust does with it when the worker starts (mode.Worker._setup_logging).
    settings = Settings(kafka_bootstrap_servers="127.0.0.1:1", redis_url_setting="redis://h:1/0")
    pipeline = real_create_app(settings, consume=False)
    worker = REAL_WORKER(
        pipeline.app, loglevel="INFO", quiet=True, logging_config=options["logging_config"]
    )
    worker.spinner = None
    worker.redirect_stdouts = False
    monkeypatch.setattr(logging.getLogger("aiokafka"), "level", logging.NOTSET)
    worker._setup_logging()
    names = ("faust.worker", "mode.services", "aiokafka.conn", "streamtally.processors")
    for name in names:
        logging.getLogger(name).warning("from %s: %s", name, HOSTILE)
    logging.getLogger("aiokafka.conn").debug("below the level: not shown")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(names), lines
    for name, line in zip(names, lines, strict=True):
        got = json.loads(line)
        assert (got["logger"], got["level"]) == (name, "WARNING")
        assert got["message"] == f"from {name}: {HOSTILE}"


@pytest.mark.usefixtures("root_logging")
def test_the_worker_runs_as_the_static_member_its_instance_id_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--instance-id`` wins over STREAMTALLY_WORKER_INSTANCE_ID, is checked as it is, and
    the worker's consumer joins with it (the start says which membership it has)."""
    import streamtally.cli.worker
    import streamtally.processors.app

    async def ensure_topics(servers: str, topics: Any) -> list[str]:
        return []

    async def check_layout(url: str, *, cluster: bool) -> None:
        return None

    made: ClassVar[list[dict[str, Any]]] = []
    monkeypatch.setattr(FakeWorker, "made", made)
    monkeypatch.setattr(faust, "Worker", FakeWorker)
    monkeypatch.setattr(streamtally.cli.worker, "ensure_topics", ensure_topics)
    monkeypatch.setattr(streamtally.cli.worker, "_check_layout", check_layout)
    given: list[Settings] = []
    real_create_app = streamtally.processors.app.create_app

    def create_app(settings: Settings, sinks: Any, **kwargs: Any) -> Any:
        given.append(settings)
        return real_create_app(settings, sinks, consume=False, **kwargs)

    monkeypatch.setattr(streamtally.processors.app, "create_app", create_app)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("STREAMTALLY_WORKER_INSTANCE_ID", "from-env")
    main(["worker", "--log-format", "json", "--loglevel", "info", "--instance-id", "worker-7"])
    messages = [json.loads(line)["message"] for line in capsys.readouterr().err.splitlines()]
    assert (
        "group membership: static, instance id 'worker-7', session timeout 45 s "
        "(STREAMTALLY_SESSION_TIMEOUT)"
    ) in messages
    assert [s.worker_instance_id for s in given] == ["worker-7"]
    # a bad id: one line, exit 2, no worker
    assert main(["worker", "--instance-id", "worker 7"]) == 2
    err = capsys.readouterr().err
    assert "STREAMTALLY_WORKER_INSTANCE_ID='worker 7'" in err
    assert "should match pattern" in err
    assert len(given) == 1
