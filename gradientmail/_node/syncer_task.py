"""The syncer: closes the run's rounds, in order, together with every other syncer.

Each round is a pure state machine (``protocol.rounds``); this task only lists, reads,
writes and sleeps as its steps say: it observes the round, takes claims (``RoundClaimed``,
``TookOverRound``), follows (``FollowingRound``), adopts records (``RoundSuperseded`` when
this node held the round) and commits the rounds it holds (``_node.commit``:
``RoundClosed``, ``RoundCommitted``, ``RoundIncomplete``). Leases are read through a
``LeaseWatch`` (at most every ``min(lease_every, lease_timeout / 4)`` seconds, or at once
when a decision to close needs a fresh listing). In a signed run only snapshots and beats
that verify count.

``run_syncer`` rebuilds the state (θ and outer momentum of every fragment) from the store on
start and after every failure (``Recovered``; each fragment's rebuild happens at its next
commit, ``commit.load_fragment``). ``MailboxUnavailable``, ``RecordError`` and ``CorruptBlob`` while
recovering or on a round are reported (``RecoveryFailed``, ``RoundFailed``) and retried with
backoff; anything else fails the node (``SyncerStopped``, then ``NodeFailed``):
``StoreAccessError`` at once, any other exception as a bug.

Runs as one task of the node's task group; aggregation, the outer step, encoding and
decoding run in worker threads. Cancellation stops it between or within requests; a round
it was closing is then taken over by others once its lease is gone.
"""

from collections.abc import MutableMapping

from gradientmail._node.commit import FragmentState, SyncerState, commit
from gradientmail._node.runtime import Nudge, Runtime, backoff
from gradientmail.errors import CorruptBlob, MailboxUnavailable, RecordError
from gradientmail.events.kinds import (
    FollowingRound,
    Recovered,
    RecoveryFailed,
    RoundClaimed,
    RoundFailed,
    RoundSuperseded,
    TookOverRound,
)
from gradientmail.protocol.cadence import Cadence, counted_first
from gradientmail.protocol.checkpoint import check_record
from gradientmail.protocol.expectation import expectation
from gradientmail.protocol.liveness import LeaseWatch, Liveness
from gradientmail.protocol.records import RoundRecord
from gradientmail.protocol.rounds import (
    Adopt,
    Again,
    Claim,
    Commit,
    Follow,
    RoundObservation,
    RoundState,
    TakeOver,
    Wait,
    observed,
    quorum_learners,
)

__all__ = ["recover", "run_syncer"]

_RETRIED = (MailboxUnavailable, RecordError, CorruptBlob)
"""What a round or a recovery retries: the store out of reach for now, or an object in it
that does not decode or verify (another writer's junk, skipped or replaced by a later
write). Not ``StoreAccessError``: no retry fixes the operator's settings."""

Verified = MutableMapping[tuple[int, str], bool]
"""Which snapshots of a signed run verify, by ``(round, learner)``: snapshots are
create-once, so each is read once."""


async def recover(rt: Runtime) -> SyncerState:
    """The syncer's state from the store: the newest record of every fragment (θ and the
    momentum rebuilt lazily, ``commit.load_fragment``) and the next round to run."""
    fragments_count = rt.config.fragments
    rounds = await rt.store.record_rounds()
    next_round = rounds[-1] + 1 if rounds else 0
    fragments = [FragmentState(version=0, record=None) for _ in range(fragments_count)]
    for round in rounds[-fragments_count:]:
        record = await rt.store.record(round)
        if record is None:
            raise RecordError(f"records/{round:010d} was listed but is gone")
        check_record(record, round, rt.config)
        fragments[record.fragment] = FragmentState(version=record.version, record=record)
    return SyncerState(next_round=next_round, fragments=tuple(fragments))


