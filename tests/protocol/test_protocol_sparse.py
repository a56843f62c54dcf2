"""The ``topk`` encoding (``protocol.sparse``) and its error feedback (``protocol.feedback``):
round trip, the exact accounting of what is not sent, piece-by-piece decoding, and the
refusal of hostile blobs before anything of their declared size is allocated."""

import math
import struct

import hypothesis.strategies as st
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from gradientmail.errors import CodecError
from gradientmail.protocol import gaps, pieces
from gradientmail.protocol.codec import decode_fragment, encode_fragment, open_fragment
from gradientmail.protocol.feedback import Feedback, encoded
from gradientmail.protocol.framing import FRAGMENT_FORMAT, Meta, spec_digest, write_header
from gradientmail.protocol.merge import merged
from gradientmail.protocol.records import FragmentSpec, ParamSpec, RunConfig
from gradientmail.protocol.sparse import BITS, SparseBlob, Sparsity, delta_sparsity

SPEC = FragmentSpec(
    index=1,
    params=(
        ParamSpec(name="w", shape=(13, 7), dtype="float32"),
        ParamSpec(name="b", shape=(5,), dtype="float32"),
        ParamSpec(name="s", shape=(), dtype="float32"),
    ),
)
SHAPES = [p.shape for p in SPEC.params]

sparsities = st.builds(
    Sparsity,
    chunk=st.integers(1, 120),
    bits=st.sampled_from(BITS),
    density=st.one_of(st.none(), st.floats(0.001, 1.0)),
)
finite32 = st.floats(-(2.0**100), 2.0**100, width=32)
"""Finite, subnormals included; small enough that a difference never overflows."""


def tensors_from(values: list[float]) -> list[torch.Tensor]:
    flat = torch.tensor(values, dtype=torch.float32)
    out, at = [], 0
    for shape in SHAPES:
        n = math.prod(shape)
        out.append(flat[at : at + n].view(shape))
        at += n
    return out


NUMEL = sum(math.prod(s) for s in SHAPES)
fragments = st.lists(finite32, min_size=NUMEL, max_size=NUMEL).map(tensors_from)


def encode(tensors: list[torch.Tensor], sparsity: Sparsity) -> bytes:
    return encode_fragment(tensors, SPEC, "topk", block_size=1, sparsity=sparsity)


@settings(max_examples=100, deadline=None)
@given(fragments, sparsities)
def test_round_trip_sends_the_selection_within_a_factor_two(
    tensors: list[torch.Tensor], sparsity: Sparsity
) -> None:
    """Every element sent has its input's sign and is within a factor two of it, every
    chunk sends at most its selection, and the same input gives the same bytes."""
    blob = encode(tensors, sparsity)
    assert blob == encode([t.clone() for t in tensors], sparsity)
    for x, y in zip(tensors, decode_fragment(blob, SPEC), strict=True):
        x, y = x.reshape(-1), y.reshape(-1)
        sent = y != 0
        assert bool((torch.sign(y[sent]) == torch.sign(x[sent])).all())
        assert bool((y[sent].abs() <= 2 * x[sent].abs()).all())
        assert bool((x[sent].abs() <= 2 * y[sent].abs()).all())
        for start in range(0, x.numel(), sparsity.chunk):
            chunk = slice(start, min(start + sparsity.chunk, x.numel()))
            n = chunk.stop - chunk.start
            limit = n if sparsity.density is None else math.ceil(sparsity.density * n)
            assert int(sent[chunk].sum()) <= min(n, limit)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(fragments, fragments, sparsities)
def test_sent_plus_residual_is_the_input_bit_for_bit(
    snapshot: list[torch.Tensor], base: list[torch.Tensor], sparsity: Sparsity
) -> None:
    """``decode(blob) + e == S − B`` in fp32, element by element and bit for bit (a zero's
    sign aside), for any finite input, subnormals included."""
    x = [s - b for s, b in zip(snapshot, base, strict=True)]
    blob, opened, left = encoded(snapshot, base, SPEC, sparsity)
    sent = decode_fragment(blob, SPEC)
    for t, y, r in zip(x, sent, left, strict=True):
        total = y + r
        assert torch.equal(total, t)
        # Bit for bit, where a signed zero (+0 + −0 is +0) cannot differ.
        nonzero = t != 0
        assert torch.equal(total[nonzero].view(torch.int32), t[nonzero].view(torch.int32))
    assert isinstance(opened, SparseBlob)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(fragments, fragments, sparsities, st.floats(0.0, 1.0))
