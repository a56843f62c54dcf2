"""Blobs and the tensor codec: content addresses and the bytes a fragment's tensors travel as.

A blob is addressed by the sha256 of its bytes (``digest``); whoever reads one checks the
bytes against the address it followed (``verify``).

A fragment's tensors travel as one safetensors file (never pickle, never ``torch.load``)
holding at most two flat tensors: ``values``, every parameter's stored elements concatenated
in ``FragmentSpec.params`` order, and, for the quantized encodings, ``scales``, every
parameter's block scales concatenated in the same order. The spec already names and shapes
every parameter, so the blob does not: a header with one entry per parameter would cost more
than the values of a small fragment (measured: 1,424 of a 7,848-byte int4 blob of 12,416
parameters). The file's ``__metadata__`` holds one key, ``gradientmail``, whose value is
canonical JSON naming the blob's ``format`` (``FRAGMENT_FORMAT``), ``encoding``,
``block_size``, ``fragment`` and ``params`` (``spec_digest``: 16 hex digits of the sha256 of
the fragment's parameter names, shapes and dtypes), so a blob is never decoded into another
fragment's parameters of the same total size. One key keeps the bytes deterministic, so two
nodes that encode the same tensors write the same blob. Encodings:

``fp32``
    ``values`` is ``F32``. Exact.
``bf16``
    ``values`` is ``BF16`` (round to nearest even). The error of an element is at most half
    a bf16 step at that element: ``|x − x̂| ≤ 2⁻⁹·2^⌈log₂|x|⌉``.
``int8``, ``int4``
    Blockwise absmax, per parameter: each parameter is flattened and cut into blocks of
    ``block_size`` elements (the last one may be shorter; a block never straddles two
    parameters, so a small bias is not quantized with a large weight's scale). A block's scale
    is ``s = absmax / Q`` with ``Q = 127`` (int8) or ``Q = 7`` (int4); an element is stored as
    ``q = round(x / s)`` in ``[−Q, Q]`` and decodes to ``q·s``, so its error is at most half a
    step, ``s / 2`` (up to fp32 rounding). int8 stores ``q`` as ``I8``; int4 stores ``q + 8``
    two to a byte (low nibble first, over the whole fragment; an odd tail is padded with the
    nibble 8, i.e. zero) as ``U8``. ``scales`` is ``F32``. A block holding NaN or ±Inf gets
    the scale NaN and decodes as all NaN, so a non-finite delta stays non-finite and a round
    still rejects it.

Decoding returns fresh fp32 CPU tensors of the spec's shapes, the caller's to keep or mutate.
It checks everything against the spec first: the file's framing, the metadata (the
fragment and its parameters' digest included), the set of tensors, their dtypes and sizes,
and the range of every quantized value; anything else raises ``CodecError``, whose
``reason`` says whether the blob is ``shape`` (well formed, for another model or fragment)
or ``corrupt``.

Pure: no I/O. Encoding and decoding run on whatever thread calls them; both are vectorized
torch operations, one pass over each parameter.
"""

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any, Final, get_args

import msgspec
import safetensors
import safetensors.torch
import torch
from torch import Tensor

from gradientmail.errors import CodecError, CorruptBlob
from gradientmail.protocol.records import (
    DECODE_FAILURES,
    Encoding,
    FragmentSpec,
    decode_failure,
)

__all__ = [
    "ENCODINGS",
    "FRAGMENT_FORMAT",
    "MAX_HEADER_BYTES",
    "CodecError",
    "decode_fragment",
    "digest",
    "encode_fragment",
    "spec_digest",
    "verify",
]

FRAGMENT_FORMAT: Final = "gradientmail-fragment/2"
"""The ``format`` a fragment blob's metadata names; another value is not read."""
MAX_HEADER_BYTES: Final = 1 << 16
"""The largest safetensors header a reader parses (a fragment blob's is a few hundred bytes)."""
ENCODINGS: Final[tuple[Encoding, ...]] = get_args(Encoding)

_METADATA_KEY: Final = "gradientmail"
_VALUES: Final = "values"
_SCALES: Final = "scales"
_LEVELS: Final = {"int8": 127, "int4": 7}
_STORED_DTYPE: Final = {"fp32": "F32", "bf16": "BF16", "int8": "I8", "int4": "U8"}


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


