"""A round's outcome: its aggregate, θ_{v+1}, the outer momentum and the update blob.

``outcome`` aggregates the round's candidates (``aggregation.aggregate``) and runs the step
(``checkpoint.step``) and the committed update (``outer.committed_update``). A final round
(its candidates all final) commits θ + Δ̄ with no outer step and the momentum unchanged,
its update dense even in a ``topk`` run (``sparse.sent_as``).
An outer step that is not finite (finite deltas whose sum overflows) is refused
(``refused_non_finite``): every accepted snapshot is rejected as ``non-finite`` and the
fragment stays as it was.

Pure: no I/O; runs on whatever thread calls it (the syncer runs it in a worker thread).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from gradientmail.protocol.aggregation import Aggregate, Candidate, Screen, aggregate, refused
from gradientmail.protocol.checkpoint import step
from gradientmail.protocol.outer import committed_update
from gradientmail.protocol.pieces import all_finite
from gradientmail.protocol.records import Encoding, FragmentSpec, RunConfig
from gradientmail.protocol.sparse import sent_as, update_sparsity

__all__ = ["NON_FINITE", "Outcome", "finite", "outcome", "refused_non_finite"]

NON_FINITE = "the outer step gives a non-finite θ or momentum"
"""The detail of the rejections of a refused round."""


@dataclass(frozen=True)
class Outcome:
    """What a round commits: its aggregate (``result``), θ_{v+1}, the momentum after it and
    the update blob every learner applies, in ``encoding`` (``sparse.sent_as``)."""

    result: Aggregate
    theta: list[Tensor]
    momentum: list[Tensor]
    update: bytes
    encoding: Encoding


def finite(*groups: Sequence[Tensor]) -> bool:
    """Whether every element of every tensor of ``groups`` is finite."""
    return all(all_finite(t) for group in groups for t in group)


def refused_non_finite(
    result: Aggregate, theta: Sequence[Tensor], momentum: Sequence[Tensor]
) -> Aggregate | None:
    """``result`` refused (every participant rejected as ``non-finite``) when it accepted
    snapshots and the step it made gives a non-finite θ or momentum; None when it stands."""
    if result.mean is None or finite(theta, momentum):
        return None
    return refused(result, NON_FINITE)


def outcome(
    version: int,
    theta: Sequence[Tensor],
    momentum: Sequence[Tensor] | None,
    candidates: Sequence[Candidate],
    spec: FragmentSpec,
    config: RunConfig,
    screen: Screen | None = None,
) -> Outcome:
    """The outcome of the round that takes fragment ``spec.index`` from ``version`` (θ
    ``theta``, outer momentum ``momentum``; None: no step yet) to ``version + 1``, from the
    round's ``candidates`` (``aggregation.counted_snapshots``), screened by ``screen`` when
    given (``protocol.screening``). Inputs are never modified. Raises what ``aggregate``
    raises for the caller's bugs, and what ``screen`` raises."""
    final = bool(candidates) and all(c.snapshot.final is True for c in candidates)
    result = aggregate(
        version, candidates, spec, config, theta=theta, momentum=momentum, screen=screen
    )
    committed = _numerics(version, theta, momentum, result.mean, spec, config, final=final)
    refusal = refused_non_finite(result, committed[0], committed[1])
    if refusal is None:
        return Outcome(result, *committed)
    return Outcome(refusal, *_numerics(version, theta, momentum, None, spec, config, final=False))


def _numerics(
    version: int,
    theta: Sequence[Tensor],
    momentum: Sequence[Tensor] | None,
    mean: Sequence[Tensor] | None,
    spec: FragmentSpec,
    config: RunConfig,
    *,
    final: bool,
) -> tuple[list[Tensor], list[Tensor], bytes, Encoding]:
    """θ_{v+1}, the new momentum, the update blob of one round and its encoding: the raw θ'
    of ``checkpoint.step`` (which a replay runs again), committed through its update (a
    blob of ``version + 1``)."""
    raw, stepped = step(theta, momentum, mean, config, final=final)
    encoding = sent_as(config, "update", final=final)
    update, committed = committed_update(
        theta,
        raw,
        spec,
        encoding,
        block_size=config.block_size,
        version=version + 1,
        sparsity=update_sparsity(config),
    )
    return committed, stepped, update, encoding
