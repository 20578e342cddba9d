"""Credentials never printed: `streamtally.redact`, and where the CLI uses it.

Exact outputs of the redaction functions (hostile inputs included), the
settings' repr and errors, the log formatters, `say`, and the messages of
commands given a Redis URL with a password that cannot be reached.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from streamtally.cli import main
from streamtally.cli._args import servers_problem
from streamtally.cli._logging import JsonFormatter, TextFormatter
from streamtally.cli._output import hiding, redacted, say
from streamtally.cli.stack import _note_overrides
from streamtally.cli.tokens import run_redis
from streamtally.cli.worker import _check_layout
from streamtally.errors import InputError, StackError
from streamtally.redact import (
    redact_servers,
    redact_text,
    redact_url,
    scrub,
    url_secrets,
)
from streamtally.settings import Settings
from streamtally.stack import StackConfig

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # the user kept, the password hidden
        ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://user:secret@host:6380/2", "rediss://user:***@host:6380/2"),
        ("rediss://:secret@host", "rediss://:***@host"),
        ("redis://:secret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        # a user info without a colon may be a password: hidden whole
        ("redis://secret@host/0", "redis://***@host/0"),
        # percent-encoded: replaced as written, never decoded
        ("redis://user:p%40ss%3Aw%2Fd@host/0", "redis://user:***@host/0"),
        ("redis://us%40er:pw@host", "redis://us%40er:***@host"),
        # a raw "@" in the password: the user info ends at the last "@"
        ("redis://user:p@ss@host:6379", "redis://user:***@host:6379"),
        # an "@" only after the authority: ambiguous, all hidden after the scheme
        ("redis://user:pa/ss@host/0", "redis://***"),
        ("redis://user:pa?ss@host/0", "redis://***"),
        ("redis://user:pa#ss@host/0", "redis://***"),
        ("redis://u:p?password=zzzz@h", "redis://***"),
        ("redis://host/0?password=p@ss", "redis://***"),
        ("redis://host/0?client_name=a@b", "redis://***"),
        # query-string secrets, names in any case
        ("redis://host:6379/0?password=secret", "redis://host:6379/0?password=***"),
        (
            "redis://host/0?db=1&Password=secret&socket_timeout=5",
            "redis://host/0?db=1&Password=***&socket_timeout=5",
        ),
        ("redis://host/0?auth=secret#frag", "redis://host/0?auth=***#frag"),
        ("redis://host/0?x_token=a;y=b", "redis://host/0?x_token=***;y=b"),
        ("redis://u:pw@host/0?password=pw2", "redis://u:***@host/0?password=***"),
        ("redis://u:p@h/0?password=p@ss&db=1", "redis://u:***@h/0?password=***&db=1"),
        # unix sockets
        ("unix://:secret@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
        ("unix:///run/redis.sock?password=secret", "unix:///run/redis.sock?password=***"),
        # nothing secret: unchanged, character for character
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://host/0?db=1&client_name=x", "redis://host/0?db=1&client_name=x"),
        ("redis://@host", "redis://@host"),
        ("redis://user:@host", "redis://user:@host"),
        ("redis://host/0?password=", "redis://host/0?password="),
        ("", ""),
        ("garbage", "garbage"),
        ("host:6379", "host:6379"),
        ("redis:/host", "redis:/host"),
        ("://", "://"),
        # no scheme
        ("user:secret@host:6379", "user:***@host:6379"),
        ("//user:secret@host", "//user:***@host"),
        # unicode and control characters are kept as they are (escaping is the printer's job)
        ("redis://ü:pässwörd@hôst/0", "redis://ü:***@hôst/0"),
        ("redis://u:\x1b[2Jx\n@h", "redis://u:***@h"),
        ("redis://h\u202e/0?password=\u2028", "redis://h\u202e/0?password=***"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent


def test_redact_url_of_a_very_long_url_is_fast_and_exact() -> None:
    password = "x" * 1_000_000
    start = time.monotonic()
    assert redact_url(f"redis://u:{password}@h/0") == "redis://u:***@h/0"
    assert redact_url("redis://h/0?" + "&a" * 200_000 + "&password=" + password) == (
        "redis://h/0?" + "&a" * 200_000 + "&password=***"
    )
    assert redact_url("@" * 100_000) == "***@"
    assert redact_text("a" * 200_000 + "://u:p@h") == "a" * 200_000 + "://u:***@h"
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(
    ("servers", "shown"),
    [
        ("127.0.0.1:9092", "127.0.0.1:9092"),
        ("a:9092,b:9092, [::1]:9093", "a:9092,b:9092, [::1]:9093"),
        ("a:9092,user:secret@b:9092", "a:9092,user:***@b:9092"),
        ("SASL_SSL://user:secret@b:9092", "SASL_SSL://user:***@b:9092"),
        (" secret@b:9092 ,c", " ***@b:9092 ,c"),
        ("", ""),
    ],
)
def test_redact_servers(servers: str, shown: str) -> None:
    assert redact_servers(servers) == shown


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            "cannot reach Redis at redis://u:secret@h:1/0 (refused)",
            "cannot reach Redis at redis://u:***@h:1/0 (refused)",
        ),
        ("'rediss://:secret@h' and redis://secret@h", "'rediss://:***@h' and redis://***@h"),
        ("kafka://h:9092;kafka://g:9092", "kafka://h:9092;kafka://g:9092"),
        ("no URL user:pw@host here", "no URL user:pw@host here"),
        ("line one\nredis://u:pw@h\nline three", "line one\nredis://u:***@h\nline three"),
        ("", ""),
    ],
)
def test_redact_text(text: str, shown: str) -> None:
    assert redact_text(text) == shown


def test_url_secrets_are_the_hidden_values_as_written_and_decoded() -> None:
    assert url_secrets("redis://u:p%40ss@h/0?password=x%2By") == {
        "p%40ss",
        "p@ss",
        "p",
        "ss",
        "x%2By",
        "x+y",
    }
    assert url_secrets("redis://u:longpart/rest@h/0") == {"longpart/rest", "longpart", "rest"}
    assert url_secrets("redis://secret@h") == {"secret"}
    assert url_secrets("redis://127.0.0.1:6379/0") == frozenset()
    assert url_secrets("redis://u:@h") == frozenset()


def test_scrub_replaces_longest_first_and_skips_short_secrets() -> None:
    assert scrub("pw=abcdef; again abcdef", {"abcd", "abcdef"}) == "pw=***; again ***"
    assert scrub("a password 'ab'", {"ab"}) == "a password 'ab'"  # too short to scrub
    assert scrub("nothing", set()) == "nothing"


def test_settings_repr_and_str_hide_the_credentials() -> None:
    settings = Settings.load(
        {"REDIS_URL": f"redis://u:{SECRET}@h:1/0", "KAFKA_BOOTSTRAP_SERVERS": f"u:{SECRET}@k:1"}
    )
    for shown in (repr(settings), str(settings), f"{settings!r}"):
        assert SECRET not in shown
        assert "redis_url_setting='redis://u:***@h:1/0'" in shown
        assert "kafka_bootstrap_servers='u:***@k:1'" in shown
    assert settings.redis_url == f"redis://u:{SECRET}@h:1/0"  # the value itself is kept


def test_a_settings_error_hides_the_url_it_quotes() -> None:
    with pytest.raises(InputError) as caught:
        Settings.load({"REDIS_URL": f"redis://u:{SECRET}@h/0", "STREAMTALLY_REDIS_PORT": "x"})
    assert SECRET not in str(caught.value)


def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = None if exc is None else (type(exc), exc, exc.__traceback__)
    return logging.LogRecord("redis.connection", logging.WARNING, "f", 1, message, args, exc_info)


def test_log_formatters_hide_urls_and_the_hidden_secrets() -> None:
    try:
        raise ConnectionError(f"no answer at redis://:{SECRET}@h:1/0 (AUTH {SECRET})")
    except ConnectionError as exc:
        error = exc
    with hiding({SECRET}):
        text = TextFormatter().format(_record("at %s: %s", f"rediss://u:{SECRET}@h", SECRET))
        data = JsonFormatter().format(_record("failed", exc=error))
    assert SECRET not in text
    assert text.endswith("redis.connection: at rediss://u:***@h: ***")
    assert SECRET not in data
    assert "no answer at redis://:***@h:1/0 (AUTH ***)" in json.loads(data)["exception"]
    # outside `hiding`, URLs are still redacted but the bare value is not known
    assert redacted(f"redis://u:{SECRET}@h {SECRET}") == f"redis://u:***@h {SECRET}"


def test_say_hides_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    with hiding({SECRET}):
        say(f"Redis at redis://:{SECRET}@h failed: {SECRET}")
    assert capsys.readouterr().err == "Redis at redis://:***@h failed: ***\n"


def test_a_kafka_address_with_credentials_is_refused_without_them() -> None:
    problem = servers_problem(f"a:9092,user:{SECRET}@b:9092")
    assert problem == "'user:***@b:9092': no user or password here (HOST[:PORT])"


def test_a_broken_url_error_hides_the_pieces_of_its_password() -> None:
    # urllib takes "longpart" for the port and says so
    with pytest.raises(InputError) as caught:
        run_redis("redis://u:longpart/rest@h/0", lambda store: store.ping())
    assert str(caught.value) == (
        "bad Redis URL 'redis://***': Port could not be cast to integer value as '***'"
    )


def test_run_redis_errors_hide_the_password() -> None:
    with pytest.raises(StackError) as caught:
        run_redis(f"redis://u:{SECRET}@127.0.0.1:1/0", lambda store: store.ping())
    assert SECRET not in str(caught.value)
    assert str(caught.value).startswith("cannot reach Redis at redis://u:***@127.0.0.1:1/0 (")
    with pytest.raises(InputError) as bad:
        run_redis(f"http://u:{SECRET}@h/0", lambda store: store.ping())
    assert SECRET not in str(bad.value)
    assert str(bad.value).startswith("bad Redis URL 'http://u:***@h/0': ")


@pytest.mark.parametrize(
    "argv",
    [
        ["usage"],
        ["tokens", "get", "some-id"],
        ["tokens", "get", "some-id", "--redis-url", f"redis://:{SECRET}@127.0.0.1:1/0"],
        ["stack", "status"],
    ],
)
def test_commands_never_print_the_redis_password(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("REDIS_URL", f"redis://user:{SECRET}@127.0.0.1:1/0")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("STREAMTALLY_STATE_DIR", str(tmp_path))
    code = main(argv)
    out, err = capsys.readouterr()
    assert code != 0
    assert SECRET not in out + err
    if argv[0] == "stack":
        assert "state dir: " in out  # `status` itself names no URL but the local stack's
    else:
        assert err.startswith(f"streamtally {argv[0]}: cannot reach Redis at redis://")
        assert ":***@127.0.0.1:1/0" in err


def test_help_never_shows_the_redis_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REDIS_URL", f"redis://user:{SECRET}@127.0.0.1:1/0")
    for argv in (["--help"], ["tokens", "get", "--help"], ["usage", "--help"], ["worker", "-h"]):
        with pytest.raises(SystemExit):
            main(argv)
        out, err = capsys.readouterr()
        assert "usage: streamtally" in out
        assert SECRET not in out + err


def test_stack_up_notes_an_external_redis_without_its_password(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    settings = Settings(
        redis_url_setting=f"redis://user:{SECRET}@h:1/0",
        kafka_bootstrap_servers=f"SASL_SSL://u:{SECRET}@k:1",
        state_dir_setting=tmp_path,
    )
    _note_overrides(settings, StackConfig.from_settings(settings))
    assert capsys.readouterr().out == (
        "note: KAFKA_BOOTSTRAP_SERVERS=SASL_SSL://u:***@k:1 is set, so the app uses that, not "
        "this local stack\n"
        "note: REDIS_URL=redis://user:***@h:1/0 is set, so the app uses that, not this local "
        "stack\n"
    )


def test_run_redis_connects_to_the_url_itself_not_its_redacted_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    used: list[str] = []

    def from_url(url: str, **options: float) -> object:
        used.append(url)
        raise ValueError(f"cannot parse {url}")

    monkeypatch.setattr("streamtally.cli.tokens.RedisStore.from_url", from_url)
    with pytest.raises(InputError) as caught:
        run_redis(f"redis://u:{SECRET}@h/0", lambda store: store.ping())
    assert used == [f"redis://u:{SECRET}@h/0"]
    assert str(caught.value) == "bad Redis URL 'redis://u:***@h/0': cannot parse redis://u:***@h/0"


def test_the_worker_refuses_a_broken_redis_url_in_one_line_without_its_password() -> None:
    with pytest.raises(InputError) as caught:
        asyncio.run(_check_layout("redis://u:longpart/rest@h/0", cluster=False))
    assert str(caught.value) == (
        "REDIS_URL: bad Redis URL 'redis://***': Port could not be cast to integer value as '***'"
    )
