"""Whose usage a provider's line is: its API key's or project's id, mapped to a tenant.

A usage report names keys by the provider's id for them (OpenAI ``key_…``, Anthropic
``apikey_01…``), never by the key itself, and projects or workspaces by theirs
(``proj_…``, ``wrkspc_01…``).  `TenantMap.load` reads either of two files:

- the proxy's ``--api-keys`` file (`streamtally.producers.proxy.api_keys`), each entry that names
  its key's id at the provider in ``provider_key_id`` (the proxy ignores the field)::

      {"keys": [{"sha256": "<64 hex>", "tenant": "acme", "provider_key_id": "key_abc"}]}

- a mapping file of its own, for projects, workspaces or keys the proxy does not hold::

      {"provider_ids": {"proj_abc": "acme", "wrkspc_01x": "globex", "key_def": "acme"}}

A line maps by its first id the map holds: the API key's, then the project's or
workspace's (`UsageLine.ids`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from streamtally.errors import InputError
from streamtally.json_input import read_json_file

__all__ = ["TenantMap"]


@dataclass(frozen=True, slots=True)
class TenantMap:
    """Provider id (key, project or workspace) -> tenant."""

    tenants: Mapping[str, str]

    def tenant_of(self, ids: Sequence[str]) -> str | None:
        """The tenant of the first of `ids` the map holds; None: none of them."""
        for provider_id in ids:
            tenant = self.tenants.get(provider_id)
            if tenant is not None:
                return tenant
        return None

    def named(self) -> frozenset[str]:
        """Every tenant the map names."""
        return frozenset(self.tenants.values())

    @classmethod
    def load(cls, path: str | Path) -> TenantMap:
        """Read a map (either format, see the module docstring); `InputError` naming the file
        and the entry when it is not one."""
        where = f"--provider-map {path}"
        doc = read_json_file(where, path)
        if isinstance(doc, dict) and isinstance(doc.get("provider_ids"), dict):
            pairs = list(doc["provider_ids"].items())
            names = [f'provider_ids["{key}"]' for key, _ in pairs]
        elif isinstance(doc, dict) and isinstance(doc.get("keys"), list):
            entries = doc["keys"]
            pairs, names = [], []
            for n, entry in enumerate(entries):
                if not isinstance(entry, dict):
                    raise InputError(f"{where}: entry {n} of keys must be an object")
                if "provider_key_id" in entry:
                    pairs.append((entry["provider_key_id"], entry.get("tenant")))
                    names.append(f"entry {n} of keys")
            if not pairs:
                raise InputError(
                    f"{where}: no entry of keys has a provider_key_id (the id the provider's "
                    "usage report gives the key, e.g. key_… or apikey_01…)"
                )
        else:
            raise InputError(
                f'{where}: expected {{"provider_ids": {{"<id>": "<tenant>"}}}} or an --api-keys '
                'file whose entries have "provider_key_id"'
            )
        tenants: dict[str, str] = {}
        for (provider_id, tenant), name in zip(pairs, names, strict=True):
            if not isinstance(provider_id, str) or not provider_id:
                raise InputError(f"{where}: {name}: the provider id must be a non-empty string")
            if not isinstance(tenant, str) or not tenant:
                raise InputError(f"{where}: {name}: the tenant must be a non-empty string")
            if provider_id in tenants:
                raise InputError(f"{where}: {name}: {provider_id} is mapped twice")
            tenants[provider_id] = tenant
        return cls(tenants)
