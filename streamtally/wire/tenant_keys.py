"""Signed tenant claims: which producer may bill which tenant (docs/tenants.md).

Any client that can write the raw topics could otherwise bill any tenant: the
tenant is a field of the record's body.  With a trust file, the worker bills
only records that carry a Kafka header ``st-auth`` signed by a key the
operator issued, and only for the tenants that key may claim.

The producer's key file (one per producer, kept secret)::

    {"key_id": "gw-acme-1", "secret": "<64 hex digits, or base64 of 32 bytes or more>"}

The worker's trust file (``STREAMTALLY_TENANT_KEYS``)::

    {"keys": {"gw-acme-1": {"secret": "...", "tenants": ["acme", "acme-*"]}}}

A key id is 1 to 64 of ``A-Z a-z 0-9 . _ -``.  A secret is hex when it is
only hex digits (even length), else base64 (standard or URL-safe, padding
optional); it must decode to at least 32 bytes.  A tenant rule is a tenant
name matched exactly, or a name ending in ``*`` matching every tenant that
starts with what precedes it (``"acme-*"``: ``acme-eu``, not ``acme``);
``"*"`` alone matches every tenant (a gateway that serves them all).  A ``*``
anywhere else is refused, as in the price table.

The header, on every raw record::

    st-auth: v1:<key id>:<64 lowercase hex digits of the MAC>

The MAC is HMAC-SHA256 under the key's secret of `canonical_message`:

    b"streamtally.st-auth.v1\\x00"
    + u32be(len(tenant)) + tenant (UTF-8)
    + u32be(len(request_id)) + request_id (UTF-8)
    + i64be(seq)
    + SHA-256(the record's value bytes)

so a header is bound to its record: moved to another record (another
request, sequence number, tenant or body), it no longer verifies.  The
worker compares MACs in constant time (`hmac.compare_digest`).  Secrets are
never part of a repr, a log line or an error message.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from streamtally.errors import (
    BadSignature,
    InputError,
    TenantNotAllowed,
    UnsignedRecord,
    UntrustedRecord,
)

__all__ = [
    "HEADER",
    "MIN_SECRET_BYTES",
    "BadSignature",
    "ProducerKey",
    "TenantNotAllowed",
    "TenantTrust",
    "TrustedKey",
    "UnsignedRecord",
    "UntrustedRecord",
    "canonical_message",
    "decode_secret",
]

#: The Kafka header that carries a record's signed tenant claim.
HEADER: Final = "st-auth"
#: The header's version prefix.
VERSION: Final = "v1"
#: Bytes a secret must have at least.
MIN_SECRET_BYTES: Final = 32
_DOMAIN: Final = b"streamtally.st-auth.v1\x00"
_KEY_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HEX: Final = re.compile(r"(?:[0-9a-fA-F]{2})+")
_MAC_HEX: Final = re.compile(rb"[0-9a-f]{64}")


def canonical_message(tenant: str, request_id: str, seq: int, value: bytes) -> bytes:
    """The bytes a record's MAC is computed over (see the module docstring)."""
    t = tenant.encode("utf-8", "surrogatepass")
    r = request_id.encode("utf-8", "surrogatepass")
    return b"".join(
        (
            _DOMAIN,
            len(t).to_bytes(4, "big"),
            t,
            len(r).to_bytes(4, "big"),
            r,
            seq.to_bytes(8, "big", signed=True),
            hashlib.sha256(value).digest(),
        )
    )


def _mac(secret: bytes, tenant: str, request_id: str, seq: int, value: bytes) -> bytes:
    return hmac.digest(secret, canonical_message(tenant, request_id, seq, value), "sha256")


def decode_secret(text: Any, where: str) -> bytes:
    """A secret's bytes: hex if only hex digits, else base64; at least `MIN_SECRET_BYTES`.

    `InputError` names `where`, never the secret.
    """
    if not isinstance(text, str) or not text:
        raise InputError(f"{where}: the secret must be a non-empty string (hex or base64)")
    if _HEX.fullmatch(text):
        secret = bytes.fromhex(text)
    else:
        padded = text + "=" * (-len(text) % 4)
        try:
            if "-" in text or "_" in text:
                secret = base64.urlsafe_b64decode(padded.encode("ascii"))
            else:
                secret = base64.b64decode(padded.encode("ascii"), validate=True)
        except (binascii.Error, ValueError, UnicodeError):
            raise InputError(f"{where}: the secret is neither hex nor base64") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise InputError(
            f"{where}: the secret is {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}"
        )
    return secret


def _check_key_id(key_id: Any, where: str) -> str:
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise InputError(f"{where}: a key id is 1 to 64 of A-Z a-z 0-9 . _ -")
    return key_id


def _read_json(path: Path, what: str) -> Any:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        # The message of a JSON error may quote the file, secret included: not shown.
        raise InputError(f"{what} {path} is not valid JSON") from None


