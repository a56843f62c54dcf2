"""The tensor codec: exact and bounded round trips, determinism and strict decoding."""

import json
import math
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import CorruptBlob, RecordError
from gradientmail.protocol.codec import (
    ENCODINGS,
    FRAGMENT_FORMAT,
    CodecError,
    decode_fragment,
    digest,
    encode_fragment,
    spec_digest,
    verify,
)
from gradientmail.protocol.records import FragmentSpec, ParamSpec

CHECKS = settings(max_examples=60, deadline=None)
LEVELS = {"int8": 127, "int4": 7}
EPS = 2.0**-24


def spec_of(*shapes: tuple[int, ...], index: int = 0) -> FragmentSpec:
    return FragmentSpec(
        index=index,
        params=tuple(
            ParamSpec(name=f"layer.{i}.weight", shape=shape, dtype="float32")
            for i, shape in enumerate(shapes)
        ),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


SHAPES = [(3, 4), (5,), (), (0, 2), (7, 1, 3)]


def sample(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def test_digest_and_verify() -> None:
    data = b"abc"
    sha = digest(data)
    assert sha == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert verify(data, sha) is data
    with pytest.raises(CorruptBlob, match=sha):
        verify(b"abd", sha)


def test_fp32_round_trip_is_bitwise_exact_including_non_finite() -> None:
    spec = spec_of(*SHAPES)
    tensors = sample(SHAPES)
    tensors[0][0, 0] = math.nan
    tensors[0][1, 1] = math.inf
    tensors[1][0] = -0.0
    out = decode_fragment(encode_fragment(tensors, spec, "fp32", block_size=4), spec)
    for a, b in zip(tensors, out, strict=True):
        assert b.dtype == torch.float32
        assert b.device.type == "cpu"
        assert b.shape == a.shape
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_decoded_tensors_are_fresh_and_writable(encoding: str) -> None:
    spec = spec_of((4, 4))
    data = encode_fragment(sample([(4, 4)]), spec, encoding, block_size=3)  # type: ignore[arg-type]
    first = decode_fragment(data, spec)[0]
    first.add_(1.0)
    assert not torch.equal(first, decode_fragment(data, spec)[0])


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_encoding_is_deterministic_and_leaves_inputs_alone(encoding: str) -> None:
    spec = spec_of(*SHAPES)
    tensors = sample(SHAPES, seed=3)
    copies = [t.clone() for t in tensors]
    one = encode_fragment(tensors, spec, encoding, block_size=5)  # type: ignore[arg-type]
    two = encode_fragment(copies, spec, encoding, block_size=5)  # type: ignore[arg-type]
    assert one == two
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies, strict=True))


def test_metadata_names_format_encoding_block_size_fragment_and_parameters() -> None:
    spec = spec_of((2, 2), (5,), index=3)
    data = encode_fragment(sample([(2, 2), (5,)]), spec, "int8", block_size=3)
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + size])
    meta = json.loads(header["__metadata__"]["gradientmail"])
    assert meta == {
        "format": FRAGMENT_FORMAT,
        "encoding": "int8",
        "block_size": 3,
        "fragment": 3,
        "params": spec_digest(spec),
    }
    assert set(header) == {"__metadata__", "values", "scales"}
    assert header["values"]["dtype"] == "I8"
    assert header["values"]["shape"] == [9]
    assert header["scales"]["shape"] == [2 + 2], "blocks never straddle two parameters"


def test_the_header_does_not_grow_with_the_number_of_parameters() -> None:
    few, many = spec_of((64, 64)), spec_of(*[(64,)] * 64)
    sizes = []
    for spec in (few, many):
        tensors = sample([param.shape for param in spec.params])
        data = encode_fragment(tensors, spec, "int4", block_size=64)
        sizes.append(struct.unpack_from("<Q", data)[0])
    assert sizes[0] == sizes[1] < 400


def test_a_blob_decodes_only_into_the_parameters_it_was_encoded_for() -> None:
    ours, other = spec_of((2, 3)), spec_of((3, 2))
    renamed = FragmentSpec(
        index=0, params=(ParamSpec(name="other.weight", shape=(2, 3), dtype="float32"),)
    )
    data = encode_fragment(sample([(3, 2)]), other, "fp32", block_size=4)
    for spec in (ours, renamed):
        with pytest.raises(CodecError, match="other parameters") as info:
            decode_fragment(data, spec)
        assert info.value.reason == "shape"


