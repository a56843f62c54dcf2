"""Centered clipping among three or more deltas (``RunConfig.robust``): one arbitrary delta
moves the mean at most by the stated bound, a delta far from the others weighs nothing,
deltas within the radius are the plain mean bit for bit, and a replay gets the same bits."""

import math

import msgspec
import pytest
import torch
from bounds_helpers import CONFIG, SPEC, VERSION, candidate, tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.protocol.aggregation import aggregate
from gradientmail.protocol.mean import l2_norm, pairwise_distances, weighted_mean
from gradientmail.protocol.robust import RADIUS, centered


def bound(k: int) -> float:
    """The most one arbitrary delta among ``k`` (weighing at most as an honest one) moves the
    mean from the honest deltas' plain mean, over their largest distance ``R`` from it.

    The center is the mean of a majority core ``m = ⌊k/2⌋ + 1``: without the liar, within
    ``R`` of the honest mean; with it, the liar's sum of distances is at most a trimmed
    honest delta's, so the liar is within ``(2k − 1)/(k − 2)·R`` and the center within
    ``C = (2k − 1)/((k − 2)·m) + (m − 1)/m`` times ``R``. Honest terms move the mean at most
    their distance from the center (``(1 + C)·R``), the liar's at most ``τ/k``, and ``τ`` is
    ``RADIUS`` × a distance no larger than the largest honest one."""
    m = k // 2 + 1
    center = max(1.0, (2 * k - 1) / ((k - 2) * m) + (m - 1) / m)
    return center + (1 + center) * (1 + (RADIUS - 1) / k)


NINE = st.lists(st.floats(-1.0, 1.0, width=32), min_size=9, max_size=9)


@settings(max_examples=80, deadline=None)
@given(
    NINE,
    st.lists(NINE, min_size=2, max_size=5),
    st.floats(0.01, 1.0),
    st.one_of(NINE, st.lists(st.floats(-1e6, 1e6, width=32), min_size=9, max_size=9)),
    st.integers(0, CONFIG.max_tokens_per_step * 4),
)
def test_one_arbitrary_delta_among_three_or_more_moves_the_mean_at_most_the_bound(
    base: list[float], noise: list[list[float]], scale: float, liar: list[float], tokens: int
) -> None:
    honest = [[b + scale * n for b, n in zip(base, row, strict=True)] for row in noise]
    candidates = [candidate(f"h{k}", values) for k, values in enumerate(honest)]
    candidates.append(candidate("z", liar, tokens=tokens))
    result = aggregate(VERSION, candidates, SPEC, CONFIG)
    accepted = {p.learner for p in result.participants}
    kept = [tensors(v) for k, v in enumerate(honest) if f"h{k}" in accepted]
    if len(accepted) < 3 or len(kept) < 2 or result.mean is None:
        return  # the outlier test left a round of two: the two-learner rule
    plain = weighted_mean(kept, [1.0 / len(kept)] * len(kept), SPEC)
    radius = max(l2_norm(d, minus=plain) or 0.0 for d in kept)
    moved = l2_norm(result.mean, minus=plain) or 0.0
    assert moved <= bound(len(accepted)) * radius * (1 + 1e-4) + 1e-5


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.floats(-1e3, 1e3), min_size=4, max_size=4), min_size=3, max_size=7),
    st.lists(st.floats(0.0, 1.0), min_size=7, max_size=7),
)
def test_each_delta_moves_the_mean_at_most_its_weight_times_the_radius(
    points: list[list[float]], raw: list[float]
) -> None:
    weights = raw[: len(points)]
    total = math.fsum(weights)
    weights = [w / total for w in weights] if total > 0 else [1 / len(points)] * len(points)
    pairwise = [[math.dist(p, q) for q in points] for p in points]
    result = centered(weights, pairwise)
    assert all(c >= 0 for c in result.coefficients)
    assert math.fsum(result.coefficients) == pytest.approx(1.0)
    assert math.fsum(result.center) == pytest.approx(1.0)
    assert result.radii == [result.radii[0]] * len(points)  # no steps: one radius
    for w, s, d, r in zip(weights, result.scales, result.distances, result.radii, strict=True):
        assert 0.0 <= s <= 1.0
        assert w * s * d <= w * r * (1 + 1e-9) + 1e-9
        if d >= 2 * r * (1 + 1e-9) + 1e-9:
            assert s == 0.0


