"""Who is calling the API: bearer tokens, their SHA-256 in a tokens file, and their role.

A billing system or a dashboard gets a token of its tenant: it reads that
tenant's usage rows and requests, nothing else.  An operator token reads
every tenant's.  The operator keeps the tokens file (``--tokens`` or
``STREAMTALLY_API_TOKENS``); it holds no token, only each one's SHA-256, so
a copy of the file (a backup, a config repository) lets nobody call the API::

    {"tokens": [
      {"name": "acme-billing", "sha256": "<64 hex digits>", "tenant": "acme"},
      {"name": "ops", "sha256": "<64 hex digits>", "role": "operator"}
    ]}

Every entry has a unique ``name`` (1 to 64 of ``A-Z a-z 0-9 . _ -``; it is
what log lines say, never the token) and either a ``tenant`` or ``"role":
"operator"``.  A token is any string of 1 to 4096 visible ASCII characters;
``secrets.token_urlsafe(32)`` makes a good one (docs/api.md, "The usage API").

A presented token is hashed and its digest compared with every entry's, each
with `hmac.compare_digest` and without stopping at a match, so the time a
check takes says nothing about which digests the file holds.  Tokens are
never part of a repr, a log line or an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from streamtally.errors import InputError

__all__ = ["OPERATOR", "Principal", "TokenTable", "token_digest"]

#: The ``role`` of an entry that reads every tenant's data.
OPERATOR: Final = "operator"
#: Longest token accepted: a longer header is refused before it is hashed.
MAX_TOKEN_CHARS: Final = 4096
_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")
_TOKEN: Final = re.compile(r"[\x21-\x7e]+")


def token_digest(token: str) -> bytes:
    """The SHA-256 of a token's UTF-8 bytes: what a tokens file holds, in hex."""
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: a tenant's token (`tenant` set) or the operator's (None)."""

    #: The entry's name in the tokens file (for log lines; never the token).
    name: str
    #: The only tenant this caller may read; None: the operator, who reads every tenant.
    tenant: str | None

    @property
    def is_operator(self) -> bool:
        return self.tenant is None

    def may_read(self, tenant: str) -> bool:
        """Whether this caller may read `tenant`'s usage rows and requests."""
        return self.tenant is None or self.tenant == tenant


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes = field(repr=False)
    principal: Principal


class TokenTable:
    """The tokens file: which token digest is which caller."""

    def __init__(self, entries: Sequence[tuple[bytes, Principal]]) -> None:
        seen_names: set[str] = set()
        seen_digests: set[bytes] = set()
        for digest, principal in entries:
            if len(digest) != hashlib.sha256().digest_size:
                raise ValueError(f"{principal.name}: a digest is 32 bytes")
            if principal.name in seen_names:
                raise ValueError(f"two entries are named {principal.name!r}")
            if digest in seen_digests:
                raise ValueError(f"{principal.name}: another entry has the same sha256")
            seen_names.add(principal.name)
            seen_digests.add(digest)
        self._entries = tuple(_Entry(digest, principal) for digest, principal in entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TokenTable({len(self._entries)} entries)"

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        """Read a tokens file; `InputError` naming the file and the entry if it is not one."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise InputError(
                f"cannot read the API tokens file {path}: {exc.strerror or exc}"
            ) from None
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            raise InputError(f"the API tokens file {path} is not valid JSON") from None
        return cls.from_dict(doc, where=f"the API tokens file {path}")

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "the API tokens") -> TokenTable:
        """The table a parsed tokens file describes; `InputError` if it is not one."""
        if (
            not isinstance(doc, dict)
            or set(doc) != {"tokens"}
            or not isinstance(doc["tokens"], list)
        ):
            raise InputError(f'{where}: expected {{"tokens": [...]}}')
        entries = [_entry(item, f"{where}, entry {n}") for n, item in enumerate(doc["tokens"])]
        try:
            return cls(entries)
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from None

    def authenticate(self, token: str | None) -> Principal | None:
        """The caller a presented token is, or None (no token, malformed, or unknown).

        Every entry's digest is compared, in constant time each, whatever matched.
        """
        if token is None or len(token) > MAX_TOKEN_CHARS or not _TOKEN.fullmatch(token):
            return None
        digest = token_digest(token)
        found: Principal | None = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry.principal
        return found


def _entry(item: Any, where: str) -> tuple[bytes, Principal]:
    if not isinstance(item, Mapping):
        raise InputError(f"{where}: expected an object")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InputError(f"{where}: name must be 1 to 64 of A-Z a-z 0-9 . _ -")
    where = f"{where} ({name})"
    unknown = sorted(set(item) - {"name", "sha256", "tenant", "role"})
    if unknown:
        raise InputError(f"{where}: unknown fields {', '.join(map(repr, unknown))}")
    digest = item.get("sha256")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise InputError(f"{where}: sha256 must be the token's SHA-256 as 64 lowercase hex digits")
    tenant, role = item.get("tenant"), item.get("role")
    if (tenant is None) == (role is None):
        raise InputError(f'{where}: give either a tenant or "role": "{OPERATOR}", not both')
    if role is not None and role != OPERATOR:
        raise InputError(f'{where}: the only role is "{OPERATOR}"')
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InputError(f"{where}: tenant must be a non-empty string")
    return bytes.fromhex(digest), Principal(name=name, tenant=tenant)
