"""Hostile input never crashes the command line: exit 0, 1 or 2, and for 2 exactly one line.

As `tests/unit/core/test_fuzz.py` does for the fold, this feeds the commands what
a user, a file or a script can hand them, built deterministically (fixed
seeds, so every failure reproduces): files that are not UTF-8, empty, one huge
line, a directory, missing, or named with control characters and undecodable
bytes; manifests of every wrong shape; arguments with control characters,
bidi overrides and lone surrogates (argv bytes that are not UTF-8); bad days,
tenants, ids and endpoints.  Every command runs in this process,
`streamtally.cli.main`, with Kafka and Redis pointed at a port where nothing
listens (127.0.0.1:1), so those that get as far as connecting take their error
path.  Each run must end with status 0, 1 or 2; with 2, stderr is exactly one
line; nothing prints a traceback, and no output holds a raw control character.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamtally.cli import main

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "samples"
SEED = 20260102

#: Argument values: control characters, separators, bidi, surrogates, shapes.
VALUES = [
    "",
    " ",
    "-",
    "--",
    "acme",
    "a\nb",
    "a\rb",
    "\x1b[2J\x1b[H",
    "\x00",
    "\x7f\x85\x9b",
    "x\u2028y\u2029z",
    "\u202eevil\u202c",
    "\u2066iso\u2069",
    "\udcff",
    "ok\udcfe\udcff",
    "é" * 3,
    "漢字",
    "x" * 70_000,
    "--help=no",
    "%s%d{}",
]
DAYS = ["2026-01-02", "2026-02-30", "2026-1-2", "20260102", "+2026-01-02", "9999-99-99", "\udcff"]
ENDPOINTS = [
    "127.0.0.1:1",
    "",
    "localhost:port",
    "[::1",
    "::::",
    "a,,b",
    "h\x1b:1",
    "\udcff:1",
    "1.2.3.4:99999",
]
REDIS_URLS = [
    "redis://127.0.0.1:1/0",
    "nonsense",
    "redis://h:x/0",
    "redis://127.0.0.1:99999/0",
    "redis://\x1b[2J:1/0",
    "redis://\udcff:1/0",
    "unix:///nonexistent/redis.sock",
]
#: Characters no output may hold raw (line ends aside).
RAW = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]} - {"\n"}
RAW |= {"\u2028", "\u2029", *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))}


@dataclass(frozen=True)
class Files:
    """Hostile files, in one directory."""

    root: Path

    def path(self, name: str) -> str:
        return str(self.root / name)


def _write_files(root: Path) -> Files:
    rng = random.Random(SEED)
    sample = (SAMPLES / "openai" / "text_usage.sse").read_bytes()
    engine = (SAMPLES / "dynamo" / "eos_no_usage.jsonl").read_bytes()
    contents = {
        "empty": b"",
        "bad_utf8.sse": b'data: {"id": "\xff\xfe"}\n\n'
        + bytes(rng.randrange(256) for _ in range(512)),
        "bad_utf8.jsonl": b'{"token_ids": [1], "text": "\xff"}\n',
        "noise.bin": bytes(rng.randrange(256) for _ in range(4096)),
        "huge_line.sse": b"data: " + b"x" * (6 << 20),
        "huge_event.sse": b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"'
        + b"y" * (5 << 20)
        + b'"}}]}\n\n',
        "nul.sse": b"\x00" * 1000,
        "crlf_only.sse": b"\r\n" * 1000,
        "not_sse.sse": b"<html>502 Bad Gateway</html>\n" + sample,
        "sample.sse": sample,
        "engine.jsonl": engine,
        "engine_surrogate.jsonl": b'{"token_ids": [1], "text": "\\udcff"}\n',
        "deep.jsonl": b"[" * 50_000 + b"\n",
        "ctl\x1b[2J\nname.sse": sample,
    }
    for name, data in contents.items():
        (root / name).write_bytes(data)
    (root / "a_directory").mkdir()
    (root / "ÿ.sse".encode("latin-1").decode("utf-8", "surrogateescape")).write_bytes(sample)
    manifests = {
        "m_bad_utf8.jsonl": b'{"file": "sample.sse", "source": "openai"}\n\xff\xfe\n',
        "m_empty.jsonl": b"",
        "m_blank.jsonl": b"\n \n\t\n",
        "m_not_json.jsonl": b"file=sample.sse\n",
        "m_list.jsonl": b"[]\n",
        "m_number.jsonl": b"1e999\n",
        "m_deep.jsonl": b"{" + b'"a":{' * 30_000 + b"\n",
        "m_missing_file.jsonl": b'{"file": "nope.sse", "source": "openai"}\n',
        "m_directory.jsonl": b'{"file": "a_directory", "source": "openai"}\n',
        "m_bad_source.jsonl": b'{"file": "sample.sse", "source": "\\u001b[2J"}\n',
        "m_types.jsonl": b'{"file": "sample.sse", "source": "openai", "request_id": [], '
        b'"tenant": 1}\n',
        "m_surrogate.jsonl": b'{"file": "sample.sse", "source": "openai", "tenant": "\\udcff"}\n',
        "m_hostile_ok.jsonl": b'{"file": "sample.sse", "source": "openai", '
        b'"request_id": "r\\n\\u001b[2J", "tenant": "t\\u2028\\u202e"}\n',
        "m_huge_event.jsonl": b'{"file": "huge_event.sse", "source": "openai"}\n',
        "m_not_sse.jsonl": b'{"file": "not_sse.sse", "source": "openai"}\n',
        "m_nul_file.jsonl": b'{"file": "a\\u0000b", "source": "openai"}\n',
    }
    for name, data in manifests.items():
        (root / name).write_bytes(data)
    return Files(root)


def _cases(files: Files) -> Iterator[list[str]]:
    rng = random.Random(SEED)
    names = sorted(p.name for p in files.root.iterdir())
    file_args = [files.path(n) for n in names] + [files.path("missing.sse"), "-"]
    manifests = [files.path(n) for n in names if n.startswith("m_")]
    sources = ["openai", "anthropic", "gemini", "openai-responses", "dynamo", "vllm", "atomr"]
    for path in file_args:
        for source in rng.sample(sources, 2):
            yield ["fold", "--source", source, path]
        yield ["produce", "--source", rng.choice(sources), path]
    for manifest in manifests:
        yield ["produce", "--manifest", manifest]
        yield ["demo", "--no-stack", "--manifest", manifest, "--timeout", "1"]
    for value in VALUES:
        yield ["fold", "--source", "openai", "--request-id", value, files.path("sample.sse")]
        yield ["fold", "--source", "dynamo", "--model", value, files.path("engine.jsonl")]
        yield ["produce", "--source", "openai", "--tenant", value, files.path("sample.sse")]
        yield ["produce", "--source", "openai", "--request-id", value, files.path("sample.sse")]
        yield ["tokens", "get", value]
        yield ["usage", "--tenant", value]
        yield ["usage", "--tenant", value, "--json"]
        yield ["deadletter", "--limit", value]
        yield ["rebuild", "--batch-size", value]
        yield [value]
        yield ["fold", "--source", value, files.path("sample.sse")]
    for day in DAYS:
        yield ["usage", "--day", day]
    for endpoint in ENDPOINTS:
        yield ["billing", "export", "--bootstrap-servers", endpoint]
        yield ["deadletter", "--json", "--bootstrap-servers", endpoint]
        yield ["rebuild", "--yes", "--bootstrap-servers", endpoint]
        yield [
            "produce",
            "--source",
            "openai",
            "--bootstrap-servers",
            endpoint,
            files.path("sample.sse"),
        ]
    for url in REDIS_URLS:
        yield ["tokens", "get", "r1", "--redis-url", url]
        yield ["usage", "--redis-url", url]
        yield ["rebuild", "--redis-url", url]
    yield ["worker"]
    yield ["worker", "--log-format", "json"]
    yield ["demo", "--no-stack"]


@dataclass(frozen=True)
class Run:
    argv: list[str]
    code: object
    out: str
    err: str


def _run(argv: list[str]) -> Run:
    out, err = io.StringIO(), io.StringIO()
    stdin = io.TextIOWrapper(io.BytesIO(b"data: {\xff}\n\n\x00"))
    saved = sys.stdin
    sys.stdin = stdin
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code: object = main(argv)
            except SystemExit as exc:  # argparse: usage errors and --help
                code = exc.code
            except Exception as exc:  # escaped: a traceback for the user  # noqa: BLE001
                code = f"an exception escaped: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        sys.stdin = saved
    return Run(argv, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Run]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
        patch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
        patch.setenv("STREAMTALLY_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        files = _write_files(tmp_path_factory.mktemp("hostile"))
        patch.chdir(files.root)
        return [_run(argv) for argv in _cases(files)]


def _short(argv: list[str]) -> str:
    return json.dumps([a if len(a) < 80 else a[:77] + "..." for a in argv])


def test_every_run_ends_in_0_1_or_2_with_one_line_for_2(runs: list[Run]) -> None:
    problems = []
    for run in runs:
        where = _short(run.argv)
        if run.code not in (0, 1, 2):
            problems.append(f"{where}: exit {run.code!r}")
        if "Traceback" in run.err or "Traceback" in run.out:
            problems.append(f"{where}: a traceback: {run.err[-300:]!r}")
        if run.code == 2 and (run.err.count("\n") != 1 or not run.err.endswith("\n")):
            problems.append(f"{where}: exit 2 with {run.err.count(chr(10))} lines: {run.err!r}")
        raw = sorted({f"U+{ord(c):04X}" for c in run.out + run.err if c in RAW})
        if raw:
            problems.append(f"{where}: raw {raw} in the output")
    assert not problems, f"{len(problems)} of {len(runs)} runs:\n" + "\n".join(problems[:40])


def test_the_fuzzer_reaches_every_outcome(runs: list[Run]) -> None:
    codes = {run.code for run in runs}
    assert {0, 2} <= codes, codes
    commands = {run.argv[0] for run in runs if run.argv}
    assert {"fold", "produce", "tokens", "usage", "billing", "deadletter", "rebuild"} <= commands
    assert {"worker", "demo"} <= commands
    # the error paths are reached, not only the argument checks
    said = "\n".join(run.err for run in runs)
    for expected in (
        "cannot reach Kafka",
        "cannot reach Redis",
        "is not UTF-8 text",
        "not UTF-8 text (byte",
        "cannot read",
        "a raw record may have",
        "is not SSE",
        "not a manifest line",
    ):
        assert expected in said, expected
    assert len(runs) > 300
