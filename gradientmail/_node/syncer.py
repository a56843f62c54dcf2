"""The syncer: closes the run's rounds, in order, together with every other syncer.

Decisions are pure functions over immutable views (``decide_round``, ``decide_close``,
``quorum_learners``); ``run_syncer`` only lists, reads, writes and sleeps.

For round ``r``:

- a record exists: adopt it and go on with ``r + 1`` (``RoundSuperseded`` when this node
  had claimed the round);
- no claim: take claim 0 (``RoundClaimed``) and close the round;
- claims exist and the last is this node's (a restart, or a retry after a failure): close it;
- claims exist: follow (``FollowingRound``), and take the next claim (``TookOverRound``) when
  the last claimant's lease is gone (``lease_gone``) or no record lands within
  ``claim_timeout`` seconds of the later of the round's first snapshot and the moment this
  node began following that claimant (``no_record``). A round nobody published to is not
  expected to close, so it does not time its claimant out.

Closing waits for the quorum (at least ``quorum_min`` snapshots and at least
``quorum_fraction`` of the live learners), then up to ``grace`` seconds more or until every
live learner has published (a decision to close is taken on a listing of the leases made
at that moment, not on one up to ``lease_every`` old); then aggregates, applies the outer
step, writes the θ, outer-state and update blobs, and the record last (``RoundClosed``,
``RoundCommitted``).
After each commit it collects garbage (``collect_garbage``).

Live learners are the nodes holding a live lease (``Liveness``) whose role is ``learner``,
from the moment they join, not only once they have published: a round then waits (up to
``grace``) for a learner that joined together with the others instead of closing on the
first snapshot and leaving the rest late. A syncer-only node beats a ``syncer`` lease so
that its claims can be judged; it never counts toward a quorum.

The whole state (θ and outer momentum of every fragment) is in the store. ``run_syncer``
rebuilds it from the newest record of each fragment on start and after every failure
(``Recovered``); a store or data error while recovering or on a round is reported
(``RecoveryFailed``, ``RoundFailed``) and retried with backoff. Any other exception is a bug:
it propagates (the node reports ``SyncerStopped`` and the next ``step()`` raises it).

Runs as one task of the node's task group; aggregation, the outer step, encoding and
decoding run in worker threads. Cancellation stops it between or within requests; a round
it was closing is then taken over by others once its lease is gone.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal, TypeAlias

import anyio.to_thread
import torch
from torch import Tensor

from gradientmail._node.runtime import Runtime, backoff
from gradientmail.errors import CorruptBlob, GradientmailError, RecordError
from gradientmail.events.kinds import (
    FollowingRound,
    Recovered,
    RecoveryFailed,
    RoundClaimed,
    RoundClosed,
    RoundCommitted,
    RoundFailed,
    RoundSuperseded,
    TookOverRound,
)
from gradientmail.lease import Liveness
from gradientmail.protocol import keys
from gradientmail.protocol.aggregation import Candidate, aggregate
from gradientmail.protocol.codec import CodecError, decode_fragment, encode_fragment
from gradientmail.protocol.outer import committed_update, outer_step
from gradientmail.protocol.records import (
    FragmentSpec,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.signing import Problem
from gradientmail.store import gather

__all__ = [
    "Adopt",
    "Claim",
    "CloseView",
    "Follow",
    "Resume",
    "RoundAction",
    "RoundView",
    "SyncerState",
    "TakeOver",
    "decide_close",
    "decide_round",
    "quorum_learners",
    "run_syncer",
]

_log = logging.getLogger("gradientmail.syncer")


# -- pure decisions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoundView:
    """What a syncer knows of round ``round`` at ``now``.

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
    """The round has a record: take it as the round's outcome."""


@dataclass(frozen=True, slots=True)
class Claim:
    """Nobody claimed the round: take claim ``k`` (0) and close it."""

    k: int


@dataclass(frozen=True, slots=True)
class Resume:
    """The last claim is this node's: close the round."""


