"""How long a learner waits on rounds before its steps (``LearnerDriver.wait_to_step``, with
``RunConfig.overlap``): the seconds in all, the share of its time over about the last
fragment period (each snapshot states it: ``Snapshot.waited``), and whom the waits are for
(``Waiting``, reported when the share is over ``WAITING_WARNING``). Used on the event-loop
thread only."""

from msgspec import UNSET

from gradientmail._node.runtime import Runtime
from gradientmail.events.kinds import WAITING_WARNING, Waiting
from gradientmail.protocol.records import RoundRecord

__all__ = ["Waits"]


class Waits:
    """The waits of one learner (see the module docstring); ``waited`` counts the seconds
    ``LearnerDriver.wait_to_step`` has waited in all."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self.waited = 0.0
        self._marks: tuple[tuple[float, float], ...] = ((rt.clock.now(), 0.0),)
        self._waited_for: tuple[str, ...] = ()
        self._warned = 0

    def share(self) -> float:
        """The share of its time this learner waited on rounds over about the last fragment
        period (its last ``fragments`` snapshots), 0 to 1, noting the present as the start
        of the next snapshot's interval; reports ``Waiting`` when it is over
        ``WAITING_WARNING``, at most once a period."""
        rt = self._rt
        now = rt.clock.now()
        period = rt.config.fragments
        marks = (*self._marks, (now, self.waited))[-(period + 1) :]
        self._marks = marks
        began, before = marks[0]
        share = 0.0 if now <= began else min(1.0, max(0.0, (self.waited - before) / (now - began)))
        self._warned = max(0, self._warned - 1)
        if share > WAITING_WARNING and not self._warned:
            rt.emit(Waiting(rt.learner, round(share, 3), self._waited_for))
            self._warned = period
        return share

    def note(self, record: RoundRecord, step_time: float | None) -> None:
        """The learners ``record``'s round took after this learner's snapshot, a step time
        (``step_time``) or more later (``Participant.arrived``): whom its waits are for."""
        arrived = {p.learner: p.arrived for p in record.participants if p.arrived is not UNSET}
        mine = arrived.get(self._rt.learner)
        if mine is None or step_time is None:
            return
        later = tuple(sorted(n for n, at in arrived.items() if at - mine >= step_time))
        if later:
            self._waited_for = later