def test_any_floating_dtype_is_encoded_as_fp32() -> None:
    spec = spec_of((3,))
    x = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    out = decode_fragment(encode_fragment([x], spec, "fp32", block_size=1), spec)
    assert torch.equal(out[0], x.float())


finite32 = st.floats(
    min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32
).map(lambda v: 0.0 if abs(v) < 1e-30 else v)


@st.composite
def fragments(draw: st.DrawFn) -> tuple[FragmentSpec, list[torch.Tensor]]:
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e6]))
    tensors = [
        torch.tensor(draw(st.lists(finite32, min_size=n, max_size=n)), dtype=torch.float32)
        .mul(scale)
        .reshape(n)
        for n in lengths
    ]
    return spec_of(*[(n,) for n in lengths]), tensors


@CHECKS
@given(fragments(), st.sampled_from(["int8", "int4"]), st.integers(1, 16))
def test_blockwise_error_is_at_most_half_a_step(
    fragment: tuple[FragmentSpec, list[torch.Tensor]], encoding: str, block_size: int
) -> None:
    spec, tensors = fragment
    data = encode_fragment(tensors, spec, encoding, block_size=block_size)  # type: ignore[arg-type]
    decoded = decode_fragment(data, spec)
    for x, y in zip(tensors, decoded, strict=True):
        for start in range(0, x.numel(), block_size):
            block, got = x[start : start + block_size], y[start : start + block_size]
            absmax = float(block.abs().max())
            step = absmax / LEVELS[encoding]
            error = float((block.double() - got.double()).abs().max())
            assert error <= step / 2 + 4 * EPS * absmax, (error, step)
            assert float(got.abs().max()) <= absmax * (1 + 4 * EPS)


@CHECKS
@given(st.lists(finite32, min_size=1, max_size=64))
def test_bf16_error_is_at_most_half_a_bf16_step(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    spec = spec_of((len(values),))
    y = decode_fragment(encode_fragment([x], spec, "bf16", block_size=8), spec)[0]
    _, exponent = torch.frexp(x.double())
    half_step = torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 9)
    assert bool(((x.double() - y.double()).abs() <= half_step).all())


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_non_finite_block_decodes_as_nan_and_others_are_intact(encoding: str) -> None:
    spec = spec_of((12,))
    x = torch.arange(12, dtype=torch.float32)
    x[5] = math.inf
    y = decode_fragment(encode_fragment([x], spec, encoding, block_size=4), spec)[0]  # type: ignore[arg-type]
    assert bool(torch.isnan(y[4:8]).all())
    assert bool(torch.isfinite(y[:4]).all())
    assert bool(torch.isfinite(y[8:]).all())


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_zero_blocks_and_odd_lengths_decode_exactly(encoding: str) -> None:
    spec = spec_of((7,), (0,), ())
    tensors = [torch.zeros(7), torch.zeros(0), torch.tensor(0.0)]
    tensors[0][6] = 3.0
    out = decode_fragment(encode_fragment(tensors, spec, encoding, block_size=3), spec)  # type: ignore[arg-type]
    assert torch.equal(out[0], tensors[0])
    assert out[1].shape == (0,)
    assert out[2].shape == ()


def test_int4_packs_two_values_per_byte() -> None:
    spec = spec_of((1001,))
    data = encode_fragment([torch.randn(1001)], spec, "int4", block_size=1001)
    header_size = struct.unpack_from("<Q", data)[0]
    assert len(data) - 8 - header_size == 501 + 4


def test_a_million_elements_round_trip() -> None:
    spec = spec_of((1000, 1000))
    x = torch.randn(1000, 1000)
    for encoding in ENCODINGS:
        y = decode_fragment(encode_fragment([x], spec, encoding, block_size=256), spec)[0]  # type: ignore[arg-type]
        assert float((x - y).abs().max()) < 0.7


# Strict decoding: every malformed blob raises CodecError naming what is wrong.


def raw_blob(tensors: dict[str, torch.Tensor], meta: object) -> bytes:
    metadata = None if meta is None else {"gradientmail": json.dumps(meta)}
    return safetensors.torch.save(tensors, metadata=metadata)


SPEC = spec_of((2, 3))
META = {
    "format": FRAGMENT_FORMAT,
    "encoding": "int8",
    "block_size": 4,
    "fragment": 0,
    "params": spec_digest(SPEC),
}
GOOD = {"values": torch.ones(6, dtype=torch.int8), "scales": torch.ones(2)}


