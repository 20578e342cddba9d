"""The compiled hot path (`streamtally._native`): used only while fresh, and it folds alike.

The freshness rules are checked on a package and build made up in a temporary
folder.  The last tests run the same records through the pipeline's processor
in two child processes, one on the compiled modules and one on the sources,
and compare every output byte; ``STREAMTALLY_NATIVE_REQUIRED=1`` (set by
`.ci/run`) turns a missing or stale build into a failure instead of a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import streamtally.core.fold
from benchmarks.pipeline_workload import RequestBuilder, bench_names, interleave
from streamtally import _native
from streamtally.ops import native
from streamtally.ops.build_cache import BuildCache
from streamtally.settings import Settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _keep_the_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """`activate` records what it found: the tests' calls leave this process's record alone."""
    monkeypatch.setattr(_native, "_found", list(_native._found))


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "pkg"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "fold.py").write_text("X = 1\n")
    return package


def _build(tmp_path: Path, package: Path, **changes: object) -> Path:
    build = tmp_path / "build"
    lib = build / "lib"
    files = {}
    for name in (*_native.MODULES, "streamtally_native__mypyc"):
        file = lib / (name.replace(".", "/") + _native.python_tag())
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(b"")
        files[name] = str(file.relative_to(build))
    manifest = {
        "format": 1,
        "python": _native.python_tag(),
        "modules": list(_native.MODULES),
        "sources": _native.source_digest(package),
        "files": files,
    } | changes
    (build / _native.MANIFEST).write_text(json.dumps(manifest))
    return build


def test_a_build_of_these_sources_for_this_python_is_fresh(tmp_path: Path) -> None:
    package = _package(tmp_path)
    build = _build(tmp_path, package)
    reason, files = _native.check_build(build, package)
    assert reason is None
    assert set(files) == {*_native.MODULES, "streamtally_native__mypyc"}
    assert all(f.is_file() for f in files.values())
    assert native.fresh(build, package)


def test_any_change_to_any_source_makes_the_build_stale(tmp_path: Path) -> None:
    package = _package(tmp_path)
    build = _build(tmp_path, package)
    (package / "core" / "fold.py").write_text("X = 2\n")
    reason, files = _native.check_build(build, package)
    assert reason is not None
    assert "sources changed" in reason
    assert files == {}
    # A new module, or a source in a linked folder, counts as well.
    build = _build(tmp_path, package)
    (package / "extra.py").write_text("")
    assert "sources changed" in (_native.check_build(build, package)[0] or "")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "agent.py").write_text("A = 1\n")
    (package / "processors").symlink_to(linked)
    build = _build(tmp_path, package)
    assert _native.check_build(build, package)[0] is None
    (linked / "agent.py").write_text("A = 2\n")
    assert "sources changed" in (_native.check_build(build, package)[0] or "")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"python": ".cpython-399-x86_64-linux-gnu.so"}, "built for .cpython-399"),
        ({"modules": ["streamtally.core.fold"]}, "another list of modules"),
        ({"files": "nonsense"}, "malformed"),
    ],
)
def test_a_build_for_another_python_or_list_is_not_used(
    tmp_path: Path, changes: dict[str, object], expected: str
) -> None:
    package = _package(tmp_path)
    build = _build(tmp_path, package, **changes)
    reason, files = _native.check_build(build, package)
    assert reason is not None
    assert expected in reason
    assert files == {}


def test_an_incomplete_or_missing_build_is_not_used(tmp_path: Path) -> None:
    package = _package(tmp_path)
    reason, _ = _native.check_build(tmp_path / "nothing", package)
    assert reason is not None
    assert reason.startswith("not built")
    build = _build(tmp_path, package)
    (build / "lib" / "streamtally" / "core" / ("fold" + _native.python_tag())).unlink()
    reason, _ = _native.check_build(build, package)
    assert reason is not None
    assert "streamtally.core.fold" in reason
    (build / _native.MANIFEST).write_text("{not json")
    reason, _ = _native.check_build(build, package)
    assert reason is not None
    assert "unreadable" in reason


def test_the_switch_turns_it_off_without_looking_at_the_build(tmp_path: Path) -> None:
    package = _package(tmp_path)
    build = _build(tmp_path, package)
    before = list(sys.meta_path)
    found = _native.activate(build, package, environ={_native.ENV_NATIVE: "off"})
    assert not found.active
    assert found.reason == "STREAMTALLY_NATIVE=off"
    assert sys.meta_path == before


def test_modules_imported_already_are_not_replaced(tmp_path: Path) -> None:
    # Here the package and its core were imported long ago: a fresh build found now is not
    # put in front of modules that are loaded (or, if it was active, it stays as it was).
    assert streamtally.core.fold.__name__ in sys.modules
    was_active = _native.status().active
    package = _package(tmp_path)
    build = _build(tmp_path, package)
    before = list(sys.meta_path)
    found = _native.activate(build, package, environ={})
    assert sys.meta_path == before
    if was_active:
        assert found.active
        assert found.modules == _native.MODULES
    else:
        assert not found.active
        assert found.reason.startswith("imported before activation")


_FOLD = """
import hashlib, json, sys
from streamtally import _native
from streamtally.billing.pricing import PriceTable
from streamtally.processors.requests import Outputs, Position, RequestProcessor
import streamtally.core.fold as fold_module

