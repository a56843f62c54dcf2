"""The safetensors framing every fragment blob shares (``codec``'s dense encodings,
``sparse``'s ``topk``): the header, its one metadata key and the checks of both.

A blob is a safetensors file: an 8-byte little-endian header size, the header (JSON, padded
with spaces to a multiple of 8) and the tensors' bytes, each at its ``data_offsets``, tiling
the rest of the file. The metadata is one key, ``gradientmail``, whose value is canonical
JSON (``Meta``), so the bytes are deterministic.

Pure: no I/O; the caller's thread.
"""

import hashlib
import math
import struct
from collections.abc import Mapping
from typing import Any, Final, get_args

import msgspec

from gradientmail.errors import CodecError
from gradientmail.protocol.pieces import ITEMSIZE
from gradientmail.protocol.records import DECODE_FAILURES, Encoding, FragmentSpec, decode_failure

__all__ = [
    "FRAGMENT_FORMAT",
    "MAX_HEADER_BYTES",
    "Meta",
    "check_header",
    "check_offsets",
    "read_header",
    "read_meta",
    "spec_digest",
    "write_header",
]

FRAGMENT_FORMAT: Final = "gradientmail-fragment/2"
"""The ``format`` a fragment blob's metadata names; another value is not read."""
MAX_HEADER_BYTES: Final = 1 << 16
"""The largest safetensors header a reader parses (a fragment blob's is a few hundred bytes)."""
METADATA_KEY: Final = "gradientmail"

meta_encoder = msgspec.json.Encoder(order="deterministic")
# The safetensors header keeps its keys in the order they are given.
_header_encoder = msgspec.json.Encoder()


class Meta(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    format: str
    encoding: str
    block_size: int
    fragment: int
    params: str
    bits: int = 0
    version: int = 0
    """The version of its fragment the blob belongs to: the one a round's update, checkpoint
    and deltas make (Θ⁰'s is 0, omitted). Not read back: it keeps the blobs of different
    rounds apart, so equal payloads (an empty round's zero update, say) never share a blob
    that collecting one round would take from another (``garbage``)."""


def spec_digest(spec: FragmentSpec) -> str:
    """16 hex digits of the sha256 of ``spec``'s parameters (names, shapes, dtypes, in
    order): what a blob's metadata names so that it only decodes into those parameters."""
    described = [[param.name, list(param.shape), param.dtype] for param in spec.params]
    return hashlib.sha256(meta_encoder.encode(described)).hexdigest()[:16]


Expected = Mapping[str, tuple[str, tuple[int, ...]]]
"""Every tensor a blob holds, in its stored order: name -> (safetensors dtype, shape)."""


def write_header(meta: Meta, expected: Expected) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header of a blob of ``expected`` (length prefix included, padded as safetensors
    pads it) and each tensor's ``[start, end)`` in the data after it."""
    offsets: dict[str, tuple[int, int]] = {}
    at = 0
    for name, (dtype, shape) in expected.items():
        offsets[name] = (at, at + math.prod(shape) * ITEMSIZE[dtype])
        at = offsets[name][1]
    header: dict[str, Any] = {"__metadata__": {METADATA_KEY: meta_encoder.encode(meta).decode()}}
    for name, (dtype, shape) in expected.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets[name])}
    text = _header_encoder.encode(header)
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def read_header(data: bytes) -> dict[str, Any]:
    """The safetensors header of ``data`` as a dict, its size within ``MAX_HEADER_BYTES``.
    Raises ``CodecError``."""
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


def read_meta(header: dict[str, Any], spec: FragmentSpec) -> Meta:
    """The metadata of a fragment blob's ``header``, checked against ``spec``: the format,
    a known encoding, a positive block size, the fragment and its parameters' digest.
    Raises ``CodecError``."""
    raw = header.get("__metadata__")
    if not isinstance(raw, dict) or not isinstance(raw.get(METADATA_KEY), str):
        raise CodecError(f"not a gradientmail fragment blob: no {METADATA_KEY!r} metadata")
    try:
        meta = msgspec.json.decode(raw[METADATA_KEY].encode(), type=Meta, strict=True)
    except DECODE_FAILURES as exc:
        raise CodecError(f"malformed fragment metadata: {decode_failure(exc)}") from None
    if meta.format != FRAGMENT_FORMAT:
        raise CodecError(
            f"blob format {meta.format!r} is not one this gradientmail reads "
            f"({FRAGMENT_FORMAT}); upgrade gradientmail"
        )
    if meta.encoding not in get_args(Encoding):
        raise CodecError(
            f"unknown encoding {meta.encoding!r}: expected one of {', '.join(get_args(Encoding))}"
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


def check_header(header: dict[str, Any], expected: Expected) -> None:
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


def check_offsets(header: dict[str, Any], expected: Expected, after: int) -> None:
    """Check that the tensors' ``data_offsets`` tile the ``after`` bytes that follow the
    header exactly, as safetensors' own reader does (``check_header`` passed)."""
    spans = []
    for name, (dtype, shape) in expected.items():
        offsets = header[name].get("data_offsets")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        ):
            raise CodecError(f"malformed safetensors data: {name}: data_offsets {offsets!r}")
        spans.append((offsets[0], offsets[1], math.prod(shape) * ITEMSIZE[dtype], name))
    at = 0
    for begin, end, size, name in sorted(spans):
        if begin != at or end - begin != size:
            raise CodecError(f"malformed safetensors data: {name}: data_offsets {[begin, end]}")
        at = end
    if at != after:
        raise CodecError(
            f"malformed safetensors data: the tensors take {at} bytes, the blob holds {after} "
            "after its header"
        )
