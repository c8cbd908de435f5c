"""Packed little-endian int32/float32 arrays: how large integer arrays cross the link.

`array` keeps the control plane free of numpy and torch; the data plane reads the same bytes
with `torch.frombuffer`.
"""

import sys
from array import array
from collections.abc import Iterable

assert sys.byteorder == "little", "the wire format is little-endian; add a byteswap for this host"


def pack_i32(values: Iterable[int]) -> bytes:
    return array("i", values).tobytes()


def unpack_i32(data: bytes) -> array:
    out = array("i")
    out.frombytes(data)
    return out


def pack_f32(values: Iterable[float]) -> bytes:
    return array("f", values).tobytes()


def unpack_f32(data: bytes) -> array:
    out = array("f")
    out.frombytes(data)
    return out
