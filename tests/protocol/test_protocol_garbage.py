"""Garbage collection by reference (``protocol.garbage``) over random runs with planted
snapshots: what replay of every retained version reads is never deleted, and nothing named
only by an unverified or foreign snapshot is."""

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.protocol import garbage, keys
from gradientmail.protocol.checkpoint import is_checkpoint, retained
from gradientmail.protocol.records import (
    BlobRef,
    Participant,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.signing import Problem

POOL = [f"{n:064x}" for n in range(12)]
"""Few names, so that records, deltas and planted snapshots share blobs often."""


def _ref(n: int) -> BlobRef:
    return BlobRef(sha256=POOL[n], size=1, encoding="fp32")


def _snapshot(learner: str, round: int, fragment: int, blob: int) -> Snapshot:
    return Snapshot(
        learner=learner,
        round=round,
        fragment=fragment,
        base_version=0,
        steps=1,
        tokens=1,
        norm=1.0,
        delta=_ref(blob),
    )


@dataclass
class Run:
    """A run as the store holds it: records by round, snapshots by round (with their
    problem), Θ⁰, and the blobs deleted so far."""

    config: RunConfig
    theta0: list[BlobRef]
    records: dict[int, RoundRecord] = field(default_factory=dict)
    snapshots: dict[int, list[tuple[Snapshot, Problem | None]]] = field(default_factory=dict)
    honest: dict[int, list[Snapshot]] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)


def _record(
    round: int,
    fragment: int,
    version: int,
    learners: list[str],
    update: BlobRef,
    checkpoint: tuple[BlobRef, BlobRef] | None,
) -> RoundRecord:
    """The record of ``round``, ``fragment``'s ``version``, with θ and the outer state at a
    ``checkpoint``."""
    draft = RoundRecordDraft(
        round=round,
        fragment=fragment,
        version=version,
        committed_by="a",
        participants=tuple(
            Participant(learner=name, weight=1.0, steps=1, tokens=1, base_version=0)
            for name in learners
        ),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
    )
    theta, outer = checkpoint or (None, None)
    return RoundRecord.committed(draft, update=update, theta=theta, outer=outer)


@st.composite
def runs(draw: st.DrawFn) -> tuple[Run, int]:
    fragments = draw(st.integers(1, 3))
    config = RunConfig(
        fragments=fragments,
        keep_rounds=draw(st.integers(1, 4)),
        keep_versions=draw(st.integers(1, 3)),
        checkpoint_every=draw(st.integers(1, 3)),
    )
    blob = st.integers(0, len(POOL) - 1)
    run = Run(config, [_ref(draw(blob)) for _ in range(fragments)])
    count = draw(st.integers(1, 18))
    for round in range(count + fragments):
        fragment = keys.fragment_of(round, fragments)
        version = keys.version_of(round, fragments)
        learners = draw(st.lists(st.sampled_from("ab"), unique=True))
        honest = [_snapshot(name, round, fragment, draw(blob)) for name in learners]
        run.honest[round] = honest
        listed: list[tuple[Snapshot, Problem | None]] = [(s, None) for s in honest]
        for k in range(draw(st.integers(0, 3))):
            problem = draw(st.sampled_from([None, "unsigned", "bad-signature"]))
            planted = _snapshot(f"m{k}", round, draw(st.integers(0, fragments - 1)), draw(blob))
            listed.append((planted, problem))
        run.snapshots[round] = listed
        checkpoint = is_checkpoint(version, config)
        run.records[round] = _record(
            round,
            fragment,
            version,
            [s.learner for s in honest],
            _ref(draw(blob)),
            (_ref(draw(blob)), _ref(draw(blob))) if checkpoint else None,
        )
    return run, count


def _names(refs: list[BlobRef | None]) -> set[str]:
    return {ref.sha256 for ref in refs if ref is not None}


def _collect(run: Run, round: int) -> None:
    """What the syncer does after committing ``round``: the rounds with snapshots are the
    rounds a listing finds."""
    stale = garbage.stale(round, run.config, run.snapshots)
    ahead = frozenset(r for r in run.snapshots if r > round)
    wanted = garbage.reads(round, run.config, stale, ahead)
    if wanted is None:
        return
    records = {r: run.records[r] for r in wanted.records if r <= round}
    snapshots = {r: list(run.snapshots.get(r, [])) for r in wanted.snapshots}
    doomed = garbage.collectable(round, run.config, run.theta0, records, snapshots, stale)
    for r in doomed.rounds:
        run.snapshots.pop(r, None)
    run.deleted |= doomed.blobs


def _needed(run: Run, round: int) -> set[str]:
    """What replaying every retained version reads after ``round``, and what the learners
    have published to any round ahead (beyond the next ``F − 1`` when a slow closer's
    learners ran on)."""
    kept = retained(round, run.config)
    needed = _names(list(run.theta0))
    for r in kept.records:
        record = run.records[r]
        needed |= _names([record.update, record.theta, record.outer])
    for r in [*kept.snapshots, *(r for r in run.honest if r > round)]:
        needed |= _names([s.delta for s in run.honest[r]])  # type: ignore[misc]
    return needed


