"""Fragments a piece at a time: the quantizer, the int4 packer and ``FragmentBlob``, a
checked blob decoded piece by piece, which ``codec`` builds on.

A piece is ``CHUNK_ELEMENTS`` elements of one parameter (its last piece shorter); whatever
works a piece at a time holds its inputs and outputs plus a few pieces, never a whole
temporary copy of a fragment. Quantized pieces start on a block boundary of their
parameter, so each block is quantized exactly as a whole-tensor pass quantizes it; any
``[start, end)`` of a parameter decodes, block-aligned inside. Pure: no I/O, the caller's
thread.
"""

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeAlias

import torch
from torch import Tensor

from gradientmail.protocol.records import Encoding, FragmentSpec, ParamSpec

__all__ = [
    "CHUNK_ELEMENTS",
    "BlobView",
    "FragmentBlob",
    "PartedBlob",
    "all_finite",
    "chunk_ranges",
    "row_count",
    "row_width",
]

LEVELS: Final = {"int8": 127, "int4": 7}
STORED_DTYPE: Final = {"fp32": "F32", "bf16": "BF16", "int8": "I8", "int4": "U8"}
TORCH_DTYPE: Final = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int4": torch.uint8,
}
ITEMSIZE: Final = {"F32": 4, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "U16": 2}
CHUNK_ELEMENTS = 1 << 22
"""The elements encoded, decoded or aggregated at a time (16 MiB as fp32): what bounds the
working memory beyond the blobs and the tensors themselves."""


