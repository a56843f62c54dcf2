"""The values the pure learner (``protocol.learner``) is made of and answers with: its
actions, and the state of one fragment. Pure: no I/O."""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, TypeAlias

from torch import Tensor

from gradientmail.protocol import keys
from gradientmail.protocol.config import MergeRule
from gradientmail.protocol.merge import Dropped, Merge, Outcome, Resolution
from gradientmail.protocol.records import RoundRecord

__all__ = [
    "Action",
    "Apply",
    "Download",
    "Dropped",
    "Failure",
    "FlushingClose",
    "Publish",
    "Published",
    "Ready",
    "Recorded",
    "Resolved",
    "Slot",
    "Stage",
    "TakeSnapshot",
    "Tensors",
    "Unavailable",
]

Tensors: TypeAlias = tuple[Tensor, ...]
Failure = Literal["gone", "corrupt"]
Stage = Literal["update", "theta"]


@dataclass(frozen=True, slots=True)
class Apply:
    """Merge ``theta`` (version ``version`` of ``fragment``, committed by ``round``) into the
    live weights: ``merge.merge_into(params, outcome, theta=…, snapshot=…, base=…, rule=…,
    alpha=…)``. ``lag`` is the number of local steps since the snapshot when it was
    included, else None; ``step`` the local step count."""

    fragment: int
    round: int
    version: int
    outcome: Merge
    theta: Tensors
    snapshot: Tensors | None
    base: Tensors
    rule: MergeRule
    alpha: float
    step: int
    lag: int | None


@dataclass(frozen=True, slots=True)
class TakeSnapshot:
    """Copy ``fragment``'s live weights to the CPU and hand them to ``Learner.took``; the
    snapshot is for ``round``."""

    fragment: int
    round: int


@dataclass(frozen=True, slots=True)
class Publish:
    """Write ``snapshot − base`` of ``fragment`` for ``round`` (covering ``steps`` and
    ``tokens``), then report how it ended (``PublishEnded``). ``closing``: taken
    after closing began (the flush); ``final``: a closing learner's last snapshot
    (``Finalized``); ``step_time``: the learner's median step time (None: not known
    yet)."""

    fragment: int
    round: int
    base_version: int
    base: Tensors
    snapshot: Tensors
    steps: int
    tokens: int
    closing: bool = False
    final: bool = False
    step_time: float | None = None


@dataclass(frozen=True, slots=True)
class Download:
    """Fetch ``record``'s version of its fragment: ``base + update`` when ``base`` is not
    None (the next version), else θ rebuilt from the checkpoint at or below the record
    (``protocol.checkpoint``); then ``VersionReady`` or ``DownloadFailed``."""

    fragment: int
    record: RoundRecord
    base: Tensors | None


@dataclass(frozen=True, slots=True)
class Recorded:
    """``record`` was folded (report it)."""

    record: RoundRecord


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a round did with this learner's snapshot (the ``Ledger``'s resolution)."""

    resolution: Resolution


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Neither the update nor the θ of ``round`` (``fragment``) could be used: ``detail``.
    Reported once per record; the download is retried at every poll until it works or a
    newer record of the fragment replaces it."""

    fragment: int
    round: int
    detail: str


Action: TypeAlias = (
    Apply | TakeSnapshot | Publish | Download | Recorded | Resolved | Dropped | Unavailable
)


@dataclass(frozen=True, slots=True)
class Published:
    """A snapshot of a fragment for ``round``, taken after local step ``step`` at time ``at``
    when the learner's schedule had stood still for ``stood`` steps in all (``snapshot`` is
    None until the driver hands the copy over). ``outcome`` is set once the round's record
    is folded."""

    round: int
    step: int
    at: float
    stood: int = 0
    snapshot: Tensors | None = None
    outcome: Outcome | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    """Version ``version`` of a fragment, committed by ``round``: ``theta``."""

    round: int
    version: int
    theta: Tensors


@dataclass(frozen=True, slots=True)
class Slot:
    """One fragment as this learner holds it. ``wanted`` is the newest record of it not yet
    prepared; ``update_failed`` whether its update could not be used; ``reported`` whether
    it was reported ``Unavailable``."""

    version: int
    base: Tensors
    published: Published | None = None
    in_flight: bool = False
    ready: Ready | None = None
    wanted: RoundRecord | None = None
    update_failed: bool = False
    reported: bool = False

    @property
    def blocked(self) -> bool:
        """Whether a snapshot must wait: one is unresolved or a version is pending."""
        return (
            self.in_flight
            or self.published is not None
            or self.ready is not None
            or self.wanted is not None
        )