@dataclass(frozen=True, slots=True)
class ProducerKey:
    """The key a producer signs its records with (its key file)."""

    key_id: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_key_id(self.key_id, "producer key")
        if len(self.secret) < MIN_SECRET_BYTES:
            raise InputError(f"producer key: the secret is fewer than {MIN_SECRET_BYTES} bytes")

    @classmethod
    def load(cls, path: Path) -> ProducerKey:
        """Read a key file; `InputError` (never quoting the secret) if it is not one."""
        doc = _read_json(path, "producer key file")
        where = f"producer key file {path}"
        if not isinstance(doc, dict) or set(doc) != {"key_id", "secret"}:
            raise InputError(f'{where}: expected {{"key_id": ..., "secret": ...}}')
        return cls(_check_key_id(doc["key_id"], where), decode_secret(doc["secret"], where))

    def sign(self, *, tenant: str, request_id: str, seq: int, value: bytes) -> bytes:
        """The ``st-auth`` header value of one record."""
        mac = _mac(self.secret, tenant, request_id, seq, value)
        return f"{VERSION}:{self.key_id}:{mac.hex()}".encode("ascii")


@dataclass(frozen=True, slots=True)
class TrustedKey:
    """A key of the trust file: its secret and the tenants it may bill."""

    key_id: str
    secret: bytes = field(repr=False)
    #: Exact tenant names, and prefixes of the rules that end in ``*``.
    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    def may_bill(self, tenant: str) -> bool:
        return tenant in self.exact or any(tenant.startswith(p) for p in self.prefixes)


def _rules(tenants: Any, where: str) -> tuple[frozenset[str], tuple[str, ...]]:
    if not isinstance(tenants, list) or not tenants:
        raise InputError(
            f'{where}: "tenants" must be a non-empty list (remove the key to revoke it)'
        )
    exact: set[str] = set()
    prefixes: list[str] = []
    for rule in tenants:
        if not isinstance(rule, str) or not rule:
            raise InputError(f"{where}: a tenant rule is a non-empty string")
        if "*" in rule[:-1]:
            raise InputError(f"{where}: tenant rule {rule!r}: a * may only end a rule")
        if rule.endswith("*"):
            prefixes.append(rule[:-1])
        else:
            exact.add(rule)
    return frozenset(exact), tuple(prefixes)


class TenantTrust:
    """The worker's trust file: the keys it accepts and the tenants each may bill."""

    def __init__(self, keys: Mapping[str, TrustedKey]) -> None:
        self.keys = dict(keys)

    def __repr__(self) -> str:
        return f"TenantTrust(keys={sorted(self.keys)})"

    @classmethod
    def load(cls, path: Path) -> TenantTrust:
        """Read a trust file; `InputError` (never quoting a secret) if it is not one."""
        return cls.from_document(_read_json(path, "trust file"), f"trust file {path}")

    @classmethod
    def from_document(cls, doc: Any, where: str = "trust file") -> TenantTrust:
        if not isinstance(doc, dict) or set(doc) != {"keys"} or not isinstance(doc["keys"], dict):
            raise InputError(f'{where}: expected {{"keys": {{"<key id>": {{...}}}}}}')
        keys = {}
        for key_id, entry in doc["keys"].items():
            at = f"{where}, key {key_id!r}"
            _check_key_id(key_id, at)
            if not isinstance(entry, dict) or set(entry) != {"secret", "tenants"}:
                raise InputError(f'{at}: expected {{"secret": ..., "tenants": [...]}}')
            exact, prefixes = _rules(entry["tenants"], at)
            keys[key_id] = TrustedKey(key_id, decode_secret(entry["secret"], at), exact, prefixes)
        if not keys:
            raise InputError(f"{where}: no keys (without a trust file every producer is trusted)")
        return cls(keys)

    def refusal(
        self,
        headers: Sequence[tuple[str, bytes]],
        *,
        tenant: str,
        request_id: str,
        seq: int,
        value: bytes,
    ) -> UntrustedRecord | None:
        """Why this record may not bill its tenant; None when its claim is good."""
        claims = [v for name, v in headers if name == HEADER]
        if not claims:
            return UnsignedRecord(
                f"record has no {HEADER} header: this worker bills signed records only "
                "(STREAMTALLY_TENANT_KEYS)"
            )
        if len(claims) > 1:
            return BadSignature(f"{HEADER} header is malformed: the record has {len(claims)}")
        parts = claims[0].split(b":") if isinstance(claims[0], bytes) else []
        if (
            len(parts) != 3
            or parts[0] != VERSION.encode()
            or not _KEY_ID.fullmatch(parts[1].decode("ascii", "replace"))
            or not _MAC_HEX.fullmatch(parts[2])
        ):
            shown = claims[0][:100] if isinstance(claims[0], bytes) else claims[0]
            return BadSignature(
                f"{HEADER} header is malformed (expected {VERSION}:<key id>:<64 hex digits>): "
                f"{shown!r}"
            )
        key_id = parts[1].decode("ascii")
        key = self.keys.get(key_id)
        if key is None:
            return BadSignature(f"{HEADER} key {key_id!r} is not in the worker's trust file")
        expected = _mac(key.secret, tenant, request_id, seq, value)
        if not hmac.compare_digest(expected, bytes.fromhex(parts[2].decode("ascii"))):
            return BadSignature(
                f"{HEADER} signature by key {key_id!r} does not match the record "
                f"(tenant {tenant!r}, request {request_id!r}, seq {seq})"
            )
        if not key.may_bill(tenant):
            return TenantNotAllowed(f"{HEADER} key {key_id!r} may not bill tenant {tenant!r}")
        return None
