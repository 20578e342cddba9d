"""Readers of the raw records' Avro bodies, generated from schemas/: do not edit.

Written by ``python -m streamtally.wire.avro._compiled`` (`module_source`):
the readers `compile_reader` makes for the current RawSseEvent and
RawEngineOutput schemas, as typed functions that mypy checks and mypyc
compiles.  `tests/unit/wire/test_avro_compiled.py` checks that this file is what
the generator writes for the schemas of today.
"""


from __future__ import annotations

from datetime import timedelta as _timedelta
from typing import Any, Final

from streamtally.wire.avro._compiled import _DOUBLE, _EPOCH, _FLOAT


def _long_tail(buf: bytes, pos: int, b: int) -> tuple[int, int]:
    """The rest of a varint whose first byte `b` (already read) has its high bit set."""
    n = b & 0x7F
    shift = 7
    while True:
        b = buf[pos]  # IndexError past the end: a truncated body
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")
    if n >> 64:
        raise ValueError("a varint beyond 64 bits")
    return (n >> 1) ^ -(n & 1), pos


def _eof(what: str) -> EOFError:
    return EOFError(f"the body ends inside {what}")


_rawsseevent_c4: Final = ('UNKNOWN', 'OPENAI', 'OPENAI_RESPONSES', 'ANTHROPIC', 'GEMINI', 'DYNAMO', 'VLLM', 'ATOMR')


_rawsseevent_c11: Final = ('UNKNOWN', 'EVENT', 'END')


