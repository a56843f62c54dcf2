"""A round's aggregation: every rejection reason, weights, the mean and the cosine."""

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.protocol.aggregation import (
    MAX_DELTA_RATIO,
    Candidate,
    aggregate,
    counted_snapshots,
    refused,
)
from gradientmail.protocol.mean import l2_norm
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    ParamSpec,
    RejectReason,
    RunConfig,
    Snapshot,
)

SPEC = FragmentSpec(
    index=1,
    params=(
        ParamSpec(name="a.weight", shape=(2, 3), dtype="float32"),
        ParamSpec(name="a.bias", shape=(3,), dtype="float32"),
    ),
)
CONFIG = RunConfig(fragments=2, sync_every=4, max_staleness=1, max_tokens_per_step=100)
VERSION = 5
ROUND = VERSION * 2 + 1  # the round taking fragment 1 from version 5 to 6
REF = BlobRef(sha256="0" * 64, size=1, encoding="fp32")


def snapshot(learner: str, **changes: object) -> Snapshot:
    fields: dict[str, object] = {
        "learner": learner,
        "round": ROUND,
        "fragment": 1,
        "base_version": VERSION,
        "steps": 4,
        "tokens": 40,
        "delta": REF,
        "norm": 1.0,
    }
    fields.update(changes)
    return Snapshot(**fields)  # type: ignore[arg-type]


def delta(value: float) -> list[torch.Tensor]:
    return [torch.full((2, 3), value), torch.full((3,), value)]


def good(learner: str, value: float = 1.0, **changes: object) -> Candidate:
    return Candidate(snapshot=snapshot(learner, **changes), delta=delta(value), problem=None)


def reasons(result: object) -> dict[str, RejectReason]:
    return {r.learner: r.reason for r in result.rejected}  # type: ignore[attr-defined]


def test_a_clean_round_weighs_by_tokens() -> None:
    result = aggregate(
        VERSION, [good("b", 3.0, tokens=30), good("a", 1.0, tokens=10)], SPEC, CONFIG
    )
    assert [p.learner for p in result.participants] == ["a", "b"]
    assert [p.weight for p in result.participants] == [0.25, 0.75]
    assert result.participants[0].steps == 4
    assert result.participants[0].tokens == 10
    assert result.participants[0].base_version == VERSION
    assert result.rejected == ()
    assert result.mean is not None
    for tensor in result.mean:
        assert tensor.dtype == torch.float32
        assert torch.allclose(tensor, torch.full_like(tensor, 2.5))
    assert result.cosine == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("weighting", "expected"),
    [("tokens", [0.25, 0.75]), ("steps", [0.75, 0.25]), ("equal", [0.5, 0.5])],
)
def test_weighting(weighting: str, expected: list[float]) -> None:
    config = RunConfig(fragments=2, sync_every=4, weighting=weighting)  # type: ignore[arg-type]
    candidates = [good("a", tokens=10, steps=3), good("b", tokens=30, steps=1)]
    result = aggregate(VERSION, candidates, SPEC, config)
    assert [p.weight for p in result.participants] == pytest.approx(expected)


def test_zero_tokens_everywhere_falls_back_to_equal_weights() -> None:
    result = aggregate(VERSION, [good("a", tokens=0), good("b", tokens=0)], SPEC, CONFIG)
    assert [p.weight for p in result.participants] == [0.5, 0.5]