sse, messages = json.load(open(sys.argv[1]))
processor = RequestProcessor(PriceTable.load_or_default(None), timeout=30.0)
digest = hashlib.sha256()
out = Outputs()
for i, (topic, key, value) in enumerate(messages):
    position = Position(topic, 0, i, 1_790_000_000.0)
    read = processor.read_sse if topic == sse else processor.read_engine
    raw = read(bytes.fromhex(key), bytes.fromhex(value), position, out)
    if raw is not None:
        processor.apply(out, raw)
for value in out.chunk_values:
    digest.update(value)
for done in out.completed:
    digest.update(done.tokens_value + done.billing_value)
print(json.dumps({
    "active": _native.status().active,
    "fold_module": fold_module.__file__,
    "chunks": len(out.chunk_values),
    "completed": len(out.completed),
    "digest": digest.hexdigest(),
}))
"""


def _fold_in_child(messages: Path, native_switch: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != _native.ENV_NATIVE}
    if native_switch:
        env[_native.ENV_NATIVE] = native_switch
    done = subprocess.run(
        [sys.executable, "-c", _FOLD, str(messages)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _messages(path: Path) -> Path:
    """The repo's sample requests of every source, as the raw topics carry them, interleaved."""
    settings = Settings.load({"KAFKA_BOOTSTRAP_SERVERS": "x:1", "REDIS_URL": "redis://x:1/0"})
    names = bench_names(settings)
    requests = RequestBuilder("native", ROOT / "samples", names).requests(12_000)
    messages = [
        (topic, (key or b"").hex(), value.hex())
        for topic, key, value, _ in interleave(requests, 16)
    ]
    path.write_text(json.dumps([names.topics.raw_sse.name, messages]))
    return path


def test_the_compiled_modules_and_the_sources_write_the_same_bytes(tmp_path: Path) -> None:
    reason, _ = _native.check_build(_native.BUILD_DIR, _native.PACKAGE_DIR)
    if reason is not None:
        if os.environ.get("STREAMTALLY_NATIVE_REQUIRED") == "1":
            pytest.fail(f"the compiled modules are required here, but: {reason}")
        pytest.skip(f"no fresh build of the compiled modules: {reason}")
    messages = _messages(tmp_path / "messages.json")
    compiled = _fold_in_child(messages, "")
    plain = _fold_in_child(messages, "off")
    assert compiled["active"] is True
    assert str(compiled["fold_module"]).endswith(_native.python_tag())
    assert plain["active"] is False
    assert str(plain["fold_module"]).endswith("fold.py")
    assert isinstance(compiled["chunks"], int)
    assert compiled["chunks"] > 1_000
    assert isinstance(compiled["completed"], int)
    assert compiled["completed"] > 50
    assert compiled["digest"] == plain["digest"]
    assert (compiled["chunks"], compiled["completed"]) == (plain["chunks"], plain["completed"])


# --------------------------------------------------------------------------- the build cache


def test_a_build_of_the_same_sources_is_taken_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = _package(tmp_path)
    cache = tmp_path / "cache"
    key = native.cache_key(_native.source_digest(package))
    BuildCache(cache).store(_build(tmp_path, package), key)
    monkeypatch.setattr(native, "PACKAGE_DIR", package)
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path / "clone" / ".native")
    (tmp_path / "clone").mkdir()

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled although the cache held the build")

    monkeypatch.setattr(native.subprocess, "run", no_compiling)
    result = native.build(progress=lambda _: None, cache=cache)
    assert result.cached is not None
    assert result.cached.parent == cache
    assert native.fresh(tmp_path / "clone" / ".native", package)
    assert native.build(progress=lambda _: None, cache=cache).built is False  # fresh now


def test_a_cached_build_of_other_sources_is_not_taken(tmp_path: Path) -> None:
    package = _package(tmp_path)
    key = native.cache_key(_native.source_digest(package))
    cache = BuildCache(tmp_path / "cache")
    cache.store(_build(tmp_path, package), key)
    (package / "core" / "fold.py").write_text("X = 2\n")  # the sources changed since
    assert native.cache_key(_native.source_digest(package)) != key
    assert not native._take_cached(cache, key, tmp_path / "staging", package)
    assert not (tmp_path / "staging").exists()


def test_the_cache_folder_is_set_or_off(tmp_path: Path) -> None:
    assert Settings.load({"STREAMTALLY_NATIVE_CACHE": "off"}).native_cache is None
    assert Settings.load({"STREAMTALLY_NATIVE_CACHE": str(tmp_path)}).native_cache == tmp_path
    xdg = Settings.load({"XDG_CACHE_HOME": str(tmp_path)}).native_cache
    assert xdg == tmp_path / "streamtally" / "native"
