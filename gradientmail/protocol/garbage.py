"""Garbage collection by reference: what goes after a round is committed.

``checkpoint.retained`` says which rounds' records and snapshots replay needs. A blob goes
only when a committed, verified record that left the retained set, or a verified snapshot of
its round's fragment in a round that left it, names it, and nothing that stays names it:
Θ⁰ (the manifest), a retained record (of any fragment), or any snapshot of a kept round or
of a round ahead (learners may be publishing there: up to ``F − 1`` rounds while the closer
keeps up, more when their waits for a slow one end). A snapshot that fails the run key or
names another fragment never dooms a blob, and nothing is deleted while a retained record
cannot be read. Equal payloads share one blob, so a blob is judged by every name, not by who
wrote it; blobs of different rounds are never equal (each names its fragment's version,
``framing.Meta.version``), so what a collection deletes is no blob that a round being
committed or published now names. Rounds whose keys outlive their collection (``stale``: a
snapshot that landed after it, a collection that failed) go with the next.

Pure: the node reads what ``reads`` names and hands it to ``collectable``.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import retained
from gradientmail.protocol.records import BlobRef, RoundRecord, RunConfig, Snapshot
from gradientmail.protocol.signing import Problem

__all__ = ["Garbage", "Reads", "collectable", "reads", "stale", "still_retained"]

Snapshots = Mapping[int, Sequence[tuple[Snapshot, Problem | None]]]
"""Every snapshot listed in a round, with its problem under the run key (None: verified)."""


@dataclass(frozen=True, slots=True)
class Reads:
    """What ``collectable`` needs read after a round: the ``records`` of these rounds and
    the ``snapshots`` of those."""

    records: frozenset[int]
    snapshots: frozenset[int]


@dataclass(frozen=True, slots=True)
class Garbage:
    """What goes: the ``rounds`` whose snapshots and claims are deleted, and the ``blobs``
    (sha256 names) nothing that stays names."""

    rounds: frozenset[int]
    blobs: frozenset[str]

    def deletions(self, listed: Iterable[str]) -> list[str]:
        """The keys to delete: those of ``listed`` (a listing of ``keys.ROUNDS``) in the
        ``rounds``, then the ``blobs``'."""
        rounds = [key for key in listed if keys.parse_round_key(key) in self.rounds]
        return [*rounds, *(keys.blob(sha) for sha in sorted(self.blobs))]


def stale(round: int, config: RunConfig, present: Iterable[int]) -> frozenset[int]:
    """The rounds before ``round`` (just committed) that still have keys in the store
    (``present``: the rounds of a listing of ``keys.ROUNDS``) though no retained set holds
    them: a snapshot published after its round was collected (a learner judged gone that
    was only slow), or a collection that failed."""
    kept = retained(round, config).snapshots
    return frozenset(r for r in present if r < round and r not in kept)


def reads(
    round: int,
    config: RunConfig,
    stale: frozenset[int] = frozenset(),
    ahead: frozenset[int] = frozenset(),
) -> Reads | None:
    """What to read after committing ``round`` (``stale``: rounds left over from earlier
    collections; ``ahead``: the rounds after it a listing found, read with the next
    ``F − 1`` whether listed or not); None when nothing leaves the retained set."""
    before, now = retained(round - 1, config), retained(round, config)
    gone_records = before.records - now.records
    gone_rounds = (before.snapshots - now.snapshots) | stale
    if not gone_records and not gone_rounds:
        return None
    ahead = ahead | frozenset(range(round + 1, round + config.fragments))
    return Reads(now.records | gone_records, now.snapshots | gone_rounds | ahead)


def collectable(
    round: int,
    config: RunConfig,
    theta0: Sequence[BlobRef],
    records: Mapping[int, RoundRecord],
    snapshots: Snapshots,
    stale: frozenset[int] = frozenset(),
) -> Garbage:
    """What goes after committing ``round``, from the ``records`` (verified, by round) and
    ``snapshots`` that ``reads`` named (with the same ``stale`` rounds, which go as the
    rounds leaving the retained set do); nothing when a retained record is missing from
    ``records`` (it could not be read: what it names is unknown)."""
    before, now = retained(round - 1, config), retained(round, config)
    gone_records = before.records - now.records
    gone_rounds = (before.snapshots - now.snapshots) | (stale - now.snapshots)
    if not now.records <= records.keys():
        return Garbage(frozenset(), frozenset())
    keep = _names(theta0) | {name for r in now.records for name in _named(records[r])}
    for r, listed in snapshots.items():
        if r in now.snapshots or r > round:
            keep |= {name for snapshot, _ in listed for name in _names(snapshot.blobs)}
    doomed = {name for r in gone_records if r in records for name in _named(records[r])}
    for r in gone_rounds:
        fragment = keys.fragment_of(r, config.fragments)
        for snapshot, problem in snapshots.get(r, ()):
            if problem is None and snapshot.round == r and snapshot.fragment == fragment:
                doomed |= _names(snapshot.blobs)
    return Garbage(frozenset(gone_rounds), frozenset(doomed - keep))


def still_retained(
    round: int, config: RunConfig, records: Mapping[int, RoundRecord]
) -> dict[int, RoundRecord]:
    """The ``records`` (by round) that stay retained after committing ``round``
    (``checkpoint.retained``): what a syncer keeps holding of those it read or adopted."""
    kept = retained(round, config).records
    return {r: record for r, record in records.items() if r in kept}


def _named(record: RoundRecord) -> set[str]:
    return _names(ref for ref in (record.update, record.theta, record.outer) if ref is not None)


def _names(refs: Iterable[BlobRef]) -> set[str]:
    names = set()
    for ref in refs:
        names.add(ref.sha256)
        if isinstance(ref.index, str):
            names.add(ref.index)
    return names
