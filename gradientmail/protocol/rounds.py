"""The syncer's round as a pure state machine: what to do next about one round.

For round ``r`` a syncer holds a ``RoundState`` (its timers are values in it) and feeds it
one ``RoundObservation`` per look at the store (the record, the claims, who published, the
leases). ``observed(state, view, now, config)`` answers ``(state', step)``; the node's shell
(``_node/syncer_task.py``) only lists, reads, writes and sleeps as ``step`` says: ``Adopt`` a
record, ``Claim`` or ``TakeOver`` a claim, ``Follow``, ``Wait`` (``due=True``: at the due
pace, for ``due_for`` seconds after the first snapshot, or after the moment its recent
rounds' pace says the first is near: ``cadence``), ``Again`` (``fresh=True``: on a
lease listing taken now) or ``Commit``.

A round commits after its quorum and grace, on a lease listing taken after its snapshots
were listed, or, quorum or not, once every live learner missing from it has moved past it
for ``grace`` seconds. Live learners are the nodes with a live ``learner`` or ``closing``
lease (``quorum_learners``); in an adaptive run (``RunConfig.overlap`` None) a round counts only
those that took part in the round before, each for at most a patience
(``protocol.expectation``). The rules and their reasons: docs/protocol.md, "Closing a round".

Pure: no I/O, no clock; the caller passes ``now``.
"""

from dataclasses import dataclass, replace
from typing import Literal, TypeAlias

from gradientmail.protocol.expectation import Expectation
from gradientmail.protocol.records import RoundRecord, RunConfig

__all__ = [
    "AFTER_COMMIT",
    "MAX_CLAIMS",
    "Adopt",
    "Again",
    "Claim",
    "CloseView",
    "Commit",
    "Follow",
    "Resume",
    "RoundAction",
    "RoundObservation",
    "RoundState",
    "RoundView",
    "Step",
    "TakeOver",
    "Wait",
    "counted_claims",
    "decide_close",
    "decide_round",
    "due_for",
    "observed",
    "quorate",
    "quorum_learners",
]


@dataclass(frozen=True, slots=True)
class RoundView:
    """What a syncer knows of round ``round`` at ``now``, for ``decide_round``.

    ``claims``: ``(k, claimant)`` in order; ``following_since``: when this node began
    following the last claimant (None if it has not); ``first_snapshot_at``: when it first
    saw a snapshot in the round (None if none yet).
    """

    round: int
    me: str
    has_record: bool
    claims: tuple[tuple[int, str], ...]
    live: frozenset[str]
    following_since: float | None
    first_snapshot_at: float | None
    now: float
    claim_timeout: float


@dataclass(frozen=True, slots=True)
class Adopt:
    """The round has a record: take it as the round's outcome (``record``, set by
    ``observed``); ``superseded`` when this node held the round."""

    record: RoundRecord | None = None
    superseded: bool = False


@dataclass(frozen=True, slots=True)
class Claim:
    """Nobody claimed the round: take claim ``k`` (0) and close it."""

    k: int


@dataclass(frozen=True, slots=True)
class Resume:
    """The last claim is this node's: close the round."""


