"""Compact encodings for token IDs and logprobs.

Token IDs are stored as little-endian int32 bytes and logprobs as float32 bytes:
4 bytes a token instead of the ~6-8 a JSON list of numbers costs. `struct` with
a cached format per length is the fastest pure-Python packer (about 3x faster
than `array` from a tuple), and ingestion packs every token of every prompt.
float32 keeps logprobs to ~1e-7 relative, far below what a PPO ratio resolves.
"""

from __future__ import annotations

import base64
import functools
import struct
from collections.abc import Sequence


@functools.lru_cache(maxsize=4096)
def _fmt(kind: str, n: int) -> struct.Struct:
    return struct.Struct(f"<{n}{kind}")


def pack_ints(values: Sequence[int] | None) -> bytes | None:
    if values is None:
        return None
    return _fmt("i", len(values)).pack(*values)


def unpack_ints(blob: bytes | None) -> tuple[int, ...]:
    if not blob:
        return ()
    return _fmt("i", len(blob) // 4).unpack(blob)


def pack_floats(values: Sequence[float] | None) -> bytes | None:
    if values is None:
        return None
    return _fmt("f", len(values)).pack(*values)


def unpack_floats(blob: bytes | None) -> tuple[float, ...] | None:
    if blob is None:
        return None
    return _fmt("f", len(blob) // 4).unpack(blob) if blob else ()


# The same packing as text, for token arrays kept inside a JSON column (the extra choices of a
# request with n > 1, store/mapping.py): base64 of the bytes above, so they cost what a column
# would (+1/3) and round-trip to exactly the values the columns give back.

def ints_to_text(values: Sequence[int]) -> str:
    return base64.b64encode(_fmt("i", len(values)).pack(*values)).decode("ascii")


def text_to_ints(text: str) -> tuple[int, ...]:
    return unpack_ints(base64.b64decode(text, validate=True))


def floats_to_text(values: Sequence[float]) -> str:
    return base64.b64encode(_fmt("f", len(values)).pack(*values)).decode("ascii")


def text_to_floats(text: str) -> tuple[float, ...]:
    blob = base64.b64decode(text, validate=True)
    return _fmt("f", len(blob) // 4).unpack(blob) if blob else ()
