"""The index sets of a ``topk`` blob (``protocol.sparse``): each chunk's strictly increasing
offsets stored as the gaps between them in a Golomb–Rice code.

The ``i``-th element a chunk sends, at offset ``o_i`` in it, is stored as its gap
``g_i = o_i − o_{i−1} − 1`` (``o_{−1} = −1``), cut at ``r`` bits (``shift``): ``g_i mod 2^r``
goes to ``low`` in ``r`` bits, ``g_i >> r`` to ``high`` in unary (that many 0 bits, then a 1
bit). Both streams run over the blob's elements in order, low bits of each byte first, the
last byte's padding bits zero. ``r`` is a function of the number of elements sent and the
fragment's size alone (so one index set has one encoding): about ``log2`` of the mean gap
less half a bit, the best cut for the gaps of a selection of no particular pattern, whose
index then takes about ``r + 2`` bits instead of 16 (at 1% density about 8, at 4% about 6;
``tests/protocol/test_protocol_gaps.py``).

Reading a stream checks what a hostile writer could get wrong: every code ends within the
bits its chunks can hold (``read_offsets`` reads no further), and the caller checks each offset
against its chunk and the streams' lengths and padding (``sparse.open_sparse``).

Pure: no I/O; the caller's thread. Memory: the streams of the elements read and a few
tensors of their number.
"""

from dataclasses import dataclass
from typing import Final

import numpy as np
import torch
from torch import Tensor

from gradientmail.errors import CodecError

__all__ = [
    "MAX_SHIFT",
    "Streams",
    "high_bytes",
    "pack_fields",
    "read_fields",
    "read_offsets",
    "shift",
    "write",
]

MAX_SHIFT: Final = 16
"""The widest ``low`` field: a gap in a chunk of at most ``2^16`` elements fits it."""


@dataclass(frozen=True, slots=True)
class Streams:
    """Where a blob's index streams lie in its bytes: ``high`` in ``[high_at, high_end)``,
    ``low`` from ``low_at``, cut at ``r`` bits."""

    high_at: int
    high_end: int
    low_at: int
    r: int


def shift(sent: int, numel: int) -> int:
    """The number of low bits ``r`` of a blob sending ``sent`` of a fragment's ``numel``
    elements: ``⌊log2(ln 2 · numel / sent)⌋`` in integers, 0 to ``MAX_SHIFT``."""
    if sent <= 0:
        return 0
    ratio = numel * 693 // (sent * 1000)
    return min(MAX_SHIFT, max(0, ratio.bit_length() - 1))