@dataclass(frozen=True, slots=True)
class Follow:
    """Another node holds the round: wait for its record. ``announce``: this node has just
    begun following ``claimant`` (the shell reports it)."""

    claimant: str
    announce: bool = False


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The last claimant failed the round: take claim ``k`` and close it."""

    k: int
    cause: Literal["lease_gone", "no_record"]


@dataclass(frozen=True, slots=True)
class Wait:
    """Closing: the round is not ready; look again after the poll interval, or after the
    due poll interval when ``due`` (it has a snapshot, or its first is expected). ``due_at``:
    the pause ends then at the latest (``RoundState.due_from``, or in a synchronous run
    ``expected_at``). ``waited_on``: a due round of a synchronous run (``overlap`` 0), whose
    every learner waits for its record from its own snapshot on: look again at the wait
    pace, since its snapshots often all land within one due pause; where they do not
    (``RoundState.loose``), only while one snapshot can complete the round."""

    due: bool = False
    due_at: float | None = None
    waited_on: bool = False


@dataclass(frozen=True, slots=True)
class Again:
    """Look again at once; with ``fresh``, on a listing of the leases taken now."""

    fresh: bool = False


@dataclass(frozen=True, slots=True)
class Commit:
    """Close the round now. ``missing``: live learners without a snapshot in it (the round
    closes without them; it is empty when nobody published)."""

    missing: frozenset[str]
    published: frozenset[str]


RoundAction: TypeAlias = Adopt | Claim | Resume | Follow | TakeOver
Step: TypeAlias = Adopt | Claim | TakeOver | Follow | Wait | Again | Commit


MAX_CLAIMS = 10_000
"""Claim numbers are four digits (``protocol.keys.round_claim``, ``keys.create_claim``)."""

AFTER_COMMIT = 0.1
"""Seconds a round counts as due from when the round before it ended: a learner that
closes publishes its flush and its final snapshots as soon as it holds the version just
committed, long before the pace of the rounds says the next one is near."""


def counted_claims(claims: tuple[tuple[int, str], ...]) -> tuple[tuple[int, str], ...]:
    """The claims that count: the contiguous run numbered from 0. Honest nodes only ever take
    the claim after the last one, so a claim after a gap (say one planted at ``9999``) is
    someone else's object, ignored."""
    run: list[tuple[int, str]] = []
    for k, claimant in sorted(claims):
        if k != len(run):
            break
        run.append((k, claimant))
    return tuple(run)


def due_for(config: RunConfig) -> float:
    """How long a round stays due after the snapshot that made it so (for a syncer its
    first, for a learner its own): the others' within ``grace``, the close within as much
    again. Past that the node waits on something slower and polls at its idle pace."""
    return 2 * config.grace


def decide_round(view: RoundView) -> RoundAction:
    """What a syncer does next about ``view.round`` (see the module docstring).

    When every claim number is taken (``MAX_CLAIMS`` claims, which only a hostile writer
    makes), a syncer that would take over closes without a claim (``Resume``): the record is
    create-once, so closers racing for it still commit one outcome."""
    if view.has_record:
        return Adopt()
    claims = counted_claims(view.claims)
    if not claims:
        return Claim(0)
    k, claimant = claims[-1]
    if claimant == view.me:
        return Resume()
    cause: Literal["lease_gone", "no_record"] | None = None
    if claimant not in view.live:
        cause = "lease_gone"
    elif view.following_since is not None and view.first_snapshot_at is not None:
        since = max(view.following_since, view.first_snapshot_at)
        if view.now - since >= view.claim_timeout:
            cause = "no_record"
    if cause is None:
        return Follow(claimant)
    return TakeOver(k + 1, cause) if k + 1 < MAX_CLAIMS else Resume()


def quorum_learners(live: frozenset[str], learners: frozenset[str]) -> frozenset[str]:
    """The learners a quorum counts: holders of a live lease whose role is ``learner`` or
    ``closing`` (``keys.trains``)."""
    return live & learners


@dataclass(frozen=True, slots=True)
class CloseView:
    """What the closer of a round knows at ``now``: who has a snapshot in it, the live
    learners, when the quorum was first reached (None: not yet), and since when every live
    learner without a snapshot in it has had one in one of the next ``fragments - 1`` rounds
    (None: not so)."""

    snapshots: frozenset[str]
    learners: frozenset[str]
    quorum_at: float | None
    now: float
    passed_at: float | None = None
    deadline: float | None = None


def quorate(snapshots: frozenset[str], learners: frozenset[str], config: RunConfig) -> bool:
    """Whether ``snapshots`` make the quorum among the live ``learners``."""
    count = len(snapshots)
    return count >= config.quorum_min and count >= config.quorum_fraction * len(learners)


def decide_close(view: CloseView, config: RunConfig) -> Literal["waiting", "grace", "close"]:
    """``waiting`` for the quorum, in ``grace`` after it, or ``close`` now.

    A round closes once every live learner without a snapshot in it has moved past it for
    ``grace`` seconds (``passed_at``), quorum or not: they will not publish to it, and
    waiting would stall the run (a round nobody published to closes empty, its fragment
    unchanged; this is what lets the last node's flush rounds close when its own progress
    skipped a fragment, and lets learners closing together finish when one of them still
    had steps of a fragment the others had published in full). Past ``deadline`` (an
    adaptive round's patience) a round with ``quorum_min`` snapshots closes with them.
    """
    if view.passed_at is not None and view.now - view.passed_at >= config.grace:
        return "close"
    if not view.snapshots:
        return "waiting"
    if (
        view.deadline is not None
        and view.now >= view.deadline
        and len(view.snapshots) >= config.quorum_min
    ):
        return "close"
    if not quorate(view.snapshots, view.learners, config):
        return "waiting"
    if view.learners <= view.snapshots:
        return "close"
    if view.quorum_at is not None and view.now - view.quorum_at >= config.grace:
        return "close"
    return "grace"


