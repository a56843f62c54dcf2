"""``RunConfig.robust``'s coefficients: each accepted delta's share of a round's mean.

Every round first caps the weights (``bounds.capped_counts``: normalized weights ``wᵢ``).
Then, by the number ``K`` of accepted deltas:

- ``K ≥ 3``, centered clipping (``centered``): the center ``c`` is the weighted mean of the
  core, the ``⌊K/2⌋ + 1`` deltas with the smallest weighted sum of distances to the others;
  a delta's radius ``τᵢ`` is ``RADIUS`` × the lower median of the distances
  ``dᵢ = ‖Δᵢ − c‖``, times its judged steps over the round's lower median steps when more
  (at most ``sync_every`` over them); the mean is ``c + Σ wᵢ·sᵢ·(Δᵢ − c)`` with ``sᵢ = 1``
  within ``τᵢ``, fading to 0 at ``2τᵢ`` (``sᵢ·dᵢ = 2τᵢ − dᵢ`` between), so that one delta
  moves the mean by at most ``wᵢ·τᵢ`` about the center, and a delta beyond ``2τᵢ`` by
  nothing. Nothing faded: the plain weighted mean,
  bit for bit.
- ``K = 2``: each delta's norm clipped to the smaller (``bounds.clip_scales``).
- ``K = 1``: clipped against the fragment's outer momentum (``bounds.lone_scale``).

Every rule is a linear combination of the round's deltas: the coefficients are what the
record stores as weights, so a replay of the mean gets the same bits. Distances come from
the pairwise distances of the deltas (one pass, ``aggregation.pairwise_distances``), never
from a decoded copy of a delta.

Pure and deterministic: plain float arithmetic in the order given.
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from gradientmail.protocol.bounds import capped_counts, clip_scales, judged_steps, lone_scale
from gradientmail.protocol.records import RunConfig, Snapshot

__all__ = ["RADIUS", "Centered", "bounded_weights", "centered", "distances_to"]

RADIUS = 2.0
"""The radius of centered clipping over the lower median distance of a round's deltas from
its center: honest deltas of a round lie within 1.2 to 1.7 times that median."""

_ROUNDING = 1e-6
"""Distances within this fraction of the round's largest pairwise distance of the radius are
within it: a distance taken from pairwise distances is exact to about 1e-8 of them."""


@dataclass(frozen=True)
class Centered:
    """Centered clipping of one round: the ``coefficients`` of the deltas in the mean, the
    ``center``'s coefficients (summing to 1), each delta's ``distances`` from the center,
    its ``radii`` and its ``scales`` (1.0: within its radius)."""

    coefficients: list[float]
    center: list[float]
    distances: list[float]
    radii: list[float]
    scales: list[float]


def distances_to(center: Sequence[float], pairwise: Sequence[Sequence[float]]) -> list[float]:
    """Each delta's distance from ``Σⱼ centerⱼ·Δⱼ`` (coefficients summing to 1), from the
    ``pairwise`` distances: ``‖Δᵢ − c‖² = Σⱼ aⱼ·Dᵢⱼ² − ½·Σⱼₖ aⱼ·aₖ·Dⱼₖ²``."""
    spread = math.fsum(
        a * b * pairwise[j][k] ** 2
        for j, a in enumerate(center)
        for k, b in enumerate(center)
        if a and b
    )
    out = []
    for row in pairwise:
        square = math.fsum(a * row[j] ** 2 for j, a in enumerate(center) if a) - spread / 2
        out.append(math.sqrt(max(square, 0.0)))
    return out


def _core(weights: Sequence[float], pairwise: Sequence[Sequence[float]]) -> list[float]:
    """The center's coefficients: the weighted mean of the ``⌊K/2⌋ + 1`` deltas with the
    smallest weighted sum of distances to the others (ties: the first)."""
    scores = [math.fsum(w * d for w, d in zip(weights, row, strict=True)) for row in pairwise]
    size = len(weights) // 2 + 1
    chosen = sorted(range(len(weights)), key=lambda i: (scores[i], i))[:size]
    total = math.fsum(weights[i] for i in chosen)
    if total <= 0:
        return [1.0 / size if i in chosen else 0.0 for i in range(len(weights))]
    return [weights[i] / total if i in chosen else 0.0 for i in range(len(weights))]


def _scale(distance: float, radius: float, slack: float) -> float:
    """The fade of a delta at ``distance`` from the center: 1 within ``radius`` (give or take
    ``slack``), ``(2·radius − distance) / distance`` up to twice it, 0 beyond."""
    if distance <= radius + slack:
        return 1.0
    if not math.isfinite(distance) or distance >= 2 * radius:
        return 0.0
    return (2 * radius - distance) / distance


def centered(
    weights: Sequence[float],
    pairwise: Sequence[Sequence[float]],
    steps: Sequence[float] | None = None,
) -> Centered:
    """Centered clipping of a round of three or more deltas with normalized ``weights``,
    ``pairwise`` distances (symmetric, zero diagonal) and ``steps`` (``judged_steps``; None:
    all alike): see the module's docstring."""
    center = _core(weights, pairwise)
    distances = distances_to(center, pairwise)
    radius = RADIUS * statistics.median_low(distances)
    if not math.isfinite(radius):
        radius = math.inf
    radii = [radius * stretch for stretch in _stretches(steps, len(weights))]
    largest = max((d for row in pairwise for d in row if math.isfinite(d)), default=0.0)
    scales = [_scale(d, r, _ROUNDING * largest) for d, r in zip(distances, radii, strict=True)]
    if all(s == 1.0 for s in scales):
        return Centered(list(weights), center, distances, radii, scales)
    kept = [w * s for w, s in zip(weights, scales, strict=True)]
    rest = max(1.0 - math.fsum(kept), 0.0)
    coefficients = [k + rest * a for k, a in zip(kept, center, strict=True)]
    return Centered(coefficients, center, distances, radii, scales)