@pytest.mark.parametrize(
    ("candidate", "reason", "detail"),
    [
        (
            Candidate(snapshot=snapshot("x"), delta=None, problem=("corrupt", "hash mismatch")),
            "corrupt",
            "hash mismatch",
        ),
        (
            Candidate(snapshot=snapshot("x"), delta=None, problem=("shape", "other model")),
            "shape",
            "other model",
        ),
        (good("x", round=ROUND + 2), "corrupt", "names round"),
        (good("x", fragment=0), "shape", "fragment 0"),
        (
            Candidate(snapshot=snapshot("x"), delta=delta(1.0)[:1], problem=None),
            "shape",
            "1 tensors",
        ),
        (
            Candidate(
                snapshot=snapshot("x"), delta=[torch.ones(3, 2), torch.ones(3)], problem=None
            ),
            "shape",
            "a.weight",
        ),
        (good("x", math.nan), "non-finite", "NaN or Inf"),
        (good("x", math.inf), "non-finite", "NaN or Inf"),
        (good("x", base_version=VERSION - 2), "stale", "based on version 3"),
        (good("x", base_version=VERSION + 1), "stale", "newer"),
        (good("x", steps=0), "tokens", "0 steps"),
        (good("x", tokens=-1), "tokens", "-1 tokens"),
        (good("x", steps=2, tokens=201), "tokens", "over 100 per step"),
    ],
)
def test_each_rejection_reason(candidate: Candidate, reason: str, detail: str) -> None:
    result = aggregate(VERSION, [candidate, good("ok")], SPEC, CONFIG)
    assert [p.learner for p in result.participants] == ["ok"]
    (rejection,) = result.rejected
    assert rejection.learner == "x"
    assert rejection.reason == reason
    assert detail in rejection.detail
    assert rejection.steps == candidate.snapshot.steps
    assert rejection.tokens == candidate.snapshot.tokens
    assert result.cosine is None


def test_the_largest_finite_deltas_are_finite() -> None:
    largest = float(torch.finfo(torch.float32).max)
    result = aggregate(VERSION, [good("x", largest), good("y", -largest)], SPEC, CONFIG)
    assert [p.learner for p in result.participants] == ["x", "y"]
    assert not result.rejected
    assert result.mean is not None
    assert all(bool(torch.isfinite(t).all()) for t in result.mean)


def test_staleness_boundary_is_accepted() -> None:
    result = aggregate(VERSION, [good("x", base_version=VERSION - 1)], SPEC, CONFIG)
    assert [p.learner for p in result.participants] == ["x"]
    assert result.rejected == ()


def test_tokens_boundary_is_accepted() -> None:
    result = aggregate(VERSION, [good("x", steps=2, tokens=200)], SPEC, CONFIG)
    assert result.rejected == ()


def test_outliers_need_three_snapshots() -> None:
    two = aggregate(VERSION, [good("a", 1.0), good("b", 100.0)], SPEC, CONFIG)
    assert reasons(two) == {}
    three = aggregate(VERSION, [good("a", 1.0), good("b", 1.1), good("c", 100.0)], SPEC, CONFIG)
    assert reasons(three) == {"c": "outlier"}
    assert "median" in three.rejected[0].detail
    assert [p.learner for p in three.participants] == ["a", "b"]


def test_outlier_norms_are_recomputed_not_trusted() -> None:
    liar = good("c", 100.0, norm=1.0)
    result = aggregate(VERSION, [good("a", 1.0, norm=50.0), good("b", 1.0), liar], SPEC, CONFIG)
    assert reasons(result) == {"c": "outlier"}


def test_outliers_are_judged_among_snapshots_that_passed_the_other_checks() -> None:
    # The NaN snapshot does not count towards the three: two remain, no outlier test.
    result = aggregate(
        VERSION, [good("a", 1.0), good("b", 100.0), good("c", math.nan)], SPEC, CONFIG
    )
    assert reasons(result) == {"c": "non-finite"}


def test_a_full_snapshot_among_short_closing_ones_is_judged_per_step() -> None:
    # The survivors' flush after a restart: three closing learners' partial deltas of 20
    # steps and the restarted learner's full one of 100, each moving 0.1 per step.
    config = RunConfig(fragments=2, sync_every=100, max_tokens_per_step=100)
    short = [good(name, 2.0, steps=20, closing=True) for name in ("a", "b", "c")]
    full = good("d", 10.0, steps=100)
    result = aggregate(VERSION, [*short, full], SPEC, config)
    assert reasons(result) == {}
    assert [p.learner for p in result.participants] == ["a", "b", "c", "d"]
    # Per step it is the same test: the full snapshot 5.5 times faster is still rejected.
    fast = good("d", 55.0, steps=100)
    rejected = aggregate(VERSION, [*short, fast], SPEC, config)
    assert reasons(rejected) == {"d": "outlier"}
    assert "brought to 100 steps" in rejected.rejected[0].detail


