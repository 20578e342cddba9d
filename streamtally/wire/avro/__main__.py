"""`python -m streamtally.wire.avro fingerprints|release`: the schema release tool.

`fingerprints` prints each record's current version and fingerprint (the
table of docs/avro-framing.md); `release` writes `schemas/history/<Name>/<n>.avsc`
for every current schema that is not released yet.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from streamtally.wire.avro._compat import release
from streamtally.wire.avro._schemas import CURRENT, RECORD_NAMES

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m streamtally.wire.avro fingerprints|release`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["fingerprints"]:
        for name in RECORD_NAMES:
            cur = CURRENT[name]
            version = "unreleased" if cur.version is None else f"v{cur.version}"
            print(f"{name:16} {version:10} {cur.fingerprint.hex()}")
        return 0
    if args == ["release"]:
        for path in release():
            print(f"wrote {path}")
        return 0
    print("usage: python -m streamtally.wire.avro fingerprints|release", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