@dataclass(frozen=True, slots=True)
class Follow:
    """Another node holds the round: wait for its record."""

    claimant: str


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The last claimant failed the round: take claim ``k`` and close it."""

    k: int
    cause: Literal["lease_gone", "no_record"]


RoundAction: TypeAlias = Adopt | Claim | Resume | Follow | TakeOver


def decide_round(view: RoundView) -> RoundAction:
    """What a syncer does next about ``view.round`` (see the module docstring)."""
    if view.has_record:
        return Adopt()
    if not view.claims:
        return Claim(0)
    k, claimant = view.claims[-1]
    if claimant == view.me:
        return Resume()
    if claimant not in view.live:
        return TakeOver(k + 1, "lease_gone")
    if view.following_since is not None and view.first_snapshot_at is not None:
        since = max(view.following_since, view.first_snapshot_at)
        if view.now - since >= view.claim_timeout:
            return TakeOver(k + 1, "no_record")
    return Follow(claimant)


def quorum_learners(live: frozenset[str], learners: frozenset[str]) -> frozenset[str]:
    """The learners a quorum counts: holders of a live lease whose role is ``learner``."""
    return live & learners


@dataclass(frozen=True, slots=True)
class CloseView:
    """What the closer of a round knows at ``now``: who has a snapshot in it, the live
    learners, when the quorum was first reached (None: not yet), and when it first saw a
    snapshot in one of the next ``fragments - 1`` rounds while this one had none (None: it
    has not)."""

    snapshots: frozenset[str]
    learners: frozenset[str]
    quorum_at: float | None
    now: float
    passed_at: float | None = None


def decide_close(view: CloseView, config: RunConfig) -> Literal["waiting", "grace", "close"]:
    """``waiting`` for the quorum, in ``grace`` after it, or ``close`` now.

    A round nobody published to closes empty (its fragment unchanged) once a later round
    has had a snapshot for ``grace`` seconds: the learners publishing there have moved past
    this round, and waiting for one that left would stall the run. This is what lets the
    last node's flush rounds close when its own progress skipped a fragment.
    """
    count = len(view.snapshots)
    if count == 0 and view.passed_at is not None and view.now - view.passed_at >= config.grace:
        return "close"
    if count < config.quorum_min or count < config.quorum_fraction * len(view.learners):
        return "waiting"
    if view.learners <= view.snapshots:
        return "close"
    if view.quorum_at is not None and view.now - view.quorum_at >= config.grace:
        return "close"
    return "grace"


# -- the syncer's state -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FragmentState:
    """One fragment as the syncer holds it: its newest ``version``, the ``record`` that made
    it (None for Θ⁰), and θ and the outer momentum once loaded (None until needed; the
    momentum stays None at version 0)."""

    version: int
    record: RoundRecord | None
    theta: tuple[Tensor, ...] | None = None
    momentum: tuple[Tensor, ...] | None = None


@dataclass(frozen=True, slots=True)
class SyncerState:
    """Everything a syncer carries from one round to the next; rebuilt from the store by
    ``recover``. ``recent`` caches the records of the newest rounds for garbage collection."""

    next_round: int
    fragments: tuple[FragmentState, ...]
    recent: Mapping[int, RoundRecord] = field(default_factory=dict)

    def adopted(self, record: RoundRecord, window: int, fragment: FragmentState) -> "SyncerState":
        fragments = list(self.fragments)
        fragments[record.fragment] = fragment
        recent = {r: rec for r, rec in self.recent.items() if r > record.round - window}
        recent[record.round] = record
        return replace(self, next_round=record.round + 1, fragments=tuple(fragments), recent=recent)


def _check_record(record: RoundRecord, round: int, config: RunConfig) -> RoundRecord:
    if (
        record.round != round
        or record.fragment != keys.fragment_of(round, config.fragments)
        or record.version != keys.version_of(round, config.fragments)
    ):
        raise RecordError(
            f"records/{round:010d} names round {record.round}, fragment {record.fragment}, "
            f"version {record.version}: not what round {round} produces"
        )
    return record


async def _decode(rt: Runtime, data: bytes, spec: FragmentSpec) -> tuple[Tensor, ...]:
    return tuple(await anyio.to_thread.run_sync(decode_fragment, data, spec))


async def _load(rt: Runtime, fragment: int, state: FragmentState) -> FragmentState:
    """``state`` with θ (and momentum) loaded from its record's blobs, or Θ⁰."""
    if state.theta is not None:
        return state
    spec = rt.specs[fragment]
    ref = rt.manifest.theta0[fragment] if state.record is None else state.record.theta
    data = await rt.store.get_blob(ref)
    if data is None:
        raise CorruptBlob(f"the θ blob of fragment {fragment} version {state.version} is gone")
    theta = await _decode(rt, data, spec)
    momentum = None
    if state.record is not None:
        outer = await rt.store.get_blob(state.record.outer)
        if outer is None:
            raise CorruptBlob(
                f"the outer-state blob of fragment {fragment} version {state.version} is gone"
            )
        momentum = await _decode(rt, outer, spec)
    return replace(state, theta=theta, momentum=momentum)