@dataclass(frozen=True, slots=True)
class FlushingClose:
    """A close with flush (``BeganClosing``, docs/protocol.md "The last round of a
    run"): ``models`` the live model when it began (one tuple per fragment), ``round``
    the first round past every version that model held (its final snapshots are skipped
    once others trained on in a round more than ``F`` past it: ``jobs``), ``behind``
    whether the learner was ``behind`` then (its unsent steps dropped, it publishes
    nothing more and ends on the newest θ: every version it applies while closing merges
    as ``final``), ``finals`` the round each fragment's final snapshot went to (empty
    until published), ``missed`` the fragments whose final round committed without their
    final snapshot and that publish it again, ``again`` those whose final snapshot went
    out again, ``trained`` the rounds in which another learner trained on since the
    finals went out and ``lacked`` what they moved each fragment's θ by (added back to a
    final sent again: ``applied``). A left-out final goes out again once whatever left
    it out (a learner still flushing meets that learner's final in the next round of the
    fragment), and again as long as the rounds that leave it out hold only other
    learners' closing snapshots or none, and rejected none (their flushes are finite, so
    their finals come: a round closes empty only once every live learner published past
    it); left out a second time by a round in which another learner trained on, or one
    that rejected a snapshot (this one's, or one that may be of a learner training on),
    it ends on the others' θ."""

    models: tuple[Tensors, ...]
    round: int
    behind: bool = False
    finals: tuple[int, ...] = ()
    missed: frozenset[int] = frozenset()
    again: frozenset[int] = frozenset()
    trained: frozenset[int] = frozenset()
    lacked: Mapping[int, Tensors] = field(default_factory=dict)

    def folded(self, record: RoundRecord, name: str) -> "FlushingClose":
        """``record`` was folded: note a round in which another learner trained on once the
        finals went out (``trained``), and a final round of this learner's that left it out."""
        fragment = record.fragment
        participants = record.participants
        state = self
        if self.finals and any(p.learner != name and p.closing is not True for p in participants):
            state = replace(self, trained=self.trained | {record.round})
        if not state.finals or record.round != state.finals[fragment]:
            return state
        if any(p.learner == name for p in participants):
            return state
        flushing = not record.rejected and all(p.closing is True for p in participants)
        if fragment in state.again and not flushing:
            return state
        return replace(state, missed=state.missed | {fragment})

    def applied(
        self, fragment: int, round: int, before: Tensors, after: Tensors
    ) -> "FlushingClose":
        """``round``'s version of ``fragment`` was applied, θ going from ``before`` to
        ``after``: once the finals went out, what a round in which another learner trained
        on moved θ is what the model closing began with lacks (``lacked``), and a final sent
        again adds it back, so that it does not take that learner's steps back; what the
        others' flush rounds moved it (their outer step's look-ahead) a final does take
        back, as the run's last model is the mean of the models."""
        if round not in self.trained:
            return self
        moved = tuple(a.sub(b) for a, b in zip(after, before, strict=True))
        earlier = self.lacked.get(fragment)
        if earlier is not None:
            moved = tuple(m.add(e) for m, e in zip(moved, earlier, strict=True))
        return replace(self, lacked={**self.lacked, fragment: moved})

    def took_final(self, fragment: int, round: int) -> bool:
        """Whether ``round`` is where ``fragment``'s final snapshot went, no resend of it
        pending (the learner ends on that round's θ: ``merge``'s ``final``)."""
        return bool(self.finals) and self.finals[fragment] == round and fragment not in self.missed

    def done(self, slots: tuple[Slot, ...]) -> bool:
        """Every final round applied, and no left-out final waiting to go out again."""
        fragments = len(slots)
        return not self.missed and all(
            slot.version >= keys.version_of(round, fragments)
            for slot, round in zip(slots, self.finals, strict=False)
        )

    def jobs(self, slots: tuple[Slot, ...], went_on: int) -> tuple["FlushingClose", list[Publish]]:
        """The final snapshots to publish now (the ``Finalized`` input of ``Learner.handle``),
        ``went_on`` the newest round folded in which another learner trained on."""
        fragments = len(slots)
        if not self.finals:
            if went_on > self.round + fragments:
                # Others trained on for a whole cycle of rounds that the model closing began
                # with lacks (they went by while this learner paused, or while its flush
                # settled): that model is behind theirs, and must not pull the run back.
                # Their flush rounds do not count: learners closing together, each flush
                # slow, must still end on a final round, not on a flush round's look-ahead.
                return self, []
            wanted = list(range(fragments))
        else:
            wanted = [
                f
                for f in sorted(self.missed)
                if slots[f].version >= keys.version_of(self.finals[f], fragments)
            ]
        jobs = []
        finals = list(self.finals or [-1] * fragments)
        for fragment in wanted:
            slot = slots[fragment]
            round = keys.round_of(fragment, slot.version + 1, fragments)
            model = self.models[fragment]
            lacked = self.lacked.get(fragment)
            if lacked is not None:
                model = tuple(
                    m.add(x.to(m.device, m.dtype)) for m, x in zip(model, lacked, strict=True)
                )
            jobs.append(
                Publish(
                    fragment, round, slot.version, slot.base, model, 0, 0, closing=True, final=True
                )
            )
            finals[fragment] = round
        sent = frozenset(job.fragment for job in jobs) if self.finals else frozenset()
        state = replace(self, finals=tuple(finals), missed=self.missed - sent)
        return replace(state, again=self.again | sent), jobs