def test_a_hand_built_blob_decodes() -> None:
    assert torch.equal(decode_fragment(raw_blob(GOOD, META), SPEC)[0], torch.ones(2, 3))


@pytest.mark.parametrize(
    ("data", "match", "reason"),
    [
        (b"", "too short", "corrupt"),
        (b"\x00" * 7, "too short", "corrupt"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header claims", "corrupt"),
        (struct.pack("<Q", 5) + b"nope!", "not a JSON object", "corrupt"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object", "corrupt"),
        (raw_blob(GOOD, None), "no 'gradientmail' metadata", "corrupt"),
        (raw_blob(GOOD, {**META, "format": "gradientmail-fragment/9"}), "upgrade", "corrupt"),
        (raw_blob(GOOD, {**META, "encoding": "fp8"}), "unknown encoding", "corrupt"),
        (raw_blob(GOOD, {**META, "block_size": 0}), "block size", "corrupt"),
        (raw_blob(GOOD, {**META, "block_size": "4"}), "malformed fragment metadata", "corrupt"),
        (raw_blob(GOOD, {**META, "fragment": 1}), "holds fragment 1", "shape"),
        (raw_blob(GOOD, {**META, "params": "0" * 16}), "other parameters", "shape"),
        (raw_blob({"values": GOOD["values"]}, META), "missing", "shape"),
        (raw_blob({**GOOD, "x": torch.ones(1)}, META), "unexpected", "shape"),
        (raw_blob({**GOOD, "values": torch.ones(5, dtype=torch.int8)}, META), "shape", "shape"),
        (raw_blob({**GOOD, "scales": torch.ones(3)}, META), "shape", "shape"),
        (raw_blob({**GOOD, "values": torch.ones(6)}, META), "dtype 'F32'", "corrupt"),
        (
            raw_blob({**GOOD, "values": torch.full((6,), -128, dtype=torch.int8)}, META),
            "below -127",
            "corrupt",
        ),
        (
            raw_blob({**GOOD, "scales": torch.tensor([1.0, -1.0])}, META),
            "negative",
            "corrupt",
        ),
        (
            raw_blob({**GOOD, "scales": torch.tensor([1.0, math.inf])}, META),
            "infinite",
            "corrupt",
        ),
        (
            raw_blob(
                {"values": torch.zeros(3, dtype=torch.uint8), "scales": torch.ones(2)},
                {**META, "encoding": "int4"},
            ),
            "below -7",
            "corrupt",
        ),
        (raw_blob(GOOD, META)[:-3], "malformed safetensors", "corrupt"),
        (raw_blob(GOOD, META) + b"xx", "malformed safetensors", "corrupt"),
    ],
)
def test_malformed_blobs_raise_codec_error(data: bytes, match: str, reason: str) -> None:
    with pytest.raises(CodecError, match=match) as info:
        decode_fragment(data, SPEC)
    assert info.value.reason == reason
    assert isinstance(info.value, RecordError)


def test_garbage_bytes_raise_codec_error() -> None:
    gen = torch.Generator().manual_seed(7)
    for n in (8, 64, 4096):
        data = bytes(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).tolist())
        with pytest.raises(CodecError):
            decode_fragment(data, SPEC)


@CHECKS
@given(st.data())
def test_flipping_any_byte_never_decodes_silently_wrong_shapes(data: st.DataObject) -> None:
    blob = bytearray(encode_fragment([torch.randn(2, 3)], SPEC, "int8", block_size=4))
    position = data.draw(st.integers(0, len(blob) - 1))
    blob[position] ^= data.draw(st.integers(1, 255))
    try:
        out = decode_fragment(bytes(blob), SPEC)
    except CodecError:
        return
    assert [t.shape for t in out] == [torch.Size([2, 3])]
    assert out[0].dtype == torch.float32


@pytest.mark.parametrize(
    ("tensors", "encoding", "block_size", "match"),
    [
        ([], "fp32", 4, "has 1 parameters, got 0"),
        ([torch.ones(3, 2)], "fp32", 4, "shape"),
        ([torch.ones(2, 3, dtype=torch.int64)], "fp32", 4, "floating-point"),
        ([torch.ones(2, 3)], "fp8", 4, "unknown encoding"),
        ([torch.ones(2, 3)], "int8", 0, "block_size"),
    ],
)
def test_encode_rejects_bad_arguments(
    tensors: list[torch.Tensor], encoding: str, block_size: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        encode_fragment(tensors, SPEC, encoding, block_size=block_size)  # type: ignore[arg-type]
