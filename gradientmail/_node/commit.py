"""Committing a round the syncer holds, and collecting the garbage it leaves.

``commit`` loads the fragment's θ and momentum, downloads and aggregates the round's
snapshots (``aggregation.counted``: final snapshots only make a final round, which adds
their mean with no outer step), applies the outer step, checks that θ′ and the momentum
are finite (a round whose outer step would not be finite rejects its snapshots, reason
``non-finite``, and leaves the fragment unchanged), writes the θ, outer-state and update
blobs, and the record last (``RoundClosed``, ``RoundCommitted``; ``RoundIncomplete`` when
live learners are missing).
``collect_garbage`` then deletes by reference: a content-addressed blob goes only when no
kept object names it.

Runs in the syncer task; aggregation, the outer step, encoding and decoding in worker
threads.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import anyio.to_thread
import torch
from torch import Tensor

from gradientmail._node.runtime import Runtime
from gradientmail.errors import CorruptBlob, GradientmailError, RecordError
from gradientmail.events.kinds import RoundClosed, RoundCommitted, RoundIncomplete
from gradientmail.protocol import keys
from gradientmail.protocol.aggregation import Aggregate, Candidate, aggregate, counted, refused
from gradientmail.protocol.codec import CodecError, decode_fragment, encode_fragment, open_fragment
from gradientmail.protocol.outer import committed_update, final_step, outer_step
from gradientmail.protocol.records import (
    FragmentSpec,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.rounds import Commit, RoundState
from gradientmail.protocol.signing import Problem
from gradientmail.store import gather

__all__ = ["FragmentState", "SyncerState", "collect_garbage", "commit", "load"]

_log = logging.getLogger("gradientmail.syncer")


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
    ``recover``. ``recent`` caches the records of the newest rounds and ``deltas`` the delta
    blobs the snapshots of recent rounds name, for garbage collection."""

    next_round: int
    fragments: tuple[FragmentState, ...]
    recent: Mapping[int, RoundRecord] = field(default_factory=dict)
    deltas: Mapping[int, frozenset[str]] = field(default_factory=dict)

    def adopted(self, record: RoundRecord, window: int, fragment: FragmentState) -> "SyncerState":
        fragments = list(self.fragments)
        fragments[record.fragment] = fragment
        recent = {r: rec for r, rec in self.recent.items() if r > record.round - window}
        recent[record.round] = record
        return replace(self, next_round=record.round + 1, fragments=tuple(fragments), recent=recent)


def window(config: RunConfig) -> int:
    """How many rounds back a record's blobs are kept."""
    return config.keep_versions * config.fragments


async def load(rt: Runtime, fragment: int, state: FragmentState) -> FragmentState:
    """``state`` with θ (and momentum) loaded from its record's blobs, or Θ⁰."""
    if state.theta is not None:
        return state
    spec = rt.specs[fragment]
    ref = rt.manifest.theta0[fragment] if state.record is None else state.record.theta
    data = await rt.store.get_blob(ref)
    if data is None:
        raise CorruptBlob(f"the θ blob of fragment {fragment} version {state.version} is gone")
    theta = tuple(await anyio.to_thread.run_sync(decode_fragment, data, spec))
    momentum = None
    if state.record is not None:
        outer = await rt.store.get_blob(state.record.outer)
        if outer is None:
            raise CorruptBlob(
                f"the outer-state blob of fragment {fragment} version {state.version} is gone"
            )
        momentum = tuple(await anyio.to_thread.run_sync(decode_fragment, outer, spec))
    return replace(state, theta=theta, momentum=momentum)


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
    current = await load(rt, fragment, state.fragments[fragment])
    if current.version != version - 1 or current.theta is None:
        raise RecordError(
            f"round {round} makes version {version} of fragment {fragment}, but the newest "
            f"record holds version {current.version}"
        )
    spec = rt.specs[fragment]
    snapshots = await rt.store.snapshots(round)
    candidates = await gather(
        [partial(_candidate, rt, s, problem, fragment, spec) for s, problem in snapshots]
    )
    result, theta, momentum, update_bytes = await anyio.to_thread.run_sync(
        _outcome, current, counted(candidates, step.missing), spec, config
    )
    claimed = held.claimed_at if held.claimed_at is not None else started
    quorum_at = held.quorum_at if held.quorum_at is not None else started
    draft = RoundRecordDraft(
        round=round,
        fragment=fragment,
        version=version,
        committed_by=rt.learner,
        participants=result.participants,
        rejected=result.rejected,
        quorum_seconds=max(0.0, quorum_at - claimed),
        grace_seconds=max(0.0, started - quorum_at),
        cosine=result.cosine,
    )
    rt.emit(RoundClosed(rt.learner, draft))
    if step.missing or not step.published:
        rt.emit(RoundIncomplete(rt.learner, round, tuple(sorted(step.missing)), not step.published))
    blobs = await anyio.to_thread.run_sync(_fp32_blobs, theta, momentum, spec)
    theta_ref, outer_ref, update_ref = await gather(
        [
            partial(rt.store.put_blob, blobs[0], "fp32"),
            partial(rt.store.put_blob, blobs[1], "fp32"),
            partial(rt.store.put_blob, update_bytes, config.update_encoding),
        ]
    )
    ours = RoundRecord.committed(draft, theta=theta_ref, outer=outer_ref, update=update_ref)
    landed, mine = await rt.store.put_record(ours)
    if not mine:
        return state, landed, False
    rt.emit(RoundCommitted(rt.learner, landed, rt.clock.now() - started))
    committed = FragmentState(version, landed, tuple(theta), tuple(momentum))
    deltas = {**state.deltas, round: frozenset(s.delta.sha256 for s, _ in snapshots)}
    state = replace(state.adopted(landed, window(config), committed), deltas=deltas)
    return await collect_garbage(rt, state, round), landed, True


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
        # Checked now, decoded a piece at a time by the aggregation.
        delta = await anyio.to_thread.run_sync(open_fragment, data, spec)
    except CodecError as exc:
        return Candidate(snapshot=snapshot, delta=None, problem=(exc.reason, str(exc)))
    return Candidate(snapshot=snapshot, delta=delta, problem=None)


