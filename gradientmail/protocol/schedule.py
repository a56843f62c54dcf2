"""The unpaced learner's schedule rules in seconds and positions: how far to move its phase
when its snapshots came late, and how many steps to hold it when they came early
(docs/protocol.md, "A learner that falls behind" and "A learner that runs ahead").

A step advances the schedule ``rate`` positions (``protocol.pace``), so one position takes
``step_time / rate`` seconds and a fragment period ``sync_every`` of them. Pure.
"""

import math
from typing import TypeGuard

from gradientmail.protocol.fragments import due
from gradientmail.protocol.records import RunConfig

__all__ = ["phase_shift", "positions_until_due", "steps_to_hold"]


def positions_until_due(fragment: int, position: int, config: RunConfig) -> int | None:
    """The positions after ``position`` (phase included) at which ``fragment`` comes due
    next, None if it never does within a period."""
    for ahead in range(1, config.sync_every + 1):
        if fragment in due(position + ahead, config):
            return ahead
    return None


def _usable(step_time: float | None) -> TypeGuard[float]:
    return step_time is not None and step_time > 0 and math.isfinite(step_time)


def phase_shift(
    lag: float, least: float, step_time: float | None, rate: float, config: RunConfig
) -> int:
    """The positions to advance the phase by for a snapshot ``lag`` seconds behind its
    round's first ones (0: none): the lag plus half the grace, when the lag is over
    ``least`` and shorter than a period, and a period is longer than the grace (within a
    shorter one every phase lands in time; a lag of a period or more is a pause or a blocked
    fragment, which moving would not help)."""
    if not _usable(step_time):
        return 0
    per_position = step_time / rate
    period = per_position * config.sync_every
    if lag <= least or period <= config.grace or lag >= period:
        return 0
    return math.ceil((lag + config.grace / 2) / per_position)


def steps_to_hold(
    early: float, step_time: float | None, rate: float, held: int, config: RunConfig
) -> int:
    """The steps to hold the schedule for a snapshot ``early`` seconds before its round's
    last one, less the ``held`` steps already held (or to hold) since it was taken: none for
    less than a step, or for a period or more (a pause of the others, not a phase)."""
    if not _usable(step_time):
        return 0
    if early < step_time or early >= step_time / rate * config.sync_every:
        return 0
    return max(0, int(early / step_time) - held)
