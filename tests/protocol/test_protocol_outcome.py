"""A round's outcome (``protocol.outcome``): the aggregate, θ_{v+1}, the momentum and the
update, and the refusal of an outer step that is not finite."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from gradientmail.protocol.aggregation import Aggregate, Candidate, aggregate
from gradientmail.protocol.config import TOPK_CHECKPOINT_EVERY
from gradientmail.protocol.outcome import NON_FINITE, finite, outcome, refused_non_finite
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    ParamSpec,
    Participant,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.sparse import sent_as

SPEC = FragmentSpec(index=0, params=(ParamSpec(name="w", shape=(3,), dtype="float32"),))
CONFIG = RunConfig(fragments=1, sync_every=4, outer_lr=1.0, outer_momentum=0.9)


def candidate(
    learner: str, delta: torch.Tensor, *, final: bool = False, round: int = 5
) -> Candidate:
    snapshot = Snapshot(
        learner=learner, round=round, fragment=0, base_version=round,
        steps=0 if final else 4, tokens=0 if final else 40,
        delta=BlobRef(sha256="0" * 64, size=1, encoding="fp32"), norm=None,
        final=True if final else None,
    )  # fmt: skip
    return Candidate(snapshot=snapshot, delta=[delta], problem=None)


def test_an_outer_step_that_overflows_commits_nothing() -> None:
    """Deltas within the bound whose outer step is not finite: the round rejects them as
    non-finite and commits θ, U and the momentum unchanged and finite."""
    theta = (torch.full((3,), 3e36),)
    done = outcome(5, theta, None, [candidate("a", torch.full((3,), 2e38))], SPEC, CONFIG)
    assert [(r.learner, r.reason, r.detail) for r in done.result.rejected] == [
        ("a", "non-finite", NON_FINITE)
    ]
    assert done.result.participants == ()
    assert torch.equal(done.theta[0], theta[0])
    assert torch.equal(done.momentum[0], torch.zeros(3))


def test_a_finite_step_stands_and_a_round_without_snapshots_is_not_refused() -> None:
    participant = Participant(learner="a", weight=1.0, steps=1, tokens=1, base_version=0)
    accepted = Aggregate(
        mean=[torch.ones(3)], participants=(participant,), rejected=(), cosine=None
    )
    empty = Aggregate(mean=None, participants=(), rejected=(), cosine=None)
    ones, infinite = [torch.ones(3)], [torch.tensor([1.0, float("inf"), 0.0])]
    assert refused_non_finite(accepted, ones, ones) is None
    assert refused_non_finite(empty, infinite, infinite) is None
    refused = refused_non_finite(accepted, ones, infinite)
    assert refused is not None
    assert [(r.learner, r.reason) for r in refused.rejected] == [("a", "non-finite")]
    assert not finite(ones, infinite)


def test_a_final_round_adds_the_mean_and_keeps_the_momentum() -> None:
    theta, momentum = (torch.ones(3),), (torch.full((3,), 0.5),)
    finals = [
        candidate(name, torch.full((3,), value), final=True)
        for name, value in [("a", 2.0), ("b", 4.0)]
    ]
    done = outcome(5, theta, momentum, finals, SPEC, CONFIG)
    assert torch.equal(done.theta[0], torch.full((3,), 4.0))
    assert torch.equal(done.momentum[0], momentum[0])


def test_a_topk_runs_final_round_commits_the_mean_through_a_dense_update() -> None:
    """A ``topk`` run's final round sends its update dense (``sent_as``): θ_{v+1} is θ plus
    the mean of what the closing learners' weights held, to int4's rounding; its other
    rounds keep the ``topk`` update."""
    config = RunConfig(
        fragments=1, sync_every=4, delta_encoding="topk", update_encoding="topk", topk_chunk=3
    )
    theta = (torch.zeros(3),)
    residuals = {"a": [0.4, 1.0, -0.5], "b": [0.2, 3.0, 0.5]}
    finals = [candidate(n, torch.tensor(v), final=True) for n, v in residuals.items()]
    done = outcome(5, theta, None, finals, SPEC, config)
    assert done.encoding == sent_as(config, "update", final=True) == "int4"
    assert sent_as(config, "delta", final=True) == "int4"
    assert sent_as(config, "delta", final=False) == "topk"
    assert torch.allclose(done.theta[0], torch.tensor([0.3, 2.0, 0.0]), atol=2.0 / 7)
    ordinary = [candidate(n, torch.tensor(v)) for n, v in residuals.items()]
    assert outcome(5, theta, None, ordinary, SPEC, config).encoding == "topk"


def test_a_sparse_configs_update_moves_only_what_its_round_sent() -> None:
    """``RunConfig.sparse()``: ``topk`` both ways, fields given kept, outer lr 1 and no
    momentum, so that a round's update moves only the elements its deltas sent; with a
    momentum it also moves every element an earlier round moved, dense in a long run."""
    spec = FragmentSpec(index=0, params=(ParamSpec(name="w", shape=(8,), dtype="float32"),))
    sparse = RunConfig.sparse(topk_density=0.25, fragments=1, sync_every=4, topk_chunk=8)
    assert (sparse.delta_encoding, sparse.update_encoding, sparse.topk_density) == (
        "topk",
        "topk",
        0.25,
    )
    assert (sparse.outer_lr, sparse.outer_momentum) == (1.0, 0.0)
    assert sparse.checkpoint_interval == TOPK_CHECKPOINT_EVERY
    assert RunConfig.sparse(outer_lr=2.0).outer_lr == 2.0
    assert RunConfig.sparse().topk_density == RunConfig().topk_density
    with_momentum = replace(sparse, outer_momentum=0.6)
    first, second = torch.zeros(8), torch.zeros(8)
    first[0], second[7] = 1.0, 1.0
    for config, moved in ((sparse, [7]), (with_momentum, [0, 7])):
        one = outcome(5, (torch.zeros(8),), None, [candidate("a", first)], spec, config)
        assert one.encoding == "topk"
        later = [candidate("a", second, round=6)]
        two = outcome(6, one.theta, one.momentum, later, spec, config)
        assert (two.theta[0] != one.theta[0]).nonzero().flatten().tolist() == moved


MAGNITUDES = st.sampled_from([1.0, 1e30, 3e36, 1e38, 3e38])
VECTORS = st.lists(
    st.tuples(MAGNITUDES, st.sampled_from([-1.0, 1.0])).map(lambda v: v[0] * v[1]),
    min_size=3,
    max_size=3,
)


@settings(max_examples=60, deadline=None)
@given(
    VECTORS,
    st.lists(VECTORS, min_size=1, max_size=3),
    st.one_of(st.none(), MAGNITUDES),
    st.sampled_from([0.0, 0.9]),
)
def test_a_committed_round_is_finite_and_a_refused_one_changes_nothing(
    theta_values: list[float],
    deltas: list[list[float]],
    momentum_value: float | None,
    coefficient: float,
) -> None:
    """Over finite θ, momentum and deltas of any size: θ_{v+1} and the momentum are finite;
    a refused round commits θ and the momentum bit for bit and rejects exactly the
    snapshots the aggregate accepted; a round that is not refused is the aggregate's."""
    config = RunConfig(fragments=1, sync_every=4, outer_lr=1.0, outer_momentum=coefficient)
    theta = (torch.tensor(theta_values),)
    momentum = None if momentum_value is None else (torch.full((3,), momentum_value),)
    candidates = [candidate(f"l{k}", torch.tensor(values)) for k, values in enumerate(deltas)]
    before = [t.clone() for t in theta]
    done = outcome(5, theta, momentum, candidates, SPEC, config)
    alone = aggregate(5, candidates, SPEC, config, theta=theta, momentum=momentum)
    assert finite(done.theta, done.momentum)
    assert torch.equal(theta[0], before[0])
    refused = [r for r in done.result.rejected if r.detail == NON_FINITE]
    if not refused:
        assert done.result.participants == alone.participants
        assert done.result.rejected == alone.rejected
        return
    assert sorted(r.learner for r in refused) == [p.learner for p in alone.participants]
    assert done.result.participants == ()
    assert torch.equal(done.theta[0], theta[0])
    kept = momentum[0] if momentum is not None else torch.zeros(3)
    assert torch.equal(done.momentum[0], kept)