async def run_syncer(rt: Runtime, published: Nudge | None = None) -> None:
    """Close rounds until cancelled (see the module docstring). ``published``: set when
    this node's learner has a snapshot in the store; a round this syncer holds and waits
    on at its idle pace is looked at again then."""
    published = Nudge() if published is None else published
    every = min(rt.options.lease_every, rt.options.lease_timeout / 4)
    watch = LeaseWatch(Liveness(rt.options.lease_timeout), every)
    verified: Verified = {}
    cadence = Cadence()
    delay: float | None = None
    while True:
        try:
            state = await recover(rt)
        except _RETRIED as exc:
            delay = backoff(delay, rt.options)
            rt.emit(RecoveryFailed(rt.learner, exc, delay))
            await rt.clock.sleep(delay)
            continue
        rt.emit(Recovered(rt.learner, state.next_round))
        delay = None
        while True:
            round = state.next_round
            for stale in [key for key in verified if key[0] < round]:
                del verified[stale]
            try:
                state, watch, listed = await _run_round(
                    rt, state, watch, verified, published, cadence
                )
            except _RETRIED as exc:
                delay = backoff(delay, rt.options)
                rt.emit(RoundFailed(rt.learner, round, exc, delay))
                await rt.clock.sleep(delay)
                break
            delay = None
            cadence = cadence.seen(round, *listed)


async def _run_round(
    rt: Runtime,
    state: SyncerState,
    watch: LeaseWatch,
    verified: Verified,
    published: Nudge,
    cadence: Cadence,
) -> tuple[SyncerState, LeaseWatch, tuple[float | None, float | None]]:
    """Run round ``state.next_round`` until it is adopted or committed, at the pace
    ``cadence`` expects its first snapshot at; also answers when this syncer first listed
    a snapshot in it and, when it held the round, the last (None: never)."""
    round = state.next_round
    expected = expectation(state.newest(2 * rt.config.fragments), rt.config)
    held = RoundState(
        round,
        rt.learner,
        rt.options.claim_timeout,
        expected,
        due_from=cadence.due_from(round),
        expected_at=cadence.expected_at(round),
        opened_at=rt.clock.now(),
        loose=cadence.loose(rt.options.pause(due=True)),
    )
    fresh = False
    while True:
        view, watch = await _observe(rt, held, watch, verified, fresh)
        now = rt.clock.now()
        held, step = observed(held, view, now, rt.config)
        fresh = False
        match step:
            case Adopt(record=record, superseded=superseded) if record is not None:
                if superseded:
                    rt.emit(RoundSuperseded(rt.learner, record))
                return _adopt(rt, state, record), watch, _listed(held, record)
            case Claim(k) | TakeOver(k, _):
                if await rt.store.claim_round(held.round, k, rt.learner):
                    _claimed(rt, held.round, step, view)
                    held = held.claimed(now)
            case Follow(_, announce):
                if announce:
                    claimants = tuple(c for _, c in view.claims)
                    timeout = rt.options.claim_timeout
                    rt.emit(FollowingRound(rt.learner, held.round, claimants, timeout))
                await rt.clock.sleep(rt.options.poll_interval)
            case Wait():
                await _pause(rt, published, step, now)
            case Again(fresh=fresh):
                pass
            case Commit():
                state, record, mine = await commit(rt, state, held, step)
                if not mine:
                    rt.emit(RoundSuperseded(rt.learner, record))
                    return _adopt(rt, state, record), watch, _listed(held, record)
                return state, watch, _listed(held, record)
            case _:
                raise AssertionError(f"round {held.round}: unexpected step {step!r}")


def _listed(held: RoundState, record: RoundRecord) -> tuple[float | None, float | None]:
    """When this syncer first listed a snapshot in ``held``'s round that the cadence counts
    (``record`` says whose were closing), and its last."""
    last = held.arrivals[-1][1] if held.arrivals else None
    return counted_first(held.arrivals, held.first_listed, record), last