_meta_encoder = msgspec.json.Encoder(order="deterministic")


class _Meta(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    format: str
    encoding: str
    block_size: int
    fragment: int
    params: str


def spec_digest(spec: FragmentSpec) -> str:
    """16 hex digits of the sha256 of ``spec``'s parameters (names, shapes, dtypes, in
    order): what a blob's metadata names so that it only decodes into those parameters."""
    described = [[param.name, list(param.shape), param.dtype] for param in spec.params]
    return hashlib.sha256(_meta_encoder.encode(described)).hexdigest()[:16]


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _expected(
    spec: FragmentSpec, encoding: Encoding, block_size: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor the blob must hold: name -> (safetensors dtype, shape)."""
    numel = sum(param.numel for param in spec.params)
    stored = _blocks(numel, 2) if encoding == "int4" else numel
    expected: dict[str, tuple[str, tuple[int, ...]]] = {
        _VALUES: (_STORED_DTYPE[encoding], (stored,))
    }
    if encoding in _LEVELS:
        blocks = sum(_blocks(param.numel, block_size) for param in spec.params)
        expected[_SCALES] = ("F32", (blocks,))
    return expected


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


def _quantize(flat: Tensor, levels: int, block_size: int) -> tuple[Tensor, Tensor]:
    """``(q, scales)`` of a flat fp32 tensor: q as int8 in [-levels, levels]."""
    numel = flat.numel()
    blocks = _blocks(numel, block_size)
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


def _pack4(q: Tensor) -> Tensor:
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def encode_fragment(
    tensors: Sequence[Tensor], spec: FragmentSpec, encoding: Encoding, *, block_size: int
) -> bytes:
    """The blob of ``tensors`` (one per ``spec.params``, in order) in ``encoding``.

    Tensors may live on any device and be of any floating dtype; they are read as fp32 on the
    CPU and left untouched. The same tensors, spec, encoding and block size always give the
    same bytes. Raises ``ValueError`` if the tensors do not match the spec (count, shape, not
    floating point), for an unknown encoding or a ``block_size`` below 1.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}: expected one of {', '.join(ENCODINGS)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    _check_tensors(tensors, spec)
    flat = [tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1) for tensor in tensors]
    out: dict[str, Tensor] = {}
    if encoding == "fp32":
        out[_VALUES] = torch.cat(flat)
    elif encoding == "bf16":
        out[_VALUES] = torch.cat(flat).to(torch.bfloat16)
    else:
        quantized = [_quantize(values, _LEVELS[encoding], block_size) for values in flat]
        q = torch.cat([q for q, _ in quantized])
        out[_VALUES] = q if encoding == "int8" else _pack4(q)
        out[_SCALES] = torch.cat([scales for _, scales in quantized])
    meta = _Meta(
        format=FRAGMENT_FORMAT,
        encoding=encoding,
        block_size=block_size,
        fragment=spec.index,
        params=spec_digest(spec),
    )
    return safetensors.torch.save(
        out, metadata={_METADATA_KEY: _meta_encoder.encode(meta).decode()}
    )


def _header(data: bytes) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if len(data) < 8:
        raise CodecError(f"{len(data)} bytes is too short to be a safetensors file")
    (size,) = struct.unpack_from("<Q", data)
    if size > MAX_HEADER_BYTES or 8 + size > len(data):
        raise CodecError(
            f"the safetensors header claims {size} bytes; the blob has {len(data)} "
            f"(limit {MAX_HEADER_BYTES})"
        )
    try:
        header = msgspec.json.decode(bytes(data[8 : 8 + size]), type=dict[str, Any])
    except DECODE_FAILURES as exc:
        raise CodecError(
            f"the safetensors header is not a JSON object: {decode_failure(exc)}"
        ) from None
    return header


def _meta(header: dict[str, Any], spec: FragmentSpec) -> _Meta:
    raw = header.get("__metadata__")
    if not isinstance(raw, dict) or not isinstance(raw.get(_METADATA_KEY), str):
        raise CodecError(f"not a gradientmail fragment blob: no {_METADATA_KEY!r} metadata")
    try:
        meta = msgspec.json.decode(raw[_METADATA_KEY].encode(), type=_Meta, strict=True)
    except DECODE_FAILURES as exc:
        raise CodecError(f"malformed fragment metadata: {decode_failure(exc)}") from None
    if meta.format != FRAGMENT_FORMAT:
        raise CodecError(
            f"blob format {meta.format!r} is not one this gradientmail reads "
            f"({FRAGMENT_FORMAT}); upgrade gradientmail"
        )
    if meta.encoding not in ENCODINGS:
        raise CodecError(
            f"unknown encoding {meta.encoding!r}: expected one of {', '.join(ENCODINGS)}"
        )
    if meta.block_size < 1:
        raise CodecError(f"block size {meta.block_size} is not a positive integer")
    if meta.fragment != spec.index:
        raise CodecError(
            f"the blob holds fragment {meta.fragment}, decoded as fragment {spec.index}",
            reason="shape",
        )
    if meta.params != spec_digest(spec):
        raise CodecError(
            f"the blob was encoded for other parameters than fragment {spec.index}'s "
            f"(digest {meta.params!r}, expected {spec_digest(spec)!r}): another model",
            reason="shape",
        )
    return meta


def _check_header(header: dict[str, Any], expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    names = set(header) - {"__metadata__"}
    missing = [name for name in expected if name not in names]
    extra = sorted(names - set(expected))
    if missing or extra:
        raise CodecError(
            f"the blob's tensors differ from the fragment's: missing {missing[:3]}, "
            f"unexpected {extra[:3]}",
            reason="shape",
        )
    for name, (dtype, shape) in expected.items():
        entry = header[name]
        if not isinstance(entry, dict):
            raise CodecError(f"{name}: malformed safetensors entry")
        if entry.get("dtype") != dtype:
            raise CodecError(f"{name}: dtype {entry.get('dtype')!r}, expected {dtype}")
        got = entry.get("shape")
        if not isinstance(got, list) or tuple(got) != shape:
            raise CodecError(f"{name}: shape {got!r}, expected {list(shape)}", reason="shape")


def _dequantize(q: Tensor, scales: Tensor, numel: int, block_size: int) -> Tensor:
    blocks = scales.numel()
    values = q.to(torch.float32)
    if numel != blocks * block_size:
        values = torch.nn.functional.pad(values, (0, blocks * block_size - numel))
    return (values.view(blocks, block_size) * scales.unsqueeze(1)).reshape(-1)[:numel]


def _unpack4(packed: Tensor, numel: int) -> Tensor:
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel]
    return nibbles.to(torch.int8) - 8


def decode_fragment(data: bytes, spec: FragmentSpec) -> list[Tensor]:
    """The tensors of ``spec`` a blob holds: fresh fp32 CPU tensors of the spec's shapes.

    Raises ``CodecError`` (``reason`` ``"shape"`` or ``"corrupt"``) naming what is wrong when
    ``data`` is not a well-formed blob of this fragment; it never returns partial results.
    """
    header = _header(data)
    meta = _meta(header, spec)
    encoding: Encoding = meta.encoding  # type: ignore[assignment]  # checked in _meta
    _check_header(header, _expected(spec, encoding, meta.block_size))
    try:
        stored = safetensors.torch.load(bytes(data))
    except (safetensors.SafetensorError, RuntimeError, ValueError) as exc:
        raise CodecError(f"malformed safetensors data: {exc}") from None
    values = stored[_VALUES]
    numels = [param.numel for param in spec.params]
    if encoding in ("fp32", "bf16"):
        parts = torch.split(values.to(torch.float32), numels)
        return [part.view(param.shape) for part, param in zip(parts, spec.params, strict=True)]
    levels = _LEVELS[encoding]
    q = values if encoding == "int8" else _unpack4(values, sum(numels))
    blocks = [_blocks(n, meta.block_size) for n in numels]
    result: list[Tensor] = []
    for param, q_part, scales in zip(
        spec.params, torch.split(q, numels), torch.split(stored[_SCALES], blocks), strict=True
    ):
        if bool((scales < 0).any()) or bool(torch.isinf(scales).any()):
            raise CodecError(f"{param.name}: a block scale is negative or infinite")
        if q_part.numel() and int(q_part.min()) < -levels:
            raise CodecError(
                f"{param.name}: an {encoding} value is below -{levels}, outside "
                f"[-{levels}, {levels}]"
            )
        flat = _dequantize(q_part, scales, param.numel, meta.block_size)
        result.append(flat.view(param.shape))
    return result
