"""``protocol.gaps``: the index codes of a ``topk`` blob round-trip from any chunk on, read
no further than their chunks allow, and take about ``r + 2`` bits an index."""

import itertools

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from gradientmail.errors import CodecError
from gradientmail.protocol import gaps


@st.composite
def index_sets(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """``(lengths, counts, offsets)``: chunks and a strictly increasing selection of each."""
    lengths = draw(st.lists(st.integers(1, 300), min_size=1, max_size=8))
    counts, offsets = [], []
    for length in lengths:
        chosen = draw(st.sets(st.integers(0, length - 1), max_size=length))
        counts.append(len(chosen))
        offsets.extend(sorted(chosen))
    return lengths, counts, offsets


def streams_of(high: bytes, low: bytes, r: int) -> tuple[bytes, gaps.Streams]:
    """The two streams behind three bytes of something else, as a blob holds them."""
    data = b"xyz" + high + low
    return data, gaps.Streams(3, 3 + len(high), 3 + len(high), r)


@settings(max_examples=300, deadline=None)
@given(index_sets(), st.data())
def test_offsets_round_trip_from_any_chunk(
    chosen: tuple[list[int], list[int], list[int]], data: st.DataObject
) -> None:
    """Whatever ``r``, reading from any chunk's first code on gives that chunk's offsets and
    the ones after, and the codes end where the high stream's bits do."""
    lengths, counts, offsets = chosen
    numel, sent = sum(lengths), len(offsets)
    r = data.draw(st.sampled_from([gaps.shift(sent, numel), 0, 3, gaps.MAX_SHIFT]))
    high, low = gaps.write(torch.tensor(counts), torch.tensor(offsets, dtype=torch.int64), r)
    blob, streams = streams_of(high, low, r)
    span = sent + (numel >> r)
    if r == gaps.shift(sent, numel):
        assert len(high) <= gaps.high_bytes(sent, numel, r)
    _, got, ends = gaps.read_offsets(blob, streams, 0, 0, torch.tensor(counts), span)
    assert got.tolist() == offsets
    assert len(high) == -(-int(ends[-1]) // 8) if sent else high == b""
    first = data.draw(st.integers(0, len(counts) - 1))
    skip = sum(counts[:first])
    bit = int(ends[skip - 1]) if skip else 0
    _, rest, _ = gaps.read_offsets(blob, streams, bit, skip, torch.tensor(counts[first:]), span)
    assert rest.tolist() == offsets[skip:]


def test_a_code_longer_than_its_chunks_allow_is_not_read() -> None:
    """A stream of zero bits (an endless quotient) is refused within the span the chunks
    allow, not read to its end."""
    blob, streams = streams_of(bytes(64), b"", 0)
    with pytest.raises(CodecError, match="end after 0 of 1"):
        gaps.read_offsets(blob, streams, 0, 0, torch.tensor([1]), 9)


@pytest.mark.parametrize(("density", "bits"), [(0.01, 8.5), (0.04, 6.5), (0.3, 3.5)])
def test_an_index_of_no_particular_pattern_takes_about_r_plus_two_bits(
    density: float, bits: float
) -> None:
    """Chunks of 4096 with a selection drawn at random: the codes take under ``bits`` an
    index (16 as plain ``U16`` offsets), and under ``r + 2.5``."""
    generator = torch.Generator().manual_seed(0)
    chunk, chunks = 4096, 100
    k = round(density * chunk)
    offsets = torch.cat(
        [torch.randperm(chunk, generator=generator)[:k].sort().values for _ in range(chunks)]
    )
    r = gaps.shift(k * chunks, chunk * chunks)
    high, low = gaps.write(torch.full((chunks,), k), offsets, r)
    per_index = 8 * (len(high) + len(low)) / (k * chunks)
    assert per_index < min(bits, r + 2.5)


def test_the_cut_follows_the_mean_gap() -> None:
    """``r`` is 0 for a dense selection, grows by one as the density halves, and stays
    within ``MAX_SHIFT``."""
    assert gaps.shift(0, 100) == 0
    assert gaps.shift(100, 100) == 0
    cuts = [gaps.shift(1 << 20 >> k, 1 << 20) for k in range(1, 21)]
    assert cuts == sorted(cuts)
    assert all(b - a <= 1 for a, b in itertools.pairwise(cuts))
    assert gaps.shift(1, 1 << 40) == gaps.MAX_SHIFT


@settings(max_examples=200, deadline=None)
@given(st.integers(1, gaps.MAX_SHIFT), st.data())
def test_fields_of_any_width_round_trip_from_any_one(r: int, data: st.DataObject) -> None:
    """What ``pack_fields`` writes (a ``topk`` blob's codes and ``low``), ``read_fields``
    reads back from any field on, through either of its paths (widths dividing 8 or not),
    and the padding bits are zero."""
    values = data.draw(st.lists(st.integers(0, (1 << r) - 1), min_size=1, max_size=40))
    packed = gaps.pack_fields(torch.tensor(values), r)
    assert len(packed) == -(-len(values) * r // 8)
    assert len(values) * r % 8 == 0 or packed[-1] >> (len(values) * r % 8) == 0
    first = data.draw(st.integers(0, len(values) - 1))
    got = gaps.read_fields(b"ab" + packed, 2, first, len(values) - first, r)
    assert got.tolist() == values[first:]
