"""Where a dense blob keeps its tensors, and the rows of a fragment.

A dense blob (``protocol.codec``) holds ``values`` and, quantized, ``scales``
(``expected_tensors``). Its layout can be read from its header alone (``blob_layout``), so
a reader of some rows of a fragment (a sharded rank) fetches only the byte ranges that
hold them (``row_spans``) and decodes them (``decode_rows``), checked as the codec checks a
whole blob. A part of a fragment holds one range of rows of each parameter (``Rows``) and
is encoded as a fragment of those rows (``part_spec``); a delta's parts hold every row once,
in order (``check_parts``).

Pure: no I/O; runs on whatever thread calls it.
"""

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

import torch
from torch import Tensor

from gradientmail.errors import CodecError
from gradientmail.protocol import pieces, sparse
from gradientmail.protocol.framing import (
    MAX_HEADER_BYTES,
    check_header,
    check_offsets,
    read_header,
    read_meta,
)
from gradientmail.protocol.pieces import (
    ITEMSIZE,
    LEVELS,
    STORED_DTYPE,
    TORCH_DTYPE,
    row_count,
    row_width,
)
from gradientmail.protocol.records import Encoding, FragmentSpec, ParamSpec

__all__ = [
    "HEAD_BYTES",
    "SCALES",
    "VALUES",
    "BlobLayout",
    "Rows",
    "blob_layout",
    "check_parts",
    "decode_rows",
    "expected_tensors",
    "part_spec",
    "row_spans",
]

VALUES: Final = "values"
"""A dense blob's tensor of every parameter's stored elements, in ``spec.params`` order."""
SCALES: Final = "scales"
"""A quantized blob's tensor of every parameter's block scales, in the same order."""


