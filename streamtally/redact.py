"""Credentials taken out of whatever streamtally prints: URLs, Kafka server lists, free text.

A Redis URL may carry a password (``redis://user:secret@host:6379/0``,
``rediss://:secret@host``, ``redis://host/0?password=secret``); streamtally
prints URLs in its log lines, its error messages and ``stack status``.  Every
such place shows `redact_url` of the URL instead::

    redis://user:secret@host:6379/0    ->  redis://user:***@host:6379/0
    rediss://:secret@host              ->  rediss://:***@host
    redis://secret@host                ->  redis://***@host
    redis://host/0?password=secret     ->  redis://host/0?password=***

The user name is kept (it says whose credentials were used); a user-info part
without a colon is replaced whole, since clients differ on whether it is a
user or a password.  The URL is not decoded or re-encoded: what is kept is
kept character for character, a percent-encoded password is replaced like
any other.  Parsing is lenient and errs towards hiding too much: the user
info ends at the last ``@`` of the authority; an ``@`` only after it (a raw
``/``, ``?`` or ``#`` inside a password, or an ``@`` in a query value) makes
the URL ambiguous, and everything after its ``scheme://`` is hidden
(``redis://user:pa/ss@host/0`` -> ``redis://***``).  A raw ``&``, ``;`` or
``#`` ends a query value, as it does for every URL parser.

`redact_credentials` hides what an HTTP client quotes of the calls it made (an
exception's repr holds the request's headers): the values of the credential
headers (``Authorization``, ``Proxy-Authorization``, ``x-api-key``,
``x-goog-api-key``, ``api-key``), a ``Bearer`` token anywhere, and a ``key=``
parameter outside a URL (``Authorization: Bearer sk-1`` -> ``Authorization:
***``, ``'x-api-key': 'k'`` -> ``'x-api-key': '***'``).

`redact_servers` does the same for each entry of a Kafka bootstrap list (no
Kafka client takes credentials there, but a user may still paste some), and
`redact_text` for every ``scheme://`` URL inside free text (a log record, an
exception's message from a library).  `url_secrets` and `scrub` handle what
these cannot see: the password itself (raw or decoded) quoted by a library
out of its URL.

Pure string functions, no dependency: the lowest layer, so that every other
layer (`streamtally.settings` included) can use them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Final
from urllib.parse import unquote

__all__ = [
    "MIN_SCRUBBED",
    "REDACTED",
    "hiding",
    "redact_credentials",
    "redact_servers",
    "redact_text",
    "redact_url",
    "redacted",
    "scrub",
    "url_secrets",
]

#: What stands in the place of a secret.
REDACTED: Final = "***"
#: Secrets shorter than this are not scrubbed out of free text (`scrub`): replacing every
#: "ab" of a log line would hide the line, not the secret.
MIN_SCRUBBED: Final = 4

_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.\-_]*://")
#: A ``scheme://`` URL inside free text: up to the next white space.
#: (Not preceded by a scheme character: a long run of letters is scanned once, not once per letter.)
_URL_IN_TEXT: Final = re.compile(r"(?<![A-Za-z0-9+.\-_])[A-Za-z][A-Za-z0-9+.\-_]*://\S*")
#: A query parameter ``name=value`` (its name and value bounded by ``? & ;`` and ``#``).
_PARAMETER: Final = re.compile(r"(?<=[?&;])([^=&;#?]*)=([^&;#]*)")
#: What separates the pieces of a secret a URL parser may quote on their own.
_PIECES: Final = re.compile(r"[/?#@:]")
#: Parts of a query parameter's name that make its value a secret.
_SECRET_NAME_PARTS: Final = ("pass", "pwd", "secret", "token", "credential")
#: Whole names (lower case, ``-`` as ``_``) whose value is a secret.
_SECRET_NAMES: Final = frozenset({"auth", "key", "apikey", "api_key", "sig", "signature"})


def _is_secret_name(name: str) -> bool:
    lowered = unquote(name).strip().lower().replace("-", "_")
    return lowered in _SECRET_NAMES or any(part in lowered for part in _SECRET_NAME_PARTS)


def _split(url: str) -> tuple[str, str]:
    """``(scheme:// or // or "", the rest)``."""
    match = _SCHEME.match(url)
    if match is not None:
        return url[: match.end()], url[match.end() :]
    if url.startswith("//"):
        return "//", url[2:]
    return "", url


def _userinfo_end(rest: str) -> tuple[int, bool]:
    """Where the user info of `rest` (a URL after its ``scheme://``) ends (its ``@``, or -1),
    and whether `rest` is ambiguous (an ``@`` after the authority, none in it)."""
    end = len(rest)
    for delimiter in "/?#":
        found = rest.find(delimiter)
        if found != -1:
            end = min(end, found)
    at = rest.rfind("@", 0, end)
    if at != -1:
        return at, False
    # A raw "/", "?" or "#" in a password, or an "@" in a query value: which is it?
    at = rest.rfind("@")
    return at, at != -1


def _redact_userinfo(userinfo: str) -> str:
    user, colon, password = userinfo.partition(":")
    if colon:
        return f"{user}:{REDACTED}" if password else userinfo
    return REDACTED if userinfo else userinfo


def _redact_parameter(match: re.Match[str]) -> str:
    name, value = match.group(1), match.group(2)
    if value and _is_secret_name(name):
        return f"{name}={REDACTED}"
    return match.group()


def redact_url(url: str) -> str:
    """`url` with its password and secret query values replaced by ``***``.

    Anything else is kept as it is, character for character; text that is
    not a URL comes back unchanged unless it holds ``user:password@``.
    """
    prefix, rest = _split(url)
    at, ambiguous = _userinfo_end(rest)
    if ambiguous:
        return prefix + REDACTED
    userinfo, tail = ("", rest) if at == -1 else (_redact_userinfo(rest[:at]), rest[at:])
    if "=" in tail and "?" in tail:  # the query comes after the user info
        tail = _PARAMETER.sub(_redact_parameter, tail)
    return prefix + userinfo + tail


def redact_servers(servers: str) -> str:
    """A Kafka bootstrap list (``host:port,...``) with any credentials of an entry hidden."""
    if "@" not in servers and "?" not in servers:
        return servers
    entries = servers.split(",")
    return ",".join(
        entry[: len(entry) - len(entry.lstrip())] + redact_url(entry.lstrip()) for entry in entries
    )


def redact_text(text: str) -> str:
    """`text` with every ``scheme://`` URL in it passed through `redact_url`."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group()), text)


#: A credential header and its value as a library quotes it: ``Name: value`` (a header
#: line), ``'Name': 'value'`` (a dict's repr), ``("Name", "value")`` (a list of pairs),
#: ``Name=value``.  The value ends at its closing quote, or at a line end without one.
_CREDENTIAL_HEADER: Final = re.compile(
    r"(?i)(?P<name>\b(?:proxy-)?authorization|\bx-api-key|\bx-goog-api-key|\bapi-key)"
    r"(?P<sep>['\"]?\s*(?:[:=,]|\)\s*,)\s*)"
    r"(?:(?P<q>['\"])(?:\\.|(?!(?P=q)).)*(?P=q)|[^\r\n,;}\]]+)"
)
_BEARER: Final = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-]{4,}")
_KEY_PARAMETER: Final = re.compile(r"(?i)(?<![A-Za-z0-9_])((?:api_?)?key=)[^&#\s'\"]+")


def _hide_header(match: re.Match[str]) -> str:
    quote = match.group("q")
    value = f"{quote}{REDACTED}{quote}" if quote else REDACTED
    return f"{match.group('name')}{match.group('sep')}{value}"


def redact_credentials(text: str) -> str:
    """`text` with credential header values, ``Bearer`` tokens and ``key=`` values hidden
    (see the module docstring)."""
    text = _CREDENTIAL_HEADER.sub(_hide_header, text)
    text = _BEARER.sub(lambda match: f"{match.group(1)} {REDACTED}", text)
    return _KEY_PARAMETER.sub(lambda match: f"{match.group(1)}{REDACTED}", text)


def url_secrets(url: str) -> frozenset[str]:
    """The secrets `redact_url` hides in `url`: as written, percent-decoded, and their pieces
    between ``/ ? # @ :``.

    For `scrub`: a library that parsed the URL may quote its password decoded,
    or, parsing a broken URL, a piece of it as a port or a path.
    """
    found: set[str] = set()
    _prefix, rest = _split(url)
    for match in _PARAMETER.finditer(rest):
        if match.group(2) and _is_secret_name(match.group(1)):
            found.add(match.group(2))
    at, _ambiguous = _userinfo_end(rest)
    if at != -1:
        user, colon, password = rest[:at].partition(":")
        found.add(password if colon else user)
    found |= {unquote(secret) for secret in found}
    found |= {piece for secret in found for piece in _PIECES.split(secret)}
    found.discard("")
    return frozenset(found)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with each of `secrets` (those of `MIN_SCRUBBED` characters or more) as ``***``.

    Longer secrets first, so that a secret holding a shorter one is hidden whole.
    """
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= MIN_SCRUBBED and secret in text:
            text = text.replace(secret, REDACTED)
    return text


#: The secrets of this command (its Redis password), scrubbed out of messages (`hiding`).
_HIDDEN: set[str] = set()


@contextmanager
def hiding(secrets: Iterable[str]) -> Iterator[None]:
    """While the block runs, `redacted` (so `say` and every log record) also hides `secrets`.

    `streamtally.cli.main` hides the secrets of the command's Redis URL
    (`streamtally.redact.url_secrets`): a library may quote a password it
    took out of the URL, where no URL is left to redact.
    """
    before = set(_HIDDEN)
    _HIDDEN.update(secrets)
    try:
        yield
    finally:
        _HIDDEN.intersection_update(before)


def redacted(text: str) -> str:
    """`text` with the credentials of every URL in it, credential headers and ``Bearer``
    tokens (`redact_credentials`) and the secrets being hidden as ``***``.

    What every message and log record goes through (`streamtally.cli._output.say`,
    `streamtally.cli._logging`) and the proxy's `describe`.
    """
    text = redact_credentials(redact_text(text))
    return scrub(text, _HIDDEN) if _HIDDEN else text
