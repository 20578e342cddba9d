"""What a user can get wrong ends in one line on stderr and exit status 2, never a traceback.

Argument bytes that are not UTF-8 (argv holds them as lone surrogates),
unreadable or undecodable files, endpoints no client can use, text in Redis
that is not UTF-8, and usage errors.  A programming error still shows its
traceback: it is a bug to report, not a message.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from streamtally.cli import main
from tests.unit.cli.test_cli_output import FakeStore, store

__all__ = ["store"]  # the fixture, imported

STREAMTALLY = Path(sys.executable).with_name("streamtally")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int | str | None, str, str]:
    """Exit status of ``streamtally ARGV`` in this process (argparse's exits included)."""
    try:
        code: int | str | None = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(err: str, start: str) -> None:
    assert err.startswith(start), err
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.fixture
def closed_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens there: a command that gets that far fails on connecting."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")


def test_tokens_get_of_undecodable_argv_bytes_is_one_line(
    store: type[FakeStore], capsys: pytest.CaptureFixture[str]
) -> None:
    """``streamtally tokens get $'\\xff'``: Python hands over '\\udcff'; Redis cannot take it."""
    code, out, err = run(capsys, "tokens", "get", "\udcff")
    assert (code, out) == (2, "")
    assert_one_line(err, "streamtally tokens get: argument REQUEST_ID: '\\udcff' is not UTF-8")


@pytest.mark.parametrize(
    "argv",
    [
        ["usage", "--tenant", "acme\udcff"],
        ["produce", "--source", "openai", "--tenant", "\udcfe", "f.sse"],
        ["produce", "--source", "openai", "--request-id", "r\udcff", "f.sse"],
        ["produce", "--source", "vllm", "--model", "m\udcff", "f.jsonl"],
        ["rebuild", "--redis-url", "redis://\udcff/0"],
    ],
)
def test_any_text_argument_with_undecodable_bytes_is_one_line(
    argv: list[str], closed_ports: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert_one_line(err, f"streamtally {argv[0]}: argument ")
    assert "is not UTF-8 text" in err


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("\udcff:9092", "not UTF-8 text"),
        ("localhost:port", "the port must be a number from 1 to 65535"),
        ("localhost:70000", "the port must be a number from 1 to 65535"),
        ("a:1,,b:2", "an empty host"),
        ("[::1", "is not [IPv6]:PORT"),
        ("::::", "has no valid host"),
    ],
)
@pytest.mark.parametrize("command", [["billing", "export"], ["deadletter"], ["rebuild"]])
def test_a_bad_bootstrap_servers_argument_is_one_line(
    value: str, why: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, *command, "--bootstrap-servers", value)
    assert (code, out) == (2, "")
    assert_one_line(err, f"streamtally {' '.join(command)}: argument --bootstrap-servers: ")
    assert why in err


@pytest.mark.parametrize("value", ["localhost:port", "h\udcff:1", "[::1]:x"])
def test_a_bad_bootstrap_servers_variable_is_one_line_naming_it(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", value)
    code, out, err = run(capsys, "billing", "export")
    assert (code, out) == (2, "")
    assert_one_line(err, "streamtally billing: KAFKA_BOOTSTRAP_SERVERS: ")


def test_valid_bootstrap_servers_are_taken() -> None:
    from streamtally.cli._args import servers_problem

    for value in ("127.0.0.1:9092", "kafka", "a:1, b:2", "[::1]:9092", "::1", "[fe80::1]"):
        assert servers_problem(value) is None, value


def test_fold_of_a_standard_input_that_cannot_be_read_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Unreadable(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            raise IsADirectoryError(21, "Is a directory")

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Unreadable())))
    code, out, err = run(capsys, "fold", "--source", "openai", "-")
    assert (code, out) == (2, "")
    assert_one_line(err, "streamtally fold: cannot read standard input: Is a directory")


def test_redis_text_that_is_not_utf8_is_one_line(
    store: type[FakeStore], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def tokens_text(self: FakeStore, ref: object) -> str:
        return b"\xff".decode("utf-8")  # what the store's decode of a foreign value raises

    monkeypatch.setattr(FakeStore, "tokens_text", tokens_text)
    code, out, err = run(capsys, "tokens", "get", "r1", "--tenant", "acme")
    assert (code, out) == (2, "")
    assert_one_line(err, "streamtally tokens: Redis at ")
    assert "holds text that is not UTF-8" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["fold", "--source", "bedrock", "x.sse"],
        ["usage", "--day", "2026-02-30"],
        ["deadletter", "--limit", "-1"],
        ["produce", "--no-such-option"],
        ["tokens"],
        [],
    ],
)
def test_a_usage_error_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert_one_line(err, "streamtally")
    assert "--help`)" in err


def test_a_programming_error_is_not_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import streamtally.cli.fold

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(streamtally.cli.fold, "fold_stream", broken)
    path = tmp_path / "a.sse"
    path.write_bytes(b"data: {}\n\n")
    with pytest.raises(RuntimeError, match="a bug"):
        main(["fold", "--source", "openai", str(path)])


# --------------------------------------------------------------------------- the installed command


def installed(*argv: str | bytes, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "REDIS_URL": "redis://127.0.0.1:1/0",
    }
    return subprocess.run(
        [os.fsencode(STREAMTALLY), *[a if isinstance(a, bytes) else a.encode() for a in argv]],
        capture_output=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env=env,
    )


@pytest.mark.parametrize(
    "argv",
    [
        [b"produce", b"--manifest", b"m.jsonl"],  # a manifest that is not UTF-8
        [b"tokens", b"get", b"\xff"],
        [b"produce", b"--source", b"openai", b"--tenant", b"\xff\n", b"a.sse"],
        [b"fold", b"--source", b"openai", b"\xff\x1b[2J.sse"],  # missing, with such a name
        [b"billing", b"export", b"--bootstrap-servers", b"\xff"],
    ],
)
def test_the_installed_command_says_one_line_for_hostile_bytes(
    argv: list[bytes], tmp_path: Path
) -> None:
    (tmp_path / "m.jsonl").write_bytes(b'{"file": "\xff.sse", "source": "openai"}\n')
    (tmp_path / "a.sse").write_bytes(b"data: {}\n\n")
    result = installed(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == b""
    err = result.stderr.decode("utf-8")  # strict: whatever was quoted came out as valid UTF-8
    assert err.startswith("streamtally "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert "\x1b" not in err