def _rawsseevent_0(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f0: Any
    f2: Any
    f3: Any
    f6: Any
    f8: Any
    f10: Any
    f13: Any
    f15: Any
    f17: Any
    b = buf[pos]
    if b < 0x80:
        n1 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n1 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n1, pos = _long_tail(buf, pos + 1, b)
    if n1 < 0 or pos + n1 > size:
        raise _eof('a string')
    f0 = buf[pos:pos + n1].decode()
    pos += n1
    b = buf[pos]
    if b < 0x80:
        f2 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f2 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f2, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        i5 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        i5 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        i5, pos = _long_tail(buf, pos + 1, b)
    if not 0 <= i5 < 8:
        raise IndexError(f'enum index {i5} out of range')
    f3 = _rawsseevent_c4[i5]
    b = buf[pos]
    if b < 0x80:
        n7 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n7 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n7, pos = _long_tail(buf, pos + 1, b)
    if n7 < 0 or pos + n7 > size:
        raise _eof('a string')
    f6 = buf[pos:pos + n7].decode()
    pos += n7
    b = buf[pos]
    if b < 0x80:
        us9 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        us9 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        us9, pos = _long_tail(buf, pos + 1, b)
    f8 = _EPOCH + _timedelta(microseconds=us9)
    b = buf[pos]
    if b < 0x80:
        i12 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        i12 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        i12, pos = _long_tail(buf, pos + 1, b)
    if not 0 <= i12 < 3:
        raise IndexError(f'enum index {i12} out of range')
    f10 = _rawsseevent_c11[i12]
    b = buf[pos]
    if b < 0x80:
        n14 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n14 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n14, pos = _long_tail(buf, pos + 1, b)
    if n14 < 0 or pos + n14 > size:
        raise _eof('a string')
    f13 = buf[pos:pos + n14].decode()
    pos += n14
    b = buf[pos]
    if b < 0x80:
        n16 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n16 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n16, pos = _long_tail(buf, pos + 1, b)
    if n16 < 0 or pos + n16 > size:
        raise _eof('a string')
    f15 = buf[pos:pos + n16].decode()
    pos += n16
    b = buf[pos]
    if b < 0x80:
        u18 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u18 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u18, pos = _long_tail(buf, pos + 1, b)
    if u18 == 0:
        f17 = None
    elif u18 == 1:
        b = buf[pos]
        if b < 0x80:
            n19 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n19 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n19, pos = _long_tail(buf, pos + 1, b)
        if n19 < 0 or pos + n19 > size:
            raise _eof('a string')
        f17 = buf[pos:pos + n19].decode()
        pos += n19
    else:
        raise IndexError(f'union branch {u18} out of range')
    return {'request_id': f0, 'seq': f2, 'source': f3, 'tenant': f6, 'received_at': f8, 'kind': f10, 'event': f13, 'data': f15, 'sse_id': f17}, pos


def read_raw_sse_event(buf: bytes, pos: int) -> tuple[Any, int]:
    """Reads a RawSseEvent body written with the current schema."""
    return _rawsseevent_0(buf, pos, len(buf))


_rawengineoutput_c4: Final = ('UNKNOWN', 'OPENAI', 'OPENAI_RESPONSES', 'ANTHROPIC', 'GEMINI', 'DYNAMO', 'VLLM', 'ATOMR')


_rawengineoutput_c11: Final = ('UNKNOWN', 'EVENT', 'END')


def _rawengineoutput_2(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f33: Any
    b = buf[pos]
    if b < 0x80:
        n34 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n34 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n34, pos = _long_tail(buf, pos + 1, b)
    if n34 < 0 or pos + n34 > size:
        raise _eof('a string')
    f33 = buf[pos:pos + n34].decode()
    pos += n34
    return {'error': f33}, pos


def _rawengineoutput_4(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f54: Any
    f56: Any
    b = buf[pos]
    if b < 0x80:
        u55 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u55 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u55, pos = _long_tail(buf, pos + 1, b)
    if u55 == 0:
        f54 = None
    elif u55 == 1:
        b = buf[pos]
        if b < 0x80:
            f54 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f54 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f54, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u55} out of range')
    b = buf[pos]
    if b < 0x80:
        u57 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u57 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u57, pos = _long_tail(buf, pos + 1, b)
    if u57 == 0:
        f56 = None
    elif u57 == 1:
        b = buf[pos]
        if b < 0x80:
            f56 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f56 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f56, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u57} out of range')
    return {'audio_tokens': f54, 'cached_tokens': f56}, pos


def _rawengineoutput_5(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f60: Any
    f62: Any
    f64: Any
    f66: Any
    b = buf[pos]
    if b < 0x80:
        u61 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u61 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u61, pos = _long_tail(buf, pos + 1, b)
    if u61 == 0:
        f60 = None
    elif u61 == 1:
        b = buf[pos]
        if b < 0x80:
            f60 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f60 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f60, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u61} out of range')
    b = buf[pos]
    if b < 0x80:
        u63 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u63 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u63, pos = _long_tail(buf, pos + 1, b)
    if u63 == 0:
        f62 = None
    elif u63 == 1:
        b = buf[pos]
        if b < 0x80:
            f62 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f62 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f62, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u63} out of range')
    b = buf[pos]
    if b < 0x80:
        u65 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u65 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u65, pos = _long_tail(buf, pos + 1, b)
    if u65 == 0:
        f64 = None
    elif u65 == 1:
        b = buf[pos]
        if b < 0x80:
            f64 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f64 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f64, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u65} out of range')
    b = buf[pos]
    if b < 0x80:
        u67 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u67 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u67, pos = _long_tail(buf, pos + 1, b)
    if u67 == 0:
        f66 = None
    elif u67 == 1:
        b = buf[pos]
        if b < 0x80:
            f66 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f66 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f66, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u67} out of range')
    return {'accepted_prediction_tokens': f60, 'audio_tokens': f62, 'reasoning_tokens': f64, 'rejected_prediction_tokens': f66}, pos