@dataclass(frozen=True, slots=True)
class RoundObservation:
    """One look at a round: its ``record`` (None: none yet, or not looked for), its
    ``claims`` in order, the learners with a snapshot in it (in a signed run, only snapshots
    that verify), the learners with a snapshot in one of the next ``fragments - 1`` rounds
    (``later``; None when not listed), the holders of a live lease, the nodes whose lease
    says ``learner`` or ``closing`` (``learners``) and ``closing`` (``closing``), when the
    snapshots and the leases were listed, and when the record was looked for
    (``record_at``; None: not in this look, ``RoundState.wants_record``)."""

    record: RoundRecord | None
    claims: tuple[tuple[int, str], ...]
    snapshots: frozenset[str]
    live: frozenset[str]
    learners: frozenset[str]
    snapshots_at: float
    leases_at: float
    later: frozenset[str] | None = None
    record_at: float | None = None
    closing: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RoundState:
    """A syncer's state in round ``round``: who it follows and since when, when it first saw
    a snapshot there, and once it holds the round (``claimed_at``) when the quorum was first
    reached, since when every live learner without a snapshot in it has moved past it, and
    when it first listed each learner's snapshot (``arrivals``, in that order).
    ``expected``: whom the round waits for in an adaptive run (``expectation``);
    ``due_from``: when its first snapshot is expected soon (``cadence.Cadence.due_from``),
    from which it is due before any snapshot is listed; ``expected_at``: when that first
    snapshot is expected (``cadence.Cadence.expected_at``); ``opened_at``: when this
    syncer took the round up, the round before it ended (``AFTER_COMMIT``);
    ``record_looked_at``: when this node last looked for the round's record; ``loose``:
    the recent rounds' snapshots landed over several due pauses (``Cadence.loose``)."""

    round: int
    me: str
    claim_timeout: float
    expected: Expectation | None = None
    due_from: float | None = None
    expected_at: float | None = None
    opened_at: float | None = None
    following: str | None = None
    following_since: float | None = None
    first_snapshot_at: float | None = None
    claimed_at: float | None = None
    quorum_at: float | None = None
    passed_at: float | None = None
    arrivals: tuple[tuple[str, float], ...] = ()
    record_looked_at: float | None = None
    loose: bool = False

    @property
    def closing(self) -> bool:
        """Whether this node holds the round's last claim and closes it."""
        return self.claimed_at is not None

    @property
    def first_listed(self) -> float | None:
        """When this node first listed a snapshot in the round (None: it has not): while
        deciding (``first_snapshot_at``), before a takeover began its ``arrivals``."""
        if self.first_snapshot_at is not None:
            return self.first_snapshot_at
        return self.arrivals[0][1] if self.arrivals else None

    def claimed(self, now: float) -> "RoundState":
        """This node won its claim on the round at ``now`` (or holds the last one)."""
        return replace(self, claimed_at=now)

    def arrived(self, learner: str) -> float | None:
        """How many seconds after the round's first snapshot this node first listed
        ``learner``'s (None: it has not)."""
        times = dict(self.arrivals)
        if learner not in times:
            return None
        return times[learner] - self.arrivals[0][1]

    def wants_record(self, now: float, every: float) -> bool:
        """Whether the next look should look for the round's record: always while deciding;
        while closing the round, once ``every`` seconds. Only a takeover commits a round
        this node holds, and only past the claim timeout or once its lease is gone; its
        own record write is create-once and adopts a record found there
        (``RoundSuperseded``), so looking less often costs a superseded closer the time to
        its next look, never a second record, where looking at every due poll doubles the
        requests of a round everyone waits on."""
        if not self.closing or self.record_looked_at is None:
            return True
        return now - self.record_looked_at >= every

    def wants_later(self, snapshots: frozenset[str], learners: frozenset[str]) -> bool:
        """Whether the next look should list the later rounds' snapshots (``later``): only
        while closing a round that is empty or that some live learner (of ``learners``) has
        not published to."""
        return self.closing and (not snapshots or not learners <= snapshots)


