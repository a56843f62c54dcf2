"""Whom an adaptive round waits for, and from when: the deadline of a round in a run whose
learners are not paced (``RunConfig.overlap`` None).

A round counts the learners that took part in the round before it and the closing ones
(``expectation``), and waits for them at most ``Expectation.patience`` seconds past the
moment its patience starts (``Expectation.start``): the first snapshot of a learner that is
not closing (its lease says ``closing`` from before its flush, its snapshots in the recent
records say so after); with only closers' snapshots, no earlier than the recent rounds'
pace expects the round's first. A closing learner publishes its flush and its final
snapshots as soon as it can, ahead of that pace; counted from them, the patience would run
out before the others are due and close the round with the closer alone. The rules and
their reasons: docs/protocol.md, "Fleets of unequal machines".

Pure: no I/O, no clock; times are the syncer's clock.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from gradientmail.protocol.records import RoundRecord, RunConfig

__all__ = ["MAX_PATIENCE_GRACES", "Expectation", "expectation", "first_training"]

MAX_PATIENCE_GRACES = 10
"""An adaptive round waits for a learner that took part in the round before at most this
many graces past its first snapshot, whatever step time was stated."""


@dataclass(frozen=True, slots=True)
class Expectation:
    """Whom an adaptive round waits for (``learners``), for how long (``patience``,
    seconds), and which of them are closing (``closing``: their newest snapshot in the
    recent records was a closing one)."""

    learners: frozenset[str]
    patience: float
    closing: frozenset[str] = frozenset()

    def start(
        self,
        arrivals: Sequence[tuple[str, float]],
        expected_at: float | None,
        closing: frozenset[str] = frozenset(),
    ) -> float:
        """When the patience of a round starts, ``arrivals`` its snapshots as listed
        (learner and when, in that order, at least one): the first of a learner that is
        not closing (neither in ``self.closing`` nor in ``closing``, those whose lease says
        so); with none, the first, or ``expected_at`` (when the recent rounds' pace expected
        the round's first snapshot) if that is later."""
        training = first_training(arrivals, self.closing | closing)
        if training is not None:
            return training
        first = arrivals[0][1]
        return first if expected_at is None else max(first, expected_at)


def first_training(arrivals: Sequence[tuple[str, float]], closers: frozenset[str]) -> float | None:
    """When the first of ``arrivals`` (learner and when, in that order) of a learner not
    among ``closers`` was listed (None: there is none)."""
    return next((at for learner, at in arrivals if learner not in closers), None)


def expectation(recent: Sequence[RoundRecord], config: RunConfig) -> Expectation | None:
    """Whom the round after ``recent`` (the records before it, in round order, the newest
    last) waits for in an adaptive run: the learners that took part in the newest
    (participants and rejected), those that trained in the newest round in which one did
    (a round of closing snapshots alone says nothing of who trains on), and the closing
    ones (their newest snapshot in ``recent`` was taken after they began closing: their
    final snapshots may still come), for the grace plus the slowest step time the newest
    stated (at most ``MAX_PATIENCE_GRACES`` graces). None (every live learner, without a
    deadline) in a paced run, and when there is no previous record or nobody took part in
    it."""
    if config.overlap is not None or not recent:
        return None
    previous = recent[-1]
    learners = frozenset(p.learner for p in previous.participants) | frozenset(
        r.learner for r in previous.rejected
    )
    if not learners:
        return None
    for record in reversed(recent):
        trained = frozenset(p.learner for p in record.participants if p.closing is not True)
        if trained:
            learners |= trained
            break
    closing: dict[str, bool] = {}
    for record in recent:
        closing.update((r.learner, False) for r in record.rejected)
        closing.update((p.learner, p.closing is True) for p in record.participants)
    closers = frozenset(learner for learner, yes in closing.items() if yes)
    slowest = max((p.pace or 0.0 for p in previous.participants), default=0.0)
    patience = min(config.grace + slowest, MAX_PATIENCE_GRACES * max(config.grace, 1.0))
    return Expectation(learners | closers, patience, closers)