def _blocks(numel: int, block_size: int) -> int:
    """The blocks of ``block_size`` elements ``numel`` elements take (the last one may be
    shorter)."""
    return -(-numel // block_size)


def expected_tensors(
    spec: FragmentSpec, encoding: Encoding, block_size: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor a blob of ``spec`` in ``encoding`` must hold: name -> (safetensors
    dtype, shape)."""
    numel = sum(param.numel for param in spec.params)
    stored = _blocks(numel, 2) if encoding == "int4" else numel
    expected: dict[str, tuple[str, tuple[int, ...]]] = {VALUES: (STORED_DTYPE[encoding], (stored,))}
    if encoding in LEVELS:
        blocks = sum(_blocks(param.numel, block_size) for param in spec.params)
        expected[SCALES] = ("F32", (blocks,))
    return expected


Rows: TypeAlias = Sequence[tuple[int, int]]
"""One ``(start, end)`` range of rows per parameter of a fragment, in ``spec.params`` order."""


def part_spec(spec: FragmentSpec, rows: Rows) -> FragmentSpec:
    """The fragment a part of ``spec`` holding ``rows`` is encoded as: the same parameters,
    each cut to its rows (``(end − start, *shape[1:])``; a 0-dimensional parameter keeps its
    shape when its one row is in, else ``(0,)``). ``rows`` must fit (``check_parts``)."""
    params = []
    for param, (start, end) in zip(spec.params, rows, strict=True):
        if param.shape:
            shape: tuple[int, ...] = (end - start, *param.shape[1:])
        else:
            shape = () if end > start else (0,)
        params.append(ParamSpec(name=param.name, shape=shape, dtype=param.dtype))
    return FragmentSpec(index=spec.index, params=tuple(params))


def check_parts(spec: FragmentSpec, parts: Sequence[Rows]) -> str | None:
    """None when ``parts`` (each one ``Rows``) hold every row of every parameter of ``spec``
    once, in order: part ``k``'s range of a parameter starts where part ``k − 1``'s ended
    (at 0 for the first) and the last part's ends at the parameter's rows. Else what is
    wrong, for the ``shape`` rejection of the snapshot."""
    count = len(spec.params)
    for k, rows in enumerate(parts):
        if len(rows) != count:
            return f"part {k} names rows of {len(rows)} parameters, the fragment has {count}"
    for index, param in enumerate(spec.params):
        at = 0
        for k, rows in enumerate(parts):
            start, end = rows[index]
            if start != at or end < start:
                return (
                    f"part {k} holds rows [{start}, {end}) of {param.name!r}, which should "
                    f"start at row {at}: the parts must hold every row once, in order"
                )
            at = end
        if at != row_count(param):
            return f"the parts hold {at} rows of {param.name!r}, which has {row_count(param)}"
    return None


HEAD_BYTES: Final = 8 + MAX_HEADER_BYTES
"""The most bytes of a blob's start its header can take (``blob_layout`` reads them)."""


@dataclass(frozen=True)
class BlobLayout:
    """Where a blob of ``spec`` keeps each parameter, read from its header alone: a reader
    of some rows (``row_spans``, ``decode_rows``) fetches only the bytes they take."""

    spec: FragmentSpec
    encoding: Encoding
    block_size: int
    values_at: int
    scales_at: int
    starts: tuple[int, ...]
    block_starts: tuple[int, ...]


def blob_layout(head: bytes, size: int, spec: FragmentSpec) -> BlobLayout:
    """The layout of a blob of ``size`` bytes whose first bytes are ``head`` (at least its
    header: ``HEAD_BYTES`` or the whole blob), checked as ``open_fragment`` checks the
    header. Raises ``CodecError``."""
    header = read_header(head)
    meta = read_meta(header, spec)
    if meta.encoding == sparse.TOPK:
        raise CodecError("a topk blob is read whole, not by rows", reason="shape")
    encoding: Encoding = meta.encoding  # type: ignore[assignment]  # checked in read_meta
    expected = expected_tensors(spec, encoding, meta.block_size)
    check_header(header, expected)
    start = 8 + struct.unpack_from("<Q", head)[0]
    check_offsets(header, expected, size - start)
    numels = [param.numel for param in spec.params]
    scales_at = start + header[SCALES]["data_offsets"][0] if encoding in LEVELS else -1
    return BlobLayout(
        spec=spec,
        encoding=encoding,
        block_size=meta.block_size,
        values_at=start + header[VALUES]["data_offsets"][0],
        scales_at=scales_at,
        starts=tuple(itertools.accumulate(numels, initial=0)),
        block_starts=tuple(
            itertools.accumulate((_blocks(n, meta.block_size) for n in numels), initial=0)
        ),
    )


def _row_elements(
    layout: BlobLayout, index: int, rows: tuple[int, int]
) -> tuple[int, int, int, int]:
    """``(start, end, lo, hi)``: elements ``[start, end)`` of parameter ``index`` are its
    ``rows``; ``[lo, hi)`` widens them to whole blocks (the same when not quantized)."""
    param = layout.spec.params[index]
    width = row_width(param)
    start, end = rows[0] * width, rows[1] * width
    if layout.encoding not in LEVELS or end <= start:
        return start, end, start, end
    size = layout.block_size
    return start, end, start // size * size, min(-(-end // size) * size, param.numel)


def row_spans(layout: BlobLayout, rows: Rows) -> list[tuple[int, int]]:
    """The byte ranges of the blob that hold ``rows`` (one range of rows per parameter,
    within it): for each parameter, its values, then its block scales (an empty range when
    not quantized or when no row is asked for)."""
    spans = []
    for index, part in enumerate(rows):
        _, _, lo, hi = _row_elements(layout, index, part)
        first = layout.starts[index]
        if layout.encoding == "int4":
            values = (
                layout.values_at + (first + lo) // 2,
                layout.values_at + -(-(first + hi) // 2),
            )
        else:
            item = ITEMSIZE[STORED_DTYPE[layout.encoding]]
            values = (
                layout.values_at + (first + lo) * item,
                layout.values_at + (first + hi) * item,
            )
        if hi <= lo:
            values = (values[0], values[0])
        scales = (0, 0)
        if layout.encoding in LEVELS and hi > lo:
            block = layout.block_starts[index] + lo // layout.block_size
            count = -(-(hi - lo) // layout.block_size)
            scales = (layout.scales_at + 4 * block, layout.scales_at + 4 * (block + count))
        spans.extend([values, scales])
    return spans


def decode_rows(layout: BlobLayout, rows: Rows, fetched: Sequence[bytes]) -> list[Tensor]:
    """The tensors of ``part_spec(layout.spec, rows)``, fresh fp32 CPU tensors, from the
    bytes ``fetched`` of ``row_spans(layout, rows)``, checked as ``open_fragment`` checks
    them (every scale and quantized value of the blocks read). Raises ``CodecError``."""
    spec = part_spec(layout.spec, rows)
    out = []
    for index, param in enumerate(spec.params):
        start, end, lo, hi = _row_elements(layout, index, rows[index])
        values, scales = fetched[2 * index], fetched[2 * index + 1]
        name = layout.spec.params[index].name
        if end <= start:
            out.append(torch.empty(param.shape, dtype=torch.float32))
            continue
        if layout.encoding in ("fp32", "bf16"):
            flat = torch.frombuffer(bytearray(values), dtype=TORCH_DTYPE[layout.encoding])
            out.append(flat.to(torch.float32).view(param.shape))
            continue
        levels = LEVELS[layout.encoding]
        if layout.encoding == "int8":
            q = torch.frombuffer(bytearray(values), dtype=torch.int8)
        else:
            packed = torch.frombuffer(bytearray(values), dtype=torch.uint8)
            q = pieces.unpack4(packed, (layout.starts[index] + lo) % 2, hi - lo)
        block_scales = torch.frombuffer(bytearray(scales), dtype=torch.float32)
        if bool((block_scales < 0).any()) or bool(torch.isinf(block_scales).any()):
            raise CodecError(f"{name}: a block scale is negative or infinite")
        if int(q.min()) < -levels:
            raise CodecError(
                f"{name}: an {layout.encoding} value is below -{levels}, outside "
                f"[-{levels}, {levels}]"
            )
        decoded = pieces.dequantize(q, block_scales, hi - lo, layout.block_size)
        out.append(decoded[start - lo : end - lo].clone().view(param.shape))
    return out