async def recover(rt: Runtime) -> SyncerState:
    """The syncer's state from the store: the newest record of every fragment (θ loaded
    lazily) and the next round to run."""
    fragments_count = rt.config.fragments
    rounds = await rt.store.record_rounds()
    next_round = rounds[-1] + 1 if rounds else 0
    fragments = [FragmentState(version=0, record=None) for _ in range(fragments_count)]
    for round in rounds[-fragments_count:]:
        record = await rt.store.record(round)
        if record is None:
            raise RecordError(f"records/{round:010d} was listed but is gone")
        _check_record(record, round, rt.config)
        fragments[record.fragment] = FragmentState(version=record.version, record=record)
    return SyncerState(next_round=next_round, fragments=tuple(fragments))


# -- the task ---------------------------------------------------------------------------------


@dataclass
class _Observer:
    """The syncer's running view of the leases: who is live, and whose lease says it trains.

    Leases are listed at most every ``every`` seconds: a lease changes once per beat, and
    listing them on every poll would multiply a follower's requests for nothing.
    """

    liveness: Liveness
    every: float
    learners: frozenset[str] = frozenset()
    looked: float | None = None

    async def look(self, rt: Runtime, *, fresh: bool = False) -> frozenset[str]:
        """The live learners, from a listing of the leases at most ``every`` seconds old, or
        taken now when ``fresh``."""
        now = rt.clock.now()
        if fresh or self.looked is None or now - self.looked >= self.every:
            leases = await rt.store.leases()
            self.liveness = self.liveness.observed(
                {learner: beat for learner, (beat, _) in leases.items()}, now
            )
            self.learners = frozenset(
                learner for learner, (_, role) in leases.items() if role == "learner"
            )
            self.looked = now
        return self.liveness.live(now)


async def run_syncer(rt: Runtime) -> None:
    """Close rounds until cancelled (see the module docstring)."""
    every = min(rt.options.lease_every, rt.options.lease_timeout / 4)
    observer = _Observer(Liveness(rt.options.lease_timeout), every)
    delay: float | None = None
    while True:
        try:
            state = await recover(rt)
        except GradientmailError as exc:
            delay = backoff(delay, rt.options)
            rt.emit(RecoveryFailed(rt.learner, exc, delay))
            await rt.clock.sleep(delay)
            continue
        rt.emit(Recovered(rt.learner, state.next_round))
        delay = None
        while True:
            round = state.next_round
            try:
                state = await _run_round(rt, state, observer)
            except GradientmailError as exc:
                delay = backoff(delay, rt.options)
                rt.emit(RoundFailed(rt.learner, round, exc, delay))
                await rt.clock.sleep(delay)
                break
            delay = None


async def _adopt(rt: Runtime, state: SyncerState, record: RoundRecord) -> SyncerState:
    _check_record(record, state.next_round, rt.config)
    fragment = FragmentState(version=record.version, record=record)
    return state.adopted(record, _window(rt.config), fragment)


def _window(config: RunConfig) -> int:
    return config.keep_versions * config.fragments


async def _run_round(rt: Runtime, state: SyncerState, observer: _Observer) -> SyncerState:
    round = state.next_round
    following: str | None = None
    following_since: float | None = None
    first_snapshot_at: float | None = None
    while True:
        record = await rt.store.record(round)
        if record is not None:
            return await _adopt(rt, state, record)
        claims = tuple(await rt.store.round_claims(round))
        live = await observer.look(rt)
        if claims and claims[-1][1] != rt.learner:
            published = await rt.store.snapshot_learners(round)
            if published and first_snapshot_at is None:
                first_snapshot_at = rt.clock.now()
        now = rt.clock.now()
        action = decide_round(
            RoundView(
                round=round,
                me=rt.learner,
                has_record=False,
                claims=claims,
                live=live,
                following_since=following_since,
                first_snapshot_at=first_snapshot_at,
                now=now,
                claim_timeout=rt.options.claim_timeout,
            )
        )
        match action:
            case Adopt():
                continue
            case Claim(k):
                if await rt.store.claim_round(round, k, rt.learner):
                    rt.emit(RoundClaimed(rt.learner, round))
                    return await _close(rt, state, observer, now)
            case Resume():
                return await _close(rt, state, observer, now)
            case TakeOver(k, cause):
                if await rt.store.claim_round(round, k, rt.learner):
                    rt.emit(
                        TookOverRound(
                            rt.learner,
                            round,
                            tuple(claimant for _, claimant in claims),
                            cause,
                            rt.options.claim_timeout,
                        )
                    )
                    return await _close(rt, state, observer, now)
            case Follow(claimant):
                if claimant != following:
                    following, following_since = claimant, now
                    rt.emit(
                        FollowingRound(
                            rt.learner,
                            round,
                            tuple(c for _, c in claims),
                            rt.options.claim_timeout,
                        )
                    )
                await rt.clock.sleep(rt.options.poll_interval)


