"""What a run costs before it starts: bytes per round, requests per round, storage.

Arithmetic over a split's blob sizes (``fragments.preview``) and the config, by the rules of
the protocol (docs/protocol.md): round ``r`` updates fragment ``f = r mod F``;

- each learner puts one delta blob of ``f`` (``delta_encoding``) and its snapshot, and gets
  the round's record and its update blob (``update_encoding``);
- the syncer that closes the round gets every learner's snapshot and delta, and puts its
  claim, the update blob with its chunk index and the record; at a checkpoint (every
  ``checkpoint_every``-th version of a fragment) also θ with its index and, when the outer
  step keeps a state (``outer_momentum`` > 0), the momentum (both ``fp32``);
- what the store holds is what garbage collection keeps (``checkpoint.retained``): Θ⁰, the
  blobs of the retained records and the deltas of the retained rounds' snapshots, plus
  every round record, which is never deleted; at its peak, while a round closes, also what
  the round's collection is about to delete and the deltas of every round ahead that
  collection spares.

A fragment's round costs its own sizes; "per round" figures are means over the fragments.
Small objects (records, snapshots, claims) are sized by encoding representative ones. Not
counted: lease beats (one small put per ``lease_every`` seconds per node) and polls (a list,
or a read of the next record while a learner's round is due, per poll), which depend on
time rather than rounds.

Pure: no I/O.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import is_checkpoint, retained, stateful
from gradientmail.protocol.records import (
    BlobRef,
    Participant,
    RoundClaim,
    RoundRecord,
    RunConfig,
    Snapshot,
    chunks_of,
    encode,
)

__all__ = ["Costs", "costs"]

_HASH = "0" * 64


@dataclass(frozen=True, slots=True)
class Costs:
    """A run's costs with ``learners`` learners (``costs``); bytes are means per round.

    learner_up, learner_down
        What each learner moves per round.
    syncer_up, syncer_down
        What the syncer that closes a round moves for it (checkpoints averaged in).
    learner_requests, syncer_requests
        Puts and gets per round, likewise (``"put"``, ``"get"``).
    creation
        What the run's creator puts once: Θ⁰ of every fragment with its indexes.
    storage
        ``(least, most)`` bytes the store holds over a cycle of rounds once garbage
        collection is in its steady state, records aside: the least what a round's
        collection keeps, the most (the peak) just before it, with the round's record
        written and learners publishing in every round ahead.
    record_bytes
        What each round adds for good: its record.
    """

    config: RunConfig
    learners: int
    learner_up: float
    learner_down: float
    syncer_up: float
    syncer_down: float
    learner_requests: Mapping[str, float]
    syncer_requests: Mapping[str, float]
    creation: int
    storage: tuple[int, int]
    record_bytes: int

    def per_steps(self, steps: int) -> tuple[float, float]:
        """``(learner, syncer)``: bytes each learner moves in ``steps`` local steps (both
        directions), and what closing the rounds of those steps costs the syncers, all
        together; ``fragments`` rounds per ``sync_every`` steps."""
        rounds = steps * self.config.fragments / self.config.sync_every
        return (
            rounds * (self.learner_up + self.learner_down),
            rounds * (self.syncer_up + self.syncer_down),
        )

    def lines(self) -> list[str]:
        """The costs as lines of text (``Preview``'s table ends with them)."""
        config, steps = self.config, 1000
        learner, syncers = self.per_steps(steps)
        least, most = self.storage
        return [
            f"per round, each of {self.learners} learners: {_mb(self.learner_up)} up, "
            f"{_mb(self.learner_down)} down, 2 puts and 2+ gets",
            f"  the syncer closing it: {_mb(self.syncer_up)} up (checkpoints averaged in), "
            f"{_mb(self.syncer_down)} down, {self.syncer_requests['put']:.2f} puts and "
            f"{self.syncer_requests['get']:.0f}+ gets",
            f"  {config.fragments} rounds per {config.sync_every} steps: per {steps:,} steps "
            f"each learner moves {_mb(learner)}, the syncers {_mb(syncers)}",
            f"storage at keep_rounds={config.keep_rounds} keep_versions={config.keep_versions} "
            f"checkpoint_every={config.checkpoint_interval}: {_mb(least)} kept, {_mb(most)} at its "
            f"peak, plus {self.record_bytes:,} bytes of record per round",
        ]


def _mb(size: float) -> str:
    return f"{size / 1e6:.3f} MB"


def _index(size: int) -> int:
    return 32 * chunks_of(size)


def _small(learners: int) -> tuple[int, int, int]:
    """Encoded sizes of a representative snapshot, claim and record of ``learners``."""
    ref = BlobRef(sha256=_HASH, size=1 << 20, encoding="int8", index=_HASH)
    snapshot = Snapshot(
        learner="learner-0",
        round=1000,
        fragment=1,
        base_version=100,
        steps=50,
        tokens=1 << 16,
        delta=ref,
        norm=1.0,
        step_time=0.1,
        waited=0.0,
    )
    participant = Participant(
        learner="learner-0",
        weight=0.5,
        steps=50,
        tokens=1 << 16,
        base_version=100,
        arrived=0.5,
        step_time=0.1,
        waited=0.0,
    )
    record = RoundRecord(
        round=1000,
        fragment=1,
        version=100,
        committed_by="learner-0",
        participants=(participant,) * learners,
        quorum_seconds=0.5,
        grace_seconds=0.5,
        cosine=0.5,
        closed_at=1.8e9,
        update=ref,
        theta=ref,
        outer=ref,
    )
    return len(encode(snapshot)), len(encode(RoundClaim(learner="learner-0"))), len(encode(record))


def costs(
    delta: Sequence[int],
    update: Sequence[int],
    fp32: Sequence[int],
    config: RunConfig,
    learners: int = 2,
) -> Costs:
    """The costs of a run of ``config`` with ``learners`` learners whose fragment ``f`` has
    delta blobs of ``delta[f]`` bytes, update blobs of ``update[f]`` and fp32 blobs (θ, the
    momentum) of ``fp32[f]`` (``fragments.Preview.costs`` takes them from its sizes).
    Raises ``ValueError`` for no learners or size lists of another length than
    ``config.fragments``."""
    if learners < 1:
        raise ValueError(f"learners must be at least 1, got {learners}")
    count = config.fragments
    if not len(delta) == len(update) == len(fp32) == count:
        raise ValueError(f"fragment sizes of {len(delta)}, {len(update)}, {len(fp32)} for {count}")
    snapshot, claim, record = _small(learners)
    indexed = [size + _index(size) for size in update]
    blobs = 2 if stateful(config) else 1
    checkpoint = [blobs * size + _index(size) for size in fp32]
    share = 1 / config.checkpoint_interval
    creation = sum(size + _index(size) for size in fp32)
    after, before = _kept(config, learners, delta, indexed, checkpoint, snapshot + claim / learners)
    return Costs(
        config=config,
        learners=learners,
        learner_up=_mean(delta) + snapshot,
        learner_down=_mean(update) + record,
        syncer_up=_mean(indexed) + claim + record + share * _mean(checkpoint),
        syncer_down=learners * (_mean(delta) + snapshot),
        learner_requests={"put": 2.0, "get": 2.0},
        syncer_requests={"put": 4.0 + (blobs + 1) * share, "get": 2.0 * learners},
        creation=creation,
        storage=(creation + min(after), creation + max(before)),
        record_bytes=record,
    )


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values)


