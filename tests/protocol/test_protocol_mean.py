"""A round's mean (``protocol.mean``): a ``topk`` delta counts only at the elements it sent,
a dense one everywhere; the round (``aggregate``) and a replay (``checkpoint.mean_of``)
take the same mean, and ``RunConfig.robust`` counts every delta everywhere."""

import math

import hypothesis.strategies as st
import msgspec
import pytest
import torch
from hypothesis import given, settings

from gradientmail.protocol.aggregation import Candidate, aggregate
from gradientmail.protocol.checkpoint import mean_of
from gradientmail.protocol.codec import encode_fragment, open_fragment, tensors_of
from gradientmail.protocol.mean import by_senders, weighted_mean
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    ParamSpec,
    RoundRecord,
    RunConfig,
    Snapshot,
    SnapshotPart,
)
from gradientmail.protocol.sparse import Sparsity

SPEC = FragmentSpec(
    index=0,
    params=(
        ParamSpec(name="w", shape=(4, 5), dtype="float32"),
        ParamSpec(name="b", shape=(3,), dtype="float32"),
    ),
)
NUMEL = 23
SPARSITY = Sparsity(chunk=8, bits=2, density=0.25)
CONFIG = RunConfig(fragments=1, sync_every=4, delta_encoding="topk", update_encoding="topk")
ROBUST = msgspec.structs.replace(CONFIG, robust=True)


def split(values: list[float]) -> list[torch.Tensor]:
    flat = torch.tensor(values, dtype=torch.float32)
    return [flat[:20].view(4, 5).clone(), flat[20:].clone()]


def sparse_blob(values: list[float]) -> bytes:
    return encode_fragment(split(values), SPEC, "topk", block_size=8, sparsity=SPARSITY)


def ref(encoding: str) -> BlobRef:
    return BlobRef(sha256="0" * 64, size=1, encoding=encoding)


def snapshot(learner: str, tokens: int, encoding: str = "topk") -> Snapshot:
    return Snapshot(
        learner=learner,
        round=0,
        fragment=0,
        base_version=0,
        steps=4,
        tokens=tokens,
        delta=ref(encoding),
        norm=None,
    )


magnitudes = st.floats(2.0**-10, 1e3, width=32)
element = st.one_of(
    st.just(0.0), st.tuples(st.booleans(), magnitudes).map(lambda t: -t[1] if t[0] else t[1])
)
values = st.lists(element, min_size=NUMEL, max_size=NUMEL)


@settings(max_examples=60, deadline=None)
@given(st.lists(values, min_size=1, max_size=4), st.data())
def test_each_element_is_the_mean_of_the_deltas_that_sent_it(
    deltas: list[list[float]], data: st.DataObject
) -> None:
    """Against the formula in float64: ``Σ wᵢ·xᵢ / Σ wᵢ`` over the deltas that sent the
    element (every element of a dense one), 0 where none did."""
    dense = [data.draw(st.booleans()) for _ in deltas]
    raw = [data.draw(st.integers(1, 100)) for _ in deltas]
    weights = [w / math.fsum(raw) for w in raw]
    decoded = [
        split(d) if is_dense else tensors_of(open_fragment(sparse_blob(d), SPEC))
        for d, is_dense in zip(deltas, dense, strict=True)
    ]
    got = weighted_mean(decoded, weights, SPEC, [not d for d in dense])
    flat = torch.stack([torch.cat([t.reshape(-1) for t in delta]) for delta in decoded]).double()
    w = torch.tensor(weights, dtype=torch.float64).unsqueeze(1)
    sent = torch.where(torch.tensor(dense).unsqueeze(1), 1.0, (flat != 0).double())
    total, count, size = ((w * x).sum(0) for x in (flat, sent, flat.abs()))
    divisor = torch.where(count > 0, count, 1.0)
    want = torch.where(count > 0, total / divisor, 0.0)
    # fp32 sums of terms that may cancel: the error scales with the terms, not the result.
    error = (torch.cat([t.reshape(-1) for t in got]).double() - want).abs()
    assert bool((error <= 1e-5 * size / divisor).all()), (error.max(), want)


def test_an_element_one_learner_sent_is_its_value_not_a_share_of_it() -> None:
    only_a = [0.0] * NUMEL
    only_a[0] = 5.0
    both = [0.0] * NUMEL
    both[0], both[9] = 1.0, 3.0
    candidates = [
        Candidate(snapshot("a", 10), open_fragment(sparse_blob(only_a), SPEC)),
        Candidate(snapshot("b", 30), open_fragment(sparse_blob(both), SPEC)),
    ]
    result = aggregate(0, candidates, SPEC, CONFIG)
    assert result.mean is not None
    flat = torch.cat([t.reshape(-1) for t in result.mean])
    assert flat[0].item() == (0.25 * 5.0 + 0.75 * 1.0) / 1.0
    assert flat[9].item() == 3.0
    assert int((flat != 0).sum()) == 2
    robust = aggregate(0, candidates, SPEC, ROBUST)
    assert robust.mean is not None
    weight = robust.participants[1].weight
    assert torch.cat([t.reshape(-1) for t in robust.mean])[9].item() == pytest.approx(weight * 3.0)


def test_a_replay_takes_the_rounds_mean_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    datas = [torch.randn(NUMEL, generator=generator).tolist() for _ in range(3)]
    snapshots = [snapshot(name, tokens) for name, tokens in zip("abc", (5, 7, 11), strict=True)]
    snapshots[2] = snapshot("c", 11, encoding="int8")
    deltas = [open_fragment(sparse_blob(d), SPEC) for d in datas[:2]]
    deltas.append(open_fragment(encode_fragment(split(datas[2]), SPEC, "int8", block_size=8), SPEC))
    candidates = [Candidate(s, d) for s, d in zip(snapshots, deltas, strict=True)]
    result = aggregate(0, candidates, SPEC, CONFIG)
    assert result.mean is not None
    record = RoundRecord(
        round=0,
        fragment=0,
        version=1,
        committed_by="a",
        participants=result.participants,
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=result.cosine,
        update=ref("topk"),
    )
    replay, final = mean_of(
        record, [(s, tensors_of(d)) for s, d in zip(snapshots, deltas, strict=True)], SPEC, CONFIG
    )
    assert replay is not None
    assert not final
    for a, b in zip(replay, result.mean, strict=True):
        assert torch.equal(a, b)


def test_which_deltas_count_only_where_they_sent() -> None:
    assert by_senders(snapshot("a", 1), CONFIG)
    assert not by_senders(snapshot("a", 1, encoding="int4"), CONFIG)
    assert not by_senders(snapshot("a", 1), ROBUST)
    parts = tuple(
        SnapshotPart(delta=ref(encoding), rows=((0, 2), (0, 3))) for encoding in ("topk", "topk")
    )
    parted = msgspec.structs.replace(snapshot("a", 1), delta=msgspec.UNSET, parts=parts)
    assert by_senders(parted, CONFIG)
    dense_part = SnapshotPart(delta=ref("int8"), rows=parts[0].rows)
    mixed = msgspec.structs.replace(parted, parts=(parts[0], dense_part))
    assert not by_senders(mixed, CONFIG)
