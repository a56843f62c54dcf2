"""Each learner's pace as a run's records show it, for ``gradientmail status`` (pure).

From the newest rounds a learner took part in: its step rate (``Participant.step_time``,
the median of its recent step durations as its snapshot stated it), its local steps per
round (the median over those rounds: in the adaptive schedule a slower learner takes fewer)
and the share of its time it spent waiting on rounds (``Participant.waited``; only the
repeatable mode waits).
"""

import statistics
from collections.abc import Sequence
from typing import Any

from gradientmail.protocol.records import Participant, RoundRecord

__all__ = ["paces"]


def paces(records: Sequence[RoundRecord], *, last: int = 16) -> list[dict[str, Any]]:
    """One entry per learner in the newest ``last`` of ``records`` (in round order), by
    name: ``learner``, ``rounds`` (it took part in), ``steps_per_second``,
    ``steps_per_round`` and ``waited`` (each null when no snapshot stated it). Final
    snapshots (no steps) are left out."""
    seen: dict[str, list[Participant]] = {}
    for record in records[-last:] if last > 0 else []:
        for p in record.participants:
            if p.steps > 0:
                seen.setdefault(p.learner, []).append(p)
    out = []
    for learner, taken in sorted(seen.items()):
        newest = taken[-1]
        step_time = newest.pace
        waited = [p.waited for p in taken if isinstance(p.waited, float)]
        out.append(
            {
                "learner": learner,
                "rounds": len(taken),
                "steps_per_second": None if not step_time else 1.0 / step_time,
                "steps_per_round": statistics.median(p.steps for p in taken),
                "waited": waited[-1] if waited else None,
            }
        )
    return out
