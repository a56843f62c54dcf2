"""Blobs and the tensor codec: content addresses and the bytes a fragment's tensors travel as.

A blob is addressed by the sha256 of its bytes (``digest``); whoever reads one checks the
bytes against the address it followed (``verify``: ``CorruptBlob`` on a mismatch).

A fragment's tensors travel as one safetensors file (never pickle, never ``torch.load``) of
at most two flat tensors, ``values`` and, for int8 and int4, ``scales``, each concatenated in
``FragmentSpec.params`` order. One metadata key, ``gradientmail``, names the format,
encoding, block size, fragment and parameters' digest (``spec_digest``), so a blob never
decodes into another fragment's parameters and equal tensors encode to equal bytes.
Encodings: ``fp32`` (exact), ``bf16`` (within half a bf16 step), ``int8`` and ``int4``
(blockwise absmax per parameter, within ``s / 2``); a block holding NaN or ±Inf decodes as
all NaN. The layout and the bounds: docs/protocol.md, "Blobs and the tensor codec".

Decoding returns fresh fp32 CPU tensors of the spec's shapes, the caller's to keep or
mutate, after checking everything against the spec; anything else raises ``CodecError``,
whose ``reason`` is ``shape`` (well formed, for another model or fragment) or ``corrupt``.

Pure: no I/O. Encoding and decoding run on whatever thread calls them; both are vectorized
torch operations, one pass over each parameter.
"""

import hashlib
import struct
from collections.abc import Sequence
from typing import Final, get_args

import torch
from torch import Tensor

from gradientmail._bytes import Filling
from gradientmail.errors import CodecError, CorruptBlob
from gradientmail.protocol import pieces, sparse
from gradientmail.protocol.framing import (
    FRAGMENT_FORMAT,
    MAX_HEADER_BYTES,
    Meta,
    read_header,
    read_meta,
    spec_digest,
    write_header,
)
from gradientmail.protocol.layout import (
    HEAD_BYTES,
    SCALES,
    VALUES,
    Rows,
    blob_layout,
    check_parts,
    decode_rows,
    expected_tensors,
    part_spec,
    row_spans,
)
from gradientmail.protocol.pieces import (
    ITEMSIZE,
    LEVELS,
    TORCH_DTYPE,
    BlobView,
    FragmentBlob,
    PartedBlob,
    chunk_ranges,
    quantize_into,
    row_width,
    target,
)
from gradientmail.protocol.records import (
    Encoding,
    FragmentSpec,
    Snapshot,
)

# HEAD_BYTES, Rows, blob_layout, decode_rows, row_spans and part_spec are protocol.layout's,
# importable here too for the readers that take them with the codec.
__all__ = [
    "ENCODINGS",
    "FRAGMENT_FORMAT",
    "HEAD_BYTES",
    "MAX_HEADER_BYTES",
    "CodecError",
    "FragmentBlob",
    "PartedBlob",
    "Rows",
    "blob_layout",
    "decode_fragment",
    "decode_rows",
    "digest",
    "encode_fragment",
    "open_delta",
    "open_fragment",
    "open_parts",
    "part_spec",
    "row_spans",
    "rows_of",
    "spec_digest",
    "tensors_of",
    "verify",
]

ENCODINGS: Final[tuple[Encoding, ...]] = tuple(e for e in get_args(Encoding) if e != sparse.TOPK)
"""The dense encodings; ``topk`` blobs are ``protocol.sparse``'s."""


def digest(data: bytes) -> str:
    """The sha256 of ``data`` as 64 lowercase hex digits: the blob's address."""
    return hashlib.sha256(data).hexdigest()


def verify(data: bytes, sha256: str) -> bytes:
    """Return ``data`` if it hashes to ``sha256``; else raise ``CorruptBlob`` naming both."""
    actual = digest(data)
    if actual != sha256:
        raise CorruptBlob(
            f"blob {sha256} is corrupt: its {len(data)} bytes hash to {actual}; "
            "the store holds damaged or foreign content under that key"
        )
    return data


def _check_tensors(tensors: Sequence[Tensor], spec: FragmentSpec) -> None:
    if len(tensors) != len(spec.params):
        raise ValueError(
            f"fragment {spec.index} has {len(spec.params)} parameters, got {len(tensors)} tensors"
        )
    for tensor, param in zip(tensors, spec.params, strict=True):
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise ValueError(f"{param.name}: expected a floating-point tensor, got {tensor!r:.80}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{param.name}: shape {tuple(tensor.shape)} differs from the fragment's "
                f"{tuple(param.shape)}"
            )


