"""Only `streamtally.store` spells a Redis key: no quoted ``st:`` anywhere else.

Code outside `streamtally/store/` builds keys with the store's functions and
reads through `RedisStore`; the one test allowed to spell the layout is
``tests/unit/store/test_store_layout.py``, which pins it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STORE = (ROOT / "streamtally" / "store").resolve()
#: A string literal that starts with the key prefix (a quote, then st and a colon).
KEY_LITERAL = re.compile(r"""["']st:""")
#: Every package and folder of code (streamtally/topics etc. link to topics/ etc.).
CODE = ("streamtally", "topics", "processors", "producers", "benchmarks")
LAYOUT_TEST = (ROOT / "tests" / "unit" / "store" / "test_store_layout.py").resolve()


def _offenders(folders: tuple[str, ...], allowed: set[Path]) -> list[str]:
    files = {path.resolve() for folder in folders for path in (ROOT / folder).rglob("*.py")}
    found = []
    for path in sorted(files):
        if path.is_relative_to(STORE) or path in allowed:
            continue
        for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1):
            if KEY_LITERAL.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_no_module_outside_the_store_spells_a_key() -> None:
    assert _offenders(CODE, set()) == []


def test_only_the_layout_test_spells_a_key_among_the_tests() -> None:
    assert _offenders(("tests",), {LAYOUT_TEST}) == []


def test_the_scan_sees_the_store_and_the_layout_test() -> None:
    """The pattern matches what it must (else the tests above would pass on nothing)."""
    layout = (STORE / "layout.py").read_text("utf-8")
    assert KEY_LITERAL.search(layout)
    assert KEY_LITERAL.search(LAYOUT_TEST.read_text("utf-8"))
    scanned = {path.resolve() for path in (ROOT / "processors").rglob("*.py")}
    assert (ROOT / "processors" / "sinks.py").resolve() in scanned
