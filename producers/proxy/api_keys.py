"""`streamtally proxy --api-keys FILE`: the tenant of a call is the one its API key maps to.

With a header (``--tenant-header``, `X-Tenant` by default) the client names its own
tenant, which suits a gateway that sets the header itself, behind which nobody else
can reach the proxy.  With an API-key map the tenant comes from the credential the
caller has to present to the provider anyway, so a caller cannot bill another tenant
by naming it: a call whose key the map does not hold is refused (403) and never
forwarded, so nothing passes the proxy unbilled.

The file holds SHA-256 digests of the keys, never the keys::

    {"keys": [{"sha256": "<64 hex digits>", "tenant": "acme", "name": "acme prod"}]}

(``printf %s "$KEY" | sha256sum`` gives the digest).  The key of a call is the first of:
``Authorization: Bearer K`` (OpenAI, and OpenAI-compatible servers), ``x-api-key``
(Anthropic), ``x-goog-api-key`` or the ``key`` query parameter (Gemini).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from streamtally.errors import InputError
from streamtally.json_input import read_json_file

__all__ = ["ApiKeyTenants", "api_key_of"]

_DIGEST: Final = re.compile(r"[0-9a-f]{64}")


def api_key_of(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The API key a call presents (see the module docstring), or None."""
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    for name in ("x-api-key", "x-goog-api-key"):
        value = headers.get(name, "").strip()
        if value:
            return value
    key = query.get("key", "").strip()
    return key or None


@dataclass(frozen=True, slots=True)
class ApiKeyTenants:
    """SHA-256 of an API key -> its tenant (the keys themselves are never held)."""

    tenants: Mapping[str, str]

    def __repr__(self) -> str:
        return f"ApiKeyTenants({len(self.tenants)} keys)"

    @classmethod
    def load(cls, path: str | Path) -> ApiKeyTenants:
        """Read a map file; `InputError` (one line, the file named, no digest quoted)."""
        where = f"--api-keys {path}"
        doc = read_json_file(where, path)
        entries = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise InputError(f'{where}: expected {{"keys": [{{"sha256": ..., "tenant": ...}}]}}')
        tenants: dict[str, str] = {}
        for n, entry in enumerate(entries):
            digest = entry.get("sha256") if isinstance(entry, dict) else None
            tenant = entry.get("tenant") if isinstance(entry, dict) else None
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise InputError(f"{where}: entry {n}: sha256 must be 64 lower-case hex digits")
            if not isinstance(tenant, str) or not tenant:
                raise InputError(f"{where}: entry {n}: tenant must be a non-empty string")
            if digest in tenants:
                raise InputError(f"{where}: entry {n}: a key listed twice")
            tenants[digest] = tenant
        return cls(tenants)

    def tenant_of(self, headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
        """The tenant of the call's API key; None without a key, or with one not in the map."""
        key = api_key_of(headers, query)
        if key is None:
            return None
        return self.tenants.get(hashlib.sha256(key.encode("utf-8")).hexdigest())
