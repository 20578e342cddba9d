"""The worker's content policy, built from its settings (`streamtally.core.content`).

``STREAMTALLY_CONTENT`` names the policy; under ``redacted`` the HMAC key is
read from the file ``STREAMTALLY_CONTENT_KEY`` names, once, when the worker
starts: its text, stripped, is the key in hex or base64 (as the trust file's
secrets, `streamtally.wire.tenant_keys.decode_secret`), at least 32 bytes.  A
missing, unreadable or short key stops the worker with one line (exit 2) that
never quotes the key.  The file is read only under ``redacted``.
"""

from __future__ import annotations

from streamtally.core.content import Content, ContentPolicy
from streamtally.errors import InputError
from streamtally.settings import Settings
from streamtally.wire.tenant_keys import decode_secret

__all__ = ["content_policy"]


def content_policy(settings: Settings) -> ContentPolicy:
    """The policy `settings` name, its key read when it needs one (`InputError` otherwise)."""
    content = Content(settings.content)
    if content is not Content.REDACTED:
        return ContentPolicy(content)
    path = settings.content_key_path
    if path is None:  # Settings refuses it already; kept for Settings built otherwise
        raise InputError("STREAMTALLY_CONTENT=redacted needs STREAMTALLY_CONTENT_KEY")
    try:
        text = path.expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise InputError(f"cannot read the content key file {path}: {why}") from None
    return ContentPolicy(content, decode_secret(text, f"content key file {path}"))