def _outcome(
    current: FragmentState, candidates: Sequence[Candidate], spec: FragmentSpec, config: RunConfig
) -> tuple[Aggregate, list[Tensor], list[Tensor], bytes]:
    """The round's aggregate, θ_{v+1}, the momentum and the update blob (worker thread).

    A final round (``candidates`` all final) commits θ + Δ̄ (Δ̄ their mean: equal weights,
    as they carry no tokens) with no outer step and the momentum unchanged. An outer step
    that is not finite (finite deltas whose sum overflows) is refused: every accepted
    snapshot is rejected as ``non-finite`` and the fragment stays as it was."""
    assert current.theta is not None
    final = bool(candidates) and all(c.snapshot.final is True for c in candidates)
    result = aggregate(current.version, candidates, spec, config, theta=current.theta)
    theta, momentum, update = _numerics(
        current.theta, current.momentum, result.mean, spec, config, final=final
    )
    if result.mean is not None and not _finite(theta, momentum):
        result = refused(result, "the outer step gives a non-finite θ or momentum")
        theta, momentum, update = _numerics(current.theta, current.momentum, None, spec, config)
    return result, theta, momentum, update


def _finite(*groups: Sequence[Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for group in groups for t in group)


def _numerics(
    theta: Sequence[Tensor],
    momentum: Sequence[Tensor] | None,
    mean: Sequence[Tensor] | None,
    spec: FragmentSpec,
    config: RunConfig,
    *,
    final: bool = False,
) -> tuple[list[Tensor], list[Tensor], bytes]:
    """θ_{v+1}, the new momentum and the update blob of one round (worker thread); a
    ``final`` round's is ``outer.final_step``'s."""
    if mean is None:
        raw = list(theta)
        new_momentum = (
            list(momentum) if momentum is not None else [torch.zeros_like(t) for t in theta]
        )
    elif final:
        raw, new_momentum = final_step(theta, momentum, mean)
    else:
        raw, new_momentum = outer_step(
            theta, momentum, mean, lr=config.outer_lr, momentum_coef=config.outer_momentum
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
    """After committing ``round``: delete the snapshots and claims of round
    ``round - keep_rounds`` with the delta blobs they name, and the θ/outer/update blobs of
    the record that has just left its fragment's newest ``keep_versions``; a blob is kept
    while Θ⁰, a kept record or a snapshot of a kept round (up to ``fragments - 1`` rounds
    ahead) names it, since equal payloads share one blob. A blob names its fragment
    (``codec.spec_digest``), so only the rounds of the doomed blobs' fragments are read.

    Round records are never deleted. A failure here is logged and left for nobody: garbage
    is not worth failing a round over.
    """
    config = rt.config
    try:
        stale, old = round - config.keep_rounds, round - window(config)
        if stale < 0 and old < 0:
            return state
        fragments = {r % config.fragments for r in (stale, old) if r >= 0}
        state = await _remember(rt, state, round, (old, stale), fragments)
        keep = {ref.sha256 for ref in rt.manifest.theta0}
        for rec in state.recent.values():
            if rec.round > old:
                keep |= {rec.theta.sha256, rec.outer.sha256, rec.update.sha256}
        for r, shas in state.deltas.items():
            if r > stale:
                keep |= shas
        doomed: set[str] = set()
        keys_: list[str] = []
        if stale >= 0:
            keys_ = list(await rt.store.list_keys(keys.round_prefix(stale)))
            doomed |= state.deltas.get(stale, frozenset())
        dropped = state.recent.get(old)
        if dropped is not None:
            doomed |= {dropped.theta.sha256, dropped.outer.sha256, dropped.update.sha256}
        await rt.store.delete([*keys_, *(keys.blob(sha) for sha in sorted(doomed - keep))])
        state = replace(
            state,
            recent={r: rec for r, rec in state.recent.items() if r > old},
            deltas={r: shas for r, shas in state.deltas.items() if r > stale},
        )
    except GradientmailError as exc:
        _log.warning("%s: garbage collection after round %d failed: %s", rt.learner, round, exc)
    return state


async def _remember(
    rt: Runtime,
    state: SyncerState,
    round: int,
    since: tuple[int, int],
    fragments: set[int],
) -> SyncerState:
    """``state`` with the records of rounds ``since[0]`` to ``round`` and the snapshot
    deltas of the rounds of ``fragments`` from ``since[1]`` to ``round + fragments - 1`` it
    does not hold yet (rounds after ``round`` are read every time: their learners may still
    publish)."""
    recent, deltas = dict(state.recent), dict(state.deltas)
    for r in range(max(since[0], 0), round + 1):
        if r not in recent and (found := await rt.store.record(r)) is not None:
            recent[r] = found
    count = rt.config.fragments
    for r in range(max(since[1], 0), round + count):
        if r % count in fragments and (r not in deltas or r > round):
            deltas[r] = frozenset(s.delta.sha256 for s, _ in await rt.store.snapshots(r))
    return replace(state, recent=recent, deltas=deltas)
