"""The ``topk`` encoding: chunked Top-k with low-bit values (the SparseLoCo class of
pseudo-gradient compression), and ``SparseBlob``, a checked ``topk`` blob decoded a piece at
a time.

Of each chunk of ``chunk`` elements (never straddling two parameters) the encoder selects the
``⌈density·n⌉`` largest magnitudes (``density`` None: every non-zero element, as an update
does) and sends those whose decoded value ``x̂`` has their sign and is within a factor two
of them. What is not sent, ``r = x − x̂``, is exact in fp32 (Sterbenz), so ``x̂ + r = x`` bit
for bit (``protocol.feedback`` keeps ``r``). A chunk holding NaN or ±Inf sends its selection
as NaN. The sent elements' offsets in their chunks travel as Golomb–Rice coded gaps
(``protocol.gaps``). The formulas and the blob's tensors: docs/protocol.md, "The ``topk``
encoding and error feedback".

Opening a blob checks every count, index code, scale and padding bit against the spec
before decoding or allocating anything of the declared size, so one content has one blob;
anything else raises ``CodecError``.

Pure: no I/O; the caller's thread. Memory: the blob and a few pieces of
``pieces.CHUNK_ELEMENTS`` elements (encoding keeps only the selection of each piece).
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import torch
from torch import Tensor

from gradientmail.errors import CodecError
from gradientmail.protocol import gaps, pieces
from gradientmail.protocol.framing import Expected, Meta, check_header, check_offsets, write_header
from gradientmail.protocol.records import Encoding, FragmentSpec, RunConfig

__all__ = [
    "BITS",
    "MAX_CHUNK",
    "TOPK",
    "SparseBlob",
    "Sparsity",
    "delta_sparsity",
    "encode_sparse",
    "open_sparse",
    "sent_as",
    "update_sparsity",
]

TOPK: Final = "topk"
BITS: Final = (1, 2, 4, 8)
"""The value widths a ``topk`` blob may have (a byte holds a whole number of codes)."""
MAX_CHUNK: Final = 1 << 16
"""The largest chunk: an index within it fits 16 bits."""
UPDATE_BITS: Final = 4
"""The value width of a ``topk`` update (every non-zero element of ``U`` but those under
1/30 of their chunk's largest, which no 4-bit code carries; docs/protocol.md, "The ``topk``
encoding and error feedback", gives the measurement that chose it)."""
FINAL_DELTA: Final = "int4"
"""What a ``topk`` run's final snapshots are sent in (``sent_as``)."""
FINAL_UPDATE: Final = "int4"
"""What the updates of a ``topk`` run's final rounds are sent in (``sent_as``)."""


@dataclass(frozen=True, slots=True)
class Sparsity:
    """How a ``topk`` blob selects and stores: chunks of ``chunk`` elements, ``bits`` per
    value, the ``density`` of each chunk selected (None: every non-zero element). Raises
    ``ValueError`` for values out of range."""

    chunk: int
    bits: int
    density: float | None

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"topk chunk must be in [1, {MAX_CHUNK}], got {self.chunk!r}")
        if self.bits not in BITS:
            raise ValueError(f"topk bits must be one of {BITS}, got {self.bits!r}")
        if self.density is not None and not 0 < self.density <= 1:
            raise ValueError(f"topk density must be in (0, 1], got {self.density!r}")


def delta_sparsity(config: RunConfig) -> Sparsity:
    """A learner's ``topk`` delta under ``config``: ``topk_density`` of each chunk at
    ``topk_bits``."""
    return Sparsity(config.topk_chunk, config.topk_bits, config.topk_density)


def update_sparsity(config: RunConfig) -> Sparsity:
    """A ``topk`` update under ``config``: every non-zero element at ``UPDATE_BITS``."""
    return Sparsity(config.topk_chunk, UPDATE_BITS, None)


def sent_as(config: RunConfig, blob: Literal["delta", "update"], *, final: bool) -> Encoding:
    """The encoding a ``blob`` of a run under ``config`` goes out in: the configured one,
    except that a ``topk`` run's final snapshots and the updates of its final rounds are
    dense (``FINAL_DELTA``, ``FINAL_UPDATE``). Between rounds a ``topk`` learner's weights
    hold what its deltas have not sent (``protocol.feedback``); its final snapshot sends all
    of it, so the final round commits the mean of the closing learners' models, as under a
    dense encoding."""
    encoding = config.delta_encoding if blob == "delta" else config.update_encoding
    if not final or encoding != TOPK:
        return encoding
    return FINAL_DELTA if blob == "delta" else FINAL_UPDATE


