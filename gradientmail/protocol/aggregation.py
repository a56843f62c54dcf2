"""A round's aggregation: which snapshots count, with what weight, and their weighted mean.

``aggregate`` rejects, in this order, each with a reason: ``corrupt``, ``shape``,
``non-finite``, ``stale``, ``tokens``, ``outlier``, and with a trusted loss ``loss``
(when each applies: docs/protocol.md, "Rejections"). Norms are recomputed here;
``Snapshot.norm`` is the writer's claim and is not trusted. The accepted snapshots get
weights per ``RunConfig.weighting`` (bounded by ``robust`` with ``RunConfig.robust``); their
mean is ``protocol.mean``'s, accumulated in fp32 in learner order, so every closer computes
the same bits. Every pass reads the deltas a piece at a time (a ``screen``'s trials decode
one delta at a time).

Pure: no I/O but a ``screen``'s trusted loss; runs on whatever thread calls it (the syncer
runs it in a worker thread).
"""

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import msgspec
from torch import Tensor

from gradientmail.protocol import keys
from gradientmail.protocol.bounds import allowance, judged_steps
from gradientmail.protocol.mean import (
    Delta,
    by_senders,
    dense,
    l2_norm,
    mean_and_dots,
    pairwise_distances,
    piece_of,
    sum_of_squares,
)
from gradientmail.protocol.pieces import FragmentBlob, PartedBlob, chunk_ranges
from gradientmail.protocol.records import (
    FragmentSpec,
    Participant,
    Rejection,
    RejectReason,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.robust import bounded_weights
from gradientmail.protocol.sparse import SparseBlob

__all__ = [
    "MAX_DELTA_RATIO",
    "Aggregate",
    "Candidate",
    "Screen",
    "aggregate",
    "counted_snapshots",
    "refused",
]

MAX_DELTA_RATIO = 100.0
"""The largest delta a round accepts, relative to ``‖θ‖ + √n`` of its fragment: a hundred
times the fragment's norm, or a root-mean-square change of a hundred per element."""


Screen: TypeAlias = Callable[[Iterable[Sequence[Tensor]]], list[str | None]]
"""A round's deltas (each its tensors in ``spec.params`` order, decoded one at a time) to
why each is rejected (None: kept), in the order given (``protocol.screening``)."""


@dataclass(frozen=True)
class Candidate:
    """A snapshot of the round with its ``delta``, or with ``problem``, ``(reason, detail)``,
    when its blob could not be used (``delta`` None)."""

    snapshot: Snapshot
    delta: Delta | None
    problem: tuple[RejectReason, str] | None = None


@dataclass(frozen=True)
class Aggregate:
    """The outcome of a round: the weighted ``mean`` delta (None if nothing was accepted), the
    accepted ``participants`` with their weights, the ``rejected`` snapshots with why, and the
    mean cosine similarity of the accepted deltas to the mean (None for fewer than two)."""

    mean: list[Tensor] | None
    participants: tuple[Participant, ...]
    rejected: tuple[Rejection, ...]
    cosine: float | None


def _finite_norm(delta: Delta, spec: FragmentSpec) -> str | float:
    """The name of ``delta``'s first parameter holding NaN or ±Inf, else its L2 norm
    (``l2_norm``), in one pass: a piece's float64 sum of squares is finite exactly when
    its fp32 elements are (no fp32 square, nor ``CHUNK_ELEMENTS`` of them, overflows it)."""
    squares = []
    for index, param in enumerate(spec.params):
        for start, end in chunk_ranges(param.numel):
            square = sum_of_squares(piece_of(delta, index, start, end))
            if not math.isfinite(square):
                return param.name
            squares.append(square)
    norm = math.sqrt(math.fsum(squares))
    return norm if math.isfinite(norm) else math.inf


def _rejection(snapshot: Snapshot, reason: RejectReason, detail: str) -> Rejection:
    return Rejection(
        learner=snapshot.learner,
        reason=reason,
        steps=snapshot.steps,
        tokens=snapshot.tokens,
        detail=detail,
    )


def _check(
    candidate: Candidate, version: int, round: int, spec: FragmentSpec, config: RunConfig
) -> "tuple[RejectReason, str] | _Passed":
    """Why ``candidate`` is rejected before the outlier test, or its delta and norm."""
    snapshot = candidate.snapshot
    if candidate.problem is not None:
        return candidate.problem
    if snapshot.round != round:
        return "corrupt", f"the snapshot names round {snapshot.round}, not {round}"
    if snapshot.fragment != spec.index:
        return "shape", f"the snapshot is of fragment {snapshot.fragment}, not {spec.index}"
    delta = candidate.delta
    if delta is None:
        raise ValueError(f"candidate of {snapshot.learner!r} has neither a delta nor a problem")
    shape = _shape_problem(delta, spec)
    if shape is not None:
        return "shape", shape
    norm = _finite_norm(delta, spec)
    if isinstance(norm, str):
        return "non-finite", f"{norm} holds NaN or Inf"
    if snapshot.base_version < version - config.max_staleness:
        return "stale", (
            f"based on version {snapshot.base_version}; the round accepts "
            f"{max(version - config.max_staleness, 0)} to {version}"
        )
    if snapshot.base_version > version:
        return "stale", f"based on version {snapshot.base_version}, newer than {version}"
    # A final snapshot (a closing learner's last) carries no steps; any other at least one.
    if (snapshot.steps != 0 if snapshot.final is True else snapshot.steps < 1) or (
        snapshot.tokens < 0
    ):
        return "tokens", f"{snapshot.steps} steps and {snapshot.tokens} tokens"
    if snapshot.tokens > config.max_tokens_per_step * snapshot.steps:
        return "tokens", (
            f"{snapshot.tokens} tokens in {snapshot.steps} steps is over "
            f"{config.max_tokens_per_step} per step"
        )
    return _Passed(delta, norm)


@dataclass(frozen=True)
class _Passed:
    """A delta that passed ``_check``, with its L2 norm (``inf`` when finite elements
    overflow it)."""

    delta: Delta
    norm: float


def _shape_problem(delta: Delta, spec: FragmentSpec) -> str | None:
    if isinstance(delta, FragmentBlob | PartedBlob | SparseBlob):
        if delta.spec != spec:
            return f"the blob was opened for fragment {delta.spec.index}'s parameters"
        return None
    if len(delta) != len(spec.params):
        return f"{len(delta)} tensors, the fragment has {len(spec.params)}"
    for tensor, param in zip(delta, spec.params, strict=True):
        if tuple(tensor.shape) != tuple(param.shape):
            return f"{param.name}: shape {list(tensor.shape)}, expected {list(param.shape)}"
    return None


def _weights(snapshots: Sequence[Snapshot], config: RunConfig) -> list[float]:
    if config.weighting == "tokens":
        raw = [float(s.tokens) for s in snapshots]
    elif config.weighting == "steps":
        raw = [float(s.steps) for s in snapshots]
    else:
        raw = [1.0] * len(snapshots)
    total = math.fsum(raw)
    if total <= 0:
        return [1.0 / len(snapshots)] * len(snapshots)
    return [w / total for w in raw]


def _cosine(
    norms: Sequence[float], dots: Sequence[float] | None, mean: Sequence[Tensor]
) -> float | None:
    if dots is None:
        return None
    mean_norm = l2_norm(mean) or 0.0
    cosines = []
    for norm, dot in zip(norms, dots, strict=True):
        if not math.isfinite(norm) or norm == 0.0 or mean_norm == 0.0:
            cosines.append(0.0)
            continue
        cosines.append(max(-1.0, min(1.0, dot / (norm * mean_norm))))
    return math.fsum(cosines) / len(cosines)


def refused(result: Aggregate, detail: str, reason: RejectReason = "non-finite") -> Aggregate:
    """``result`` with every participant rejected as ``reason`` (``detail`` says why): the
    round commits its fragment unchanged."""
    rejected = [
        Rejection(learner=p.learner, reason=reason, steps=p.steps, tokens=p.tokens, detail=detail)
        for p in result.participants
    ]
    rejected.extend(result.rejected)
    rejected.sort(key=lambda r: r.learner)
    return Aggregate(mean=None, participants=(), rejected=tuple(rejected), cosine=None)


Kept: TypeAlias = list[tuple[Candidate, Delta, float]]
"""Candidates that passed the checks so far, with their deltas and recomputed norms."""


def _drop_large(
    kept: Kept, theta: Sequence[Tensor] | None, config: RunConfig, rejected: list[Rejection]
) -> Kept:
    """``kept`` without the deltas too large to be honest, which go to ``rejected``: over
    ``MAX_DELTA_RATIO × (‖θ‖ + √n)`` (when θ is known), then, among three or more, over
    ``outlier_factor`` times the median of the norms brought to its steps
    (``bounds.allowance``)."""
    if theta is not None:
        theta_norm = l2_norm(theta)
        numel = sum(t.numel() for t in theta)
        bound = MAX_DELTA_RATIO * (
            (math.inf if theta_norm is None else theta_norm) + math.sqrt(numel)
        )
        why = f"{MAX_DELTA_RATIO:g} × (‖θ‖ + √n) = {bound:.6g}"
        kept = _drop_over(kept, bound, why, rejected)
    if len(kept) >= 3:
        steps = [judged_steps(candidate.snapshot, config) for candidate, _, _ in kept]
        norms = [norm for _, _, norm in kept]
        medians = [
            statistics.median(
                n * allowance(mine, theirs) for n, theirs in zip(norms, steps, strict=True)
            )
            for mine in steps
        ]
        passed: Kept = []
        for entry, n, median in zip(kept, steps, medians, strict=True):
            candidate, _, norm = entry
            if norm <= config.outlier_factor * median:
                passed.append(entry)
                continue
            over = f"{n:g} step{'' if n == 1 else 's'}"
            detail = (
                f"norm {norm:.6g} over {over}, over {config.outlier_factor:g} × the "
                f"median {median:.6g} of the round's norms brought to {over}"
            )
            rejected.append(_rejection(candidate.snapshot, "outlier", detail))
        kept = passed
    return kept


def _drop_screened(kept: Kept, screen: Screen, rejected: list[Rejection]) -> Kept:
    """``kept`` without the deltas ``screen`` rejects, which go to ``rejected`` (``loss``)."""
    reasons = screen(dense(delta) for _, delta, _ in kept)
    for (candidate, _, _), reason in zip(kept, reasons, strict=True):
        if reason is not None:
            rejected.append(_rejection(candidate.snapshot, "loss", f"applied alone it {reason}"))
    return [entry for entry, reason in zip(kept, reasons, strict=True) if reason is None]


def _drop_over(kept: Kept, limit: float, why: str, rejected: list[Rejection]) -> Kept:
    for candidate, _, norm in kept:
        if norm > limit:
            detail = f"norm {norm:.6g} is over {why}"
            rejected.append(_rejection(candidate.snapshot, "outlier", detail))
    return [entry for entry in kept if entry[2] <= limit]


def counted_snapshots(candidates: Sequence[Candidate], missing: frozenset[str]) -> list[Candidate]:
    """The snapshots a round is made of. Final snapshots (closing learners' last,
    ``Snapshot.final``) make a final round only when nothing else is in it and no live
    learner is ``missing``; otherwise they are left out (they carry no steps), so a learner
    leaving while others go on changes nothing of their rounds."""
    ordinary = [c for c in candidates if c.snapshot.final is not True]
    return ordinary if ordinary or missing else list(candidates)


def aggregate(
    version: int,
    candidates: Sequence[Candidate],
    spec: FragmentSpec,
    config: RunConfig,
    *,
    theta: Sequence[Tensor] | None = None,
    momentum: Sequence[Tensor] | None = None,
    screen: Screen | None = None,
) -> Aggregate:
    """Close the round that takes fragment ``spec.index`` from ``version`` to ``version + 1``
    (``theta``: that version's θ, for the bound on a delta's size; None: no bound;
    ``momentum``: the fragment's outer momentum, which bounds a round of one delta under
    ``RunConfig.robust``; None: no bound; ``screen``: the trusted loss's verdicts,
    ``protocol.screening``, on each delta that passed every other rejection, or in a final
    round on the mean, which it refuses whole; None: none).

    Deterministic: candidates are taken in learner order, whatever order they come in.
    Raises ``ValueError`` for two candidates of one learner or a candidate with neither a
    delta nor a problem (the caller's bugs); every fault of a snapshot is a rejection.
    """
    round = keys.round_of(spec.index, version + 1, config.fragments)
    ordered = sorted(candidates, key=lambda c: c.snapshot.learner)
    learners = [c.snapshot.learner for c in ordered]
    if len(set(learners)) != len(learners):
        raise ValueError(f"two candidates of one learner in round {round}: {learners}")
    rejected: list[Rejection] = []
    kept: Kept = []
    for candidate in ordered:
        checked = _check(candidate, version, round, spec, config)
        if isinstance(checked, _Passed):
            kept.append((candidate, checked.delta, checked.norm))
        else:
            rejected.append(_rejection(candidate.snapshot, *checked))
    kept = _drop_large(kept, theta, config, rejected)
    final = all(candidate.snapshot.final is True for candidate, _, _ in kept)
    if screen is not None and kept and not final:
        kept = _drop_screened(kept, screen, rejected)
    rejected.sort(key=lambda r: r.learner)
    if not kept:
        return Aggregate(mean=None, participants=(), rejected=tuple(rejected), cosine=None)
    snapshots = [candidate.snapshot for candidate, _, _ in kept]
    weights, notes = _weighted(kept, spec, config, momentum)
    sparse = [by_senders(snapshot, config) for snapshot in snapshots]
    mean, dots = mean_and_dots(
        [delta for _, delta, _ in kept], weights, spec, cosines=True, sparse=sparse
    )
    result = Aggregate(
        mean=mean,
        participants=_participants(snapshots, weights, notes),
        rejected=tuple(rejected),
        cosine=_cosine([norm for _, _, norm in kept], dots, mean),
    )
    # A final snapshot is one learner's model, not steps: each alone is worse than the
    # mean the final round makes, so a screen judges that mean.
    why = screen([mean])[0] if screen is not None and final else None
    return result if why is None else refused(result, f"the final models' mean {why}", "loss")


def _weighted(
    kept: Kept, spec: FragmentSpec, config: RunConfig, momentum: Sequence[Tensor] | None
) -> tuple[list[float], list[str | None]]:
    """The accepted deltas' weights, and what bounding did to each (``RunConfig.robust``;
    None: nothing)."""
    snapshots = [candidate.snapshot for candidate, _, _ in kept]
    if not config.robust:
        return _weights(snapshots, config), [None] * len(kept)
    history = None if momentum is None else l2_norm(momentum)
    deltas = [delta for _, delta, _ in kept]
    pairwise = pairwise_distances(deltas, spec) if len(kept) >= 3 else None
    norms = [norm for _, _, norm in kept]
    return bounded_weights(snapshots, norms, config, history, pairwise)


def _participants(
    snapshots: Sequence[Snapshot], weights: Sequence[float], notes: Sequence[str | None]
) -> tuple[Participant, ...]:
    """The accepted ``snapshots`` as the record's participants, with their weights and what
    bounding did to each (``notes``, None: nothing)."""
    return tuple(
        Participant(
            learner=s.learner,
            weight=weight,
            steps=s.steps,
            tokens=s.tokens,
            base_version=s.base_version,
            closing=s.closing,
            step_time=s.step_time,
            waited=s.waited,
            bounded=msgspec.UNSET if note is None else note,
        )
        for s, weight, note in zip(snapshots, weights, notes, strict=True)
    )
