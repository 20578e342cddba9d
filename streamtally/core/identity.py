"""Who a request is: its tenant and its request id, together (`RequestRef`).

A provider's request id is unique only within the account that made the
request; two tenants of one gateway can, by accident or on purpose, send the
same id.  So a request is never keyed by its id alone: the fold state, the
commit gate, the Redis layout, the output topics' keys and the billing
``event_id`` all key it by `RequestRef`.  Two tenants that reuse one id are
two requests: neither can close, pre-empt or bill the other.

`RequestRef.text` is the identity as one string, the form Redis keys and
Kafka keys carry: the tenant with ``%`` and ``:`` percent-escaped (``%25``,
``%3A``; an ordinary tenant is written as is), a ``:``, then the request id
as is.  The escaped tenant holds no ``:``, so the first ``:`` splits the text
unambiguously (`RequestRef.parse`) whatever the request id holds.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["RequestRef", "tenant_part"]


def tenant_part(tenant: str) -> str:
    """The tenant as a key component: ``%`` → ``%25`` and ``:`` → ``%3A``, nothing else."""
    return tenant.replace("%", "%25").replace(":", "%3A")


def _unescape(part: str) -> str:
    return part.replace("%3A", ":").replace("%25", "%")


class RequestRef(NamedTuple):
    """A request's identity: (tenant, request id).  Hashable, ordered, cheap."""

    tenant: str
    request_id: str

    @property
    def text(self) -> str:
        """``{escaped tenant}:{request id}``: the identity as one unambiguous string."""
        return f"{tenant_part(self.tenant)}:{self.request_id}"

    @classmethod
    def parse(cls, text: str) -> RequestRef:
        """The reference a `text` spells; ValueError when it is not one."""
        part, sep, request_id = text.partition(":")
        tenant = _unescape(part)
        if not sep or not request_id or tenant_part(tenant) != part:
            raise ValueError(f"not a request reference (tenant:request_id): {text!r}")
        return cls(tenant, request_id)

    def __str__(self) -> str:
        """For messages: the request id and its tenant, with control characters escaped."""
        return f"{self.request_id!r} of tenant {self.tenant!r}"