def _rawengineoutput_3(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f49: Any
    f50: Any
    f51: Any
    f52: Any
    f58: Any
    b = buf[pos]
    if b < 0x80:
        f49 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f49 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f49, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        f50 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f50 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f50, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        f51 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f51 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f51, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        u53 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u53 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u53, pos = _long_tail(buf, pos + 1, b)
    if u53 == 0:
        f52 = None
    elif u53 == 1:
        f52, pos = _rawengineoutput_4(buf, pos, size)
    else:
        raise IndexError(f'union branch {u53} out of range')
    b = buf[pos]
    if b < 0x80:
        u59 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u59 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u59, pos = _long_tail(buf, pos + 1, b)
    if u59 == 0:
        f58 = None
    elif u59 == 1:
        f58, pos = _rawengineoutput_5(buf, pos, size)
    else:
        raise IndexError(f'union branch {u59} out of range')
    return {'prompt_tokens': f49, 'completion_tokens': f50, 'total_tokens': f51, 'prompt_tokens_details': f52, 'completion_tokens_details': f58}, pos


def _rawengineoutput_1(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f16: Any
    f20: Any
    f27: Any
    f30: Any
    f35: Any
    f38: Any
    f40: Any
    f42: Any
    f47: Any
    x19: Any
    x24: Any
    x46: Any
    f16 = []
    while True:
        b = buf[pos]
        if b < 0x80:
            k17 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            k17 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            k17, pos = _long_tail(buf, pos + 1, b)
        if k17 == 0:
            break
        if k17 < 0:
            k17 = -k17
            b = buf[pos]
            if b < 0x80:
                s18 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                s18 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                s18, pos = _long_tail(buf, pos + 1, b)
        for _ in range(k17):
            b = buf[pos]
            if b < 0x80:
                x19 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                x19 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                x19, pos = _long_tail(buf, pos + 1, b)
            f16.append(x19)
    b = buf[pos]
    if b < 0x80:
        u21 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u21 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u21, pos = _long_tail(buf, pos + 1, b)
    if u21 == 0:
        f20 = None
    elif u21 == 1:
        f20 = []
        while True:
            b = buf[pos]
            if b < 0x80:
                k22 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                k22 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                k22, pos = _long_tail(buf, pos + 1, b)
            if k22 == 0:
                break
            if k22 < 0:
                k22 = -k22
                b = buf[pos]
                if b < 0x80:
                    s23 = (b >> 1) ^ -(b & 1)
                    pos += 1
                elif (c := buf[pos + 1]) < 0x80:
                    z = (b & 0x7F) | (c << 7)
                    s23 = (z >> 1) ^ -(z & 1)
                    pos += 2
                else:
                    s23, pos = _long_tail(buf, pos + 1, b)
            for _ in range(k22):
                b = buf[pos]
                if b < 0x80:
                    u25 = (b >> 1) ^ -(b & 1)
                    pos += 1
                elif (c := buf[pos + 1]) < 0x80:
                    z = (b & 0x7F) | (c << 7)
                    u25 = (z >> 1) ^ -(z & 1)
                    pos += 2
                else:
                    u25, pos = _long_tail(buf, pos + 1, b)
                if u25 == 0:
                    x24 = None
                elif u25 == 1:
                    b = buf[pos]
                    if b < 0x80:
                        n26 = (b >> 1) ^ -(b & 1)
                        pos += 1
                    elif (c := buf[pos + 1]) < 0x80:
                        z = (b & 0x7F) | (c << 7)
                        n26 = (z >> 1) ^ -(z & 1)
                        pos += 2
                    else:
                        n26, pos = _long_tail(buf, pos + 1, b)
                    if n26 < 0 or pos + n26 > size:
                        raise _eof('a string')
                    x24 = buf[pos:pos + n26].decode()
                    pos += n26
                else:
                    raise IndexError(f'union branch {u25} out of range')
                f20.append(x24)
    else:
        raise IndexError(f'union branch {u21} out of range')
    b = buf[pos]
    if b < 0x80:
        u28 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u28 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u28, pos = _long_tail(buf, pos + 1, b)
    if u28 == 0:
        f27 = None
    elif u28 == 1:
        b = buf[pos]
        if b < 0x80:
            n29 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n29 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n29, pos = _long_tail(buf, pos + 1, b)
        if n29 < 0 or pos + n29 > size:
            raise _eof('a string')
        f27 = buf[pos:pos + n29].decode()
        pos += n29
    else:
        raise IndexError(f'union branch {u28} out of range')
    b = buf[pos]
    if b < 0x80:
        u31 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u31 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u31, pos = _long_tail(buf, pos + 1, b)
    if u31 == 0:
        f30 = None
    elif u31 == 1:
        b = buf[pos]
        if b < 0x80:
            n32 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n32 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n32, pos = _long_tail(buf, pos + 1, b)
        if n32 < 0 or pos + n32 > size:
            raise _eof('a string')
        f30 = buf[pos:pos + n32].decode()
        pos += n32
    elif u31 == 2:
        f30, pos = _rawengineoutput_2(buf, pos, size)
    else:
        raise IndexError(f'union branch {u31} out of range')
    b = buf[pos]
    if b < 0x80:
        u36 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u36 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u36, pos = _long_tail(buf, pos + 1, b)
    if u36 == 0:
        f35 = None
    elif u36 == 1:
        b = buf[pos]
        if b < 0x80:
            n37 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n37 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n37, pos = _long_tail(buf, pos + 1, b)
        if n37 < 0 or pos + n37 > size:
            raise _eof('a string')
        f35 = buf[pos:pos + n37].decode()
        pos += n37
    elif u36 == 2:
        b = buf[pos]
        if b < 0x80:
            f35 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f35 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f35, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u36} out of range')
    b = buf[pos]
    if b < 0x80:
        u39 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u39 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u39, pos = _long_tail(buf, pos + 1, b)
    if u39 == 0:
        f38 = None
    elif u39 == 1:
        b = buf[pos]
        if b < 0x80:
            f38 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f38 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f38, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u39} out of range')
    b = buf[pos]
    if b < 0x80:
        u41 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u41 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u41, pos = _long_tail(buf, pos + 1, b)
    if u41 == 0:
        f40 = None
    elif u41 == 1:
        if pos + 8 > size:
            raise _eof('a double')
        f40 = _DOUBLE(buf, pos)[0]
        pos += 8
    else:
        raise IndexError(f'union branch {u41} out of range')
    b = buf[pos]
    if b < 0x80:
        u43 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u43 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u43, pos = _long_tail(buf, pos + 1, b)
    if u43 == 0:
        f42 = None
    elif u43 == 1:
        f42 = []
        while True:
            b = buf[pos]
            if b < 0x80:
                k44 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                k44 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                k44, pos = _long_tail(buf, pos + 1, b)
            if k44 == 0:
                break
            if k44 < 0:
                k44 = -k44
                b = buf[pos]
                if b < 0x80:
                    s45 = (b >> 1) ^ -(b & 1)
                    pos += 1
                elif (c := buf[pos + 1]) < 0x80:
                    z = (b & 0x7F) | (c << 7)
                    s45 = (z >> 1) ^ -(z & 1)
                    pos += 2
                else:
                    s45, pos = _long_tail(buf, pos + 1, b)
            for _ in range(k44):
                if pos + 8 > size:
                    raise _eof('a double')
                x46 = _DOUBLE(buf, pos)[0]
                pos += 8
                f42.append(x46)
    else:
        raise IndexError(f'union branch {u43} out of range')
    b = buf[pos]
    if b < 0x80:
        u48 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u48 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u48, pos = _long_tail(buf, pos + 1, b)
    if u48 == 0:
        f47 = None
    elif u48 == 1:
        f47, pos = _rawengineoutput_3(buf, pos, size)
    else:
        raise IndexError(f'union branch {u48} out of range')
    return {'token_ids': f16, 'tokens': f20, 'text': f27, 'finish_reason': f30, 'stop_reason': f35, 'index': f38, 'cum_log_probs': f40, 'log_probs': f42, 'completion_usage': f47}, pos


