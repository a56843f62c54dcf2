"""One learner's bounded influence on a round: capped weights, and in rounds of one or two
deltas clipped norms, with nothing changed when both learners are alike (three or more:
``test_protocol_robust.py``)."""

import msgspec
import pytest
import torch
from bounds_helpers import CONFIG, SPEC, VERSION, candidate, tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.protocol.aggregation import aggregate
from gradientmail.protocol.bounds import (
    CLIP_FACTOR,
    HISTORY_FACTOR,
    TOKENS_RATIO,
    capped_counts,
    clip_scales,
    lone_scale,
)
from gradientmail.protocol.mean import l2_norm, weighted_mean


def test_a_liar_weighs_no_more_per_step_than_the_round_s_lower_median() -> None:
    honest = [candidate(f"h{k}", [1.0] * 9) for k in range(3)]
    liar = candidate("z", [1.0] * 9, tokens=CONFIG.max_tokens_per_step * 4)
    result = aggregate(VERSION, [*honest, liar], SPEC, CONFIG)
    weights = {p.learner: p.weight for p in result.participants}
    assert weights == {"h0": 0.25, "h1": 0.25, "h2": 0.25, "z": 0.25}
    (bounded,) = [p for p in result.participants if p.bounded is not msgspec.UNSET]
    assert bounded.learner == "z"
    assert bounded.tokens == CONFIG.max_tokens_per_step * 4  # its tokens all count
    assert "weighted for 40 of its 40000 tokens" in str(bounded.bounded)


def test_steps_weigh_at_most_sync_every() -> None:
    config = msgspec.structs.replace(CONFIG, weighting="steps")
    snapshots = [candidate("a", [1.0] * 9).snapshot, candidate("b", [1.0] * 9, steps=9).snapshot]
    counts = capped_counts(snapshots, config)
    assert [count for count, _ in counts] == [4.0, 4.0]
    assert "sync_every" in str(counts[1][1])


def test_two_learners_neither_moves_the_mean_more_than_the_other() -> None:
    liar = candidate("a", [1e6] * 9, tokens=CONFIG.max_tokens_per_step * 4)
    result = aggregate(VERSION, [liar, candidate("b", [1.0] * 9)], SPEC, CONFIG)
    assert result.rejected == ()
    assert result.mean is not None
    # Equal weights, the liar's delta clipped to b's norm: it moves the mean as far as b.
    assert [p.weight for p in result.participants] == pytest.approx([0.5 / 1e6, 0.5])
    assert all(torch.allclose(t, torch.ones_like(t)) for t in result.mean)


def test_fewer_than_two_deltas_are_not_clipped_against_the_round() -> None:
    assert clip_scales([5.0], [4.0]) == [(1.0, None)]
    assert clip_scales([], []) == []


def test_a_lone_delta_is_clipped_against_the_fragment_s_momentum() -> None:
    lone = [candidate("z", [1e6] * 9, tokens=CONFIG.max_tokens_per_step * 4)]
    momentum = tensors([0.5] * 9)  # norm 1.5
    result = aggregate(VERSION, lone, SPEC, CONFIG, momentum=momentum)
    assert result.mean is not None
    limit = HISTORY_FACTOR * 1.5
    assert l2_norm(result.mean) == pytest.approx(limit, rel=1e-6)
    assert "outer momentum" in str(result.participants[0].bounded)
    # Before the fragment's first outer step there is no momentum and no bound.
    free = aggregate(VERSION, lone, SPEC, CONFIG)
    assert [p.weight for p in free.participants] == [1.0]
    assert lone_scale(3.0, None) == (1.0, None)
    assert lone_scale(3.0, 1.5) == (1.0, None)


VALUES = st.lists(st.floats(-1.0, 1.0, width=32), min_size=9, max_size=9)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(VALUES, min_size=1, max_size=1),
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=9, max_size=9),
    st.integers(0, CONFIG.max_tokens_per_step * 4),
)
def test_one_adversarial_delta_of_two_moves_the_mean_a_bounded_amount(
    honest: list[list[float]], adversary: list[float], tokens: int
) -> None:
    candidates = [candidate(f"h{k}", values) for k, values in enumerate(honest)]
    candidates.append(candidate("z", adversary, tokens=tokens))
    result = aggregate(VERSION, candidates, SPEC, CONFIG)
    largest = max(l2_norm(tensors(values)) or 0.0 for values in honest)
    share = TOKENS_RATIO / (len(honest) + TOKENS_RATIO)
    for p in result.participants:
        if p.learner == "z":
            influence = p.weight * (l2_norm(tensors(adversary)) or 0.0)
            assert influence <= share * CLIP_FACTOR * largest * (1 + 1e-6) + 1e-30
    if result.mean is not None:
        bound = max(1.0, CLIP_FACTOR) * largest * (1 + 1e-5) + 1e-6
        assert (l2_norm(result.mean) or 0.0) <= bound


@settings(max_examples=40, deadline=None)
@given(VALUES, st.lists(st.lists(st.booleans(), min_size=9, max_size=9), min_size=1, max_size=2))
def test_alike_learners_of_a_round_of_two_are_neither_capped_nor_clipped(
    base: list[float], signs: list[list[bool]]
) -> None:
    # Sign flips of one vector: every norm is the same, bit for bit.
    deltas = [[-v if flip else v for v, flip in zip(base, row, strict=True)] for row in signs]
    candidates = [candidate(f"l{k}", values) for k, values in enumerate(deltas)]
    result = aggregate(VERSION, candidates, SPEC, CONFIG)
    k = len(deltas)
    assert [p.weight for p in result.participants] == [1.0 / k] * k
    assert all(p.bounded is msgspec.UNSET for p in result.participants)
    assert result.mean is not None
    plain = weighted_mean([tensors(d) for d in deltas], [1.0 / k] * k, SPEC)
    assert all(torch.equal(x, y) for x, y in zip(result.mean, plain, strict=True))
