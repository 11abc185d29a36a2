"""Compact encodings for token IDs and logprobs.

Token IDs are stored as little-endian int32 bytes and logprobs as float32 bytes:
4 bytes a token instead of the ~6-8 a JSON list of numbers costs, and decoding is
one `array.frombytes` call. float32 keeps logprobs to ~1e-7 relative, far below
what a PPO ratio can resolve.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_LITTLE = sys.byteorder == "little"


def pack_ints(values: Sequence[int] | None) -> bytes | None:
    if values is None:
        return None
    buf = array("i", values)
    if not _LITTLE:
        buf.byteswap()
    return buf.tobytes()


def unpack_ints(blob: bytes | None) -> tuple[int, ...]:
    if not blob:
        return ()
    buf = array("i")
    buf.frombytes(blob)
    if not _LITTLE:
        buf.byteswap()
    return tuple(buf)


def pack_floats(values: Sequence[float] | None) -> bytes | None:
    if values is None:
        return None
    buf = array("f", values)
    if not _LITTLE:
        buf.byteswap()
    return buf.tobytes()


def unpack_floats(blob: bytes | None) -> tuple[float, ...] | None:
    if blob is None:
        return None
    buf = array("f")
    buf.frombytes(blob)
    if not _LITTLE:
        buf.byteswap()
    return tuple(buf)
