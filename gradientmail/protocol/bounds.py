"""Bounds on one learner's influence on a round: capped weights and, in rounds of one or two
deltas, clipped norms (three or more: ``robust.centered``).

Applied after a round's rejections, against references taken from the round itself (never
from θ, so nothing compounds over rounds):

- ``capped_counts``: a snapshot's tokens are at most ``TOKENS_RATIO`` times the round's
  lower median of tokens per step, over its steps brought to ``[1, sync_every]``; the steps
  it counts are at most ``sync_every``;
- ``clip_scales``: a delta's norm is clipped to ``CLIP_FACTOR`` times the lower median of the
  round's norms brought to its steps (``allowance``): of two, the smaller;
- ``lone_scale``: a round's single delta is clipped to ``HISTORY_FACTOR`` times the norm of
  the fragment's outer momentum, when there is one.

Of two learners, one liar's share of the mean is at most ``TOKENS_RATIO / (1 + TOKENS_RATIO)``
of a delta no larger than ``CLIP_FACTOR`` times the honest one (docs/protocol.md,
"Aggregation"). A capped or clipped snapshot stays a participant with
all its tokens; each function returns a note saying what it did, for the record.

Pure and deterministic: plain float arithmetic on the snapshots' claims and recomputed
norms, in the order given.
"""

import math
import statistics
from collections.abc import Sequence

from gradientmail.protocol.records import RunConfig, Snapshot

__all__ = [
    "CLIP_FACTOR",
    "HISTORY_FACTOR",
    "TOKENS_RATIO",
    "allowance",
    "capped_counts",
    "clip_scales",
    "judged_steps",
    "lone_scale",
]

TOKENS_RATIO = 1.0
"""The most tokens per step a snapshot is weighted for, over the round's lower median."""
CLIP_FACTOR = 1.0
"""The largest delta norm a round takes, over the lower median of its norms brought to the
same steps."""

HISTORY_FACTOR = 2.0
"""The largest delta a round of one snapshot takes, over the norm of its fragment's outer
momentum: in a steady run that norm is 1.25 to 2.5 times a round's mean delta."""

_ROUNDING = 1e-9


def judged_steps(snapshot: Snapshot, config: RunConfig) -> float:
    """The steps a snapshot is judged and weighted for: its claim, at least one (a final
    snapshot claims none) and at most ``sync_every``."""
    return float(min(max(snapshot.steps, 1), config.sync_every))


def allowance(mine: float, theirs: float) -> float:
    """What another snapshot's norm over ``theirs`` steps is multiplied by to bring it to
    ``mine``, at the most an honest learner's delta grows between the two: as the steps
    where the steps go one way (more steps), as their square root where noise dominates
    them (fewer: ``n`` noisy steps sum to √n of one)."""
    ratio = mine / theirs
    return ratio if ratio >= 1 else math.sqrt(ratio)


def capped_counts(
    snapshots: Sequence[Snapshot], config: RunConfig
) -> list[tuple[float, str | None]]:
    """Each snapshot's count for its weight (``config.weighting``) and a note when it was
    capped: tokens at most ``TOKENS_RATIO`` × the lower median of the tokens per step of
    the snapshots with steps × its ``judged_steps``; steps at most ``sync_every``; 1 each
    for ``equal``."""
    if config.weighting == "equal":
        return [(1.0, None) for _ in snapshots]
    if config.weighting == "steps":
        return [_capped_steps(s, config) for s in snapshots]
    rates = [s.tokens / s.steps for s in snapshots if s.steps >= 1]
    if not rates:
        return [(float(s.tokens), None) for s in snapshots]
    median = statistics.median_low(rates)
    counts: list[tuple[float, str | None]] = []
    for s in snapshots:
        cap = TOKENS_RATIO * median * judged_steps(s, config)
        if s.tokens <= cap:
            counts.append((float(s.tokens), None))
            continue
        note = (
            f"weighted for {cap:.6g} of its {s.tokens} tokens: {TOKENS_RATIO:g} × the round's "
            f"lower median {median:.6g} tokens per step over {judged_steps(s, config):g} steps"
        )
        counts.append((cap, note))
    return counts


def _capped_steps(snapshot: Snapshot, config: RunConfig) -> tuple[float, str | None]:
    if snapshot.steps <= config.sync_every:
        return float(snapshot.steps), None
    return float(config.sync_every), (
        f"weighted for {config.sync_every} of its {snapshot.steps} steps (sync_every)"
    )


def clip_scales(norms: Sequence[float], steps: Sequence[float]) -> list[tuple[float, str | None]]:
    """Each delta's clip scale (1.0 when not clipped) and a note when clipped: ``norms``
    over ``steps`` (``judged_steps``), each clipped to ``CLIP_FACTOR`` × the lower median of
    the norms brought to its steps. Fewer than two deltas are not clipped. A norm of
    ``inf`` (finite elements that overflow it) is clipped to scale 0."""
    if len(norms) < 2:
        return [(1.0, None) for _ in norms]
    scales: list[tuple[float, str | None]] = []
    for norm, mine in zip(norms, steps, strict=True):
        brought = [n * allowance(mine, theirs) for n, theirs in zip(norms, steps, strict=True)]
        median = statistics.median_low(brought)
        limit = CLIP_FACTOR * median
        # Norms equal but for their last bits (sums of squares taken piece by piece) are
        # equal: only a norm over the limit by more than rounding is clipped.
        if norm <= limit * (1 + _ROUNDING) or not math.isfinite(limit):
            scales.append((1.0, None))
            continue
        scale = limit / norm
        over = f"{mine:g} step{'' if mine == 1 else 's'}"
        note = (
            f"norm {norm:.6g} clipped to {limit:.6g}: {CLIP_FACTOR:g} × the lower median of "
            f"the round's norms brought to {over}"
        )
        scales.append((scale, note))
    return scales


def lone_scale(norm: float, momentum: float | None) -> tuple[float, str | None]:
    """The clip scale of the only delta of a round (1.0 when not clipped) and a note when
    clipped: its ``norm`` at most ``HISTORY_FACTOR`` × ``momentum``, the norm of the
    fragment's outer momentum (None before its first outer step, or not finite: no
    bound)."""
    if momentum is None or not math.isfinite(momentum):
        return 1.0, None
    limit = HISTORY_FACTOR * momentum
    if norm <= limit * (1 + _ROUNDING):
        return 1.0, None
    note = (
        f"norm {norm:.6g} clipped to {limit:.6g}: {HISTORY_FACTOR:g} × the norm of the "
        "fragment's outer momentum (the round's only delta)"
    )
    return limit / norm, note
