"""The wheel, installed into a fresh virtualenv in an empty directory outside the clone.

What a user gets from `pip install streamtally`: one import root
(`streamtally`, no top-level `topics`, `processors` or `producers`), the
schemas and the default price table as package data, and commands that work
with no clone in sight: `fold` on a transcript, `produce`, `worker` against
the running stack, `tokens get` and `usage` on what the worker wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from decimal import Decimal
from pathlib import Path

import pytest

from streamtally.billing.pricing import PriceTable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "samples" / "openai" / "text_usage.sse"


def _run(*args: str | Path, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    proc = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{args[:3]} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the wheel, the venv's bin folder, an empty working directory)."""
    root = tmp_path_factory.mktemp("wheel")
    # No PYTHONPATH, no clone on the path: the clean environment of a user's shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    uv = Path(sys.executable).with_name("uv")  # make's venv has it: seconds instead of a minute
    if uv.is_file():
        _run(uv, "build", "--wheel", "-q", "-o", root, REPO, cwd=root, env=env)
    else:
        _run(
            sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", root, REPO,
            cwd=root, env=env,
        )  # fmt: skip
    (wheel,) = root.glob("streamtally-*.whl")
    bin_dir = root / "venv" / "bin"
    if uv.is_file():  # the same wheel and requirements, resolved by uv instead of pip
        _run(uv, "venv", "-q", "--python", sys.executable, root / "venv", cwd=root, env=env)
        _run(uv, "pip", "install", "-q", "--python", bin_dir / "python", wheel, cwd=root, env=env)
    else:
        _run(sys.executable, "-m", "venv", root / "venv", cwd=root, env=env)
        _run(bin_dir / "pip", "install", "-q", wheel, cwd=root, env=env)
    work = root / "empty"
    work.mkdir()
    return wheel, bin_dir, work


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def test_the_wheel_has_one_import_root_and_its_data(installed: tuple[Path, Path, Path]) -> None:
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/", 1)[0] for n in names if not n.startswith("streamtally-")}
    assert roots == {"streamtally"}
    for needed in (
        "streamtally/topics/__init__.py",
        "streamtally/processors/app.py",
        "streamtally/producers/raw.py",
        "streamtally/billing/prices.json",
        "streamtally/_schemas/Tokens.avsc",
        "streamtally/stack/pom.xml",
    ):
        assert needed in names
    assert not [n for n in names if n.startswith(("streamtally/tests", "benchmarks/"))]


def test_fold_runs_outside_the_clone(installed: tuple[Path, Path, Path]) -> None:
    _, bin_dir, work = installed
    transcript = work / "t.sse"
    transcript.write_bytes(SAMPLE.read_bytes())
    out = _run(
        bin_dir / "streamtally", "fold", "--source", "openai", "t.sse", cwd=work, env=_env(bin_dir)
    )
    tokens = json.loads(out)
    assert tokens["finish_reason"] == "stop"
    assert tokens["usage"]["output_tokens"] > 0


def test_worker_runs_outside_the_clone_with_the_default_prices(
    installed: tuple[Path, Path, Path], bootstrap_servers: str, redis_url: str
) -> None:
    _, bin_dir, work = installed
    namespace = f"wheel-{uuid.uuid4().hex[:8]}"
    request_id = f"wheel-req-{uuid.uuid4().hex[:8]}"
    env = _env(
        bin_dir,
        KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers,
        REDIS_URL=redis_url,
        STREAMTALLY_NAMESPACE=namespace,
        STREAMTALLY_STATE_DIR=str(work / "state"),
    )
    transcript = work / "t.sse"
    transcript.write_bytes(SAMPLE.read_bytes())
    log = (work / "worker.log").open("wb")
    worker = subprocess.Popen(
        [bin_dir / "streamtally", "worker", "--loglevel", "info"],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _run(
            bin_dir / "streamtally",
            "produce",
            "--source",
            "openai",
            "--tenant",
            "wheel",
            "--request-id",
            request_id,
            "t.sse",
            cwd=work,
            env=env,
            timeout=120,
        )
        deadline = time.monotonic() + 90
        tokens = None
        while time.monotonic() < deadline and tokens is None:
            proc = subprocess.run(
                [bin_dir / "streamtally", "tokens", "get", request_id, "--tenant", "wheel"],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
            if proc.returncode == 0:
                tokens = json.loads(proc.stdout)
            else:
                assert worker.poll() is None, (work / "worker.log").read_text()[-3000:]
                time.sleep(0.5)
        assert tokens is not None, (work / "worker.log").read_text()[-3000:]
        assert tokens["request_id"] == request_id
        usage = json.loads(
            _run(bin_dir / "streamtally", "usage", "--tenant", "wheel", "--json", cwd=work, env=env)
        )
        (row,) = [r for r in usage if r["model"] == tokens["model"]]
        assert row["requests"] >= 1
        # priced by the packaged table: the sample's model is in it, at a cost above 0
        assert PriceTable.default().is_priced(tokens["model"])
        assert Decimal(row["cost"]) > 0
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        finally:
            log.close()
    assert worker.returncode == 0, (work / "worker.log").read_text()[-3000:]
    assert not list(work.glob("*-data")), "faust left a data folder in the working directory"
