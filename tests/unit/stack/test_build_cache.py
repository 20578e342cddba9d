"""`BuildCache`: finished builds kept whole under a key, taken as copies, the newest kept."""

from __future__ import annotations

import os
from pathlib import Path

from streamtally.ops.build_cache import BuildCache, install


def _build(path: Path) -> Path:
    (path / "lib").mkdir(parents=True)
    (path / "lib" / "a.jar").write_bytes(b"jar bytes")
    (path / "stamp").write_text("digest\n")
    (path / "link").symlink_to("lib/a.jar")
    return path


def test_a_stored_build_is_taken_whole_and_the_source_stays_its_own(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "cache")
    built = _build(tmp_path / "built")
    cache.store(built, "k1")
    assert cache.take("k1", tmp_path / "taken")
    taken = tmp_path / "taken"
    assert (taken / "lib" / "a.jar").read_bytes() == b"jar bytes"
    assert (taken / "stamp").read_text() == "digest\n"
    assert os.readlink(taken / "link") == "lib/a.jar"
    # Taking it again gives the same; the source folder can go: the entry is a copy.
    (built / "lib" / "a.jar").unlink()
    assert cache.take("k1", tmp_path / "again")
    assert (tmp_path / "again" / "lib" / "a.jar").read_bytes() == b"jar bytes"


def test_an_unknown_key_is_not_taken(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "cache")
    assert not cache.take("nothing", tmp_path / "taken")
    assert not (tmp_path / "taken").exists()


def test_a_key_stored_twice_keeps_the_first_and_leaves_no_scratch(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "cache")
    cache.store(_build(tmp_path / "one"), "k")
    other = _build(tmp_path / "two")
    (other / "stamp").write_text("other\n")
    cache.store(other, "k")
    assert (cache.entry("k") / "stamp").read_text() == "digest\n"
    assert sorted(p.name for p in cache.root.iterdir()) == ["k"]


def test_the_cache_keeps_the_newest_builds(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "cache", keep=3)
    built = _build(tmp_path / "built")
    for i in range(5):  # each store drops all but the newest 3
        cache.store(built, f"key{i}")
        os.utime(cache.entry(f"key{i}"), (1000 + i, 1000 + i))
    assert sorted(p.name for p in cache.root.iterdir()) == ["key2", "key3", "key4"]
    assert cache.take("key2", tmp_path / "taken")  # taken: the newest now
    cache.store(built, "newest")
    assert sorted(p.name for p in cache.root.iterdir()) == ["key2", "key4", "newest"]


def test_install_puts_the_build_in_place_of_the_old_one_and_leaves_nothing_else(
    tmp_path: Path,
) -> None:
    target = _build(tmp_path / "target")
    (target / "stale").write_text("old\n")
    staging = _build(tmp_path / "staging")
    install(staging, target)
    assert not staging.exists()
    assert not (target / "stale").exists()
    assert (target / "lib" / "a.jar").read_bytes() == b"jar bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    install(_build(tmp_path / "first"), tmp_path / "new")  # no old one
    assert (tmp_path / "new" / "stamp").read_text() == "digest\n"


def test_a_build_that_cannot_be_kept_is_said_and_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache would be\n")
    said: list[str] = []
    BuildCache(blocker).store_or_say(_build(tmp_path / "built"), "k", said.append, "the jars")
    assert len(said) == 1
    assert said[0].startswith(f"the jars not kept in {blocker}: ")