def _values(codes: Tensor, scales: Tensor, bits: int) -> Tensor:
    """The decoded values ``(2c − (L − 1))·s``: the one computation the encoder and the
    decoder share, so the encoder knows the bits it sends."""
    return codes.to(torch.float32).mul(2).sub((1 << bits) - 1).mul(scales)


@dataclass(frozen=True, slots=True)
class _Piece:
    counts: Tensor
    scales: Tensor
    indices: Tensor
    codes: Tensor


def _selected(rows: Tensor, last: int, density: float | None) -> Tensor:
    """The mask of each chunk's selection (``last``: the last chunk's length)."""
    if density is None:
        return rows != 0
    magnitude = torch.nan_to_num(rows.abs(), nan=math.inf)
    chunk = rows.shape[1]
    mask = torch.zeros_like(rows, dtype=torch.bool)
    top = torch.topk(magnitude, min(chunk, math.ceil(density * chunk)), dim=1).indices
    mask.scatter_(1, top, True)
    if last < chunk:
        mask[-1] = False
        k = min(last, math.ceil(density * last))
        mask[-1, torch.topk(magnitude[-1, :last], k).indices] = True
    return mask


def _encode_piece(piece: Tensor, sparsity: Sparsity) -> _Piece:
    """A chunk-aligned piece of one parameter: what of it is sent."""
    chunk, levels = sparsity.chunk, (1 << sparsity.bits) - 1
    count = -(-piece.numel() // chunk)
    rows = torch.nn.functional.pad(piece, (0, count * chunk - piece.numel())).view(count, chunk)
    selected = _selected(rows, piece.numel() - (count - 1) * chunk, sparsity.density)
    magnitude = rows.abs()
    finite = torch.isfinite(rows).all(dim=1)
    scales = torch.where(selected, magnitude, 0.0).amax(dim=1).div_(levels)
    scales = torch.where(finite, scales, math.nan)
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    codes = rows.div(divisor).add_(levels).div_(2).round_().clamp_(0, levels)
    codes = torch.where(finite.unsqueeze(1), codes, 0.0).to(torch.uint8)
    sent = _values(codes, scales.unsqueeze(1), sparsity.bits)
    keep = (
        selected
        & (rows != 0)
        & (torch.sign(sent) == torch.sign(rows))
        & (sent.abs() <= magnitude * 2)
        & (magnitude <= sent.abs() * 2)
    )
    keep = torch.where(finite.unsqueeze(1), keep, selected)
    counts = keep.sum(dim=1, dtype=torch.int32)
    where = keep.nonzero()
    return _Piece(
        counts=counts,
        scales=torch.where(counts > 0, scales, 0.0),
        indices=where[:, 1].to(torch.int32),
        codes=codes[keep],
    )


def encode_sparse(
    pieces: Iterator[Tensor], spec: FragmentSpec, sparsity: Sparsity, meta: Meta
) -> bytes:
    """The ``topk`` blob of ``pieces`` (fp32, each parameter's in order, every piece but a
    parameter's last a whole number of chunks: ``pieces.flat_pieces``), whose metadata is
    ``meta`` (the codec's, naming the chunk and bits). The same pieces always give the same
    bytes."""
    found = [_encode_piece(piece, sparsity) for piece in pieces]
    counts = torch.cat([p.counts for p in found]) if found else torch.empty(0, dtype=torch.int32)
    scales = torch.cat([p.scales for p in found]) if found else torch.empty(0)
    indices = torch.cat([p.indices for p in found]) if found else torch.empty(0, dtype=torch.int32)
    codes = torch.cat([p.codes for p in found]) if found else torch.empty(0, dtype=torch.uint8)
    r = gaps.shift(indices.numel(), sum(param.numel for param in spec.params))
    high, low = gaps.write(counts, indices, r)
    expected = _expected(spec, sparsity.chunk, sparsity.bits, indices.numel(), r, len(high))
    if tuple(counts.shape) != expected["counts"][1]:
        raise ValueError("the pieces are not the fragment's, a whole number of chunks each")
    payload = [
        counts.numpy().astype("<i4").tobytes(),
        scales.numpy().astype("<f4").tobytes(),
        high,
        low,
        gaps.pack_fields(codes, sparsity.bits),
    ]
    return write_header(meta, expected)[0] + b"".join(payload)


def _chunks(spec: FragmentSpec, chunk: int) -> list[int]:
    """Each parameter's number of chunks."""
    return [-(-param.numel // chunk) for param in spec.params]


def _expected(spec: FragmentSpec, chunk: int, bits: int, sent: int, r: int, high: int) -> Expected:
    """Every tensor of a blob of ``spec`` sending ``sent`` elements whose index codes, cut
    at ``r`` bits, take ``high`` bytes, in its stored order."""
    count = sum(_chunks(spec, chunk))
    return {
        "counts": ("I32", (count,)),
        "scales": ("F32", (count,)),
        "high": ("U8", (high,)),
        "low": ("U8", (-(-sent * r // 8),)),
        "codes": ("U8", (-(-sent * bits // 8),)),
    }


def _counts(data: bytes, header: dict[str, Any], start: int, lengths: Tensor) -> Tensor:
    """The chunks' counts, the blob's first tensor, read and checked against the chunks'
    ``lengths`` before anything else is: their sum is what the other tensors' sizes are
    checked against."""
    entry = header.get("counts")
    if not isinstance(entry, dict):
        raise CodecError("a topk blob needs its 'counts' tensor", reason="shape")
    if entry.get("shape") != [lengths.numel()]:
        raise CodecError(
            f"counts: shape {entry.get('shape')!r}, expected [{lengths.numel()}]", reason="shape"
        )
    size = 4 * lengths.numel()
    if entry.get("dtype") != "I32" or entry.get("data_offsets") != [0, size]:
        raise CodecError("malformed safetensors data: a topk blob's counts come first, as I32")
    if len(data) - start < size:
        raise CodecError("malformed safetensors data: the blob ends within its counts")
    counts = torch.from_numpy(np.frombuffer(data, "<i4", lengths.numel(), start).astype(np.int64))
    if bool(((counts < 0) | (counts > lengths)).any()):
        raise CodecError("the chunks' counts do not fit: each must be within its chunk")
    return counts


def _declared(header: dict[str, Any], sent: int, numel: int, r: int) -> int:
    """The bytes of index codes the header declares, checked against the most ``sent``
    elements of ``numel`` cut at ``r`` bits can take before anything of that size is
    read."""
    entry = header.get("high")
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int):
        raise CodecError("a topk blob needs a flat 'high' tensor", reason="shape")
    most = gaps.high_bytes(sent, numel, r)
    if not 0 <= shape[0] <= most:
        raise CodecError(
            f"the blob declares {shape[0]} bytes of index codes, its {sent} elements take at "
            f"most {most}: a hostile or damaged index set"
        )
    return shape[0]


def open_sparse(
    data: bytes, header: dict[str, Any], start: int, spec: FragmentSpec, chunk: int, bits: int
) -> "SparseBlob":
    """``data``, whose safetensors ``header`` (its data from byte ``start``) the codec has
    read and whose metadata it has checked against ``spec`` (a ``topk`` blob of ``chunk``
    and ``bits``), checked in full (see the module docstring) without decoding it. Raises
    ``CodecError`` naming what is wrong."""
    if not 1 <= chunk <= MAX_CHUNK or bits not in BITS:
        raise CodecError(f"a topk blob of chunk {chunk} and {bits} bits: out of range")
    lengths = _lengths(spec, chunk)
    counts = _counts(data, header, start, lengths)
    sent, numel, count = int(counts.sum()), int(lengths.sum()), lengths.numel()
    r = gaps.shift(sent, numel)
    expected = _expected(spec, chunk, bits, sent, r, _declared(header, sent, numel, r))
    check_header(header, expected)
    check_offsets(header, expected, len(data) - start)
    scales = torch.from_numpy(np.frombuffer(data, "<f4", count, start + 4 * count).copy())
    if bool((scales < 0).any()) or bool(torch.isinf(scales).any()):
        raise CodecError("a chunk scale is negative or infinite")
    if bool((scales[counts == 0] != 0).any()):
        raise CodecError("a chunk that sends nothing has a non-zero scale")
    high_at = start + 8 * count
    low_at = high_at + expected["high"][1][0]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    streams = gaps.Streams(high_at, low_at, low_at, r)
    starts = _index(data, streams, offsets, lengths, chunk)
    codes_at = low_at + expected["low"][1][0]
    _check_padding(data, low_at, sent * r, "index")
    _check_padding(data, codes_at, sent * bits, "code")
    return SparseBlob(
        spec=spec,
        chunk=chunk,
        bits=bits,
        data=data,
        offsets=offsets,
        scales=scales,
        first_chunk=tuple(np.cumsum([0, *_chunks(spec, chunk)]).tolist()),
        streams=streams,
        starts=starts,
        codes_at=codes_at,
    )


def _index(
    data: bytes, streams: gaps.Streams, offsets: Tensor, lengths: Tensor, chunk: int
) -> Tensor:
    """Where each chunk's index codes start in ``high`` (and where the last ends), after
    checking every offset inside its chunk and no byte or bit of ``high`` after the last
    code. Raises ``CodecError``."""
    starts = torch.empty(lengths.numel() + 1, dtype=torch.int64)
    bit = 0
    step = max(1, pieces.CHUNK_ELEMENTS // chunk)
    for first, last in pieces.chunk_ranges(lengths.numel(), step):
        counts = offsets[first + 1 : last + 1] - offsets[first:last]
        span = int(counts.sum()) + (int(lengths[first:last].sum()) >> streams.r)
        chunk_of, index, ends = gaps.read_offsets(
            data, streams, bit, int(offsets[first]), counts, span
        )
        if bool((index >= lengths[first:last][chunk_of]).any()):
            raise CodecError("an index lies outside its chunk: a hostile or damaged blob")
        ends = torch.cat([torch.tensor([bit]), ends])
        starts[first:last] = ends[offsets[first:last] - offsets[first]]
        bit = int(ends[-1])
    starts[-1] = bit
    if -(-bit // 8) != streams.high_end - streams.high_at:
        raise CodecError("the index codes are followed by bytes that belong to none")
    _check_padding(data, streams.high_at, bit, "index")
    return starts


def _check_padding(data: bytes, at: int, used: int, what: str) -> None:
    """The bits of the byte after the ``used`` bits of the stream at ``at`` are zero."""
    if used % 8 and data[at + used // 8] >> (used % 8):
        raise CodecError(f"the padding bits after the last {what} code are not zero")


def _lengths(spec: FragmentSpec, chunk: int) -> Tensor:
    """The length of every chunk of the fragment, in order."""
    lengths = []
    for param in spec.params:
        full, rest = divmod(param.numel, chunk)
        lengths.extend([chunk] * full + ([rest] if rest else []))
    return torch.tensor(lengths, dtype=torch.int64)


@dataclass(frozen=True, eq=False)
class SparseBlob:
    """A ``topk`` blob checked against its spec (``open_sparse``), decoded on demand a piece
    at a time (``piece``). Holds the blob's bytes, one scale and one offset per chunk."""

    spec: FragmentSpec
    chunk: int
    bits: int
    data: bytes
    offsets: Tensor
    scales: Tensor
    first_chunk: tuple[int, ...]
    streams: gaps.Streams
    starts: Tensor
    codes_at: int

    def _sent(self, first: int, last: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(chunk of each, index, code)`` of the elements chunks ``[first, last)`` send
        (the chunk counted from ``first``)."""
        p0, p1 = int(self.offsets[first]), int(self.offsets[last])
        counts = self.offsets[first + 1 : last + 1] - self.offsets[first:last]
        bit, end = int(self.starts[first]), int(self.starts[last])
        chunk_of, index, _ = gaps.read_offsets(self.data, self.streams, bit, p0, counts, end - bit)
        codes = gaps.read_fields(self.data, self.codes_at, p0, p1 - p0, self.bits)
        return chunk_of, index, codes

    def piece(self, index: int, start: int, end: int) -> Tensor:
        """Elements ``[start, end)`` of the flattened parameter ``index``: a fresh fp32
        CPU tensor."""
        if end <= start:
            return torch.empty(0, dtype=torch.float32)
        c0, c1 = start // self.chunk, -(-end // self.chunk)
        first = self.first_chunk[index] + c0
        chunk_of, offset, codes = self._sent(first, first + c1 - c0)
        out = torch.zeros((c1 - c0) * self.chunk, dtype=torch.float32)
        scales = self.scales[first : first + c1 - c0][chunk_of]
        out[chunk_of * self.chunk + offset] = _values(codes, scales, self.bits)
        return out[start - c0 * self.chunk : end - c0 * self.chunk]