async def _close(
    rt: Runtime, state: SyncerState, observer: _Observer, claimed_at: float
) -> SyncerState:
    """Close ``state.next_round``, which this node holds the last claim on."""
    round = state.next_round
    config = rt.config
    quorum_at: float | None = None
    passed_at: float | None = None
    while True:
        record = await rt.store.record(round)
        if record is not None:
            rt.emit(RoundSuperseded(rt.learner, record))
            return await _adopt(rt, state, record)
        published = await rt.store.snapshot_learners(round)
        looking = rt.clock.now()
        live = await observer.look(rt)
        if not published and passed_at is None:
            for later in range(round + 1, round + config.fragments):
                if await rt.store.snapshot_learners(later):
                    passed_at = rt.clock.now()
                    break
        now = rt.clock.now()
        view = CloseView(
            snapshots=frozenset(published),
            learners=quorum_learners(live, observer.learners),
            quorum_at=quorum_at,
            now=now,
            passed_at=passed_at,
        )
        decision = decide_close(view, config)
        if decision != "waiting" and quorum_at is None:
            quorum_at = now
            view = replace(view, quorum_at=now)
            decision = decide_close(view, config)
        if decision == "close" and (observer.looked is None or observer.looked < looking):
            # Closing is final: judge it on the leases as they are now, so that a learner
            # that joined since the last listing is waited for like the others.
            live = await observer.look(rt, fresh=True)
            view = replace(view, learners=quorum_learners(live, observer.learners))
            decision = decide_close(view, config)
        if decision == "close":
            break
        await rt.clock.sleep(rt.options.poll_interval)
    started = rt.clock.now()
    fragment = keys.fragment_of(round, config.fragments)
    version = keys.version_of(round, config.fragments)
    current = await _load(rt, fragment, state.fragments[fragment])
    if current.version != version - 1:
        raise RecordError(
            f"round {round} makes version {version} of fragment {fragment}, but the newest "
            f"record holds version {current.version}"
        )
    assert current.theta is not None
    spec = rt.specs[fragment]
    snapshots = await rt.store.snapshots(round)
    candidates = await gather(
        [partial(_candidate, rt, s, problem, fragment, spec) for s, problem in snapshots]
    )
    result = await anyio.to_thread.run_sync(aggregate, current.version, candidates, spec, config)
    draft = RoundRecordDraft(
        round=round,
        fragment=fragment,
        version=version,
        committed_by=rt.learner,
        participants=result.participants,
        rejected=result.rejected,
        quorum_seconds=max(0.0, (quorum_at or started) - claimed_at),
        grace_seconds=max(0.0, started - (quorum_at or started)),
        cosine=result.cosine,
    )
    rt.emit(RoundClosed(rt.learner, draft))
    theta, momentum, update_bytes = await anyio.to_thread.run_sync(
        _numerics, current.theta, current.momentum, result.mean, spec, config
    )
    theta_bytes, outer_bytes = await anyio.to_thread.run_sync(_fp32_blobs, theta, momentum, spec)
    theta_ref, outer_ref, update_ref = await gather(
        [
            partial(rt.store.put_blob, theta_bytes, "fp32"),
            partial(rt.store.put_blob, outer_bytes, "fp32"),
            partial(rt.store.put_blob, update_bytes, config.update_encoding),
        ]
    )
    ours = RoundRecord.committed(draft, theta=theta_ref, outer=outer_ref, update=update_ref)
    landed, mine = await rt.store.put_record(ours)
    if not mine:
        rt.emit(RoundSuperseded(rt.learner, landed))
        return await _adopt(rt, state, landed)
    rt.emit(RoundCommitted(rt.learner, landed, rt.clock.now() - started))
    committed = FragmentState(
        version=version, record=landed, theta=tuple(theta), momentum=tuple(momentum)
    )
    state = state.adopted(landed, _window(config), committed)
    return await collect_garbage(rt, state, round)


