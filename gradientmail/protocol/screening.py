"""Screening a round's deltas against a trusted loss (``NodeOptions.trusted_loss``).

A syncer given a trusted loss (an evaluation on data the learners never see, run by the
operator's own nodes) scores every delta that passed the round's other rejections: the loss
of the committed θ (the baseline), and the loss of θ with that one delta applied, alone, to
the round's fragment (its trial). A delta whose trial is above the baseline, or not finite,
is rejected (``loss``): applied alone, it does not move the shared model down the trusted
loss. A final round (closing learners' models, no steps) is judged by its mean instead,
and refused whole when that mean raises the loss: one learner's model alone is worse than
the mean of several, and a final round must not make the final model worse. It is the one
rule that tells a liar from an honest learner when two learners make a round: every rule
that treats the two alike (capped weights, clipped norms) leaves a liar half the mean
(docs/reliability.md, "Threat model").

``trial_state`` builds the tensors of one trial; ``verdicts`` decides; ``screen`` puts them
together for ``aggregation.aggregate``. Pure but for the trusted loss itself, which the
operator supplies and which runs on the thread that calls ``screen`` (the syncer's worker
thread).
"""

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from torch import Tensor

from gradientmail.protocol.aggregation import Screen
from gradientmail.protocol.fragments import assembled
from gradientmail.protocol.records import FragmentSpec

__all__ = ["TrustedLoss", "screen", "trial_state", "verdicts"]

TrustedLoss = Callable[[Mapping[str, Tensor]], float]
"""Every parameter's tensors by name (``Manifest`` names) to a loss, lower being better.
Parameters only: no buffers, and a tied parameter once, under its first name, so load them
with ``model.load_state_dict(state, strict=False)`` (which copies). The tensors are the
syncer's own: read them, never modify them."""


def trial_state(
    thetas: Sequence[Sequence[Tensor]],
    specs: Sequence[FragmentSpec],
    fragment: int,
    delta: Sequence[Tensor] | None,
) -> dict[str, Tensor]:
    """Every parameter's tensor by name (``fragments.assembled``): fragment ``f``'s θ from
    ``thetas[f]`` (each in its ``specs[f].params`` order), fragment ``fragment``'s plus
    ``delta`` (None: the baseline, θ itself). ``thetas`` are never modified; a tensor that
    is neither moved, split nor cast is ``thetas``' own."""
    trial = [
        [t + d.to(t.dtype) for t, d in zip(theta, delta, strict=True)]
        if delta is not None and spec.index == fragment
        else theta
        for spec, theta in zip(specs, thetas, strict=True)
    ]
    return assembled(specs, trial)


def verdicts(baseline: float, trials: Sequence[float]) -> list[str | None]:
    """Why each delta is rejected (completing "it ..."), from the trusted loss of the
    committed θ (``baseline``) and of θ with that delta applied (``trials``): a trial above
    the baseline, or not finite; None where it is kept. Raises ``ValueError`` when the
    baseline is not finite: the trusted loss cannot judge a θ it cannot score, and rejecting
    every delta would stop the run without saying why."""
    if not math.isfinite(baseline):
        raise ValueError(
            f"the trusted loss of the committed θ is {baseline}: NodeOptions.trusted_loss "
            "must return a finite number for the shared model"
        )
    reasons: list[str | None] = []
    for trial in trials:
        if not math.isfinite(trial):
            reasons.append(f"gives a trusted loss of {trial}")
        elif trial > baseline:
            before, after = _apart(baseline, trial)
            reasons.append(f"raises the trusted loss from {before} to {after}")
        else:
            reasons.append(None)
    return reasons


def _apart(low: float, high: float) -> tuple[str, str]:
    """``low`` and ``high`` (``low < high``) at six significant digits, or at as many more
    as it takes for the two to read apart."""
    for digits in range(6, 18):
        left, right = f"{low:.{digits}g}", f"{high:.{digits}g}"
        if left != right:
            break
    return left, right


def screen(
    loss: TrustedLoss,
    thetas: Sequence[Sequence[Tensor]],
    specs: Sequence[FragmentSpec],
    fragment: int,
) -> Screen:
    """The screen of a round of ``fragment``: ``verdicts`` over ``loss`` of the baseline
    and of each delta's trial, one trial at a time. Raises what ``loss`` raises, and
    ``TypeError`` when it returns something ``float()`` does not take."""

    def scored(delta: Sequence[Tensor] | None) -> float:
        value = loss(trial_state(thetas, specs, fragment, delta))
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"NodeOptions.trusted_loss must return a number (a float), got {value!r}"
            ) from None

    def screened(deltas: Iterable[Sequence[Tensor]]) -> list[str | None]:
        baseline = scored(None)
        return verdicts(baseline, [scored(delta) for delta in deltas])

    return screened