async def _pause(rt: Runtime, published: Nudge, wait: Wait, now: float) -> None:
    """Sleep as ``wait`` says: the due pace (the wait pace when ``waited_on``), or else the
    idle pause, which the node's own publish ends; either ends at ``due_at`` at the latest."""
    pause = rt.options.pause(due=wait.due, waiting=wait.waited_on)
    if wait.due_at is not None:
        pause = min(pause, max(0.0, wait.due_at - now))
    if wait.due:
        await rt.clock.sleep(pause)
    else:
        await published.pause(rt.clock, pause)


def _claimed(rt: Runtime, round: int, step: Claim | TakeOver, view: RoundObservation) -> None:
    if isinstance(step, Claim):
        rt.emit(RoundClaimed(rt.learner, round))
        return
    claimants = tuple(claimant for _, claimant in view.claims)
    timeout = rt.options.claim_timeout
    rt.emit(TookOverRound(rt.learner, round, claimants, step.cause, timeout))


def _adopt(rt: Runtime, state: SyncerState, record: RoundRecord) -> SyncerState:
    """``state`` after another syncer's ``record``; the state held of its fragment stays as
    the start of the next rebuild (``commit.load_fragment``)."""
    check_record(record, state.next_round, rt.config)
    held = state.fragments[record.fragment].held
    fragment = FragmentState(version=record.version, record=record, held=held)
    return state.adopted(record, rt.config, fragment)


async def _observe(
    rt: Runtime, held: RoundState, watch: LeaseWatch, verified: Verified, fresh: bool
) -> tuple[RoundObservation, LeaseWatch]:
    """One look at ``held.round``: what ``observed`` needs, and nothing more (nothing past a
    record, the record while closing it only every ``poll_interval`` (``wants_record``), no
    claims while closing it, no snapshots before anyone claimed it, later rounds only while
    it is held, from the listing of its own snapshots, and counted only while it is empty
    or missing a live learner)."""
    looked = rt.clock.now()
    record_at = looked if held.wants_record(looked, rt.options.poll_interval) else None
    record = None if record_at is None else await rt.store.record(held.round)
    if record is not None:
        now = rt.clock.now()
        empty: frozenset[str] = frozenset()
        view = RoundObservation(record, (), empty, empty, empty, now, now, record_at=record_at)
        return view, watch
    claims = () if held.closing else tuple(await rt.store.round_claims(held.round))
    listed: dict[int, list[str]] = {}
    if held.closing:
        last = held.round + rt.config.fragments - 1
        listed = await rt.store.learners_by_round(held.round, last)
    elif claims:
        listed = {held.round: await rt.store.snapshot_learners(held.round)}
    published = await _verified(rt, held.round, listed.pop(held.round, []), verified)
    snapshots_at = rt.clock.now()
    if fresh or watch.due(snapshots_at):
        watch = watch.observed(await rt.store.lease_beats(), rt.clock.now())
    live = watch.live(rt.clock.now())
    later: frozenset[str] | None = None
    if held.wants_later(published, quorum_learners(live, watch.learners)):
        later = frozenset()
        for ahead, learners in listed.items():
            later |= await _verified(rt, ahead, learners, verified)
    assert watch.looked is not None
    view = RoundObservation(
        record=None,
        claims=claims,
        snapshots=published,
        live=live,
        learners=watch.learners,
        closing=watch.closing,
        snapshots_at=snapshots_at,
        leases_at=watch.looked,
        later=later,
        record_at=record_at,
    )
    return view, watch


async def _verified(
    rt: Runtime, round: int, learners: list[str], verified: Verified
) -> frozenset[str]:
    """``learners`` (with a snapshot in ``round``) whose snapshot verifies in a signed run,
    each read once (``verified``); all of them in an unsigned run."""
    if not isinstance(rt.manifest.key_id, str):
        return frozenset(learners)
    if any((round, learner) not in verified for learner in learners):
        found = {s.learner: problem is None for s, problem in await rt.store.snapshots(round)}
        for learner in learners:
            verified[(round, learner)] = found.get(learner, False)
    return frozenset(learner for learner in learners if verified[(round, learner)])
