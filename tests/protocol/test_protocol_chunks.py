"""Bounded memory: the codec, the aggregation and the outer step work a piece of
``CHUNK_ELEMENTS`` at a time and give the very bits the whole-tensor computation gives.

Each test shrinks ``CHUNK_ELEMENTS`` so that small tensors span many pieces, with piece
boundaries that fall inside quantization blocks, across parameters and on odd int4 nibbles.
The references are written here with whole tensors and safetensors' own serializer.
"""

import math

import msgspec
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradientmail.protocol.pieces as pieces
from gradientmail.protocol.aggregation import Candidate, aggregate
from gradientmail.protocol.codec import (
    FRAGMENT_FORMAT,
    CodecError,
    FragmentBlob,
    decode_fragment,
    encode_fragment,
    open_fragment,
    spec_digest,
)
from gradientmail.protocol.mean import l2_norm
from gradientmail.protocol.outer import apply_update, committed_update, outer_step
from gradientmail.protocol.pieces import all_finite
from gradientmail.protocol.records import BlobRef, FragmentSpec, ParamSpec, RunConfig, Snapshot

SPEC = FragmentSpec(
    index=1,
    params=(
        ParamSpec(name="w", shape=(37, 11), dtype="float32"),
        ParamSpec(name="odd", shape=(7,), dtype="float32"),
        ParamSpec(name="empty", shape=(0,), dtype="float32"),
        ParamSpec(name="v", shape=(301,), dtype="float32"),
    ),
)
LEVELS = {"int8": 127, "int4": 7}


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "CHUNK_ELEMENTS", 50)


def tensors(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) * scale for p in SPEC.params]


