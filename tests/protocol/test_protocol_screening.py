"""Screening a round's deltas against a trusted loss: the verdicts, the trial tensors, and
the aggregation that drops what the screen rejects (``protocol.screening``)."""

import math
from collections.abc import Mapping

import msgspec
import pytest
import torch
from bounds_helpers import CONFIG, SPEC, VERSION, candidate, tensors
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.protocol.aggregation import Candidate, aggregate
from gradientmail.protocol.records import FragmentSpec, ParamSpec
from gradientmail.protocol.screening import screen, trial_state, verdicts

OTHER = FragmentSpec(index=0, params=(ParamSpec(name="b.weight", shape=(2,), dtype="float32"),))
SPECS = (OTHER, SPEC)
TARGET = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.5, 1.5, 0.0, -1.0])


def _thetas() -> list[list[torch.Tensor]]:
    return [[torch.tensor([3.0, 4.0])], tensors([0.0] * 9)]


def _distance(state: Mapping[str, torch.Tensor]) -> float:
    """A trusted loss: the squared distance of fragment 1 from ``TARGET``."""
    flat = torch.cat([state["a.weight"].reshape(-1), state["a.bias"]])
    return float(((flat - TARGET) ** 2).sum())


losses = st.floats(allow_nan=True, allow_infinity=True, width=32)


@given(baseline=st.floats(-1e6, 1e6), trials=st.lists(losses, max_size=6))
def test_a_delta_is_kept_exactly_when_its_trial_is_finite_and_not_above_the_baseline(
    baseline: float, trials: list[float]
) -> None:
    reasons = verdicts(baseline, trials)
    assert len(reasons) == len(trials)
    for trial, reason in zip(trials, reasons, strict=True):
        assert (reason is None) == (math.isfinite(trial) and trial <= baseline), (trial, reason)


def test_a_rejection_names_both_losses() -> None:
    assert verdicts(2.0, [2.0, 2.5, math.nan]) == [
        None,
        "raises the trusted loss from 2 to 2.5",
        "gives a trusted loss of nan",
    ]


@pytest.mark.parametrize("above", [1e-7, 1e-12, 5e-16])
def test_losses_that_agree_to_six_digits_are_named_apart(above: float) -> None:
    baseline = 0.5271991
    trial = baseline * (1 + above)
    reason = verdicts(baseline, [trial])[0]
    assert reason is not None
    before, after = reason.removeprefix("raises the trusted loss from ").split(" to ")
    assert float(before) < float(after), reason


@pytest.mark.parametrize("baseline", [math.nan, math.inf, -math.inf])
def test_a_baseline_the_loss_cannot_score_is_refused_not_judged(baseline: float) -> None:
    with pytest.raises(ValueError, match="must return a finite number"):
        verdicts(baseline, [0.0])


def test_a_trial_moves_only_the_rounds_fragment_and_leaves_theta_alone() -> None:
    thetas = _thetas()
    delta = tensors([float(k) for k in range(9)])
    state = trial_state(thetas, SPECS, 1, delta)
    assert list(state) == ["b.weight", "a.weight", "a.bias"]
    assert state["b.weight"] is thetas[0][0]
    assert torch.equal(state["a.weight"], delta[0])
    assert torch.equal(state["a.bias"], delta[1])
    assert torch.equal(thetas[1][0], torch.zeros(2, 3)), "θ itself was modified"
    assert trial_state(thetas, SPECS, 1, None)["a.weight"] is thetas[1][0]


def test_a_trial_puts_a_parameter_split_by_rows_back_together() -> None:
    top = ParamSpec(name="w", shape=(1, 2), dtype="float32", start=0)
    bottom = ParamSpec(name="w", shape=(2, 2), dtype="float32", start=1)
    specs = (FragmentSpec(index=0, params=(top,)), FragmentSpec(index=1, params=(bottom,)))
    thetas = [[torch.zeros(1, 2)], [torch.ones(2, 2)]]
    state = trial_state(thetas, specs, 1, [torch.full((2, 2), 2.0)])
    assert torch.equal(state["w"], torch.tensor([[0.0, 0.0], [3.0, 3.0], [3.0, 3.0]]))


