"""The tee's content decoding and the Accept-Encoding the proxy sends upstream
(`streamtally.producers.proxy.encodings`): every coding, stacks, pieces cut at odd places."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable

import brotli
import pytest
import zstandard

from streamtally.producers.proxy.encodings import (
    DecodeError,
    UndecodableEncoding,
    accept_encoding_upstream,
    codings_of,
    decoder_for,
)

#: A body with some repetition (compressible) and multi-byte UTF-8 (split by odd cuts).
BODY = (
    '{"id":"chatcmpl-1","choices":[{"message":{"content":"' + "héllo wörld ✓ " * 700 + '"}}]}'
).encode()


def _deflate_raw(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


def _zstd_streamed(data: bytes) -> bytes:
    """A zstd frame written by a streaming compressor (no content size in its header)."""
    packer = zstandard.ZstdCompressor().compressobj()
    return packer.compress(data) + packer.flush()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": zstandard.ZstdCompressor().compress,
}


def _decode(encoding: str, data: bytes, step: int) -> bytes:
    decoder = decoder_for(encoding)
    assert decoder is not None
    out = b"".join(decoder.decompress(data[i : i + step]) for i in range(0, len(data), step))
    return out + decoder.flush()


@pytest.mark.parametrize("step", [1, 3, 7, 13, 997, 1 << 20])
@pytest.mark.parametrize("encoding", list(ENCODERS))
def test_every_coding_decodes_from_pieces_cut_anywhere(encoding: str, step: int) -> None:
    data = ENCODERS[encoding](BODY)
    assert data != BODY
    assert _decode(encoding, data, step) == BODY


@pytest.mark.parametrize("step", [1, 5, 64])
def test_the_variants_servers_send(step: int) -> None:
    # gzip of several members (concatenated), raw DEFLATE sent as "deflate", zstd in
    # several frames and from a streaming compressor: the whole body each time.
    half = len(BODY) // 2
    assert _decode("gzip", gzip.compress(BODY[:half]) + gzip.compress(BODY[half:]), step) == BODY
    assert _decode("deflate", _deflate_raw(BODY), step) == BODY
    two_frames = zstandard.ZstdCompressor().compress(BODY[:half])
    two_frames += zstandard.ZstdCompressor().compress(BODY[half:])
    assert _decode("zstd", two_frames, step) == BODY
    assert _decode("zstd", _zstd_streamed(BODY), step) == BODY


@pytest.mark.parametrize("step", [1, 11, 4096])
def test_stacked_codings_are_undone_last_first(step: int) -> None:
    # "gzip, br": gzipped first, then brotli-compressed.
    data = brotli.compress(gzip.compress(BODY))
    assert _decode("gzip, br", data, step) == BODY
    data = zstandard.ZstdCompressor().compress(brotli.compress(zlib.compress(BODY)))
    assert _decode("deflate, identity, BR ,zstd", data, step) == BODY
    with pytest.raises(DecodeError):  # the other order is not this body
        _decode("br, gzip", brotli.compress(gzip.compress(BODY)), step)


def test_decoded_bytes_come_as_soon_as_they_are_known() -> None:
    # A stream: each SSE event compressed and flushed on its own must come out at once.
    packers = {
        "gzip": zlib.compressobj(wbits=31),
        "deflate": zlib.compressobj(),
    }
    for encoding, packer in packers.items():
        decoder = decoder_for(encoding)
        assert decoder is not None
        for n in range(3):
            event = f'data: {{"n": {n}}}\n\n'.encode()
            assert (
                decoder.decompress(packer.compress(event) + packer.flush(zlib.Z_SYNC_FLUSH))
                == event
            )
    brotli_packer = brotli.Compressor()
    decoder = decoder_for("br")
    assert decoder is not None
    event = b'data: {"n": 0}\n\n'
    assert decoder.decompress(brotli_packer.process(event) + brotli_packer.flush()) == event
    zstd_packer = zstandard.ZstdCompressor().compressobj()
    decoder = decoder_for("zstd")
    assert decoder is not None
    assert decoder.decompress(zstd_packer.compress(event) + zstd_packer.flush(1)) == event


def test_no_coding_needs_no_decoder() -> None:
    assert decoder_for("") is None
    assert decoder_for("identity") is None
    assert decoder_for(" Identity ") is None
    assert codings_of("gzip, identity, X-Gzip") == ["gzip", "gzip"]


@pytest.mark.parametrize("encoding", ["compress", "exi", "gzip, pack200-gzip", "aes128gcm"])
def test_a_coding_it_cannot_read_is_named(encoding: str) -> None:
    with pytest.raises(UndecodableEncoding, match="cannot be decoded"):
        decoder_for(encoding)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
def test_bytes_that_are_not_of_the_coding_raise(encoding: str) -> None:
    with pytest.raises(DecodeError, match="not a valid"):
        _decode(encoding, b"\x00\xffnot compressed at all, really not" * 4, 16)


@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip"])
def test_a_body_cut_short_is_an_error_at_the_end(encoding: str) -> None:
    data = ENCODERS[encoding](BODY)
    decoder = decoder_for(encoding)
    assert decoder is not None
    decoder.decompress(data[: len(data) // 2])
    with pytest.raises(DecodeError, match="ends"):
        decoder.flush()


@pytest.mark.parametrize(
    ("offer", "upstream"),
    [
        (None, "identity"),  # no header: any coding; the proxy asks for the one all read
        ("", "identity"),
        ("gzip, deflate, br, zstd", "gzip, deflate, br, zstd"),
        ("br", "br"),
        ("zstd;q=1.0, br;q=0.5", "zstd;q=1.0, br;q=0.5"),
        ("compress, br", "br"),
        ("compress", "identity"),
        ("exi;q=1, compress;q=0.5", "identity"),
        ("gzip;q=0", "identity"),  # the client refuses gzip: nothing left
        ("identity;q=0, compress", "identity"),
        ("*", "gzip, deflate, br, zstd"),
        ("gzip, *;q=0.1", "gzip, deflate;q=0.1, br;q=0.1, zstd;q=0.1"),
        ("br, *;q=0", "br, gzip;q=0, deflate;q=0, zstd;q=0"),
        ("x-gzip, sdch", "x-gzip"),
        ("GZIP;Q=0.8, dcb", "GZIP;Q=0.8"),
        ("gzip;q=bogus, br", "br"),
    ],
)
def test_upstream_is_asked_only_for_what_the_tee_decodes(offer: str | None, upstream: str) -> None:
    assert accept_encoding_upstream(offer) == upstream