def test_a_short_snapshot_among_full_ones_is_allowed_the_square_root_of_its_steps() -> None:
    """A learner restarted with a fresh optimizer publishes after one step among three full
    snapshots of 100 steps: its one AdamW step moves each element by about the learning
    rate, the full ones' 100 steps (noise, mostly) move about 3 of it, as √100 steps of
    a third of it would. Brought to one step as 1/100 of theirs (per step) the others
    allowed it 5 × 0.03 and rejected it (the full-size kill benchmark's restarted learner,
    when its first snapshot came at its first step); as 1/√100 they allow it 5 × 0.3. One
    moving as much as a full snapshot in its one step is still rejected."""
    config = RunConfig(fragments=2, sync_every=100, max_tokens_per_step=100)
    full = [good(name, 3.0, steps=100) for name in ("a", "b", "c")]
    result = aggregate(VERSION, [*full, good("d", 1.0, steps=1)], SPEC, config)
    assert reasons(result) == {}
    assert [p.learner for p in result.participants] == ["a", "b", "c", "d"]
    liar = aggregate(VERSION, [*full, good("d", 3.0, steps=1)], SPEC, config)
    assert reasons(liar) == {"d": "outlier"}
    assert "brought to 1 step" in liar.rejected[0].detail


def test_claiming_more_than_sync_every_steps_buys_no_larger_allowance() -> None:
    # Steps are the writer's claim: one claiming 25 × H with a delta 25 times the others' is
    # judged as H steps, like them.
    honest = [good(name, 1.0) for name in ("a", "b", "c")]
    inflated = good("d", 25.0, steps=100, tokens=100)
    result = aggregate(VERSION, [*honest, inflated], SPEC, CONFIG)
    assert reasons(result) == {"d": "outlier"}


def test_norm_at_the_limit_is_kept() -> None:
    config = RunConfig(fragments=2, sync_every=4, outlier_factor=2.0)
    result = aggregate(VERSION, [good("a", 1.0), good("b", 1.0), good("c", 2.0)], SPEC, config)
    assert reasons(result) == {}


def test_everything_rejected_gives_no_mean() -> None:
    result = aggregate(VERSION, [good("b", math.nan), good("a", steps=0)], SPEC, CONFIG)
    assert result.mean is None
    assert result.participants == ()
    assert [r.learner for r in result.rejected] == ["a", "b"]
    assert result.cosine is None


def test_no_candidates() -> None:
    result = aggregate(VERSION, [], SPEC, CONFIG)
    assert result.mean is None
    assert result.rejected == ()


def test_cosine_of_opposite_and_orthogonal_deltas() -> None:
    ones = delta(1.0)
    x = Candidate(snapshot=snapshot("x"), delta=[t.clone() for t in ones], problem=None)
    y = Candidate(snapshot=snapshot("y"), delta=[-t for t in ones], problem=None)
    result = aggregate(VERSION, [x, y], SPEC, CONFIG)
    assert result.cosine == 0.0  # the mean is zero
    e1 = [torch.zeros(2, 3), torch.zeros(3)]
    e1[0][0, 0] = 1.0
    e2 = [torch.zeros(2, 3), torch.zeros(3)]
    e2[1][0] = 1.0
    result = aggregate(
        VERSION,
        [
            Candidate(snapshot=snapshot("x"), delta=e1, problem=None),
            Candidate(snapshot=snapshot("y"), delta=e2, problem=None),
        ],
        SPEC,
        CONFIG,
    )
    assert result.cosine == pytest.approx(math.sqrt(0.5))


def test_caller_bugs_raise() -> None:
    with pytest.raises(ValueError, match="two candidates"):
        aggregate(VERSION, [good("a"), good("a")], SPEC, CONFIG)
    with pytest.raises(ValueError, match="neither a delta nor a problem"):
        aggregate(
            VERSION, [Candidate(snapshot=snapshot("a"), delta=None, problem=None)], SPEC, CONFIG
        )