@settings(max_examples=60, deadline=None)
@given(
    NINE,
    st.permutations(range(9)),
    st.integers(3, 8),
    st.floats(0.01, 10.0),
    st.lists(st.booleans(), min_size=9, max_size=9),
)
def test_honest_deltas_within_the_radius_are_the_plain_mean_bit_for_bit(
    base: list[float], axes: list[int], k: int, spread: float, signs: list[bool]
) -> None:
    # Equal moves along distinct axes: every delta is as far from the others.
    deltas = []
    for i in range(k):
        values = list(base)
        values[axes[i]] += -spread if signs[i] else spread
        deltas.append(values)
    result = aggregate(VERSION, [candidate(f"l{i}", d) for i, d in enumerate(deltas)], SPEC, CONFIG)
    assert [p.weight for p in result.participants] == [1.0 / k] * k
    assert all(p.bounded is msgspec.UNSET for p in result.participants)
    assert result.mean is not None
    plain = weighted_mean([tensors(d) for d in deltas], [1.0 / k] * k, SPEC)
    assert all(torch.equal(x, y) for x, y in zip(result.mean, plain, strict=True))


def test_a_flipped_delta_among_four_weighs_nothing_and_replays_exactly() -> None:
    honest = [[1.0] * 9, [1.2] + [1.0] * 8, [1.0] * 8 + [0.8]]
    liar = [-4.75 * v for v in honest[0]]  # its own delta reversed, just under the outlier test
    candidates = [candidate(f"h{k}", values) for k, values in enumerate(honest)]
    candidates.append(candidate("z", liar, tokens=CONFIG.max_tokens_per_step * 4))
    result = aggregate(VERSION, candidates, SPEC, CONFIG)
    assert result.rejected == ()
    weights = {p.learner: p.weight for p in result.participants}
    assert weights["z"] == 0.0
    assert math.fsum(weights.values()) == pytest.approx(1.0)
    notes = {p.learner: p.bounded for p in result.participants}
    assert "from the round's center over the radius" in str(notes["z"])
    assert "weighted for 40 of its 40000 tokens" in str(notes["z"])
    assert all(notes[f"h{k}"] is msgspec.UNSET for k in range(3))
    # The record's weights are the mean's coefficients: a replay gets the same bits.
    replayed = weighted_mean(
        [c.delta for c in candidates],  # type: ignore[misc]
        [p.weight for p in result.participants],
        SPEC,
    )
    assert result.mean is not None
    assert all(torch.equal(x, y) for x, y in zip(result.mean, replayed, strict=True))


def test_pairwise_distances_are_exact_and_symmetric() -> None:
    deltas = [tensors([1.0] * 9), tensors([0.0] * 9), tensors([1.0] * 8 + [4.0])]
    pairwise = pairwise_distances(deltas, SPEC)
    expected = [[0.0, 3.0, 3.0], [3.0, 0.0, math.sqrt(24.0)], [3.0, math.sqrt(24.0), 0.0]]
    assert all(row == pytest.approx(want) for row, want in zip(pairwise, expected, strict=True))
    assert all(pairwise[i][j] == pairwise[j][i] for i in range(3) for j in range(3))


def test_a_delta_over_more_steps_than_the_round_s_median_has_a_wider_radius() -> None:
    points = [(1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -3.0)]
    pairwise = [[math.dist(p, q) for q in points] for p in points]
    alike = centered([0.25] * 4, pairwise)
    assert alike.scales[3] < 1.0  # beyond the radius over the same steps
    wider = centered([0.25] * 4, pairwise, [4.0, 4.0, 4.0, 12.0])
    assert wider.radii[3] == pytest.approx(3 * alike.radii[3])
    assert wider.scales == [1.0] * 4
    assert wider.coefficients == [0.25] * 4
    # Fewer steps than the median never narrow a radius.
    assert centered([0.25] * 4, pairwise, [1.0, 4.0, 4.0, 4.0]).radii == alike.radii
