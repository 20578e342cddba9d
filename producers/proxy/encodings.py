"""Content encodings the proxy's tee reads, and the Accept-Encoding it sends upstream.

The client always gets the upstream's bytes as they came; the tee decodes a
copy.  It reads every coding of HTTP's registry that an LLM API sends:
``gzip`` (and its alias ``x-gzip``, several members too), ``deflate`` (the
zlib format RFC 9110 names, or the raw DEFLATE some servers send instead),
``br`` (the `brotli` package) and ``zstd`` (the `zstandard` package, across
frames), in any stack (``Content-Encoding: gzip, br`` was gzipped, then
brotli-compressed: decoded br first).  `decoder_for` makes one incremental
decoder per response: fed in pieces cut anywhere, it gives the decoded bytes
as soon as they are known.

So that no call goes untapped for its encoding, the proxy restricts what it
asks of the upstream to these codings (`accept_encoding_upstream`): the
client's offer less what the tee cannot decode, ``identity`` when nothing is
left.  An upstream that ignores the header and still sends another coding
(``compress``, ``exi``, ...) gets `UndecodableEncoding` here: the proxy
forwards the response, logs an error naming the path and counts it.
"""

from __future__ import annotations

import zlib
from typing import Any, Final, Protocol

import brotli
import zstandard

__all__ = [
    "DECODABLE",
    "DecodeError",
    "Decoder",
    "UndecodableEncoding",
    "accept_encoding_upstream",
    "codings_of",
    "decoder_for",
]

#: The content codings the tee decodes, in the order the proxy offers them upstream.
DECODABLE: Final = ("gzip", "deflate", "br", "zstd")
_ALIASES: Final = {"x-gzip": "gzip"}


class UndecodableEncoding(ValueError):
    """A response's Content-Encoding names a coding the tee cannot decode."""


class DecodeError(ValueError):
    """The bytes are not valid in the coding the response names."""


def codings_of(header: str) -> list[str]:
    """The codings of a Content-Encoding value in the order they were applied (identity out).

    Lower-cased, aliases resolved; an empty or absent header is no coding.
    """
    codings = []
    for item in header.split(","):
        coding = item.strip().lower()
        coding = _ALIASES.get(coding, coding)
        if coding and coding != "identity":
            codings.append(coding)
    return codings


class _Step(Protocol):
    def decompress(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


class _Members:
    """A coding whose body may hold several members (gzip) or frames (zstd), one after another.

    A body that ends inside a member is cut short: `flush` raises `DecodeError`.
    """

    name = ""

    def __init__(self) -> None:
        self._member = self._new()
        self._inside = False  # bytes of a member that has not ended yet were fed

    def _new(self) -> Any:
        raise NotImplementedError

    def decompress(self, data: bytes) -> bytes:
        out = bytearray()
        while data:
            self._inside = True
            out += self._member.decompress(data)
            if not self._member.eof:
                break
            self._inside = False
            data = self._member.unused_data
            self._member = self._new()
        return bytes(out)

    def flush(self) -> bytes:
        if self._inside:
            raise DecodeError(f"the {self.name} body ends inside a member")
        return b""


class _Gzip(_Members):
    name = "gzip"

    def _new(self) -> Any:
        return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)


class _Zstd(_Members):
    name = "zstd"

    def _new(self) -> Any:
        return zstandard.ZstdDecompressor().decompressobj()


class _Deflate:
    """HTTP deflate: the zlib format, or raw DEFLATE when the first two bytes are no zlib header."""

    def __init__(self) -> None:
        self._head = b""
        self._inflate: zlib._Decompress | None = None

    def decompress(self, data: bytes) -> bytes:
        if self._inflate is None:
            self._head += data
            if len(self._head) < 2:
                return b""
            cmf, flg = self._head[0], self._head[1]
            zlib_header = cmf & 0x0F == 8 and (cmf << 8 | flg) % 31 == 0
            self._inflate = zlib.decompressobj(wbits=zlib.MAX_WBITS if zlib_header else -15)
            data, self._head = self._head, b""
        return self._inflate.decompress(data)

    def flush(self) -> bytes:
        if self._inflate is None:
            if self._head:
                raise DecodeError("a deflate body of one byte")
            return b""
        return self._inflate.flush()


