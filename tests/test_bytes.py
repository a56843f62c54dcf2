"""``_bytes.Filling``: one allocation, filled in place, handed out as the same ``bytes``."""

import sys
import tracemalloc

import pytest

from gradientmail import _bytes
from gradientmail._bytes import Filling


def test_the_filled_bytes_are_the_one_allocation() -> None:
    size = 8 * 2**20
    pattern = bytes(range(256)) * (size // 256)
    source = memoryview(pattern)
    tracemalloc.start()
    try:
        out = Filling(size)
        out.view[: size // 2] = source[: size // 2]
        with out.view[size // 2 :] as half:
            half[:] = source[size // 2 :]
        data = out.done()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert type(data) is bytes
    assert data == pattern
    assert hash(data) == hash(pattern)
    assert peak < size + 2**16


def test_on_cpython_the_bytes_are_filled_in_place_without_zeroing_first() -> None:
    in_place = sys.implementation.name == "cpython"
    assert _bytes._IN_PLACE is in_place


def test_a_shorter_result_and_the_empty_one() -> None:
    out = Filling(10)
    out.view[:4] = b"abcd"
    assert out.done(4) == b"abcd"
    assert Filling(0).done() == b""
    with pytest.raises(ValueError, match="-1 bytes"):
        Filling(-1)


def test_a_view_still_alive_refuses_rather_than_copy() -> None:
    out = Filling(100)
    kept = out.view[10:20]
    with pytest.raises(BufferError):
        out.done()
    kept.release()
