"""Committing a round the syncer holds, and collecting the garbage it leaves.

``commit`` loads the fragment's θ and momentum (with ``NodeOptions.trusted_loss``, every
fragment's θ, for the screen's trials: ``protocol.screening``), downloads the round's
snapshots and takes its outcome (``protocol.outcome``: the aggregate of the counted
snapshots, screened, the outer step, refused when not finite), writes the update blob (and at a
checkpoint, ``protocol.checkpoint``, the θ and outer-state blobs), and the record last
(``RoundClosed``, ``RoundCommitted``; ``RoundIncomplete`` when live learners are missing);
each participant with when this syncer first listed its snapshot (``Participant.arrived``).
``load_fragment`` rebuilds a fragment's θ and momentum through ``RunReader.rebuild`` when
they are not held (after a recovery, or a round another syncer committed).
``collect_garbage`` then deletes what ``garbage.collectable`` decides: by reference from
committed, verified records and snapshots, a blob going only when nothing retained names it.

Runs in the syncer task; aggregation, the outer step, encoding and decoding in worker
threads.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import anyio.to_thread
import msgspec
from torch import Tensor

from gradientmail._concurrent import gather
from gradientmail._node.runtime import Runtime
from gradientmail._rebuild import Rebuilt
from gradientmail.errors import CorruptBlob, MailboxUnavailable, RecordError
from gradientmail.events.kinds import RoundClosed, RoundCommitted, RoundIncomplete
from gradientmail.protocol import garbage, keys, screening
from gradientmail.protocol.aggregation import Aggregate, Candidate, Screen, counted_snapshots
from gradientmail.protocol.checkpoint import is_checkpoint, stateful
from gradientmail.protocol.codec import CodecError, encode_fragment, open_delta
from gradientmail.protocol.outcome import Outcome, outcome
from gradientmail.protocol.records import (
    FragmentSpec,
    Participant,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.rounds import Commit, RoundState
from gradientmail.protocol.signing import Problem
from gradientmail.protocol.sizes import delta_problem
from gradientmail.reader import RunReader

__all__ = ["FragmentState", "SyncerState", "collect_garbage", "commit", "load_fragment"]

_log = logging.getLogger("gradientmail.syncer")


@dataclass(frozen=True, slots=True)
class FragmentState:
    """One fragment as the syncer holds it: its newest ``version``, the ``record`` that made
    it (None for Θ⁰), and ``held``: θ and the outer momentum of ``version`` once loaded, or
    of an older version a replay may start from (None until needed)."""

    version: int
    record: RoundRecord | None
    held: Rebuilt | None = None

    @property
    def loaded(self) -> Rebuilt | None:
        """θ and the momentum of ``version``, if held."""
        held = self.held
        return held if held is not None and held.version == self.version else None


@dataclass(frozen=True, slots=True)
class SyncerState:
    """Everything a syncer carries from one round to the next; rebuilt from the store by
    ``recover``. ``recent``: the retained records (``checkpoint.retained``) it has adopted
    or read since, for ``newest``."""

    next_round: int
    fragments: tuple[FragmentState, ...]
    recent: Mapping[int, RoundRecord] = field(default_factory=dict)

    def newest(self, count: int) -> list[RoundRecord]:
        """The records this syncer holds of the ``count`` rounds before ``next_round``, in
        round order (those it does not hold left out)."""
        held = {f.record.round: f.record for f in self.fragments if f.record is not None}
        held.update(self.recent)
        return [held[r] for r in range(self.next_round - count, self.next_round) if r in held]

    def adopted(
        self, record: RoundRecord, config: RunConfig, fragment: FragmentState
    ) -> "SyncerState":
        fragments = list(self.fragments)
        fragments[record.fragment] = fragment
        recent = garbage.still_retained(record.round, config, self.recent)
        recent[record.round] = record
        return replace(self, next_round=record.round + 1, fragments=tuple(fragments), recent=recent)


async def load_fragment(rt: Runtime, fragment: int, state: FragmentState) -> FragmentState:
    """``state`` with θ and the momentum of its version: held, or rebuilt from the store
    (``RunReader.rebuild``: the checkpoint below it, or the older version held, and the
    rounds after it). Raises ``CorruptBlob`` when a blob the rebuild needs is gone or
    damaged, ``RecordError`` for a record it cannot use."""
    if state.loaded is not None:
        return state
    reader = RunReader(rt.store)
    rebuilt = await reader.rebuild(
        fragment, state.version, momentum=True, start=state.held, manifest=rt.manifest
    )
    if rebuilt is None:
        raise CorruptBlob(
            f"a blob that rebuilding version {state.version} of fragment {fragment} needs is "
            "gone: newer records replaced it"
        )
    return replace(state, held=rebuilt)


async def commit(
    rt: Runtime, state: SyncerState, held: RoundState, step: Commit
) -> tuple[SyncerState, RoundRecord, bool]:
    """Close and commit ``held.round`` (this node holds its last claim): the state after it,
    the round's record and whether it is this node's (False: another closer's landed
    first)."""
    round, config = held.round, rt.config
    started = rt.clock.now()
    fragment = keys.fragment_of(round, config.fragments)
    version = keys.version_of(round, config.fragments)
    current = await load_fragment(rt, fragment, state.fragments[fragment])
    loaded = current.loaded
    if current.version != version - 1 or loaded is None:
        raise RecordError(
            f"round {round} makes version {version} of fragment {fragment}, but the newest "
            f"record holds version {current.version}"
        )
    spec = rt.specs[fragment]
    state, screen = await _screen(rt, state, fragment, current)
    snapshots = await rt.store.snapshots(round)
    listed = rt.clock.now()
    candidates = await gather(
        [partial(_candidate, rt, s, problem, fragment, spec) for s, problem in snapshots]
    )
    done = await anyio.to_thread.run_sync(
        outcome,
        loaded.version,
        loaded.theta,
        loaded.momentum,
        counted_snapshots(candidates, step.missing),
        spec,
        config,
        screen,
    )
    result, theta, momentum = done.result, done.theta, done.momentum
    draft = _draft(rt, held, result, started, listed)
    rt.emit(RoundClosed(rt.learner, draft))
    if step.missing or not step.published:
        rt.emit(RoundIncomplete(rt.learner, round, tuple(sorted(step.missing)), not step.published))
    ours = await _written(rt, draft, done, spec)
    landed, mine = await rt.store.put_record(ours)
    if not mine:
        return state, landed, False
    rt.emit(RoundCommitted(rt.learner, landed, rt.clock.now() - started))
    now_held = Rebuilt(version, tuple(theta), tuple(momentum), outer=True)
    committed = FragmentState(version, landed, now_held)
    state = state.adopted(landed, config, committed)
    return await collect_garbage(rt, state, round), landed, True


async def _screen(
    rt: Runtime, state: SyncerState, fragment: int, current: FragmentState
) -> tuple[SyncerState, Screen | None]:
    """The screen of a round of ``fragment`` (``current``: that fragment, loaded) under
    ``NodeOptions.trusted_loss`` (None without one), and ``state`` holding θ of every
    fragment, which its trials need."""
    loss = rt.options.trusted_loss
    if loss is None:
        return state, None
    fragments = [
        current if f == fragment else await load_fragment(rt, f, held)
        for f, held in enumerate(state.fragments)
    ]
    thetas = [held.loaded.theta for held in fragments if held.loaded is not None]
    if len(thetas) != len(fragments):
        raise RecordError("a fragment's θ could not be loaded for the trusted loss")
    state = replace(state, fragments=tuple(fragments))
    return state, screening.screen(loss, thetas, rt.specs, fragment)


def _draft(
    rt: Runtime, held: RoundState, result: Aggregate, started: float, listed: float
) -> RoundRecordDraft:
    round, count = held.round, rt.config.fragments
    claimed = held.claimed_at if held.claimed_at is not None else started
    quorum_at = held.quorum_at if held.quorum_at is not None else started
    return RoundRecordDraft(
        round=round,
        fragment=keys.fragment_of(round, count),
        version=keys.version_of(round, count),
        committed_by=rt.learner,
        participants=tuple(_arrived(p, held, listed) for p in result.participants),
        rejected=result.rejected,
        quorum_seconds=max(0.0, quorum_at - claimed),
        grace_seconds=max(0.0, started - quorum_at),
        cosine=result.cosine,
        closed_at=rt.wall(),
    )


def _arrived(participant: Participant, held: RoundState, listed: float) -> Participant:
    """``participant`` with when this closer first listed its snapshot: in the round's
    observations, or else in the close's own listing (at ``listed``), which can find a
    snapshot that landed after the last observation."""
    arrived = held.arrived(participant.learner)
    if arrived is None:
        first = held.arrivals[0][1] if held.arrivals else listed
        arrived = max(0.0, listed - first)
    return msgspec.structs.replace(participant, arrived=round(arrived, 3))


async def _written(
    rt: Runtime, draft: RoundRecordDraft, done: Outcome, spec: FragmentSpec
) -> RoundRecord:
    """The record of ``draft`` once the update of ``done``, and at a checkpoint θ and, in a
    run whose outer step keeps a state, the momentum (fp32), are in the store."""
    # θ and the update carry a chunk index: a sharded learner's ranks read them by ranges.
    update_ref = await rt.store.put_blob(done.update, done.encoding, indexed=True)
    if not is_checkpoint(draft.version, rt.config):
        return RoundRecord.committed(draft, update=update_ref)
    kept = (done.theta, done.momentum) if stateful(rt.config) else (done.theta,)
    blobs = await anyio.to_thread.run_sync(_fp32_blobs, kept, spec, draft.version)
    refs = await gather(
        [partial(rt.store.put_blob, blobs[0], "fp32", indexed=True)]
        + [partial(rt.store.put_blob, blob, "fp32") for blob in blobs[1:]]
    )
    outer_ref = refs[1] if len(refs) > 1 else None
    return RoundRecord.committed(draft, update=update_ref, theta=refs[0], outer=outer_ref)


_WHY: dict[Problem, str] = {
    "unsigned": "the snapshot carries no signature",
    "bad-signature": "the snapshot's signature fails under the run key or its learner's keys",
    "not-admitted": "the snapshot's learner has no admitted key",
    "revoked": "the snapshot is signed with a revoked learner key",
}


async def _candidate(
    rt: Runtime, snapshot: Snapshot, problem: Problem | None, fragment: int, spec: FragmentSpec
) -> Candidate:
    if problem is not None:
        return Candidate(snapshot=snapshot, delta=None, problem=(problem, _WHY[problem]))
    if snapshot.fragment != fragment:
        detail = f"names fragment {snapshot.fragment}, but the round is of fragment {fragment}"
        return Candidate(snapshot=snapshot, delta=None, problem=("shape", detail))
    if (oversized := delta_problem(snapshot, spec)) is not None:
        return Candidate(snapshot=snapshot, delta=None, problem=("shape", oversized))
    try:
        datas = await rt.store.delta_blobs(snapshot)
    except CorruptBlob as exc:
        return Candidate(snapshot=snapshot, delta=None, problem=("corrupt", str(exc)))
    if datas is None:
        return Candidate(snapshot=snapshot, delta=None, problem=("corrupt", "the blob is gone"))
    try:
        # Checked now, decoded a piece at a time by the aggregation.
        delta = await anyio.to_thread.run_sync(open_delta, datas, snapshot, spec)
    except CodecError as exc:
        return Candidate(snapshot=snapshot, delta=None, problem=(exc.reason, str(exc)))
    return Candidate(snapshot=snapshot, delta=delta, problem=None)


def _fp32_blobs(kept: Sequence[Sequence[Tensor]], spec: FragmentSpec, version: int) -> list[bytes]:
    return [
        encode_fragment(tensors, spec, "fp32", block_size=1, version=version) for tensors in kept
    ]


async def collect_garbage(rt: Runtime, state: SyncerState, round: int) -> SyncerState:
    """After committing ``round``: list the rounds that have keys, read what
    ``garbage.reads`` names (the retained records of every fragment, the snapshots of the
    kept rounds, of the rounds that leave, of every round ahead and of ``garbage.stale``
    rounds) and delete what ``garbage.collectable`` decides: the snapshots and claims of
    the rounds that left or were stale, and the blobs only they or the records that left
    name.

    Round records are never deleted. A transient failure, or a record or snapshot that does
    not decode, is logged: garbage is not worth failing a round over. The keys of the
    rounds it left, and any that land in a collected round later, go with the next
    collection (``garbage.stale``); blobs that only the records that left named stay. A
    ``StoreAccessError`` (the operator's) propagates and fails the node.
    """
    try:
        listed = await rt.store.list_keys(keys.ROUNDS)
        present = {r for key in listed if (r := keys.parse_round_key(key)) is not None}
        stale = garbage.stale(round, rt.config, present)
        ahead = frozenset(r for r in present if r > round)
        wanted = garbage.reads(round, rt.config, stale, ahead)
        if wanted is None:
            return state
        records = {}
        for r in sorted(wanted.records):
            if (found := await rt.store.record(r)) is not None:
                records[r] = found
        snapshots = {r: await rt.store.snapshots(r) for r in sorted(wanted.snapshots)}
        doomed = garbage.collectable(
            round, rt.config, rt.manifest.theta0, records, snapshots, stale
        )
        state = replace(state, recent=garbage.still_retained(round, rt.config, records))
        await rt.store.delete(doomed.deletions(listed))
    except (MailboxUnavailable, RecordError) as exc:
        _log.warning("%s: garbage collection after round %d failed: %s", rt.learner, round, exc)
    return state