def test_what_is_kept_is_the_share_of_the_unsent_residual(
    snapshot: list[torch.Tensor], base: list[torch.Tensor], sparsity: Sparsity, keep: float
) -> None:
    """The learner keeps ``keep·e`` of the exact residual ``e`` and nothing else: the blob
    does not depend on ``keep``, and ``(1 − keep)·e`` is what is dropped."""
    blob, _, e = encoded(snapshot, base, SPEC, sparsity)
    again, _, kept = encoded(snapshot, base, SPEC, sparsity, keep=keep)
    assert again == blob
    for k, r in zip(kept, e, strict=True):
        assert torch.equal(k, r * keep)


def test_a_top_k_selection_keeps_the_largest_of_each_chunk() -> None:
    x = torch.zeros(1000)
    x[[3, 10, 500, 999]] = torch.tensor([5.0, -4.0, 3.0, 1.0])
    spec = FragmentSpec(index=0, params=(ParamSpec(name="x", shape=(1000,), dtype="float32"),))
    blob = encode_fragment([x], spec, "topk", block_size=1, sparsity=Sparsity(500, 2, 0.004))
    y = decode_fragment(blob, spec)[0]
    assert y.nonzero().flatten().tolist() == [3, 10, 500, 999]
    # 2 bits: levels ±s and ±3s with s = 5/3; -4 rounds to -3s = -5, 1 to s = 1/3·3.
    assert torch.allclose(y[[3, 10]], torch.tensor([5.0, -5.0]))


def test_non_finite_chunks_decode_as_non_finite() -> None:
    x = torch.randn(600)
    x[450] = math.nan
    spec = FragmentSpec(index=0, params=(ParamSpec(name="x", shape=(600,), dtype="float32"),))
    y = decode_fragment(
        encode_fragment([x], spec, "topk", block_size=1, sparsity=Sparsity(300, 2, 0.01)), spec
    )[0]
    assert not bool(torch.isfinite(y[300:]).all())
    assert bool(torch.isfinite(y[:300]).all())


@pytest.mark.parametrize("bits", BITS)
def test_pieces_decode_as_the_whole(monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    """With pieces of a few chunks, the blob is the same bytes and any range decodes to the
    same bits as the whole."""
    gen = torch.Generator().manual_seed(bits)
    tensors = [torch.randn(shape, generator=gen) for shape in SHAPES]
    sparsity = Sparsity(7, bits, 0.3)
    whole = encode(tensors, sparsity)
    monkeypatch.setattr(pieces, "CHUNK_ELEMENTS", 20)
    assert encode(tensors, sparsity) == whole
    blob = open_fragment(whole, SPEC)
    full = decode_fragment(whole, SPEC)
    for index, tensor in enumerate(full):
        flat = tensor.reshape(-1)
        for start in range(flat.numel()):
            for end in (start + 1, min(flat.numel(), start + 9), flat.numel()):
                assert torch.equal(blob.piece(index, start, end), flat[start:end])


def test_an_empty_selection_and_a_zero_delta() -> None:
    zeros = [torch.zeros(shape) for shape in SHAPES]
    blob = encode(zeros, Sparsity(16, 2, 0.05))
    assert all(not bool(t.any()) for t in decode_fragment(blob, SPEC))


# -- hostile blobs ---------------------------------------------------------------------------

SMALL = FragmentSpec(index=0, params=(ParamSpec(name="x", shape=(10,), dtype="float32"),))


def forged(
    counts: list[int],
    scales: list[float],
    high: bytes,
    low: bytes,
    codes: bytes,
    *,
    chunk: int = 5,
    bits: int = 8,
    declared: int | None = None,
) -> bytes:
    """A ``topk`` blob of ``SMALL`` with these tensors (``declared``: the bytes of index
    codes its header claims)."""
    meta = Meta(FRAGMENT_FORMAT, "topk", chunk, 0, spec_digest(SMALL), bits)
    expected = {
        "counts": ("I32", (len(counts),)),
        "scales": ("F32", (len(scales),)),
        "high": ("U8", (len(high) if declared is None else declared,)),
        "low": ("U8", (len(low),)),
        "codes": ("U8", (len(codes),)),
    }
    header, _ = write_header(meta, expected)
    return (
        header
        + np.array(counts, "<i4").tobytes()
        + np.array(scales, "<f4").tobytes()
        + high
        + low
        + codes
    )


def coded(counts: list[int], offsets: list[int]) -> tuple[bytes, bytes]:
    """The index streams the encoder writes for these offsets of ``SMALL``."""
    r = gaps.shift(len(offsets), 10)
    return gaps.write(torch.tensor(counts), torch.tensor(offsets), r)


# Three offsets of ten elements cut at r = 1: gaps 4 | 0, 2, so the stop bits 2, 3 and 5 of
# `high` (0x2C) and three zero low bits.
HIGH, LOW = bytes([0x2C]), bytes([0])
ALL = ([5, 5], [1.0, 1.0], bytes([0xFF, 0x03]), b"", bytes(10))
WELL_FORMED = forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes(3))