def _kept(
    config: RunConfig,
    learners: int,
    delta: Sequence[int],
    update: Sequence[int],
    checkpoint: Sequence[int],
    snapshot: float,
) -> tuple[list[int], list[int]]:
    """The bytes the store holds (Θ⁰ and records aside) around each round ``r`` of one cycle
    in garbage collection's steady state: ``(after, before)``. After ``r``'s collection: the
    blobs of ``retained(r)``'s records and the snapshots of its rounds. Before it (the
    peak): ``retained(r - 1)``'s, ``r``'s
    record, and the snapshots of ``r`` and of every round ahead that collection spares
    (``r + 1 … r + F - 1``: learners running ahead, and every learner's closing snapshots,
    publish there)."""
    count = config.fragments
    cycle = count * config.checkpoint_interval
    first = cycle * (config.keep_versions + 2) + config.keep_rounds

    def held(records: Iterable[int], rounds: Iterable[int]) -> int:
        blobs = 0.0
        for committed in records:
            fragment = keys.fragment_of(committed, count)
            blobs += update[fragment]
            if is_checkpoint(keys.version_of(committed, count), config):
                blobs += checkpoint[fragment]
        for pending in rounds:
            blobs += learners * (delta[keys.fragment_of(pending, count)] + snapshot)
        return int(blobs)

    after, before = [], []
    for round in range(first, first + cycle):
        now, then = retained(round, config), retained(round - 1, config)
        after.append(held(now.records, now.snapshots))
        ahead = set(range(round, round + count))
        before.append(held(then.records | {round}, then.snapshots | ahead))
    return after, before
