"""The usage API's tokens file and bearer-token check (`streamtally.api.auth`).

The file holds each token's SHA-256 only; a presented token is hashed and
compared with every entry; malformed files are refused naming the entry,
never quoting a token.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from streamtally.api.auth import MAX_TOKEN_CHARS, Principal, TokenTable, token_digest
from streamtally.errors import InputError

ACME_TOKEN = secrets.token_urlsafe(32)
OPS_TOKEN = secrets.token_urlsafe(32)


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def doc(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"tokens": list(entries)}


TABLE_DOC = doc(
    {"name": "acme-billing", "sha256": sha(ACME_TOKEN), "tenant": "acme"},
    {"name": "ops", "sha256": sha(OPS_TOKEN), "role": "operator"},
)


def test_token_digest_is_the_sha256_of_the_utf8_token() -> None:
    assert token_digest("abc").hex() == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_tokens_map_to_their_tenant_or_the_operator(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(TABLE_DOC))
    table = TokenTable.load(path)
    assert len(table) == 2
    acme = table.authenticate(ACME_TOKEN)
    assert acme == Principal(name="acme-billing", tenant="acme")
    assert acme is not None
    assert not acme.is_operator
    assert acme.may_read("acme")
    assert not acme.may_read("globex")
    ops = table.authenticate(OPS_TOKEN)
    assert ops == Principal(name="ops", tenant=None)
    assert ops is not None
    assert ops.is_operator
    assert ops.may_read("acme")
    assert ops.may_read("globex")


@pytest.mark.parametrize(
    "presented",
    [
        None,
        "",
        "not-a-token",
        ACME_TOKEN[:-1],
        ACME_TOKEN + "x",
        sha(ACME_TOKEN),  # the digest itself is not the token
        ACME_TOKEN + " ",
        "é" + ACME_TOKEN,
        "x" * (MAX_TOKEN_CHARS + 1),
    ],
    # the tokens are random: ids of their own keep the collection the same in every
    # process (pytest-xdist's workers must collect the same test ids)
    ids=[
        "none",
        "empty",
        "not-a-token",
        "prefix",
        "longer",
        "digest",
        "trailing-space",
        "leading-char",
        "over-the-limit",
    ],
)
def test_anything_but_a_listed_token_is_nobody(presented: str | None) -> None:
    assert TokenTable.from_dict(TABLE_DOC).authenticate(presented) is None


def test_a_long_token_within_the_limit_is_accepted() -> None:
    token = "t" * MAX_TOKEN_CHARS
    table = TokenTable.from_dict(doc({"name": "long", "sha256": sha(token), "tenant": "a"}))
    assert table.authenticate(token) == Principal("long", "a")


def test_repr_shows_no_digest() -> None:
    table = TokenTable.from_dict(TABLE_DOC)
    assert repr(table) == "TokenTable(2 entries)"
    assert sha(ACME_TOKEN) not in repr(table._entries)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], 'expected {"tokens": [...]}'),
        ({"tokens": {}}, 'expected {"tokens": [...]}'),
        ({"tokens": [], "extra": 1}, 'expected {"tokens": [...]}'),
        (doc("x"), "entry 0: expected an object"),
        (doc({"sha256": sha("a"), "tenant": "t"}), "entry 0: name must be"),
        (doc({"name": "a b", "sha256": sha("a"), "tenant": "t"}), "entry 0: name must be"),
        (doc({"name": "n", "sha256": "ab" * 31, "tenant": "t"}), "entry 0 (n): sha256 must"),
        (doc({"name": "n", "sha256": sha("a").upper(), "tenant": "t"}), "sha256 must"),
        (doc({"name": "n", "token": "a", "sha256": sha("a"), "tenant": "t"}), "unknown fields"),
        (doc({"name": "n", "sha256": sha("a")}), "either a tenant or"),
        (
            doc({"name": "n", "sha256": sha("a"), "tenant": "t", "role": "operator"}),
            "either a tenant or",
        ),
        (doc({"name": "n", "sha256": sha("a"), "role": "admin"}), 'the only role is "operator"'),
        (doc({"name": "n", "sha256": sha("a"), "tenant": ""}), "tenant must be a non-empty"),
        (doc({"name": "n", "sha256": sha("a"), "tenant": 3}), "tenant must be a non-empty"),
        (
            doc(
                {"name": "n", "sha256": sha("a"), "tenant": "t"},
                {"name": "n", "sha256": sha("b"), "tenant": "u"},
            ),
            "two entries are named 'n'",
        ),
        (
            doc(
                {"name": "n", "sha256": sha("a"), "tenant": "t"},
                {"name": "m", "sha256": sha("a"), "role": "operator"},
            ),
            "m: another entry has the same sha256",
        ),
    ],
)
def test_a_bad_tokens_file_is_refused_with_the_entry_named(document: Any, message: str) -> None:
    with pytest.raises(InputError, match="the API tokens") as raised:
        TokenTable.from_dict(document)
    assert message in str(raised.value)


def test_unreadable_and_non_json_files_are_refused_without_quoting_them(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read the API tokens file"):
        TokenTable.load(tmp_path / "missing.json")
    path = tmp_path / "tokens.json"
    path.write_text(f'{{"tokens": [{{"token": "{ACME_TOKEN}"')
    with pytest.raises(InputError, match="is not valid JSON") as raised:
        TokenTable.load(path)
    assert ACME_TOKEN not in str(raised.value)


def test_every_entry_is_compared_whatever_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time: the comparison does not stop at the first match (nor skip any entry)."""
    import streamtally.api.auth as auth

    table = TokenTable.from_dict(TABLE_DOC)
    compared: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert table.authenticate(ACME_TOKEN) == Principal("acme-billing", "acme")  # the first
    assert len(compared) == 2
    assert table.authenticate("unknown") is None
    assert len(compared) == 4
