"""Packed token IDs and logprobs: exact round trips at the edges."""

import pytest

from lightning_middleware.store.codec import (
    floats_to_text,
    ints_to_text,
    pack_floats,
    pack_ints,
    text_to_floats,
    text_to_ints,
    unpack_floats,
    unpack_ints,
)


@pytest.mark.parametrize("ids", [(), (0,), (1, 2, 3), (2**31 - 1, -(2**31), 151_643), tuple(range(5000))])
def test_ints_round_trip(ids):
    blob = pack_ints(ids)
    assert len(blob) == 4 * len(ids) and unpack_ints(blob) == ids


def test_none_and_empty():
    assert pack_ints(None) is None and unpack_ints(None) == () and unpack_ints(b"") == ()
    assert pack_floats(None) is None and unpack_floats(None) is None and unpack_floats(b"") == ()


def test_floats_are_float32_exact_enough():
    lps = (0.0, -1e-7, -0.5, -3.25, -25.123456)
    back = unpack_floats(pack_floats(lps))
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(lps, back))


def test_out_of_range_token_id_is_an_error():
    import struct

    with pytest.raises(struct.error):
        pack_ints((2**31,))


@pytest.mark.parametrize("ids", [(), (0,), (2**31 - 1, -(2**31), 151_643), tuple(range(3000))])
def test_text_packing_round_trips_like_the_columns(ids):
    lps = tuple(-0.001 * i for i in range(len(ids)))
    assert text_to_ints(ints_to_text(ids)) == ids
    assert text_to_floats(floats_to_text(lps)) == unpack_floats(pack_floats(lps))  # the same float32 values
