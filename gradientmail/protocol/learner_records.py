"""What a committed record does to the pure learner (``protocol.learner.Learner``): it is
folded into the ``Ledger`` in round order, once nothing holds it back (the publish of this
learner's snapshot for its round), and answers ``Recorded``, ``Resolved`` and ``Dropped``;
a newer version becomes the fragment's wanted download; and unpaced, the schedule moves
(``realigned``: a learner that fell behind; ``held_back``: one that runs ahead; the rules
are docs/protocol.md's, "A learner that falls behind" and "A learner that runs ahead").
Pure: no I/O, no clock; times are the driver's readings."""

from dataclasses import replace
from typing import TypeVar

from msgspec import UNSET

from gradientmail.protocol.learner_state import LearnerState
from gradientmail.protocol.learner_values import Action, Dropped, Published, Recorded, Resolved
from gradientmail.protocol.pace import fleet_step_time
from gradientmail.protocol.records import RoundRecord
from gradientmail.protocol.schedule import phase_shift, positions_until_due, steps_to_hold

__all__ = ["fold_held"]

S = TypeVar("S", bound=LearnerState)


def fold_held(state: S) -> tuple[S, list[Action]]:
    """Fold the held records, in order, up to the first whose round this learner's snapshot
    is still being published for."""
    actions: list[Action] = []
    while state.held:
        record, seen_at = state.held[0]
        slot = state.slots[record.fragment]
        published = slot.published
        if slot.in_flight and published is not None and published.round == record.round:
            break
        state = replace(state, held=state.held[1:])
        state, more = _fold(state, record, seen_at)
        actions.extend(more)
    return state, actions


def _fold(learner: S, record: RoundRecord, seen_at: float) -> tuple[S, list[Action]]:
    fragment = record.fragment
    had_steps = learner.ledger[fragment].since_base.steps > 0
    ledger, resolution = learner.ledger.recorded(record, learner.name)
    actions: list[Action] = [Recorded(record)]
    slot = learner.slots[fragment]
    published = slot.published
    if resolution is not None:
        actions.append(Resolved(resolution))
        if resolution.outcome == "rejected":
            detail = f"rejected by round {resolution.round}: {resolution.reason}"
            actions.append(
                Dropped(fragment, resolution.steps, resolution.tokens, "rejected", detail)
            )
        if published is not None and published.round == resolution.round:
            published = replace(published, outcome=resolution.outcome)
    if record.version > slot.version:
        slot = replace(slot, wanted=record, update_failed=False, reported=False)
    committed = learner.committed + (record.committed_by == learner.name)
    closing = learner.closing.folded(record, learner.name) if learner.closing else None
    others = any(p.learner != learner.name and p.closing is not True for p in record.participants)
    state = replace(
        learner,
        ledger=ledger,
        newest_round=record.round,
        committed=committed,
        closing=closing,
        went_on=record.round if others else learner.went_on,
    )
    state = state.with_slot(fragment, replace(slot, published=published))
    if learner.paced:
        # The waits at the overlap step keep paced learners in the same rounds: one that
        # fell behind catches up while the others' rounds wait for it. Moving the schedule
        # from clock readings (which include those waits) could step over a fragment's due
        # step every period, and would make the snapshots' steps depend on the timing.
        return state, actions
    fleet = fleet_step_time([state.pace.step_time, *(p.pace for p in record.participants)])
    state = replace(state, pace=state.pace.rated(fleet, state.config))
    missed = (
        had_steps
        and bool(record.participants)
        and (resolution is None or resolution.outcome == "late")
        and (resolution is not None or learner.ledger[fragment].in_flight is None)
    )
    if missed:
        state = _realigned(state, record, seen_at, published, least=0.0)
    elif resolution is not None and resolution.outcome == "included":
        # Waited for, in the late half of the grace: one jitter from missing the next.
        moved = _realigned(state, record, seen_at, published, least=learner.config.grace / 2)
        if moved.phase != state.phase:
            state = replace(moved, hold_until=state.step)
        else:
            state = _held_back(state, record, published)
    return state, actions


def _realigned(
    state: S, record: RoundRecord, seen_at: float, published: Published | None, least: float
) -> S:
    """Advance the phase when this learner was more than ``least`` seconds behind the
    first snapshots of ``record``'s round (``schedule.phase_shift``)."""
    tau, rate = state.pace.step_time, state.pace.rate
    if tau is None:
        return state
    if published is not None and published.round == record.round:
        mine = published.at
    else:
        ahead = positions_until_due(record.fragment, state.position + state.phase, state.config)
        if ahead is None:
            return state
        mine = seen_at + (ahead / rate + max(0, state.hold_until - state.step)) * tau
    lag = mine - (seen_at - record.grace_seconds)
    shift = phase_shift(lag, least, tau, rate, state.config)
    return replace(state, phase=(state.phase + shift) % state.config.sync_every)


def _held_back(state: S, record: RoundRecord, published: Published | None) -> S:
    """Hold the schedule for as many steps as the round waited after this learner's
    snapshot for its last participant's (``schedule.steps_to_hold``), less the steps
    held (or still to hold) since the snapshot was taken: they closed part of that gap."""
    if published is None:
        return state
    arrived = {p.learner: p.arrived for p in record.participants if p.arrived is not UNSET}
    mine = arrived.get(state.name)
    if mine is None:
        return state
    pending = max(0, state.hold_until - state.step)
    held = (state.stood - published.stood) + pending
    early = max(arrived.values()) - mine
    needed = steps_to_hold(early, state.pace.step_time, state.pace.rate, held, state.config)
    if needed <= 0:
        return state
    return replace(state, hold_until=state.step + pending + needed)