def _rawengineoutput_7(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f80: Any
    f81: Any
    f83: Any
    f87: Any
    f89: Any
    f92: Any
    x86: Any
    b = buf[pos]
    if b < 0x80:
        f80 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f80 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f80, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        n82 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n82 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n82, pos = _long_tail(buf, pos + 1, b)
    if n82 < 0 or pos + n82 > size:
        raise _eof('a string')
    f81 = buf[pos:pos + n82].decode()
    pos += n82
    f83 = []
    while True:
        b = buf[pos]
        if b < 0x80:
            k84 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            k84 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            k84, pos = _long_tail(buf, pos + 1, b)
        if k84 == 0:
            break
        if k84 < 0:
            k84 = -k84
            b = buf[pos]
            if b < 0x80:
                s85 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                s85 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                s85, pos = _long_tail(buf, pos + 1, b)
        for _ in range(k84):
            b = buf[pos]
            if b < 0x80:
                x86 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                x86 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                x86, pos = _long_tail(buf, pos + 1, b)
            f83.append(x86)
    b = buf[pos]
    if b < 0x80:
        u88 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u88 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u88, pos = _long_tail(buf, pos + 1, b)
    if u88 == 0:
        f87 = None
    elif u88 == 1:
        if pos + 8 > size:
            raise _eof('a double')
        f87 = _DOUBLE(buf, pos)[0]
        pos += 8
    else:
        raise IndexError(f'union branch {u88} out of range')
    b = buf[pos]
    if b < 0x80:
        u90 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u90 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u90, pos = _long_tail(buf, pos + 1, b)
    if u90 == 0:
        f89 = None
    elif u90 == 1:
        b = buf[pos]
        if b < 0x80:
            n91 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n91 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n91, pos = _long_tail(buf, pos + 1, b)
        if n91 < 0 or pos + n91 > size:
            raise _eof('a string')
        f89 = buf[pos:pos + n91].decode()
        pos += n91
    else:
        raise IndexError(f'union branch {u90} out of range')
    b = buf[pos]
    if b < 0x80:
        u93 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u93 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u93, pos = _long_tail(buf, pos + 1, b)
    if u93 == 0:
        f92 = None
    elif u93 == 1:
        b = buf[pos]
        if b < 0x80:
            n94 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n94 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n94, pos = _long_tail(buf, pos + 1, b)
        if n94 < 0 or pos + n94 > size:
            raise _eof('a string')
        f92 = buf[pos:pos + n94].decode()
        pos += n94
    elif u93 == 2:
        b = buf[pos]
        if b < 0x80:
            f92 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f92 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f92, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u93} out of range')
    return {'index': f80, 'text': f81, 'token_ids': f83, 'cumulative_logprob': f87, 'finish_reason': f89, 'stop_reason': f92}, pos


