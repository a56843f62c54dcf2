"""When a syncer expects a round's first snapshot: the pace its rounds came at.

A syncer sees a round's snapshots only when it lists them. Between rounds it polls at its
idle pace (``NodeOptions.poll_interval``), so a first snapshot can sit unseen for a whole
idle pause, and in a round every learner waits on (``RunConfig.overlap`` 0) that pause is
time no learner trains. Learners take their snapshots of consecutive rounds a fixed number
of steps apart (``RunConfig.sync_every / fragments``), so the first snapshots of recent
rounds, as this syncer listed them, say when the next one comes: ``Cadence.due_from``.
From then the round counts as due (``rounds.RoundState.due_from``) and is polled at the due
pace, for at most ``rounds.due_for`` seconds; a round of a synchronous run at the wait pace
from when its first snapshot is expected (``Cadence.expected_at``). Where the recent rounds'
snapshots landed over several due pauses (``Cadence.loose``), only the last of a round can
complete it, and a synchronous round is polled at the wait pace only once it is the one
missing (``rounds.RoundState.loose``). An adaptive round holding only closing learners'
snapshots waits for the others from ``expected_at`` at the earliest
(``protocol.expectation``). A closing learner's snapshots come ahead of the pace and do not
count as a round's first (``counted_first``).

Pure: no I/O, no clock; times are the syncer's clock.
"""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from gradientmail.protocol.expectation import first_training
from gradientmail.protocol.records import RoundRecord

__all__ = ["ANTICIPATION", "LOOSE", "Cadence", "counted_first"]

ANTICIPATION = 0.75
"""The share of the recent interval between rounds' first snapshots after which the next
round counts as due: early enough that a round coming up to a quarter of an interval early
is still polled at the due pace, late enough that a syncer polls at that pace for a quarter
of the time between rounds."""

LOOSE = 2.0
"""Due pauses over which the snapshots of recent rounds landed (the median) past which a
synchronous round counts as loose: polling the whole of such a spread at the wait pace
takes more than ``LOOSE`` times ``due / wait`` looks a round (20 at the defaults), which
find nothing a learner waits on until the last snapshot."""

_KEPT = 8
"""The rounds whose first snapshots a ``Cadence`` keeps: the median of their intervals
follows a change of pace within a few rounds and ignores one late round."""


@dataclass(frozen=True, slots=True)
class Cadence:
    """The first snapshots of a syncer's recent rounds: ``(round, when it listed the
    first)``, oldest first; ``spreads``: the seconds from the first to the last snapshot it
    listed in the recent rounds it closed."""

    firsts: tuple[tuple[int, float], ...] = ()
    spreads: tuple[float, ...] = ()

    def seen(self, round: int, at: float | None, last: float | None = None) -> "Cadence":
        """This cadence once ``round`` ended, its first snapshot listed at ``at`` (None:
        this syncer listed none, as when another syncer closed it before it looked) and,
        when this syncer closed it, its last at ``last``."""
        if at is None:
            return self
        spreads = self.spreads
        if last is not None:
            spreads = (*spreads, max(0.0, last - at))[-_KEPT:]
        return Cadence((*self.firsts, (round, at))[-_KEPT:], spreads)

    def loose(self, pause: float) -> bool:
        """Whether the recent rounds' snapshots landed over more than ``LOOSE`` pauses of
        ``pause`` seconds (the median spread; False before any round was closed here)."""
        return bool(self.spreads) and statistics.median(self.spreads) > LOOSE * pause

    def due_from(self, round: int) -> float | None:
        """When ``round`` counts as due before any of its snapshots is listed: ``ANTICIPATION``
        of the median interval between consecutive recent rounds after the first snapshot
        of the round before it; None unless that round and one before it were seen."""
        return self._after_last(round, ANTICIPATION)

    def expected_at(self, round: int) -> float | None:
        """When ``round``'s first snapshot is expected: the median interval after the first
        snapshot of the round before it; None when ``due_from`` is."""
        return self._after_last(round, 1.0)

    def _after_last(self, round: int, share: float) -> float | None:
        intervals = [
            later - earlier
            for (r0, earlier), (r1, later) in zip(self.firsts, self.firsts[1:], strict=False)
            if r1 == r0 + 1 and later >= earlier
        ]
        if not self.firsts or self.firsts[-1][0] != round - 1 or not intervals:
            return None
        return self.firsts[-1][1] + share * statistics.median(intervals)


def counted_first(
    arrivals: Sequence[tuple[str, float]], first: float | None, record: RoundRecord
) -> float | None:
    """The time a ``Cadence`` takes as ``record``'s round's first snapshot: when its closer
    first listed a snapshot of a learner that was not closing (``arrivals``: learner and
    when, in that order), else ``first`` (when it first listed any). A closing learner
    publishes its flush as soon as it closes, ahead of the rounds' pace: counted, it would
    make the next rounds look due, and closed, before the others are."""
    closing = frozenset(p.learner for p in record.participants if p.closing is True)
    training = first_training(arrivals, closing)
    return first if training is None else training