def test_a_well_formed_forgery_decodes() -> None:
    """The forger writes what the encoder writes, so each refusal below is of its one
    change."""
    assert coded([1, 2], [4, 0, 3]) == (HIGH, LOW)
    assert coded([5, 5], list(range(5)) * 2) == (ALL[2], ALL[3])
    y = decode_fragment(forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes([255, 0, 128])), SMALL)[0]
    assert y.tolist() == [0, 0, 0, 0, 255, -127.5, 0, 0, 0.5, 0]
    assert decode_fragment(forged(*ALL), SMALL)[0].tolist() == [-255.0] * 10


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (forged([1, 2], [1.0, 0.5], HIGH, bytes([1]), bytes(3)), "outside its chunk"),
        (forged([1, 2], [1.0, 0.5], bytes([0x0C]), LOW, bytes(3)), "end after 2 of 3"),
        (forged([1, 2], [1.0, 0.5], bytes([0x6C]), LOW, bytes(3)), "padding bits"),
        (forged([1, 2], [1.0, 0.5], HIGH, bytes([8]), bytes(3)), "padding bits"),
        (forged([5, 5], [1.0, 1.0], ALL[2] + bytes(1), b"", bytes(10)), "belong to none"),
        (forged([1, 2], [1.0, 0.5], HIGH + bytes(1), LOW, bytes(3)), "declares 2 bytes"),
        (forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes(3), declared=1 << 40), "declares"),
        (forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes(3), declared=0), "malformed"),
        (forged([6, 0], [1.0, 0.0], *coded([5, 0], list(range(5))), bytes(6)), "do not fit"),
        (forged([-1, 2], [1.0, 0.5], HIGH, LOW, bytes(3)), "do not fit"),
        (forged([1, 2], [-1.0, 0.5], HIGH, LOW, bytes(3)), "negative or infinite"),
        (forged([1, 2], [math.inf, 0.5], HIGH, LOW, bytes(3)), "negative or infinite"),
        (forged([0, 2], [1.0, 0.5], *coded([0, 2], [0, 3]), bytes(2)), "sends nothing"),
        (forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes([0xC0]), bits=2), "padding bits"),
        (forged([3], [1.0], HIGH, LOW, bytes(3)), "shape"),
        (forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes(3), chunk=1 << 17), "out of range"),
        (forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes(3), bits=3), "out of range"),
        (forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes(3))[:-1], "malformed"),
        (WELL_FORMED[: 8 + struct.unpack_from("<Q", WELL_FORMED)[0] + 4], "within its counts"),
    ],
)
def test_hostile_blobs_are_refused(blob: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        open_fragment(blob, SMALL)


def test_a_huge_declared_index_stream_is_refused_before_allocating() -> None:
    """A header claiming 2⁴⁰ bytes of index codes in a blob of a few hundred bytes is
    refused from the header and the counts alone (allocating it would take terabytes)."""
    blob = forged([1, 2], [1.0, 0.5], HIGH, LOW, bytes(3), declared=1 << 40)
    size = struct.unpack_from("<Q", blob)[0]
    header = msgspec.json.decode(blob[8 : 8 + size])
    assert header["high"]["shape"] == [1 << 40]
    with pytest.raises(CodecError, match="hostile"):
        open_fragment(blob, SMALL)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=2, max_size=2),
    st.binary(max_size=4),
    st.binary(max_size=4),
)
def test_any_index_streams_are_refused_or_give_increasing_offsets_in_their_chunks(
    counts: list[int], high: bytes, low: bytes
) -> None:
    """No index set a blob can hold has a duplicated, unordered or out-of-chunk offset: any
    bytes in its index streams are refused or decode to offsets strictly increasing inside
    their chunks."""
    sent = sum(counts)
    scales = [1.0 if n else 0.0 for n in counts]
    try:
        blob = open_fragment(forged(counts, scales, high, low, bytes(sent)), SMALL)
    except CodecError:
        return
    assert isinstance(blob, SparseBlob)
    y = blob.piece(0, 0, 10)
    assert [int((y[:5] != 0).sum()), int((y[5:] != 0).sum())] == counts


