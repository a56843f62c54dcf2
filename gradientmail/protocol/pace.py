"""A learner's pace: how long its steps take, and how fast its schedule runs against the
fleet's (Dynamic Local Updates, for fleets of unequal machines).

A learner's schedule counts positions, not steps (``fragments.due`` on the position plus
the phase). An adaptive learner (``RunConfig.overlap`` None) advances ``rate`` positions
per local step, ``rate`` being its step time over the fastest step time of the fleet (the
participants of the newest record it folded, itself included): the fastest learners run
at rate 1 and take ``sync_every`` steps per fragment period, a learner four times slower
runs at rate 4 and takes a quarter of them, so the snapshots of one round arrive together
and nobody's round waits for a slow machine. A learner within ``SAME_PACE`` of the fastest
keeps rate 1 (an equal fleet runs exactly the fixed schedule), and no rate exceeds a
fragment's interval (``sync_every // fragments`` positions), so a step makes at most
about one fragment due. A paced learner (``overlap`` set: the repeatable mode) always runs
at rate 1.

The step time is the median of the last ``WINDOW`` step durations: one long step (a
validation pass, a checkpoint, a pause) does not change the pace; a machine that stays
slower does, within half a window.

Pure: times are passed in.
"""

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace

from gradientmail.protocol.records import RunConfig

__all__ = ["SAME_PACE", "WINDOW", "Pace", "fleet_step_time"]

WINDOW = 7
"""Step durations the median is taken over."""

SAME_PACE = 1.1
"""A learner at most this factor slower than the fleet's fastest keeps rate 1."""


@dataclass(frozen=True, slots=True)
class Pace:
    """``durations``: the last ``WINDOW`` step durations (seconds); ``last_at``: when the
    last step was counted; ``rate``: positions per step; ``credit``: the fraction of a
    position carried to the next step."""

    durations: tuple[float, ...] = ()
    last_at: float | None = None
    rate: float = 1.0
    credit: float = 0.0

    @property
    def step_time(self) -> float | None:
        """The median step duration, None before a step was timed."""
        if not self.durations:
            return None
        return statistics.median(self.durations)

    def stepped(self, now: float) -> tuple["Pace", int]:
        """One local step counted at ``now``: the next pace and the positions the schedule
        advances (rate 1: always 1)."""
        durations = self.durations
        if self.last_at is not None and now > self.last_at:
            durations = (*durations, now - self.last_at)[-WINDOW:]
        credit = self.credit + self.rate
        advance = math.floor(credit)
        return replace(self, durations=durations, last_at=now, credit=credit - advance), advance

    def rated(self, fleet: float | None, config: RunConfig) -> "Pace":
        """The pace against the fleet's fastest step time ``fleet`` (None: unknown, the rate
        stays). Paced runs (``overlap`` set) keep rate 1."""
        own = self.step_time
        if config.overlap is not None or fleet is None or own is None or fleet <= 0:
            return self
        ratio = own / fleet
        most = max(1.0, config.sync_every / config.fragments)
        rate = 1.0 if ratio <= SAME_PACE else min(ratio, most)
        if rate == 1.0:
            return replace(self, rate=1.0, credit=0.0)
        return replace(self, rate=rate)


def fleet_step_time(step_times: Iterable[float | None]) -> float | None:
    """The fastest of the finite, positive ``step_times`` (None when there is none)."""
    known = [t for t in step_times if t is not None and math.isfinite(t) and t > 0]
    return min(known, default=None)