@settings(max_examples=150, deadline=None)
@given(runs())
def test_every_retained_version_replays_after_every_collection(drawn: tuple[Run, int]) -> None:
    run, count = drawn
    untrusted_only = set(POOL)
    for round, listed in run.snapshots.items():
        fragment = keys.fragment_of(round, run.config.fragments)
        for snapshot, problem in listed:
            if problem is None and snapshot.fragment == fragment:
                untrusted_only -= _names([snapshot.delta])  # type: ignore[list-item]
    for record in run.records.values():
        untrusted_only -= _names([record.update, record.theta, record.outer])
    untrusted_only -= _names(list(run.theta0))
    for round in range(count):
        # Writing a blob that is already there is a no-op; one collected before is written
        # again: the round's record, and the deltas its learners publish up to the rounds ahead.
        record = run.records[round]
        run.deleted -= _names([record.update, record.theta, record.outer])
        for r in range(round, round + run.config.fragments):
            run.deleted -= _names([s.delta for s in run.honest[r]])  # type: ignore[misc]
        _collect(run, round)
        lost = _needed(run, round) & run.deleted
        assert not lost, (round, lost)
        assert not untrusted_only & run.deleted
        assert not garbage.stale(round, run.config, run.snapshots)


def test_a_snapshot_that_lands_in_a_collected_round_goes_with_the_next_collection() -> None:
    """One fragment, every version a checkpoint: round 0 leaves the retained set when round
    1 commits, and a slow learner's snapshots land in it after that collection. Round 2's
    collection finds round 0 among the rounds listed (``stale``) and takes its keys and the
    blob only it names, not one a retained record names, nor keys of other rounds."""
    config = RunConfig(fragments=1, sync_every=4, checkpoint_every=1)
    checkpoints = {r: (_ref(9 + r), _ref(9 + r)) for r in range(3)}
    records = {r: _record(r, 0, r + 1, [], _ref(6 + r), checkpoints[r]) for r in range(3)}
    assert garbage.stale(1, config, {0, 1, 2}) == frozenset({0})
    assert garbage.stale(2, config, {2, 3}) == frozenset()
    stale = garbage.stale(2, config, {0, 2})
    wanted = garbage.reads(2, config, stale)
    assert wanted is not None
    assert 0 in wanted.snapshots
    late = [(_snapshot("slow", 0, 0, 5), None), (_snapshot("slower", 0, 0, 11), None)]
    doomed = garbage.collectable(2, config, [_ref(0)], records, {0: late}, stale)
    assert 0 in doomed.rounds
    assert POOL[5] in doomed.blobs
    assert POOL[11] not in doomed.blobs  # round 2's θ
    listed = [keys.snapshot(0, "slow"), keys.snapshot(2, "a"), "rounds/junk"]
    assert doomed.deletions(listed)[0] == keys.snapshot(0, "slow")
    assert keys.snapshot(2, "a") not in doomed.deletions(listed)


def test_nothing_goes_while_a_retained_record_cannot_be_read() -> None:
    config = RunConfig(fragments=1, keep_rounds=1, keep_versions=1, checkpoint_every=1)
    snapshot = _snapshot("a", 0, 0, 1)
    wanted = garbage.reads(1, config)
    assert wanted is not None
    doomed = garbage.collectable(1, config, [_ref(0)], {}, {0: [(snapshot, None)]})
    assert doomed.blobs == frozenset()


@settings(max_examples=100, deadline=None)
@given(runs())
def test_the_records_a_syncer_holds_round_after_round_are_the_retained_ones(
    drawn: tuple[Run, int],
) -> None:
    """A syncer adds each record it adopts and keeps what ``still_retained`` keeps: after
    every round it holds exactly the retained records (none it dropped is wanted again)."""
    run, count = drawn
    held: dict[int, RoundRecord] = {}
    for round in range(count):
        held = garbage.still_retained(round, run.config, held)
        held[round] = run.records[round]
        assert held.keys() == retained(round, run.config).records
        assert all(held[r] is run.records[r] for r in held)


def test_the_deletions_are_the_listed_keys_of_the_rounds_then_the_blobs_in_order() -> None:
    doomed = garbage.Garbage(frozenset({3}), frozenset({POOL[2], POOL[1]}))
    ours = [keys.round_claim(3, 0), keys.snapshot(3, "a")]
    listed = [*ours, keys.snapshot(4, "a"), "rounds/x", keys.round_prefix(2) + "planted"]
    assert doomed.deletions(listed) == [*ours, keys.blob(POOL[1]), keys.blob(POOL[2])]