def _stretches(steps: Sequence[float] | None, count: int) -> list[float]:
    """What each delta's radius is multiplied by: its steps over the round's lower median,
    at least 1 (a delta over more steps goes further, as the outlier test allows)."""
    if steps is None:
        return [1.0] * count
    median = statistics.median_low(steps)
    return [max(1.0, n / median) if median > 0 else 1.0 for n in steps]


def _faded_notes(result: Centered) -> list[str | None]:
    notes: list[str | None] = []
    for distance, radius, scale in zip(result.distances, result.radii, result.scales, strict=True):
        if scale == 1.0:
            notes.append(None)
            continue
        notes.append(
            f"distance {distance:.6g} from the round's center over the radius {radius:.6g} "
            f"({RADIUS:g} × the lower median distance, × its steps over the lower median "
            f"steps when more): weighted {scale:.6g} of its share, the rest to the center"
        )
    return notes


def bounded_weights(
    snapshots: Sequence[Snapshot],
    norms: Sequence[float],
    config: RunConfig,
    momentum: float | None,
    pairwise: Sequence[Sequence[float]] | None,
) -> tuple[list[float], list[str | None]]:
    """Each accepted delta's coefficient in the mean and what bounded it (None: nothing),
    for ``snapshots`` with their recomputed ``norms``; ``momentum``: the norm of the
    fragment's outer momentum (a round of one); ``pairwise``: the deltas' pairwise
    distances (three or more; ``aggregation.pairwise_distances``)."""
    counts = capped_counts(snapshots, config)
    total = math.fsum(count for count, _ in counts)
    if total <= 0:
        weights = [1.0 / len(snapshots)] * len(snapshots)
    else:
        weights = [count / total for count, _ in counts]
    steps = [judged_steps(s, config) for s in snapshots]
    if len(snapshots) >= 3:
        if pairwise is None:
            raise ValueError("a round of three or more deltas needs their pairwise distances")
        result = centered(weights, pairwise, steps)
        coefficients, clipped = result.coefficients, _faded_notes(result)
    else:
        single = len(snapshots) == 1
        scales = [lone_scale(norms[0], momentum)] if single else clip_scales(norms, steps)
        coefficients = [w * scale for w, (scale, _) in zip(weights, scales, strict=True)]
        clipped = [note for _, note in scales]
    notes = [
        "; ".join(note for note in (capped, faded) if note is not None) or None
        for (_, capped), faded in zip(counts, clipped, strict=True)
    ]
    return coefficients, notes
