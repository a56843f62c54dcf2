"""The learner as one pure state machine: what a node's training does with respect to the
run, fed inputs and answering with actions (no I/O, no clock, no thread; the node's tasks
move the bytes and the time around it).

``Learner`` is an immutable value; ``handle(input)`` takes one input (``Input``, the tagged
union of ``protocol.learner_inputs``) and returns the next value and the actions the driver
carries out, in order. Per fragment it keeps the base ``B`` (θ of the version its local
weights started from), the snapshot it published, and the version being prepared.

``Stepped(tokens, now)``
    One local step: ``Apply`` every prepared version (``merge.merge_into``), ``Dropped`` for
    steps a rejection reset, then ``TakeSnapshot`` for the fragment due, unless a snapshot of it
    is unresolved or a version of it pending. With ``RunConfig.overlap`` a round's version
    is applied ``overlap`` steps after its snapshot, no earlier (``wait_until``).
``Synced(now)``
    With ``overlap`` 0, after the step that snapshotted and the wait for its round's
    version: ``Apply`` every prepared version, counting no step.
``took(fragment, snapshot)`` (the reply to ``TakeSnapshot``, not an input) / ``PublishEnded``
    The ``Publish`` for the fragment's next round after the newest record applied; a failed
    publish forgets the snapshot, its steps going out with the fragment's next one.
``RecordSeen(record, now)``
    The next committed record in round order, folded into the ``Ledger`` at once or, if this
    learner's publish for its round is still out, once it returns (the participant of that
    name may be an earlier life's snapshot under the same key). Answers ``Recorded``,
    ``Resolved`` (included, late or rejected), ``Dropped`` and ``Download``.
``downloads()`` / ``VersionReady`` / ``DownloadFailed``
    The newest record of each fragment not yet prepared: its update on ``B``, or θ rebuilt
    from the checkpoint below it. A corrupt update falls back to the rebuild; a θ that
    cannot be rebuilt answers ``Unavailable`` once. No fragment holds up another.
``Flushed`` / ``settled`` / ``DroppedAll`` / ``BeganClosing`` / ``Finalized`` / ``finished``
    Closing: every fragment with steps is snapshotted; once settled, one final ``Publish``
    per fragment (docs/protocol.md, "The last round of a run"), finished once every fragment
    holds its final round's version.

The schedule's phase and pace (``protocol.pace``) follow docs/protocol.md, "A learner that
falls behind", "A learner that runs ahead" and "Fleets of unequal machines". Times are the
driver's clock readings, passed in. For every fragment at all times
``committed + dropped + since_base == total`` (the ``Ledger``).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import assert_never

from gradientmail.protocol import keys
from gradientmail.protocol.fragments import due, joined_phase
from gradientmail.protocol.learner_inputs import (
    BeganClosing,
    DownloadFailed,
    DroppedAll,
    Finalized,
    Flushed,
    Input,
    PublishEnded,
    RecordSeen,
    Stepped,
    Synced,
    VersionReady,
)
from gradientmail.protocol.learner_records import fold_held
from gradientmail.protocol.learner_state import LearnerState
from gradientmail.protocol.learner_values import (
    Action,
    Apply,
    Download,
    Dropped,
    Failure,
    FlushingClose,
    Publish,
    Published,
    Ready,
    Recorded,
    Resolved,
    Slot,
    Stage,
    TakeSnapshot,
    Tensors,
    Unavailable,
)
from gradientmail.protocol.merge import Merge
from gradientmail.protocol.records import DropReason, RoundRecord

__all__ = [
    "Action",
    "Apply",
    "BeganClosing",
    "Download",
    "DownloadFailed",
    "Dropped",
    "DroppedAll",
    "Failure",
    "Finalized",
    "Flushed",
    "Input",
    "Learner",
    "Publish",
    "PublishEnded",
    "RecordSeen",
    "Recorded",
    "Resolved",
    "Slot",
    "Stage",
    "Stepped",
    "Synced",
    "TakeSnapshot",
    "Unavailable",
    "VersionReady",
]


@dataclass(frozen=True, slots=True)
class Learner(LearnerState):
    """The learner as one immutable state machine (see the module docstring; its fields and
    queries are ``LearnerState``'s). Build it with ``start``."""

    # -- inputs ------------------------------------------------------------------------------

    def handle(self, input: Input) -> tuple["Learner", list[Action]]:
        """Take one input (see the module docstring and ``protocol.learner_inputs``): the
        next value and the actions to carry out, in order. Raises ``ValueError`` for a
        record out of order (``RecordSeen``) or models of another fragment count
        (``BeganClosing``)."""
        match input:
            case Stepped(tokens=tokens, now=now):
                return self._stepped(tokens, now)
            case Synced():
                return self._apply_ready()
            case Flushed(now=now):
                return self._flush(now)
            case RecordSeen(record=record, now=now):
                return self._record_seen(record, now)
            case VersionReady(fragment=fragment, round=round, theta=theta):
                return self._version_ready(fragment, round, theta), []
            case DownloadFailed(fragment, round, stage, failure, detail):
                return self._download_failed(fragment, round, stage, failure, detail)
            case PublishEnded(fragment=fragment, round=round, ok=ok):
                return self._published(fragment, round, ok=ok)
            case BeganClosing(models=models):
                return self._began_closing(models)
            case Finalized():
                return self._finalize()
            case DroppedAll(reason=reason, detail=detail):
                return self._dropped_all(reason, detail)
        assert_never(input)

    def took(self, fragment: int, snapshot: Tensors) -> tuple["Learner", Publish]:
        """The copy for the ``TakeSnapshot`` of ``fragment`` just answered (not an input: see
        the module docstring)."""
        slot = self.slots[fragment]
        published = slot.published
        if published is None or published.snapshot is not None:
            raise ValueError(f"fragment {fragment} has no snapshot waiting for its copy")
        flight = self.ledger[fragment].in_flight
        assert flight is not None
        slot = replace(slot, published=replace(published, snapshot=snapshot))
        job = Publish(
            fragment=fragment,
            round=published.round,
            base_version=slot.version,
            base=slot.base,
            snapshot=snapshot,
            steps=flight.covers.steps,
            tokens=flight.covers.tokens,
            closing=self.closing is not None,
            step_time=self.pace.step_time,
        )
        return self.with_slot(fragment, slot), job

    def _stepped(self, tokens: int, now: float) -> tuple["Learner", list[Action]]:
        pace, advance = self.pace.stepped(now)
        state = replace(
            self,
            ledger=self.ledger.stepped(tokens),
            step=self.step + 1,
            tokens=self.tokens + tokens,
            pace=pace,
        )
        if state.joining:
            phase = joined_phase(state.seen_round, state.config)
            state = replace(state, phase=phase, joining=False)
        state, actions = state._apply_ready()
        start = state.position
        state = replace(state, position=start + advance)
        if state.step <= state.hold_until:
            # The schedule stands still this step: nothing comes due (again).
            phase = (state.phase - advance) % state.config.sync_every
            return replace(state, phase=phase, stood=state.stood + 1), actions
        for position in range(start + 1, start + advance + 1):
            for fragment in due(position + state.phase, state.config):
                state, more = state._snapshot(fragment, now)
                actions.extend(more)
        return state, actions

    def _flush(self, now: float) -> tuple["Learner", list[Action]]:
        state, actions = self._apply_ready(holding=False)
        for fragment in range(self.config.fragments):
            state, more = state._snapshot(fragment, now)
            actions.extend(more)
        return state, actions

    def _began_closing(self, models: Sequence[Tensors]) -> tuple["Learner", list[Action]]:
        """Closing begins with ``models``, the live model. A learner ``behind`` the others
        (it stood still through more than a cycle of their rounds) with nothing in flight
        drops its unsent steps (``Dropped``, ``"behind"``): taken on a model a whole cycle
        behind theirs, at the close no later round would train them in, and a round of them
        alone would move the run's last θ by them at full weight."""
        if len(models) != self.config.fragments:
            raise ValueError(f"a run of {self.config.fragments} fragments needs one model each")
        behind = self.behind and all(f.in_flight is None for f in self.ledger.fragments)
        closing = FlushingClose(tuple(tuple(m) for m in models), self.past_versions, behind)
        state = replace(self, closing=closing)
        if not behind:
            return state, []
        detail = (
            f"its model lacked rounds up to {self.went_on} in which others trained, more than "
            f"a cycle past round {self.past_versions} when closing began"
        )
        return state._dropped_all("behind", detail)

    def _finalize(self) -> tuple["Learner", list[Action]]:
        """The final snapshots, once settled (none before, none without ``BeganClosing``):
        per fragment the model closing began with minus the newest θ held, for round
        ``round_of(f, version + 1)``. None from a learner that never stepped (its model is
        θ), nor from one whose model, when closing began, lacked more than ``F`` rounds in
        which others trained on (a snapshot of another learner that was not closing), be it
        rounds that went by while it stood still (``behind``: its unsent steps were dropped
        when closing began) or while its flush settled (its model is behind theirs). A
        fragment whose final round committed without it publishes it again, for its next
        round, once that round's θ is applied (how often: ``FlushingClose``). They carry no
        steps, so the ledger is untouched whatever the rounds do."""
        if self.closing is None or not self.settled or not self.step:
            return self, []
        closing, jobs = self.closing.jobs(self.slots, self.went_on)
        return replace(self, closing=closing), list(jobs)

    def _record_seen(self, record: RoundRecord, now: float) -> tuple["Learner", list[Action]]:
        if record.round != self.seen_round + 1:
            raise ValueError(
                f"expected the record of round {self.seen_round + 1}, got {record.round}"
            )
        state = replace(self, held=(*self.held, (record, now)))
        return fold_held(state)

    def _version_ready(self, fragment: int, round: int, theta: Tensors) -> "Learner":
        slot = self.slots[fragment]
        wanted = slot.wanted
        if wanted is None or wanted.round != round or slot.ready is not None:
            return self
        ready = Ready(round=round, version=wanted.version, theta=theta)
        return self.with_slot(
            fragment, replace(slot, ready=ready, wanted=None, update_failed=False)
        )

    def _download_failed(
        self, fragment: int, round: int, stage: Stage, failure: Failure, detail: str
    ) -> tuple["Learner", list[Action]]:
        slot = self.slots[fragment]
        if slot.wanted is None or slot.wanted.round != round:
            return self, []
        if stage == "update":
            return self.with_slot(fragment, replace(slot, update_failed=True)), []
        if failure == "gone" or slot.reported:
            return self, []
        report = Unavailable(
            fragment,
            round,
            f"round {round} (fragment {fragment}, version {slot.wanted.version}): neither its "
            f"update nor its θ can be used (θ: {detail}); the fragment keeps version "
            f"{slot.version}, and the download is retried at every poll, silently, until it "
            "works or a newer record of the fragment replaces it",
        )
        return self.with_slot(fragment, replace(slot, reported=True)), [report]

    def _dropped_all(self, reason: DropReason, detail: str) -> tuple["Learner", list[Action]]:
        """A snapshot still in flight is forgotten with its steps: its ``PublishEnded`` may
        still arrive and then only ends the flight."""
        state = self
        ledger = self.ledger
        actions: list[Action] = []
        for fragment, slot in enumerate(self.slots):
            ledger, gone = ledger.dropped(fragment, reason, detail)
            if gone.steps or gone.tokens:
                actions.append(gone)
            if slot.published is not None and slot.published.outcome is None:
                state = state.with_slot(fragment, replace(slot, published=None))
        return replace(state, ledger=ledger), actions

    # -- transitions -------------------------------------------------------------------------

    def _snapshot(self, fragment: int, now: float) -> tuple["Learner", list[Action]]:
        slot = self.slots[fragment]
        if slot.blocked or self.ledger[fragment].since_base.steps == 0:
            return self, []
        round = keys.round_of(fragment, slot.version + 1, self.config.fragments)
        published = Published(round=round, step=self.step, at=now, stood=self.stood)
        state = replace(self, ledger=self.ledger.published(fragment, round))
        state = state.with_slot(fragment, replace(slot, published=published, in_flight=True))
        return state, [TakeSnapshot(fragment, round)]

    def _apply_ready(self, *, holding: bool = True) -> tuple["Learner", list[Action]]:
        """Apply every prepared version; with ``holding`` and ``RunConfig.overlap``, the
        version of the round this learner's snapshot went to only from the step ``overlap``
        steps after that snapshot."""
        state = self
        actions: list[Action] = []
        overlap = self.config.applied_after
        for fragment, slot in enumerate(self.slots):
            ready = slot.ready
            if ready is None:
                continue
            published = slot.published
            if (
                holding
                and overlap is not None
                and published is not None
                and published.round == ready.round
                and state.step < published.step + overlap
            ):
                continue
            mine = published is not None and published.round <= ready.round
            outcome = state._merge(fragment, ready.round, published if mine else None)
            own = published if outcome == "included" else None
            lag = None if own is None else state.step - own.step
            actions.append(
                Apply(
                    fragment=fragment,
                    round=ready.round,
                    version=ready.version,
                    outcome=outcome,
                    theta=ready.theta,
                    snapshot=published.snapshot if published is not None else None,
                    base=slot.base,
                    rule=state.config.merge,
                    alpha=state.config.alpha,
                    step=state.step,
                    lag=lag,
                )
            )
            aligned = replace(
                slot,
                version=ready.version,
                base=ready.theta,
                published=None if mine else published,
                ready=None,
                reported=False,
            )
            state = state.with_slot(fragment, aligned)
            if state.closing is not None:
                closing = state.closing.applied(fragment, ready.round, slot.base, ready.theta)
                state = replace(state, closing=closing)
            if outcome == "rejected":
                # The ledger dropped the steps up to the record when it was folded; the reset
                # to the round's θ just now also wiped the steps taken since.
                detail = f"round {ready.round} rejected a snapshot"
                ledger, gone = state.ledger.dropped(fragment, "reset", detail)
                state = replace(state, ledger=ledger)
                if gone.steps or gone.tokens:
                    actions.append(gone)
        return state, actions

    def _merge(self, fragment: int, round: int, mine: Published | None) -> Merge:
        """How ``round``'s version of ``fragment`` merges: by the outcome for this learner's
        snapshot ``mine`` (None: none went to it or before), ``final`` for the round of a
        closing learner's final snapshot, else ``late``."""
        if mine is not None and mine.outcome is not None:
            return mine.outcome
        if self.closing is not None and (
            self.closing.behind or self.closing.took_final(fragment, round)
        ):
            return "final"
        return "late"

    def _published(self, fragment: int, round: int, *, ok: bool) -> tuple["Learner", list[Action]]:
        slot = self.slots[fragment]
        published = slot.published
        if not slot.in_flight:
            return fold_held(self)  # a final snapshot: nothing waited on it
        ledger = self.ledger
        slot = replace(slot, in_flight=False)
        mine = published is not None and published.round == round
        if not ok and mine and published is not None and published.outcome is None:
            slot = replace(slot, published=None)
            ledger = ledger.publish_failed(fragment)
        return fold_held(replace(self, ledger=ledger).with_slot(fragment, slot))