def high_bytes(sent: int, numel: int, r: int) -> int:
    """The most bytes ``high`` takes for ``sent`` elements of a fragment of ``numel``: one
    stop bit each and the quotients, whose sum is at most ``numel >> r`` (the gaps of a
    chunk add up to less than its length)."""
    return -(-(sent + (numel >> r)) // 8)


def pack_fields(values: Tensor, r: int) -> bytes:
    """``values`` (non-negative, below ``2^r``) in ``r`` bits each, low bits first, the last
    byte's padding bits zero: the layout of ``low`` and of a ``topk`` blob's codes."""
    if r == 0 or values.numel() == 0:
        return b""
    if 8 % r == 0:
        per = 8 // r
        padded = torch.nn.functional.pad(values.to(torch.uint8), (0, -values.numel() % per))
        packed = torch.zeros(padded.numel() // per, dtype=torch.uint8)
        for j, column in enumerate(padded.view(-1, per).unbind(1)):
            packed |= column << (r * j)
        return packed.numpy().tobytes()
    weights = torch.arange(r, dtype=torch.int64)
    bits = values.to(torch.int64).unsqueeze(1).bitwise_right_shift(weights).bitwise_and(1)
    return np.packbits(bits.to(torch.uint8).numpy().reshape(-1), bitorder="little").tobytes()


def read_fields(data: bytes, at: int, first: int, count: int, r: int) -> Tensor:
    """``count`` fields of ``r`` bits (at most ``MAX_SHIFT``) from the ``first`` on, of the
    stream ``pack_fields`` wrote at byte ``at`` of ``data``: int64."""
    if r == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64)
    lo, hi = first * r // 8, -(-(first + count) * r // 8)
    if 8 % r == 0:
        per, mask = 8 // r, (1 << r) - 1
        packed = torch.from_numpy(np.frombuffer(data, np.uint8, hi - lo, at + lo).copy())
        fields = torch.stack([(packed >> (r * j)) & mask for j in range(per)], dim=1)
        return fields.reshape(-1)[first - lo * per : first - lo * per + count].to(torch.int64)
    raw = np.zeros(hi - lo + 2, dtype=np.int64)
    raw[: hi - lo] = np.frombuffer(data, np.uint8, hi - lo, at + lo)
    place = (first + np.arange(count, dtype=np.int64)) * r - 8 * lo
    byte = place >> 3
    # A field of at most 16 bits starting anywhere in a byte lies within three bytes.
    window = raw[byte] | (raw[byte + 1] << 8) | (raw[byte + 2] << 16)
    return torch.from_numpy((window >> (place & 7)) & ((1 << r) - 1))


def _starts(counts: Tensor) -> Tensor:
    """Where each chunk's elements begin among them (``counts`` each)."""
    return torch.cumsum(counts, 0) - counts


def write(counts: Tensor, offsets: Tensor, r: int) -> tuple[bytes, bytes]:
    """``(high, low)`` of ``offsets`` (each chunk's, ``counts`` of them, strictly increasing
    within it), cut at ``r`` bits."""
    n = offsets.numel()
    if n == 0:
        return b"", b""
    offsets = offsets.to(torch.int64)
    counts = counts.to(torch.int64)
    previous = torch.cat([torch.tensor([-1]), offsets[:-1]])
    previous[_starts(counts)[counts > 0]] = -1
    gaps = offsets - previous - 1
    stops = torch.cumsum(gaps.bitwise_right_shift(r) + 1, 0) - 1
    bits = np.zeros(int(stops[-1]) + 1, dtype=np.uint8)
    bits[stops.numpy()] = 1
    high = np.packbits(bits, bitorder="little").tobytes()
    return high, pack_fields(gaps.bitwise_and((1 << r) - 1), r)


def read_offsets(
    data: bytes, streams: Streams, bit: int, first: int, counts: Tensor, span: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(chunk of each, offset, end)`` of the elements ``first, first + 1, …`` that chunks
    of ``counts`` elements send: its chunk counted from the first, its offset in it (not
    checked against the chunk's length), and the bit of ``high`` after its code. ``bit`` is
    where the first code starts in ``high``; no code is read past ``bit + span``. Raises
    ``CodecError`` when fewer codes end there than there are elements."""
    counts = counts.to(torch.int64)
    n = int(counts.sum())
    chunk_of = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    if n == 0:
        return chunk_of, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    end = min(bit + span, 8 * (streams.high_end - streams.high_at))
    lo, hi = bit // 8, -(-end // 8)
    raw = np.frombuffer(data, np.uint8, max(0, hi - lo), streams.high_at + lo)
    found = np.flatnonzero(np.unpackbits(raw, bitorder="little")[bit - 8 * lo : end - 8 * lo])
    if found.size < n:
        raise CodecError(
            f"the index codes end after {found.size} of {n} elements within the bits their "
            "chunks can take: a hostile or damaged blob"
        )
    stops = torch.from_numpy(found[:n].astype(np.int64))
    quotients = torch.diff(stops, prepend=torch.tensor([-1])) - 1
    steps = quotients.bitwise_left_shift(streams.r)
    steps.bitwise_or_(read_fields(data, streams.low_at, first, n, streams.r)).add_(1)
    total = torch.cumsum(steps, 0)
    before = torch.cat([torch.zeros(1, dtype=torch.int64), total])[_starts(counts)]
    return chunk_of, total - before[chunk_of] - 1, stops + bit + 1