def reference_blob(values: list[torch.Tensor], encoding: str, block_size: int) -> bytes:
    """The blob as the whole-tensor encoder wrote it, with safetensors' serializer."""
    flat = [v.reshape(-1) for v in values]
    out: dict[str, torch.Tensor] = {}
    if encoding in ("fp32", "bf16"):
        joined = torch.cat(flat)
        out["values"] = joined if encoding == "fp32" else joined.to(torch.bfloat16)
    else:
        levels = LEVELS[encoding]
        qs, scales = [], []
        for x in flat:
            blocks = -(-x.numel() // block_size)
            rows = torch.nn.functional.pad(x, (0, blocks * block_size - x.numel()))
            rows = rows.view(blocks, block_size)
            s = rows.abs().amax(dim=1).div_(levels)
            d = torch.where(s > 0, s, torch.ones_like(s))
            q = rows.div(d.unsqueeze(1)).round_().clamp_(-levels, levels)
            qs.append(q.to(torch.int8).reshape(-1)[: x.numel()])
            scales.append(s)
        q = torch.cat(qs)
        if encoding == "int4":
            nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
            if nibbles.numel() % 2:
                nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
            pairs = nibbles.view(-1, 2)
            q = pairs[:, 0] | (pairs[:, 1] << 4)
        out["values"] = q
        out["scales"] = torch.cat(scales)
    meta = (
        f'{{"format":"{FRAGMENT_FORMAT}","encoding":"{encoding}","block_size":{block_size},'
        f'"fragment":{SPEC.index},"params":"{spec_digest(SPEC)}"}}'
    )
    return safetensors.torch.save(out, metadata={"gradientmail": meta})


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("block_size", [1, 4, 13, 64])
def test_encoding_in_pieces_writes_the_whole_tensor_encoders_bytes(
    encoding: str, block_size: int
) -> None:
    snapshot, base = tensors(0), tensors(1)
    delta = [s - b for s, b in zip(snapshot, base, strict=True)]
    blob = encode_fragment(snapshot, SPEC, encoding, block_size=block_size, minus=base)  # type: ignore[arg-type]
    assert type(blob) is bytes
    assert blob == reference_blob(delta, encoding, block_size)
    assert blob == encode_fragment(delta, SPEC, encoding, block_size=block_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8", "int4"])
def test_decoding_in_pieces_gives_the_whole_tensor_decoders_values(encoding: str) -> None:
    values = tensors(2, scale=3.0)
    blob = encode_fragment(values, SPEC, encoding, block_size=13)  # type: ignore[arg-type]
    stored = safetensors.torch.load(blob)
    if encoding in ("fp32", "bf16"):
        expected = stored["values"].to(torch.float32)
    else:
        q = stored["values"]
        if encoding == "int4":
            q = torch.stack([q & 0x0F, q >> 4], dim=1).reshape(-1).to(torch.int8) - 8
        parts = []
        at = blocks = 0
        for param in SPEC.params:
            n, b = param.numel, -(-param.numel // 13)
            padded = torch.nn.functional.pad(q[at : at + n].float(), (0, b * 13 - n))
            scaled = padded.view(b, 13) * stored["scales"][blocks : blocks + b].unsqueeze(1)
            parts.append(scaled.reshape(-1)[:n])
            at, blocks = at + n, blocks + b
        expected = torch.cat(parts)
    decoded = torch.cat([t.reshape(-1) for t in decode_fragment(blob, SPEC)])
    assert torch.equal(decoded, expected[: decoded.numel()])
    opened = open_fragment(blob, SPEC)
    # Any range of a parameter, across block and piece boundaries.
    for start, end in [(0, 1), (5, 30), (12, 14), (200, 407)]:
        piece = opened.piece(0, start, end)
        assert torch.equal(piece, decode_fragment(blob, SPEC)[0].reshape(-1)[start:end])


def test_a_value_out_of_range_in_a_later_piece_is_refused_when_opened() -> None:
    blob = bytearray(encode_fragment(tensors(3), SPEC, "int8", block_size=8))
    # The values follow the scales: the last byte is ``v``'s last element, many pieces in.
    blob[-1] = 0x80  # int8 -128
    with pytest.raises(CodecError, match=r"v: an int8 value is below -127"):
        open_fragment(bytes(blob), SPEC)


def test_a_blob_whose_offsets_do_not_tile_its_data_is_refused() -> None:
    blob = encode_fragment(tensors(3), SPEC, "fp32", block_size=1)
    with pytest.raises(CodecError, match="after its header"):
        open_fragment(blob + b"\0\0\0\0", SPEC)
    with pytest.raises(CodecError, match="after its header"):
        open_fragment(blob[:-4], SPEC)


REF = BlobRef(sha256="0" * 64, size=1, encoding="int8")
CONFIG = RunConfig(fragments=2, sync_every=4, max_staleness=1, max_tokens_per_step=100)


def candidate(learner: str, delta: list[torch.Tensor] | FragmentBlob, tokens: int) -> Candidate:
    snapshot = Snapshot(
        learner=learner,
        round=11,
        fragment=1,
        base_version=5,
        steps=4,
        tokens=tokens,
        delta=REF,
        norm=1.0,
    )
    return Candidate(snapshot=snapshot, delta=delta, problem=None)


@pytest.mark.parametrize("robust", [False, True])
def test_aggregating_blobs_in_pieces_equals_aggregating_their_decoded_tensors(
    robust: bool,
) -> None:
    config = msgspec.structs.replace(CONFIG, robust=robust)
    deltas = [tensors(seed) for seed in (4, 5, 6)]
    blobs = [encode_fragment(d, SPEC, "int8", block_size=16) for d in deltas]
    theta = tensors(7, scale=10.0)
    opened = [
        candidate(name, open_fragment(blob, SPEC), 10 * (i + 1))
        for i, (name, blob) in enumerate(zip("abc", blobs, strict=True))
    ]
    decoded = [
        candidate(name, decode_fragment(blob, SPEC), 10 * (i + 1))
        for i, (name, blob) in enumerate(zip("abc", blobs, strict=True))
    ]
    lazy = aggregate(5, opened, SPEC, config, theta=theta)
    whole = aggregate(5, decoded, SPEC, config, theta=theta)
    assert lazy.mean is not None
    assert whole.mean is not None
    assert all(torch.equal(a, b) for a, b in zip(lazy.mean, whole.mean, strict=True))
    assert lazy.participants == whole.participants
    assert lazy.cosine == whole.cosine
    # The weighted mean accumulated in fp32 in learner order, as the whole-tensor sum does.
    # Robust: the record's weights are the capped and clipped coefficients.
    weights = [p.weight for p in lazy.participants] if robust else [1 / 6, 2 / 6, 3 / 6]
    assert any(p.bounded is not msgspec.UNSET for p in lazy.participants) is robust
    expected = [torch.zeros(p.shape) for p in SPEC.params]
    for w, c in zip(weights, decoded, strict=True):
        assert isinstance(c.delta, list)
        for acc, t in zip(expected, c.delta, strict=True):
            acc.add_(t, alpha=w)
    assert all(torch.equal(a, b) for a, b in zip(lazy.mean, expected, strict=True))
    assert lazy.cosine is not None
    assert 0 < lazy.cosine <= 1


def test_a_non_finite_piece_of_a_blob_is_rejected_with_its_parameter() -> None:
    bad = tensors(8)
    bad[3][-1] = math.inf
    blob = open_fragment(encode_fragment(bad, SPEC, "int8", block_size=16), SPEC)
    result = aggregate(5, [candidate("a", blob, 10), candidate("b", tensors(9), 10)], SPEC, CONFIG)
    assert [(r.learner, r.reason, r.detail) for r in result.rejected] == [
        ("a", "non-finite", "v holds NaN or Inf")
    ]


def test_norms_in_pieces_match_the_float64_norm() -> None:
    values, base = tensors(10), tensors(11)
    whole = math.sqrt(
        sum(float((s - b).double().square().sum()) for s, b in zip(values, base, strict=True))
    )
    assert l2_norm(values, minus=base) == pytest.approx(whole, rel=1e-12)


def test_the_outer_step_and_the_update_in_pieces_give_the_whole_tensor_bits() -> None:
    theta, momentum, mean = tensors(12, 10.0), tensors(13), tensors(14, 0.1)
    raw, buffers = outer_step(theta, momentum, mean, lr=0.7, momentum_coef=0.9)
    for t, m, d, r, b in zip(theta, momentum, mean, raw, buffers, strict=True):
        grad = torch.neg(d)
        buf = m.mul(0.9).add(grad)
        assert torch.equal(b, buf)
        assert torch.equal(r, t.add(grad.add(buf, alpha=0.9), alpha=-0.7))
    blob, new_theta = committed_update(theta, raw, SPEC, "int4", block_size=16, version=3)
    update = [r - t for r, t in zip(raw, theta, strict=True)]
    assert blob == encode_fragment(update, SPEC, "int4", block_size=16, version=3)
    decoded = decode_fragment(blob, SPEC)
    assert all(torch.equal(n, t.add(u)) for n, t, u in zip(new_theta, theta, decoded, strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(apply_update(theta, blob, SPEC), new_theta, strict=True)
    )


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(0, 9),
    columns=st.integers(0, 40),
    planted=st.lists(
        st.tuples(
            st.integers(0, 359),
            st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, -0.0, 1e-45]),
        ),
        max_size=3,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_all_finite_answers_what_isfinite_answers_over_many_pieces(
    rows: int, columns: int, planted: list[tuple[int, float]], dtype: torch.dtype
) -> None:
    """A NaN or ±Inf anywhere, in any piece (the first, a middle one, the last, shorter
    one), makes ``all_finite`` false; the largest finite values, whose sums overflow, and
    negative zero do not."""
    tensor = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows)).to(dtype)
    flat = tensor.view(-1)
    for index, value in planted:
        if index < flat.numel():
            flat[index] = value
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())