def _layout(
    spec: FragmentSpec, encoding: Encoding, block_size: int, meta: Meta
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The blob's header and each tensor's ``[start, end)`` in the data after it: the bytes
    ``safetensors.torch.save`` writes, with the tensors ordered as it orders them (larger
    elements first, then by name)."""
    expected = expected_tensors(spec, encoding, block_size)
    names = sorted(expected, key=lambda name: (-ITEMSIZE[expected[name][0]], name))
    return write_header(meta, {name: expected[name] for name in names})


def encode_fragment(
    tensors: Sequence[Tensor],
    spec: FragmentSpec,
    encoding: Encoding,
    *,
    block_size: int,
    minus: Sequence[Tensor] | None = None,
    sparsity: sparse.Sparsity | None = None,
    version: int = 0,
) -> bytes:
    """The blob of ``tensors`` (one per ``spec.params``, in order) in ``encoding``; with
    ``minus``, of ``tensors − minus`` (element by element, in fp32: a delta without its
    whole copy); ``version``: the fragment's version it belongs to (``framing.Meta``).

    Tensors may live on any device and be of any floating dtype; they are read as fp32 on the
    CPU and left untouched. The same tensors, spec, encoding and block size always give the
    same bytes. Memory: the blob itself plus a few ``pieces.CHUNK_ELEMENTS`` pieces (the blob is
    written in place, piece by piece). Raises ``ValueError`` if the tensors do not match the
    spec (count, shape, not floating point), for an unknown encoding or a ``block_size``
    below 1.
    """
    if encoding == sparse.TOPK:
        return _encode_topk(tensors, spec, sparsity, minus, version)
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}: expected one of {', '.join(ENCODINGS)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    _check_tensors(tensors, spec)
    if minus is not None:
        _check_tensors(minus, spec)
    meta = Meta(
        FRAGMENT_FORMAT, encoding, block_size, spec.index, spec_digest(spec), version=version
    )
    header, offsets = _layout(spec, encoding, block_size, meta)
    out = Filling(len(header) + max(end for _, end in offsets.values()))
    out.view[: len(header)] = header
    data = out.view[len(header) :]
    values = target(data, offsets[VALUES], TORCH_DTYPE[encoding])
    if encoding in ("fp32", "bf16"):
        at = 0
        for piece in pieces.flat_pieces(tensors, minus, pieces.CHUNK_ELEMENTS):
            assert values is not None
            values[at : at + piece.numel()].copy_(piece)
            at += piece.numel()
    else:
        quantize_into(
            pieces.flat_pieces(
                tensors, minus, max(1, pieces.CHUNK_ELEMENTS // block_size) * block_size
            ),
            encoding,
            block_size,
            values,
            target(data, offsets[SCALES], torch.float32),
        )
    del values, data
    return out.done()


def _encode_topk(
    tensors: Sequence[Tensor],
    spec: FragmentSpec,
    sparsity: sparse.Sparsity | None,
    minus: Sequence[Tensor] | None,
    version: int,
) -> bytes:
    if sparsity is None:
        raise ValueError("the topk encoding needs a sparsity (protocol.sparse.Sparsity)")
    _check_tensors(tensors, spec)
    if minus is not None:
        _check_tensors(minus, spec)
    meta = Meta(
        FRAGMENT_FORMAT,
        sparse.TOPK,
        sparsity.chunk,
        spec.index,
        spec_digest(spec),
        sparsity.bits,
        version,
    )
    step = max(1, pieces.CHUNK_ELEMENTS // sparsity.chunk) * sparsity.chunk
    return sparse.encode_sparse(pieces.flat_pieces(tensors, minus, step), spec, sparsity, meta)


def open_fragment(data: bytes, spec: FragmentSpec) -> FragmentBlob | sparse.SparseBlob:
    """``data`` as a blob of ``spec``, checked in full (framing, metadata, tensors, every
    scale and quantized value) without decoding it: its memory is the bytes' plus the
    block scales and a piece at a time.

    Raises ``CodecError`` (``reason`` ``"shape"`` or ``"corrupt"``) naming what is wrong when
    ``data`` is not a well-formed blob of this fragment.
    """
    header = read_header(data)
    meta = read_meta(header, spec)
    if meta.encoding == sparse.TOPK:
        start = 8 + struct.unpack_from("<Q", data)[0]
        return sparse.open_sparse(data, header, start, spec, meta.block_size, meta.bits)
    layout = blob_layout(data, len(data), spec)
    scales = None
    if layout.encoding in LEVELS:
        end = layout.scales_at + 4 * layout.block_starts[-1]
        raw = bytearray(memoryview(data)[layout.scales_at : end])
        scales = torch.frombuffer(raw, dtype=torch.float32) if raw else torch.empty(0)
    blob = FragmentBlob(
        spec=spec,
        encoding=layout.encoding,
        block_size=layout.block_size,
        data=data,
        values_at=layout.values_at,
        scales=scales,
        starts=layout.starts,
        block_starts=layout.block_starts,
    )
    if layout.encoding in LEVELS:
        _check_quantized(blob)
    return blob


def open_parts(datas: Sequence[bytes], spec: FragmentSpec, parts: Sequence[Rows]) -> PartedBlob:
    """The blobs ``datas`` of a delta in ``parts`` (``check_parts``), each checked in full
    as a blob of its rows (``open_fragment`` on ``part_spec``), read as one fragment of
    ``spec``. Raises ``CodecError`` (``"shape"`` for parts that do not fit ``spec``) naming
    the part that is wrong."""
    problem = check_parts(spec, parts)
    if problem is not None:
        raise CodecError(problem, reason="shape")
    blobs = []
    for k, (data, rows) in enumerate(zip(datas, parts, strict=True)):
        try:
            blobs.append(open_fragment(data, part_spec(spec, rows)))
        except CodecError as exc:
            raise CodecError(f"part {k}: {exc}", reason=exc.reason) from None
    return PartedBlob(spec, tuple(blobs), tuple(tuple(rows) for rows in parts))


def open_delta(
    datas: Sequence[bytes], snapshot: Snapshot, spec: FragmentSpec
) -> BlobView | sparse.SparseBlob:
    """``snapshot``'s delta from the bytes of its blobs (``Snapshot.blobs``, in order),
    checked: one blob (``open_fragment``) or its parts (``open_parts``). Raises
    ``CodecError`` naming what is wrong."""
    if isinstance(snapshot.parts, tuple):
        return open_parts(datas, spec, [part.rows for part in snapshot.parts])
    (data,) = datas
    return open_fragment(data, spec)


def _check_quantized(blob: FragmentBlob) -> None:
    """Every block scale finite and non-negative, every value in ``[−Q, Q]``."""
    assert blob.scales is not None
    levels = LEVELS[blob.encoding]
    for index, param in enumerate(blob.spec.params):
        scales = blob.scales[blob.block_starts[index] : blob.block_starts[index + 1]]
        if bool((scales < 0).any()) or bool(torch.isinf(scales).any()):
            raise CodecError(f"{param.name}: a block scale is negative or infinite")
        for start, end in chunk_ranges(param.numel):
            q = blob._q(blob.starts[index] + start, end - start)
            if int(q.min()) < -levels:
                raise CodecError(
                    f"{param.name}: an {blob.encoding} value is below -{levels}, outside "
                    f"[-{levels}, {levels}]"
                )


def decode_fragment(data: bytes, spec: FragmentSpec) -> list[Tensor]:
    """The tensors of ``spec`` a blob holds: fresh fp32 CPU tensors of the spec's shapes.

    Raises ``CodecError`` (``reason`` ``"shape"`` or ``"corrupt"``) naming what is wrong when
    ``data`` is not a well-formed blob of this fragment; it never returns partial results.
    Memory: the tensors plus a piece at a time (``open_fragment``).
    """
    return tensors_of(open_fragment(data, spec))


def rows_of(data: bytes, spec: FragmentSpec, rows: Rows) -> list[Tensor]:
    """The tensors of ``part_spec(spec, rows)`` from a whole blob of ``spec``, checked in
    full (``open_fragment``): the same bits as those rows of ``decode_fragment``. Raises
    ``CodecError``."""
    blob, part = open_fragment(data, spec), part_spec(spec, rows)
    return [
        blob.piece(i, start * row_width(whole), end * row_width(whole)).clone().view(p.shape)
        for i, (whole, p, (start, end)) in enumerate(
            zip(spec.params, part.params, rows, strict=True)
        )
    ]


def tensors_of(blob: BlobView | sparse.SparseBlob) -> list[Tensor]:
    """Every parameter of a checked blob (or parts), decoded: fresh fp32 CPU tensors of its
    spec's shapes."""
    spec = blob.spec
    result = []
    for index, param in enumerate(spec.params):
        out = torch.empty(param.numel, dtype=torch.float32)
        for start, end in chunk_ranges(param.numel):
            out[start:end] = blob.piece(index, start, end)
        result.append(out.view(param.shape))
    return result