class _Brotli:
    def __init__(self) -> None:
        self._decoder = brotli.Decompressor()

    def decompress(self, data: bytes) -> bytes:
        out: bytes = self._decoder.process(data)
        return out

    def flush(self) -> bytes:
        if not self._decoder.is_finished():
            raise DecodeError("the br body ends before its last block")
        return b""


_STEPS: Final[dict[str, type[_Step]]] = {
    "gzip": _Gzip,
    "deflate": _Deflate,
    "br": _Brotli,
    "zstd": _Zstd,
}
#: What each library raises on bytes that are not of its coding.
_LIBRARY_ERRORS: Final = (zlib.error, brotli.error, zstandard.ZstdError)


class Decoder:
    """The incremental decoder of one response body (its codings undone, last applied first)."""

    def __init__(self, codings: list[str]) -> None:
        self.codings = tuple(codings)
        self._steps: list[_Step] = [_STEPS[coding]() for coding in reversed(codings)]

    def decompress(self, data: bytes) -> bytes:
        """The decoded bytes that `data` (the next piece of the body) makes known."""
        try:
            for step in self._steps:
                if not data:
                    break
                data = step.decompress(data)
        except _LIBRARY_ERRORS as exc:
            raise DecodeError(f"not a valid {', '.join(self.codings)} body: {exc}") from None
        return data

    def flush(self) -> bytes:
        """The body is complete: what the decoders still hold (DecodeError if cut short)."""
        data = b""
        try:
            for step in self._steps:
                if data:
                    data = step.decompress(data)
                data += step.flush()
        except _LIBRARY_ERRORS as exc:
            raise DecodeError(f"not a valid {', '.join(self.codings)} body: {exc}") from None
        return data


def decoder_for(content_encoding: str) -> Decoder | None:
    """The decoder of a body sent with this Content-Encoding; None when it is not encoded.

    Raises `UndecodableEncoding` naming the first coding the tee cannot read.
    """
    codings = codings_of(content_encoding)
    for coding in codings:
        if coding not in _STEPS:
            raise UndecodableEncoding(f"content coding {coding!r} cannot be decoded")
    return Decoder(codings) if codings else None


def _q_of(params: list[str]) -> float | None:
    """The q value of an Accept-Encoding element's parameters (None: not given or malformed)."""
    for param in params:
        name, sep, value = param.partition("=")
        if sep and name.strip().lower() == "q":
            try:
                q = float(value.strip())
            except ValueError:
                return None
            return q if 0.0 <= q <= 1.0 else None
    return None


def accept_encoding_upstream(offer: str | None) -> str:
    """The Accept-Encoding to send upstream: `offer` less what the tee cannot decode.

    Each coding of the client's offer that the tee decodes is kept as the
    client wrote it (its q value too); ``*`` stands for every decodable coding
    the offer does not name, at its q value.  A client that sent no header
    accepts any coding (RFC 9110 12.5.3): the proxy asks for ``identity`` then,
    the one coding every client reads.  When no coding with a q above 0 is
    left, the answer is ``identity``.
    """
    if offer is None:
        return "identity"
    kept: list[str] = []
    named: set[str] = set()
    star_q: float | None = None
    star = False
    for element in offer.split(","):
        coding, *params = (part.strip() for part in element.split(";"))
        coding = coding.lower()
        if not coding:
            continue
        if coding == "*":
            star, star_q = True, _q_of(params)
            continue
        canonical = _ALIASES.get(coding, coding)
        named.add(canonical)
        if canonical in _STEPS or canonical == "identity":
            if _q_of(params) is None and any(_is_q(p) for p in params):
                continue  # a malformed q: dropped rather than guessed
            kept.append(element.strip())
    if star:
        for coding in DECODABLE:
            if coding not in named:
                kept.append(coding if star_q is None else f"{coding};q={star_q:g}")
    if not any(_accepts(element) for element in kept):
        return "identity"
    return ", ".join(kept)


def _is_q(param: str) -> bool:
    return param.partition("=")[0].strip().lower() == "q"


def _accepts(element: str) -> bool:
    """Whether an Accept-Encoding element accepts its coding (a q value above 0)."""
    params = [p.strip() for p in element.split(";")[1:]]
    q = _q_of(params)
    return q is None or q > 0