def test_the_screen_scores_the_baseline_once_and_each_delta_alone() -> None:
    seen: list[dict[str, torch.Tensor]] = []

    def loss(state: Mapping[str, torch.Tensor]) -> float:
        seen.append({name: tensor.clone() for name, tensor in state.items()})
        return _distance(state)

    toward, away = tensors(TARGET.tolist()), tensors((-TARGET).tolist())
    reasons = screen(loss, _thetas(), SPECS, 1)(iter([toward, away]))
    assert reasons[0] is None
    assert "raises the trusted loss from 9.75 to 39" in str(reasons[1])
    assert len(seen) == 3
    assert torch.equal(seen[0]["a.bias"], torch.zeros(3))


@pytest.mark.parametrize("value", ["low", None, torch.ones(2)])
def test_a_loss_that_is_not_a_number_is_named(value: object) -> None:
    with pytest.raises(TypeError, match="trusted_loss must return a number"):
        screen(lambda state: value, _thetas(), SPECS, 1)([])  # type: ignore[arg-type,return-value]


def test_a_zero_dimensional_tensor_is_a_number() -> None:
    def loss(state: Mapping[str, torch.Tensor]) -> float:
        return torch.tensor(1.5)  # type: ignore[return-value]

    assert screen(loss, _thetas(), SPECS, 1)([tensors([0.0] * 9)]) == [None]


def test_the_aggregation_rejects_what_the_screen_rejects_and_weighs_the_rest_as_without() -> None:
    honest = [candidate(name, TARGET.tolist()) for name in ("a", "b", "c")]
    liar = candidate("m", (-TARGET).tolist())
    rounds = [honest, [*honest, liar]]
    plain = aggregate(VERSION, honest, SPEC, CONFIG)
    check = screen(_distance, _thetas(), SPECS, 1)
    for candidates in rounds:
        screened = aggregate(VERSION, candidates, SPEC, CONFIG, screen=check)
        assert [p.learner for p in screened.participants] == ["a", "b", "c"]
        assert [p.weight for p in screened.participants] == [p.weight for p in plain.participants]
        assert screened.mean is not None
        assert plain.mean is not None
        assert all(torch.equal(x, y) for x, y in zip(screened.mean, plain.mean, strict=True))
    rejected = aggregate(VERSION, rounds[1], SPEC, CONFIG, screen=check).rejected
    assert [(r.learner, r.reason) for r in rejected] == [("m", "loss")]
    assert str(rejected[0].detail).startswith("applied alone it raises the trusted loss from")


def _final(learner: str, values: list[float]) -> Candidate:
    ordinary = candidate(learner, values)
    snapshot = msgspec.structs.replace(ordinary.snapshot, steps=0, tokens=0, final=True)
    return Candidate(snapshot=snapshot, delta=ordinary.delta, problem=None)


def test_a_final_round_is_judged_by_its_mean_and_refused_whole() -> None:
    """Each final model alone may be worse than θ while their mean is better: the mean is
    judged; a mean that raises the loss rejects every final snapshot and keeps θ."""
    overshoot, short = (3 * TARGET).tolist(), (-TARGET).tolist()
    check = screen(_distance, _thetas(), SPECS, 1)
    kept = aggregate(
        VERSION, [_final("a", overshoot), _final("b", short)], SPEC, CONFIG, screen=check
    )
    assert [p.learner for p in kept.participants] == ["a", "b"], kept.rejected
    assert kept.rejected == ()
    worse = aggregate(
        VERSION, [_final("a", overshoot), _final("b", overshoot)], SPEC, CONFIG, screen=check
    )
    assert worse.mean is None
    assert worse.participants == ()
    assert [(r.learner, r.reason) for r in worse.rejected] == [("a", "loss"), ("b", "loss")]
    assert str(worse.rejected[0].detail).startswith(
        "the final models' mean raises the trusted loss"
    )


def test_a_screen_sees_only_deltas_that_passed_the_other_rejections() -> None:
    calls: list[int] = []

    def loss(state: Mapping[str, torch.Tensor]) -> float:
        calls.append(1)
        return _distance(state)

    broken = candidate("n", [math.nan] * 9)
    result = aggregate(
        VERSION,
        [candidate("a", TARGET.tolist()), broken],
        SPEC,
        CONFIG,
        screen=screen(loss, _thetas(), SPECS, 1),
    )
    assert [(r.learner, r.reason) for r in result.rejected] == [("n", "non-finite")]
    assert len(calls) == 2, "the baseline and the one finite delta"