def test_l2_norm() -> None:
    assert l2_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == 5.0
    assert l2_norm([torch.tensor([math.nan])]) is None
    assert l2_norm([torch.zeros(0)]) == 0.0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-10, 10, width=32), st.integers(1, 5), st.integers(0, 400)),
        min_size=1,
        max_size=6,
    ),
    st.randoms(use_true_random=False),
)
def test_order_does_not_matter_and_weights_sum_to_one(
    entries: list[tuple[float, int, int]], rng: object
) -> None:
    weights = _order_free_mean(entries, rng, CONFIG)
    if weights:
        assert math.fsum(weights) == pytest.approx(1.0)


def _order_free_mean(
    entries: list[tuple[float, int, int]], rng: object, config: RunConfig
) -> list[float]:
    """Aggregate ``entries`` in their order and shuffled: the same participants, rejections
    and mean bits, the mean the weighted sum of the deltas; the participants' weights."""
    candidates = [
        good(f"l{i}", value, steps=steps, tokens=tokens)
        for i, (value, steps, tokens) in enumerate(entries)
    ]
    first = aggregate(VERSION, candidates, SPEC, config)
    shuffled = list(candidates)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    second = aggregate(VERSION, shuffled, SPEC, config)
    assert first.participants == second.participants
    assert first.rejected == second.rejected
    assert len(first.participants) + len(first.rejected) == len(candidates)
    if first.participants:
        assert first.mean is not None
        assert second.mean is not None
        for a, b in zip(first.mean, second.mean, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        weights = {p.learner: p.weight for p in first.participants}
        expected = math.fsum(
            weights[c.snapshot.learner] * float(c.delta[0][0, 0])  # type: ignore[index]
            for c in candidates
            if c.snapshot.learner in weights
        )
        assert float(first.mean[0][0, 0]) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    return [p.weight for p in first.participants]


@pytest.mark.parametrize("honest", [0, 1, 2])
def test_a_delta_far_larger_than_theta_is_rejected_whatever_the_count(honest: int) -> None:
    """A diverged learner (finite parameters of 3e38) claiming the most tokens allowed: the
    median rule needs three snapshots, the bound relative to θ does not."""
    theta = delta(2.0)
    bound = MAX_DELTA_RATIO * ((l2_norm(theta) or 0.0) + 3.0)
    candidates = [good(f"h{i}", 0.5) for i in range(honest)]
    candidates.append(good("diverged", 3e38, tokens=400))
    candidates.append(good("large", bound, tokens=400))  # every element at the bound: over
    result = aggregate(VERSION, candidates, SPEC, CONFIG, theta=theta)
    assert reasons(result) == {"diverged": "outlier", "large": "outlier"}
    assert [p.learner for p in result.participants] == [f"h{i}" for i in range(honest)]
    assert result.mean is None or all(bool(torch.isfinite(t).all()) for t in result.mean)
    within = aggregate(VERSION, [good("a", bound / 3)], SPEC, CONFIG, theta=theta)
    assert within.rejected == ()


def test_refused_rejects_every_participant_as_non_finite() -> None:
    result = refused(aggregate(VERSION, [good("a"), good("b")], SPEC, CONFIG), "overflow")
    assert reasons(result) == {"a": "non-finite", "b": "non-finite"}
    assert result.mean is None
    assert result.participants == ()


def final(learner: str, value: float) -> Candidate:
    return good(learner, value, steps=0, tokens=0, final=True)


def test_final_snapshots_make_a_round_only_alone_and_with_no_live_learner_missing() -> None:
    finals = [final("a", 1.0), final("b", 3.0)]

    def names(candidates: list[Candidate]) -> list[str]:
        return [c.snapshot.learner for c in candidates]

    assert names(counted_snapshots(finals, frozenset())) == ["a", "b"]
    assert names(counted_snapshots(finals, frozenset({"c"}))) == []  # c goes on: not a final round
    assert names(counted_snapshots([*finals, good("c")], frozenset())) == ["c"]
    result = aggregate(VERSION, finals, SPEC, CONFIG, theta=delta(0.0))
    assert reasons(result) == {}
    assert [p.weight for p in result.participants] == [0.5, 0.5]  # no tokens: equal weights
    assert result.mean is not None
    assert torch.equal(result.mean[0], torch.full((2, 3), 2.0))


@pytest.mark.parametrize(
    "changes", [{"steps": 1, "tokens": 0}, {"steps": 0, "tokens": 5}, {"steps": 0, "tokens": -1}]
)
def test_a_final_snapshot_with_steps_or_tokens_is_rejected(changes: dict[str, int]) -> None:
    candidate = good("a", 1.0, final=True, **changes)
    assert reasons(aggregate(VERSION, [candidate], SPEC, CONFIG, theta=delta(0.0))) == {
        "a": "tokens"
    }


ROBUST = msgspec.structs.replace(CONFIG, robust=True)


def test_by_default_no_weight_is_capped_and_no_delta_clipped() -> None:
    """The round ``robust`` would bound (a liar claiming thrice the tokens per step, with a
    delta ten times the others') is weighed and averaged as claimed."""
    candidates = [good("a", 1.0, tokens=10), good("b", 1.0, tokens=10), good("c", 4.0, tokens=30)]
    plain = aggregate(VERSION, candidates, SPEC, CONFIG)
    assert [p.weight for p in plain.participants] == [0.2, 0.2, 0.6]
    assert all(p.bounded is msgspec.UNSET for p in plain.participants)
    assert plain.mean is not None
    assert torch.allclose(plain.mean[0], torch.full((2, 3), 2.8))
    bounded = aggregate(VERSION, candidates, SPEC, ROBUST)
    assert [p.bounded is msgspec.UNSET for p in bounded.participants] == [True, True, False]
    assert bounded.mean is not None
    assert torch.allclose(bounded.mean[0], torch.full((2, 3), 1.0))


def test_robust_a_clean_round_weighs_by_tokens() -> None:
    result = aggregate(
        VERSION,
        [good("b", 3.0, steps=3, tokens=30), good("a", 1.0, steps=1, tokens=10)],
        SPEC,
        ROBUST,
    )
    assert [p.learner for p in result.participants] == ["a", "b"]
    assert [p.weight for p in result.participants] == [0.25, 0.75]
    assert all(p.bounded is msgspec.UNSET for p in result.participants)
    assert result.participants[0].steps == 1
    assert result.rejected == ()
    assert result.mean is not None
    for tensor in result.mean:
        assert torch.allclose(tensor, torch.full_like(tensor, 2.5))
    assert result.cosine == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("weighting", "expected"),
    [("tokens", [0.75, 0.25]), ("steps", [0.75, 0.25]), ("equal", [0.5, 0.5])],
)
def test_robust_weighting(weighting: str, expected: list[float]) -> None:
    config = RunConfig(fragments=2, sync_every=4, weighting=weighting, robust=True)  # type: ignore[arg-type]
    candidates = [good("a", 3.0, tokens=30, steps=3), good("b", 1.0, tokens=10, steps=1)]
    result = aggregate(VERSION, candidates, SPEC, config)
    assert [p.weight for p in result.participants] == pytest.approx(expected)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-10, 10, width=32), st.integers(1, 5), st.integers(0, 400)),
        min_size=1,
        max_size=6,
    ),
    st.randoms(use_true_random=False),
)
def test_robust_order_does_not_matter_and_weights_sum_to_at_most_one(
    entries: list[tuple[float, int, int]], rng: object
) -> None:
    # Clipped deltas weigh less than their normalized weight, never more.
    assert math.fsum(_order_free_mean(entries, rng, ROBUST)) <= 1.0 + 1e-12


def test_robust_final_snapshots_are_clipped_to_the_lower_median_of_two() -> None:
    result = aggregate(VERSION, [final("a", 1.0), final("b", 3.0)], SPEC, ROBUST, theta=delta(0.0))
    assert reasons(result) == {}
    # No tokens: equal weights; b's delta is clipped to a's norm (the lower median of two).
    assert [p.weight for p in result.participants] == pytest.approx([0.5, 0.5 / 3])
    assert result.mean is not None
    assert torch.allclose(result.mean[0], torch.full((2, 3), 1.0))