async def _candidate(
    rt: Runtime, snapshot: Snapshot, problem: Problem | None, fragment: int, spec: FragmentSpec
) -> Candidate:
    if problem is not None:
        why = "no signature" if problem == "unsigned" else "a signature that fails"
        detail = f"the snapshot carries {why} under the run key"
        return Candidate(snapshot=snapshot, delta=None, problem=(problem, detail))
    if snapshot.fragment != fragment:
        detail = f"names fragment {snapshot.fragment}, but the round is of fragment {fragment}"
        return Candidate(snapshot=snapshot, delta=None, problem=("shape", detail))
    try:
        data = await rt.store.get_blob(snapshot.delta)
    except CorruptBlob as exc:
        return Candidate(snapshot=snapshot, delta=None, problem=("corrupt", str(exc)))
    if data is None:
        return Candidate(snapshot=snapshot, delta=None, problem=("corrupt", "the blob is gone"))
    try:
        delta = await anyio.to_thread.run_sync(decode_fragment, data, spec)
    except CodecError as exc:
        return Candidate(snapshot=snapshot, delta=None, problem=(exc.reason, str(exc)))
    return Candidate(snapshot=snapshot, delta=delta, problem=None)


def _numerics(
    theta: Sequence[Tensor],
    momentum: Sequence[Tensor] | None,
    mean: Sequence[Tensor] | None,
    spec: FragmentSpec,
    config: RunConfig,
) -> tuple[list[Tensor], list[Tensor], bytes]:
    """θ_{v+1}, the new momentum and the update blob of one round (worker thread)."""
    if mean is None:
        raw = list(theta)
        new_momentum = (
            list(momentum) if momentum is not None else [torch.zeros_like(t) for t in theta]
        )
    else:
        raw, new_momentum = outer_step(
            theta,
            momentum,
            mean,
            lr=config.outer_lr,
            momentum_coef=config.outer_momentum,
        )
    update, new_theta = committed_update(
        theta, raw, spec, config.update_encoding, block_size=config.block_size
    )
    return new_theta, new_momentum, update


def _fp32_blobs(
    theta: Sequence[Tensor], momentum: Sequence[Tensor], spec: FragmentSpec
) -> tuple[bytes, bytes]:
    return (
        encode_fragment(theta, spec, "fp32", block_size=1),
        encode_fragment(momentum, spec, "fp32", block_size=1),
    )


async def collect_garbage(rt: Runtime, state: SyncerState, round: int) -> SyncerState:
    """After committing ``round``: delete the snapshots (and their blobs) and claims of round
    ``round - keep_rounds``, and the θ/outer/update blobs of the record that has just left
    its fragment's newest ``keep_versions`` (unless a kept record or Θ⁰ references them).

    Round records are never deleted. A failure here is logged and left for nobody: garbage
    is not worth failing a round over.
    """
    config = rt.config
    try:
        stale = round - config.keep_rounds
        if stale >= 0:
            doomed = list(await rt.store.list_keys(keys.round_prefix(stale)))
            for snapshot, _ in await rt.store.snapshots(stale):
                doomed.append(keys.blob(snapshot.delta.sha256))
            await rt.store.delete(doomed)
        window = _window(config)
        old = round - window
        if old >= 0:
            recent = dict(state.recent)
            for r in range(old, round + 1):
                if r not in recent:
                    found = await rt.store.record(r)
                    if found is not None:
                        recent[r] = found
            state = replace(state, recent={r: rec for r, rec in recent.items() if r > old})
            dropped = recent.get(old)
            if dropped is not None:
                keep = {ref.sha256 for ref in rt.manifest.theta0}
                for rec in state.recent.values():
                    keep |= {rec.theta.sha256, rec.outer.sha256, rec.update.sha256}
                doomed_blobs = {
                    dropped.theta.sha256,
                    dropped.outer.sha256,
                    dropped.update.sha256,
                } - keep
                await rt.store.delete(keys.blob(sha) for sha in sorted(doomed_blobs))
    except GradientmailError as exc:
        _log.warning("%s: garbage collection after round %d failed: %s", rt.learner, round, exc)
    return state