# -- error feedback --------------------------------------------------------------------------


def test_only_an_included_snapshot_hands_its_residual_to_the_merge() -> None:
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(shape, generator=gen) for shape in SHAPES]
    snapshot = [b + torch.randn(b.shape, generator=gen) for b in base]
    sparsity = delta_sparsity(RunConfig(topk_chunk=64, topk_density=0.1))
    _, _, left = encoded(snapshot, base, SPEC, sparsity)
    feedback = Feedback().taken(1, 9, left)
    for outcome in ("late", "rejected"):
        after, kept = feedback.resolved(1, 9, outcome)
        assert kept is None
        assert not after.pending
    earlier, kept = feedback.resolved(1, 8, "included")
    assert kept is None
    assert earlier.pending == feedback.pending
    assert feedback.resolved(2, 9, "included") == (feedback, None)
    after, kept = feedback.resolved(1, 9, "included")
    assert kept is left
    assert not after.pending
    # A later round settles a snapshot it did not include: forgotten, nothing kept.
    assert feedback.resolved(1, 10, "included")[1] is None


@pytest.mark.parametrize("keep", [1.0, 0.9, 0.0])
def test_the_unsent_residual_goes_out_with_the_next_delta(keep: float) -> None:
    """An included snapshot's merge adds the share ``keep`` of what its delta did not send
    to the weights, so a learner with no steps since still sends it from the new θ, and its
    weights are the committed θ plus what it has not sent and kept; the rest is dropped."""
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(shape, generator=gen) for shape in SHAPES]
    snapshot = [b + torch.randn(b.shape, generator=gen) for b in base]
    theta = [b + torch.randn(b.shape, generator=gen) * 0.1 for b in base]
    sparsity = Sparsity(64, 2, 0.05)
    blob, _, left = encoded(snapshot, base, SPEC, sparsity, keep=keep)
    sent = decode_fragment(blob, SPEC)
    unsent = [s - b - y for s, b, y in zip(snapshot, base, sent, strict=True)]
    for kept, e in zip(left, unsent, strict=True):
        assert torch.equal(kept, e * keep)
    local = merged(
        "included",
        local=snapshot,
        theta=theta,
        snapshot=snapshot,
        base=base,
        rule="keep-progress",
        alpha=0.0,
        kept=left,
    )
    for weights, t, e in zip(local, theta, left, strict=True):
        assert torch.equal(weights, t + e)
    blob, _, _ = encoded(local, theta, SPEC, sparsity)
    assert any(bool(t.any()) for t in decode_fragment(blob, SPEC)) == (keep > 0)


def test_a_delta_is_the_plain_topk_of_its_snapshot_minus_base() -> None:
    """What every learner sends, a restarted or joining one included: the residual lives
    in the weights, so the delta is the plain ``topk`` of ``S − B``."""
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(shape, generator=gen) for shape in SHAPES]
    snapshot = [b + torch.randn(b.shape, generator=gen) for b in base]
    sparsity = Sparsity(64, 2, 0.05)
    blob, _, _ = encoded(snapshot, base, SPEC, sparsity)
    assert blob == encode_fragment(
        snapshot, SPEC, "topk", block_size=1, sparsity=sparsity, minus=base
    )
