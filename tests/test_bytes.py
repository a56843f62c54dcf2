"""``_bytes.Filling``: one allocation, filled in place, handed out as the same ``bytes``."""

import tracemalloc

import pytest

from gradientmail._bytes import Filling


def test_the_filled_bytes_are_the_one_allocation() -> None:
    size = 8 * 2**20
    tracemalloc.start()
    try:
        out = Filling(size)
        out.view[:3] = b"abc"
        out.view[size - 3 :] = b"xyz"
        data = out.done()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert type(data) is bytes
    assert len(data) == size
    assert data[:3] == b"abc"
    assert data[-3:] == b"xyz"
    assert data[3:-3].count(0) == size - 6
    assert peak < size + 2**16


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