def _rawengineoutput_6(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f69: Any
    f71: Any
    f76: Any
    f95: Any
    f96: Any
    f98: Any
    x75: Any
    x79: Any
    b = buf[pos]
    if b < 0x80:
        n70 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n70 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n70, pos = _long_tail(buf, pos + 1, b)
    if n70 < 0 or pos + n70 > size:
        raise _eof('a string')
    f69 = buf[pos:pos + n70].decode()
    pos += n70
    b = buf[pos]
    if b < 0x80:
        u72 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u72 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u72, pos = _long_tail(buf, pos + 1, b)
    if u72 == 0:
        f71 = None
    elif u72 == 1:
        f71 = []
        while True:
            b = buf[pos]
            if b < 0x80:
                k73 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                k73 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                k73, pos = _long_tail(buf, pos + 1, b)
            if k73 == 0:
                break
            if k73 < 0:
                k73 = -k73
                b = buf[pos]
                if b < 0x80:
                    s74 = (b >> 1) ^ -(b & 1)
                    pos += 1
                elif (c := buf[pos + 1]) < 0x80:
                    z = (b & 0x7F) | (c << 7)
                    s74 = (z >> 1) ^ -(z & 1)
                    pos += 2
                else:
                    s74, pos = _long_tail(buf, pos + 1, b)
            for _ in range(k73):
                b = buf[pos]
                if b < 0x80:
                    x75 = (b >> 1) ^ -(b & 1)
                    pos += 1
                elif (c := buf[pos + 1]) < 0x80:
                    z = (b & 0x7F) | (c << 7)
                    x75 = (z >> 1) ^ -(z & 1)
                    pos += 2
                else:
                    x75, pos = _long_tail(buf, pos + 1, b)
                f71.append(x75)
    else:
        raise IndexError(f'union branch {u72} out of range')
    f76 = []
    while True:
        b = buf[pos]
        if b < 0x80:
            k77 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            k77 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            k77, pos = _long_tail(buf, pos + 1, b)
        if k77 == 0:
            break
        if k77 < 0:
            k77 = -k77
            b = buf[pos]
            if b < 0x80:
                s78 = (b >> 1) ^ -(b & 1)
                pos += 1
            elif (c := buf[pos + 1]) < 0x80:
                z = (b & 0x7F) | (c << 7)
                s78 = (z >> 1) ^ -(z & 1)
                pos += 2
            else:
                s78, pos = _long_tail(buf, pos + 1, b)
        for _ in range(k77):
            x79, pos = _rawengineoutput_7(buf, pos, size)
            f76.append(x79)
    f95 = buf[pos] != 0
    pos += 1
    b = buf[pos]
    if b < 0x80:
        u97 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u97 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u97, pos = _long_tail(buf, pos + 1, b)
    if u97 == 0:
        f96 = None
    elif u97 == 1:
        b = buf[pos]
        if b < 0x80:
            f96 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            f96 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            f96, pos = _long_tail(buf, pos + 1, b)
    else:
        raise IndexError(f'union branch {u97} out of range')
    b = buf[pos]
    if b < 0x80:
        u99 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u99 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u99, pos = _long_tail(buf, pos + 1, b)
    if u99 == 0:
        f98 = None
    elif u99 == 1:
        b = buf[pos]
        if b < 0x80:
            n100 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n100 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n100, pos = _long_tail(buf, pos + 1, b)
        if n100 < 0 or pos + n100 > size:
            raise _eof('a string')
        f98 = buf[pos:pos + n100].decode()
        pos += n100
    else:
        raise IndexError(f'union branch {u99} out of range')
    return {'request_id': f69, 'prompt_token_ids': f71, 'outputs': f76, 'finished': f95, 'num_cached_tokens': f96, 'output_kind': f98}, pos


def _rawengineoutput_9(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f111: Any
    f112: Any
    f113: Any
    f114: Any
    b = buf[pos]
    if b < 0x80:
        f111 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f111 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f111, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        f112 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f112 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f112, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        f113 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f113 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f113, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        f114 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f114 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f114, pos = _long_tail(buf, pos + 1, b)
    return {'input_tokens': f111, 'output_tokens': f112, 'reasoning_tokens': f113, 'cached_tokens': f114}, pos


def _rawengineoutput_8(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f102: Any
    f104: Any
    f106: Any
    f109: Any
    f115: Any
    b = buf[pos]
    if b < 0x80:
        n103 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n103 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n103, pos = _long_tail(buf, pos + 1, b)
    if n103 < 0 or pos + n103 > size:
        raise _eof('a string')
    f102 = buf[pos:pos + n103].decode()
    pos += n103
    b = buf[pos]
    if b < 0x80:
        n105 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n105 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n105, pos = _long_tail(buf, pos + 1, b)
    if n105 < 0 or pos + n105 > size:
        raise _eof('a string')
    f104 = buf[pos:pos + n105].decode()
    pos += n105
    b = buf[pos]
    if b < 0x80:
        u107 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u107 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u107, pos = _long_tail(buf, pos + 1, b)
    if u107 == 0:
        f106 = None
    elif u107 == 1:
        b = buf[pos]
        if b < 0x80:
            n108 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n108 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n108, pos = _long_tail(buf, pos + 1, b)
        if n108 < 0 or pos + n108 > size:
            raise _eof('a string')
        f106 = buf[pos:pos + n108].decode()
        pos += n108
    else:
        raise IndexError(f'union branch {u107} out of range')
    b = buf[pos]
    if b < 0x80:
        u110 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u110 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u110, pos = _long_tail(buf, pos + 1, b)
    if u110 == 0:
        f109 = None
    elif u110 == 1:
        f109, pos = _rawengineoutput_9(buf, pos, size)
    else:
        raise IndexError(f'union branch {u110} out of range')
    b = buf[pos]
    if b < 0x80:
        u116 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u116 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u116, pos = _long_tail(buf, pos + 1, b)
    if u116 == 0:
        f115 = None
    elif u116 == 1:
        b = buf[pos]
        if b < 0x80:
            n117 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n117 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n117, pos = _long_tail(buf, pos + 1, b)
        if n117 < 0 or pos + n117 > size:
            raise _eof('a string')
        f115 = buf[pos:pos + n117].decode()
        pos += n117
    else:
        raise IndexError(f'union branch {u116} out of range')
    return {'request_id': f102, 'text_delta': f104, 'tool_call_delta': f106, 'usage': f109, 'finish_reason': f115}, pos


def _rawengineoutput_0(buf: bytes, pos: int, size: int) -> tuple[Any, int]:
    f0: Any
    f2: Any
    f3: Any
    f6: Any
    f8: Any
    f10: Any
    f13: Any
    r15: Any
    r68: Any
    f118: Any
    f121: Any
    r101: Any
    b = buf[pos]
    if b < 0x80:
        n1 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n1 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n1, pos = _long_tail(buf, pos + 1, b)
    if n1 < 0 or pos + n1 > size:
        raise _eof('a string')
    f0 = buf[pos:pos + n1].decode()
    pos += n1
    b = buf[pos]
    if b < 0x80:
        f2 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        f2 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        f2, pos = _long_tail(buf, pos + 1, b)
    b = buf[pos]
    if b < 0x80:
        i5 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        i5 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        i5, pos = _long_tail(buf, pos + 1, b)
    if not 0 <= i5 < 8:
        raise IndexError(f'enum index {i5} out of range')
    f3 = _rawengineoutput_c4[i5]
    b = buf[pos]
    if b < 0x80:
        n7 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        n7 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        n7, pos = _long_tail(buf, pos + 1, b)
    if n7 < 0 or pos + n7 > size:
        raise _eof('a string')
    f6 = buf[pos:pos + n7].decode()
    pos += n7
    b = buf[pos]
    if b < 0x80:
        us9 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        us9 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        us9, pos = _long_tail(buf, pos + 1, b)
    f8 = _EPOCH + _timedelta(microseconds=us9)
    b = buf[pos]
    if b < 0x80:
        i12 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        i12 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        i12, pos = _long_tail(buf, pos + 1, b)
    if not 0 <= i12 < 3:
        raise IndexError(f'enum index {i12} out of range')
    f10 = _rawengineoutput_c11[i12]
    b = buf[pos]
    if b < 0x80:
        u14 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u14 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u14, pos = _long_tail(buf, pos + 1, b)
    if u14 == 0:
        f13 = None
    elif u14 == 1:
        r15, pos = _rawengineoutput_1(buf, pos, size)
        f13 = ('io.streamtally.v1.LLMEngineOutput', r15)
    elif u14 == 2:
        r68, pos = _rawengineoutput_6(buf, pos, size)
        f13 = ('io.streamtally.v1.RequestOutput', r68)
    elif u14 == 3:
        r101, pos = _rawengineoutput_8(buf, pos, size)
        f13 = ('io.streamtally.v1.TokenChunk', r101)
    else:
        raise IndexError(f'union branch {u14} out of range')
    b = buf[pos]
    if b < 0x80:
        u119 = (b >> 1) ^ -(b & 1)
        pos += 1
    elif (c := buf[pos + 1]) < 0x80:
        z = (b & 0x7F) | (c << 7)
        u119 = (z >> 1) ^ -(z & 1)
        pos += 2
    else:
        u119, pos = _long_tail(buf, pos + 1, b)
    if u119 == 0:
        f118 = None
    elif u119 == 1:
        b = buf[pos]
        if b < 0x80:
            n120 = (b >> 1) ^ -(b & 1)
            pos += 1
        elif (c := buf[pos + 1]) < 0x80:
            z = (b & 0x7F) | (c << 7)
            n120 = (z >> 1) ^ -(z & 1)
            pos += 2
        else:
            n120, pos = _long_tail(buf, pos + 1, b)
        if n120 < 0 or pos + n120 > size:
            raise _eof('a string')
        f118 = buf[pos:pos + n120].decode()
        pos += n120
    else:
        raise IndexError(f'union branch {u119} out of range')
    f121 = buf[pos] != 0
    pos += 1
    return {'request_id': f0, 'seq': f2, 'source': f3, 'tenant': f6, 'received_at': f8, 'kind': f10, 'payload': f13, 'model': f118, 'cancelled': f121}, pos


def read_raw_engine_output(buf: bytes, pos: int) -> tuple[Any, int]:
    """Reads a RawEngineOutput body written with the current schema."""
    return _rawengineoutput_0(buf, pos, len(buf))