def chunk_ranges(numel: int, step: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``numel`` elements, ``step`` (``CHUNK_ELEMENTS``)
    at a time."""
    step = CHUNK_ELEMENTS if step is None else step
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def all_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite, a piece at a time: ``x − x`` is 0 for
    a finite ``x`` and NaN for NaN or ±Inf, and a NaN makes its piece's sum NaN. The
    answer of ``torch.isfinite(tensor).all()``, which on CPU costs many times more."""
    flat = tensor.detach().reshape(-1)
    for start, end in chunk_ranges(flat.numel()):
        piece = flat[start:end]
        if math.isnan(float((piece - piece).sum())):
            return False
    return True


def quantize(flat: Tensor, levels: int, block_size: int) -> tuple[Tensor, Tensor]:
    """``(q, scales)`` of a flat fp32 tensor: q as int8 in [-levels, levels]."""
    numel = flat.numel()
    blocks = -(-numel // block_size)
    padded = (
        flat
        if numel == blocks * block_size
        else torch.nn.functional.pad(flat, (0, blocks * block_size - numel))
    )
    rows = padded.view(blocks, block_size)
    scales = rows.abs().amax(dim=1).div_(levels)
    finite = torch.isfinite(scales)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = rows.div(divisor.unsqueeze(1)).round_().clamp_(-levels, levels)
    if not bool(finite.all()):
        # A block with NaN/Inf keeps q = 0 and a NaN scale: it decodes as all NaN.
        q = torch.where(finite.unsqueeze(1), q, torch.zeros_like(q))
        scales = torch.where(finite, scales, torch.full_like(scales, math.nan))
    return q.to(torch.int8).reshape(-1)[:numel], scales


def target(view: memoryview, at: tuple[int, int], dtype: torch.dtype) -> Tensor | None:
    """The bytes ``at`` of ``view`` as a flat tensor of ``dtype`` written in place (None
    when empty: torch cannot view an empty buffer)."""
    if at[1] == at[0]:
        return None
    return torch.frombuffer(view[at[0] : at[1]], dtype=dtype)


class Packer:
    """int4 nibbles packed two to a byte (low first) over the whole fragment, chunk by
    chunk: a chunk of odd length leaves its last nibble for the next."""

    def __init__(self, out: Tensor | None) -> None:
        self.out = out
        self.at = 0
        self.carry: Tensor | None = None

    def add(self, q: Tensor) -> None:
        nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
        if self.carry is not None:
            nibbles = torch.cat([self.carry, nibbles])
        self.carry = nibbles[-1:].clone() if nibbles.numel() % 2 else None
        self._put(nibbles[: nibbles.numel() - nibbles.numel() % 2])

    def finish(self) -> None:
        if self.carry is not None:
            self._put(torch.cat([self.carry, torch.full((1,), 8, dtype=torch.uint8)]))

    def _put(self, nibbles: Tensor) -> None:
        if not nibbles.numel():
            return
        assert self.out is not None
        pairs = nibbles.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        self.out[self.at : self.at + packed.numel()].copy_(packed)
        self.at += packed.numel()


def flat_pieces(
    tensors: Sequence[Tensor], minus: Sequence[Tensor] | None, step: int
) -> Iterator[Tensor]:
    """Each tensor (less its counterpart in ``minus``) as fp32 CPU pieces of ``step``
    elements (a parameter's last piece shorter), in order; inputs are never modified."""
    for i, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        other = None if minus is None else minus[i].detach().reshape(-1)
        for start, end in chunk_ranges(flat.numel(), step):
            piece = flat[start:end].to(device="cpu", dtype=torch.float32)
            if other is not None:
                piece = piece - other[start:end].to(device="cpu", dtype=torch.float32)
            yield piece


def quantize_into(
    chunks: Iterator[Tensor],
    encoding: Encoding,
    block_size: int,
    values: Tensor | None,
    scales: Tensor | None,
) -> None:
    """Quantize the block-aligned ``chunks`` into the blob's ``values`` and ``scales``."""
    packer = Packer(values) if encoding == "int4" else None
    at = blocks = 0
    for piece in chunks:
        q, piece_scales = quantize(piece, LEVELS[encoding], block_size)
        if packer is not None:
            packer.add(q)
        elif values is not None:
            values[at : at + q.numel()].copy_(q)
        if scales is not None:
            scales[blocks : blocks + piece_scales.numel()].copy_(piece_scales)
        at += q.numel()
        blocks += piece_scales.numel()
    if packer is not None:
        packer.finish()


def dequantize(q: Tensor, scales: Tensor, numel: int, block_size: int) -> Tensor:
    blocks = scales.numel()
    values = q.to(torch.float32)
    if numel != blocks * block_size:
        values = torch.nn.functional.pad(values, (0, blocks * block_size - numel))
    return (values.view(blocks, block_size) * scales.unsqueeze(1)).reshape(-1)[:numel]


def unpack4(packed: Tensor, first: int, count: int) -> Tensor:
    """``count`` int4 values from the nibble ``first`` of ``packed`` on (0: its low one)."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[first : first + count]
    return nibbles.to(torch.int8) - 8


@dataclass(frozen=True, eq=False)
class FragmentBlob:
    """A fragment blob checked against its spec (``open_fragment``), decoded on demand a
    piece at a time (``piece``): its tensors never exist whole unless the caller builds
    them. Holds the blob's bytes and its block scales (fp32, one per block)."""

    spec: FragmentSpec
    encoding: Encoding
    block_size: int
    data: bytes
    values_at: int
    scales: Tensor | None
    starts: tuple[int, ...]
    block_starts: tuple[int, ...]

    def piece(self, index: int, start: int, end: int) -> Tensor:
        """Elements ``[start, end)`` of the flattened parameter ``index``: a fresh fp32
        CPU tensor."""
        first = self.starts[index] + start
        count = end - start
        if count <= 0:
            return torch.empty(0, dtype=torch.float32)
        if self.encoding in ("fp32", "bf16"):
            return self._stored(first, count).to(torch.float32)
        size = self.block_size
        lo, hi = start // size * size, min(-(-end // size) * size, self.spec.params[index].numel)
        q = self._q(self.starts[index] + lo, hi - lo)
        assert self.scales is not None
        blocks = self.block_starts[index] + lo // size
        scales = self.scales[blocks : blocks + -(-(hi - lo) // size)]
        return dequantize(q, scales, hi - lo, size)[start - lo : end - lo]

    def _stored(self, first: int, count: int) -> Tensor:
        """The stored fp32/bf16/int8 elements ``[first, first + count)`` of the fragment."""
        dtype = TORCH_DTYPE[self.encoding]
        item = ITEMSIZE[STORED_DTYPE[self.encoding]]
        at = self.values_at + first * item
        return torch.frombuffer(
            bytearray(memoryview(self.data)[at : at + count * item]), dtype=dtype
        )

    def _q(self, first: int, count: int) -> Tensor:
        """The quantized values ``[first, first + count)`` of the fragment, as int8."""
        if self.encoding == "int8":
            return self._stored(first, count)
        lo, hi = first // 2, -(-(first + count) // 2)
        packed = torch.frombuffer(
            bytearray(memoryview(self.data)[self.values_at + lo : self.values_at + hi]),
            dtype=torch.uint8,
        )
        return unpack4(packed, first % 2, count)


def row_width(param: ParamSpec) -> int:
    """The elements of one row (of the first dimension) of ``param``: a 0-dimensional
    parameter is one row of one element."""
    return math.prod(param.shape[1:]) if param.shape else 1


def row_count(param: ParamSpec) -> int:
    """The rows of ``param``'s first dimension (1 for a 0-dimensional parameter)."""
    return param.shape[0] if param.shape else 1


class Part(Protocol):
    """A checked blob of a part's rows: ``FragmentBlob`` or ``sparse.SparseBlob``."""

    def piece(self, index: int, start: int, end: int) -> Tensor: ...


@dataclass(frozen=True, eq=False)
class PartedBlob:
    """A delta in parts (``records.SnapshotPart``), read as one fragment of ``spec``: part
    ``k`` is ``parts[k]``, a checked blob of the rows ``rows[k][i]`` of each parameter
    ``i``; the parts hold every row once, in order (``layout.check_parts``). ``piece`` reads
    across them, so the aggregation treats it as it treats one ``FragmentBlob``."""

    spec: FragmentSpec
    parts: tuple[Part, ...]
    rows: tuple[tuple[tuple[int, int], ...], ...]

    def piece(self, index: int, start: int, end: int) -> Tensor:
        """Elements ``[start, end)`` of the flattened parameter ``index``: a fresh fp32
        CPU tensor."""
        width = row_width(self.spec.params[index])
        found = []
        for blob, rows in zip(self.parts, self.rows, strict=True):
            first, last = rows[index][0] * width, rows[index][1] * width
            lo, hi = max(start, first), min(end, last)
            if lo < hi:
                found.append(blob.piece(index, lo - first, hi - first))
        if not found:
            return torch.empty(0, dtype=torch.float32)
        return found[0] if len(found) == 1 else torch.cat(found)


BlobView: TypeAlias = FragmentBlob | PartedBlob
"""A checked delta decoded a piece at a time: one blob, or a snapshot's parts."""