def observed(
    state: RoundState, view: RoundObservation, now: float, config: RunConfig
) -> tuple[RoundState, Step]:
    """The next state and step of the round after ``view``, taken at ``now``."""
    if view.record_at is not None:
        state = replace(state, record_looked_at=view.record_at)
    if view.record is not None and state.closing:
        return state, Adopt(view.record, superseded=True)
    if state.closing:
        return _closing(state, view, now, config)
    return _deciding(state, view, now)


def _deciding(state: RoundState, view: RoundObservation, now: float) -> tuple[RoundState, Step]:
    first = state.first_snapshot_at
    if first is None and view.snapshots:
        first = now
    state = replace(state, first_snapshot_at=first)
    action = decide_round(
        RoundView(
            round=state.round,
            me=state.me,
            has_record=view.record is not None,
            claims=view.claims,
            live=view.live,
            following_since=state.following_since,
            first_snapshot_at=first,
            now=now,
            claim_timeout=state.claim_timeout,
        )
    )
    match action:
        case Adopt():
            return state, Adopt(view.record)
        case Resume():
            return state.claimed(now), Again()
        case Follow(claimant) if claimant != state.following:
            return replace(state, following=claimant, following_since=now), Follow(
                claimant, announce=True
            )
        case _:
            return state, action


def _before_first(
    state: RoundState, now: float, window: float, config: RunConfig, completes: bool
) -> Wait:
    """How a held round waits while none of its snapshots is listed (see ``Wait``): due for
    ``AFTER_COMMIT`` seconds from when it opened, then from ``due_from`` for ``window``
    seconds, at the wait pace from ``expected_at`` in a synchronous run where one snapshot
    can complete the round (``completes``)."""
    due_from = state.due_from
    opened = state.opened_at
    if opened is not None and now < opened + AFTER_COMMIT and (due_from is None or now < due_from):
        return Wait(due=True, due_at=opened + AFTER_COMMIT)
    if due_from is None:
        return Wait()
    if now < due_from:
        return Wait(due_at=due_from)
    due = now - due_from < window
    if not due or config.applied_after != 0 or not completes:
        return Wait(due=due)
    if state.expected_at is not None and now < state.expected_at:
        return Wait(due=True, due_at=state.expected_at)
    return Wait(due=True, waited_on=True)


def _closing(
    state: RoundState, view: RoundObservation, now: float, config: RunConfig
) -> tuple[RoundState, Step]:
    learners = quorum_learners(view.live, view.learners)
    if state.expected is not None:
        learners &= state.expected.learners
    missing = learners - view.snapshots
    passed_at = state.passed_at
    if view.later is None:
        passed_at = None
    else:
        moved_on = bool(view.later) and missing <= view.later
        passed_at = (now if passed_at is None else passed_at) if moved_on else None
    quorum_at = state.quorum_at
    if quorum_at is None and view.snapshots and quorate(view.snapshots, learners, config):
        quorum_at = now
    listed = {learner for learner, _ in state.arrivals}
    arrivals = state.arrivals + tuple(
        (learner, view.snapshots_at) for learner in sorted(view.snapshots - listed)
    )
    state = replace(state, quorum_at=quorum_at, passed_at=passed_at, arrivals=arrivals)
    deadline = None
    if state.expected is not None and arrivals:
        start = state.expected.start(arrivals, state.expected_at, view.closing)
        deadline = start + state.expected.patience
    close = CloseView(view.snapshots, learners, quorum_at, now, passed_at, deadline)
    decision = decide_close(close, config)
    if decision != "close":
        window = due_for(config)
        if state.expected is not None:
            window = max(window, state.expected.patience)
        completes = not state.loose or len(missing) <= 1
        if arrivals:
            due = now - arrivals[0][1] < window
            return state, Wait(due=due, waited_on=due and config.applied_after == 0 and completes)
        return state, _before_first(state, now, window, config, completes)
    if view.leases_at < view.snapshots_at:
        return state, Again(fresh=True)
    return state, Commit(missing=missing, published=view.snapshots)
