"""The state the pure learner (``protocol.learner.Learner``) holds, and the questions it
answers about it without changing it: what was seen, what is held, whether closing is done,
whether and how long a step waits, what to download. Pure: no I/O, no clock."""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Self

from gradientmail.protocol import keys
from gradientmail.protocol.learner_values import Download, FlushingClose, Slot, Tensors
from gradientmail.protocol.merge import Ledger
from gradientmail.protocol.pace import Pace
from gradientmail.protocol.records import RoundRecord, RunConfig
from gradientmail.protocol.rounds import due_for

__all__ = ["LearnerState"]


_STILL = Pace()


@dataclass(frozen=True, slots=True)
class LearnerState:
    """The learner's whole state (``protocol.learner``'s docstring says what it does with it).
    Build it with ``start``.

    ``committed`` counts the records folded that this learner's node committed; ``held`` the
    records seen but not yet folded (each with the time it was seen); ``phase`` the steps
    added to the step count for ``due`` (``joining``: set at the first step, the learner
    joined a run in progress); the steps after ``step`` up to ``hold_until`` do not advance
    the schedule (each takes its advance from the phase), ``stood`` counts those taken so
    far; ``position`` is the schedule's count of positions (``pace``: how many a step
    advances; the step count itself at rate 1); ``went_on`` the newest round folded that
    holds a snapshot of another learner that was not closing (others trained on in it)."""

    config: RunConfig
    name: str
    ledger: Ledger
    slots: tuple[Slot, ...]
    newest_round: int
    step: int = 0
    tokens: int = 0
    committed: int = 0
    held: tuple[tuple[RoundRecord, float], ...] = ()
    phase: int = 0
    joining: bool = False
    hold_until: int = 0
    stood: int = 0
    position: int = 0
    pace: Pace = _STILL
    went_on: int = -1
    closing: FlushingClose | None = None

    @classmethod
    def start(
        cls,
        config: RunConfig,
        name: str,
        versions: Sequence[int],
        thetas: Sequence[Tensors],
        newest_round: int,
    ) -> Self:
        """A learner that joined at ``versions`` (θ ``thetas``) after round ``newest_round``
        (-1: none yet). Joined to a run in progress, its first step makes the round after
        the newest it has seen by then come due (``fragments.joined_phase``)."""
        if len(versions) != config.fragments or len(thetas) != config.fragments:
            raise ValueError(f"a run of {config.fragments} fragments needs one version each")
        return cls(
            config=config,
            name=name,
            ledger=Ledger.new(config.fragments),
            slots=tuple(Slot(v, tuple(t)) for v, t in zip(versions, thetas, strict=True)),
            newest_round=newest_round,
            joining=newest_round >= 0,
        )

    # -- queries -----------------------------------------------------------------------------

    @property
    def seen_round(self) -> int:
        """The newest round whose record this learner was fed (folded or held)."""
        return self.held[-1][0].round if self.held else self.newest_round

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(slot.version for slot in self.slots)

    @property
    def aligned_round(self) -> int:
        """The newest round among the versions held (-1: Θ⁰ only)."""
        fragments = len(self.slots)
        return max(
            (keys.round_of(f, s.version, fragments) for f, s in enumerate(self.slots) if s.version),
            default=-1,
        )

    @property
    def settled(self) -> bool:
        """Closing is done: no fragment has steps or a version pending."""
        return not any(
            slot.blocked or self.ledger[f].since_base.steps > 0 for f, slot in enumerate(self.slots)
        )

    @property
    def past_versions(self) -> int:
        """The first round past every version this learner holds."""
        fragments = len(self.slots)
        return max(keys.round_of(f, s.version + 1, fragments) for f, s in enumerate(self.slots))

    @property
    def behind(self) -> bool:
        """Whether others trained on (``went_on``) in a round more than ``F`` past every
        version this learner holds: its model lacks a whole cycle of their progress (it
        stood still through those rounds, a pause or a validation pass)."""
        return self.went_on > self.past_versions + len(self.slots)

    @property
    def finished(self) -> bool:
        """Closing is done: settled, and every final round (if any) applied."""
        return self.settled and (self.closing is None or self.closing.done(self.slots))

    @property
    def paced(self) -> bool:
        """Whether the rounds pace this learner (``RunConfig.overlap``): a learner ahead of
        the others waits for their rounds at its overlap step, so its schedule never moves
        (the resynchronization rules would make the snapshots' steps depend on the
        timing)."""
        return self.config.overlap is not None

    @property
    def publishing(self) -> bool:
        return any(slot.in_flight for slot in self.slots)

    def awaiting(self, now: float) -> bool:
        """Whether a round is due for this learner at ``now``: closing is not finished, or a
        snapshot of it went out less than ``rounds.due_for`` seconds ago and its round's
        record has not been seen."""
        if self.closing is not None and not self.finished:
            return True
        window = due_for(self.config)
        return any(
            slot.published is not None
            and slot.published.outcome is None
            and now - slot.published.at < window
            for slot in self.slots
        )

    def wait_until(self, now: float) -> float | None:
        """When the next step may be taken at the latest (``RunConfig.overlap``), None
        when it need not wait: it waits while it is the step at which a fragment applies
        the version of the round its snapshot went to and that version is not ready, until
        ``rounds.due_for`` after the snapshot. Never while closing: the flush applies
        whatever is ready."""
        overlap = self.config.applied_after
        if overlap is None or self.closing is not None:
            return None
        window = due_for(self.config)
        until = None
        for slot in self.slots:
            published = slot.published
            if published is None or self.step + 1 < published.step + overlap:
                continue
            ready = slot.ready
            end = published.at + window
            if (ready is None or ready.round < published.round) and now < end:
                until = end if until is None else min(until, end)
        return until

    def downloads(self) -> list[Download]:
        """The versions to fetch now, one per fragment that wants one (see ``Download``)."""
        wanted = []
        for fragment, slot in enumerate(self.slots):
            record = slot.wanted
            if record is None or slot.ready is not None:
                continue
            nxt = record.version == slot.version + 1 and not slot.update_failed
            wanted.append(Download(fragment, record, slot.base if nxt else None))
        return wanted

    def with_slot(self, fragment: int, slot: Slot) -> Self:
        """This state with ``slot`` as ``fragment``'s."""
        slots = list(self.slots)
        slots[fragment] = slot
        return replace(self, slots=tuple(slots))
