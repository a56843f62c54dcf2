"""The outer step against torch's SGD, bit for bit, and the exactly reproducible update."""

import hashlib

import pytest
import torch

from gradientmail.protocol.codec import ENCODINGS, decode_fragment, encode_fragment
from gradientmail.protocol.outer import apply_update, committed_update, final_step, outer_step
from gradientmail.protocol.records import Encoding, FragmentSpec, ParamSpec
from gradientmail.protocol.sparse import Sparsity

SHAPES = [(17, 33), (33,), (5, 3, 7), ()]
SPEC = FragmentSpec(
    index=0,
    params=tuple(
        ParamSpec(name=f"p{i}", shape=shape, dtype="float32") for i, shape in enumerate(SHAPES)
    ),
)


def bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.int32) for t in tensors]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(bits(a), bits(b), strict=True))


@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (0.1, 0.5), (1.0, 0.99)])
def test_outer_step_matches_torch_sgd_bitwise_over_100_rounds(lr: float, momentum: float) -> None:
    gen = torch.Generator().manual_seed(1)
    theta0 = [torch.randn(shape, generator=gen) for shape in SHAPES]
    params = [torch.nn.Parameter(t.clone()) for t in theta0]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)
    theta, buffers = [t.clone() for t in theta0], None
    for _ in range(100):
        mean_delta = [torch.randn(shape, generator=gen) * 0.01 for shape in SHAPES]
        for param, delta in zip(params, mean_delta, strict=True):
            param.grad = -delta
        optimizer.step()
        before = [t.clone() for t in theta]
        theta, buffers = outer_step(theta, buffers, mean_delta, lr=lr, momentum_coef=momentum)
        assert same_bits(theta, [p.detach() for p in params])
        assert same_bits(buffers, [optimizer.state[p]["momentum_buffer"] for p in params])
        assert not same_bits(before, theta)


def test_outer_step_leaves_its_inputs_alone() -> None:
    theta = [torch.ones(3)]
    momentum = [torch.ones(3)]
    delta = [torch.ones(3)]
    outer_step(theta, momentum, delta, lr=0.7, momentum_coef=0.9)
    assert torch.equal(theta[0], torch.ones(3))
    assert torch.equal(momentum[0], torch.ones(3))
    assert torch.equal(delta[0], torch.ones(3))


def test_first_step_and_zero_momentum() -> None:
    theta, buffers = outer_step([torch.zeros(2)], None, [torch.ones(2)], lr=0.5, momentum_coef=0.9)
    # g = −1, m = g, θ' = 0 − 0.5·(g + 0.9·m) = 0.95
    assert torch.allclose(theta[0], torch.full((2,), 0.95))
    assert torch.equal(buffers[0], torch.full((2,), -1.0))
    theta, _ = outer_step([torch.zeros(2)], None, [torch.ones(2)], lr=0.5, momentum_coef=0.0)
    assert torch.equal(theta[0], torch.full((2,), 0.5))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0, "momentum_coef": 0.9}, "lr"),
        ({"lr": float("nan"), "momentum_coef": 0.9}, "lr"),
        ({"lr": 0.7, "momentum_coef": 1.5}, "momentum"),
    ],
)
def test_outer_step_rejects_bad_hyperparameters(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        outer_step([torch.zeros(2)], None, [torch.zeros(2)], **kwargs)  # type: ignore[arg-type]


def test_outer_step_rejects_mismatched_tensors() -> None:
    with pytest.raises(ValueError, match="shape"):
        outer_step([torch.zeros(2)], None, [torch.zeros(3)], lr=0.7, momentum_coef=0.9)
    with pytest.raises(ValueError, match="momentum"):
        outer_step([torch.zeros(2)], [], [torch.zeros(2)], lr=0.7, momentum_coef=0.9)


@pytest.mark.parametrize("encoding", [*ENCODINGS, "topk"])
def test_a_learner_applying_the_update_reproduces_the_committed_theta(encoding: Encoding) -> None:
    gen = torch.Generator().manual_seed(2)
    syncer = [torch.randn(shape, generator=gen) for shape in SHAPES]
    learner = [t.clone() for t in syncer]
    momentum = None
    for _ in range(20):
        mean_delta = [torch.randn(shape, generator=gen) * 0.01 for shape in SHAPES]
        raw, momentum = outer_step(syncer, momentum, mean_delta, lr=0.7, momentum_coef=0.9)
        blob, syncer = committed_update(
            syncer, raw, SPEC, encoding, block_size=64, version=1, sparsity=Sparsity(64, 8, None)
        )
        learner = apply_update(learner, blob, SPEC)
        assert same_bits(learner, syncer)


def test_in_place_application_matches() -> None:
    theta = [torch.randn(shape) for shape in SHAPES]
    raw = [t + 0.01 * torch.randn_like(t) for t in theta]
    blob, committed = committed_update(theta, raw, SPEC, "int8", block_size=16, version=1)
    in_place = [t.clone() for t in theta]
    for t, u in zip(in_place, decode_fragment(blob, SPEC), strict=True):
        t.add_(u)
    assert same_bits(in_place, committed)


def test_a_round_without_snapshots_commits_theta_and_a_zero_update() -> None:
    theta = [torch.randn(shape) for shape in SHAPES]
    blob, committed = committed_update(theta, theta, SPEC, "int4", block_size=8, version=5)
    assert same_bits(committed, theta)
    zeros = [torch.zeros(shape) for shape in SHAPES]
    assert blob == encode_fragment(zeros, SPEC, "int4", block_size=8, version=5)


@pytest.mark.parametrize("encoding", ["fp32", "int8", "topk"])
def test_equal_updates_of_two_versions_are_two_blobs(encoding: Encoding) -> None:
    """Collection deletes a blob by its name: a zero update of one round must not be the
    blob another round's record names, or collecting the first takes the second's."""
    theta = [torch.randn(shape) for shape in SHAPES]
    sparsity = Sparsity(64, 8, None)
    first, _ = committed_update(
        theta, theta, SPEC, encoding, block_size=8, version=5, sparsity=sparsity
    )
    again, _ = committed_update(
        theta, theta, SPEC, encoding, block_size=8, version=5, sparsity=sparsity
    )
    later, _ = committed_update(
        theta, theta, SPEC, encoding, block_size=8, version=6, sparsity=sparsity
    )
    assert first == again
    assert hashlib.sha256(first).digest() != hashlib.sha256(later).digest()
    assert same_bits(decode_fragment(first, SPEC), decode_fragment(later, SPEC))


def test_a_final_step_adds_the_mean_delta_and_keeps_the_momentum() -> None:
    theta = [torch.tensor([1.0, 2.0])]
    momentum = [torch.tensor([0.5, -0.5])]
    raw, kept = final_step(theta, momentum, [torch.tensor([0.25, -1.0])])
    assert torch.equal(raw[0], torch.tensor([1.25, 1.0]))
    assert torch.equal(kept[0], momentum[0])
    assert kept[0] is not momentum[0]
    _, fresh = final_step(theta, None, [torch.zeros(2)])
    assert torch.equal(fresh[0], torch.zeros(2))
    with pytest.raises(ValueError, match="theta and mean_delta"):
        final_step(theta, None, [torch.zeros(3)])
