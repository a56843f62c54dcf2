"""Checkpoints without I/O: replaying a fragment from a checkpoint gives θ and the momentum
the rounds committed, bit for bit, for every encoding; garbage collection keeps exactly what
a replay reads; a record that lacks its checkpoint, or a config that disagrees, is refused
with a clear error."""

from dataclasses import dataclass

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import RecordError
from gradientmail.protocol import keys
from gradientmail.protocol.aggregation import Candidate, aggregate
from gradientmail.protocol.checkpoint import (
    base,
    check_record,
    is_checkpoint,
    mean_of,
    replayed,
    retained,
    step,
)
from gradientmail.protocol.codec import ENCODINGS, decode_fragment, encode_fragment
from gradientmail.protocol.config import CHECKPOINT_EVERY, TOPK_CHECKPOINT_EVERY
from gradientmail.protocol.outer import committed_update
from gradientmail.protocol.records import (
    BlobRef,
    Encoding,
    FragmentSpec,
    ParamSpec,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
    Snapshot,
    decode,
    encode,
)
from gradientmail.protocol.sparse import update_sparsity

SHAPES = [(17, 33), (33,), (5, 3, 7), ()]
SPEC = FragmentSpec(
    index=0,
    params=tuple(
        ParamSpec(name=f"p{i}", shape=shape, dtype="float32") for i, shape in enumerate(SHAPES)
    ),
)
LEARNERS = ("a", "b", "c")
REF = BlobRef(sha256="0" * 64, size=1, encoding="fp32")


def bits(tensors: object) -> list[torch.Tensor]:
    assert isinstance(tensors, list | tuple)
    return [t.contiguous().view(torch.int32) for t in tensors]


def same_bits(a: object, b: object) -> bool:
    return all(torch.equal(x, y) for x, y in zip(bits(a), bits(b), strict=True))


@dataclass(frozen=True)
class Committed:
    """One committed round as the store holds it, and what the syncer held after it."""

    record: RoundRecord
    update: bytes
    snapshots: list[tuple[Snapshot, list[torch.Tensor]]]
    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]


def snapshot(learner: str, version: int, round: int, tokens: int, final: bool) -> Snapshot:
    return Snapshot(
        learner=learner, round=round, fragment=0, base_version=version - 1,
        steps=0 if final else 4, tokens=0 if final else tokens, delta=REF, norm=None,
        final=True if final else msgspec.UNSET,
    )  # fmt: skip


def run(config: RunConfig, versions: int, seed: int) -> list[Committed]:
    """``versions`` rounds of fragment 0 closed as the syncer closes them (``aggregate``,
    ``checkpoint.step``, ``committed_update``): learners with uneven tokens, an empty round
    at version 3 and a final round at version 6, their records through JSON and back."""
    gen = torch.Generator().manual_seed(seed)
    theta = [torch.randn(shape, generator=gen) for shape in SHAPES]
    momentum: list[torch.Tensor] | None = None
    out = []
    for version in range(1, versions + 1):
        round = keys.round_of(0, version, config.fragments)
        final = version == 6
        learners = () if version == 3 else LEARNERS
        snaps = [
            (
                snapshot(name, version, round, 100 + 37 * i * version, final),
                [torch.randn(shape, generator=gen) * 0.05 for shape in SHAPES],
            )
            for i, name in enumerate(learners)
        ]
        candidates = [Candidate(snapshot=s, delta=d) for s, d in snaps]
        result = aggregate(version - 1, candidates, SPEC, config, theta=theta)
        raw, momentum = step(theta, momentum, result.mean, config, final=final)
        update, theta = committed_update(
            theta,
            raw,
            SPEC,
            config.update_encoding,
            block_size=config.block_size,
            version=version,
            sparsity=update_sparsity(config),
        )
        draft = RoundRecordDraft(
            round=round, fragment=0, version=version, committed_by="s",
            participants=result.participants, rejected=result.rejected,
            quorum_seconds=0.0, grace_seconds=0.0, cosine=result.cosine,
        )  # fmt: skip
        record = decode(encode(RoundRecord.committed(draft, update=REF)), RoundRecord)
        out.append(Committed(record, update, snaps, theta, momentum))
    return out


@pytest.mark.parametrize("encoding", [*ENCODINGS, "topk"])
def test_replay_from_every_checkpoint_is_exact(encoding: Encoding) -> None:
    """From each version c (θ_c and m_c as a checkpoint stores them, fp32 through the codec;
    Θ⁰ with no momentum at 0), replaying the rounds after it gives every later θ and momentum
    bit for bit; θ alone needs only the updates."""
    config = RunConfig(fragments=1, sync_every=4, update_encoding=encoding, block_size=16)
    rounds = run(config, 10, seed=3)
    gen = torch.Generator().manual_seed(3)
    theta0 = [torch.randn(shape, generator=gen) for shape in SHAPES]
    for start in range(len(rounds)):
        if start == 0:
            theta, momentum = theta0, None
        else:
            held = rounds[start - 1]
            theta = decode_fragment(encode_fragment(held.theta, SPEC, "fp32", block_size=1), SPEC)
            momentum = decode_fragment(
                encode_fragment(held.momentum, SPEC, "fp32", block_size=1), SPEC
            )
        only_theta = theta
        for committed in rounds[start:]:
            mean = mean_of(committed.record, committed.snapshots, SPEC, config)
            theta, momentum = replayed(theta, momentum, committed.update, SPEC, config, mean=mean)
            only_theta, none = replayed(only_theta, None, committed.update, SPEC, config, mean=None)
            assert none is None
            version = committed.record.version
            assert same_bits(theta, committed.theta), (start, version)
            assert same_bits(only_theta, committed.theta), (start, version)
            assert same_bits(momentum, committed.momentum), (start, version)


def test_a_replay_without_a_participants_snapshot_says_whose() -> None:
    config = RunConfig(fragments=1, sync_every=4)
    committed = run(config, 1, seed=0)[0]
    with pytest.raises(RecordError, match="counts 'b', whose snapshot is gone"):
        mean_of(committed.record, [committed.snapshots[0]], SPEC, config)


def test_the_checkpoint_rule() -> None:
    config = RunConfig(checkpoint_every=4)
    assert [v for v in range(13) if is_checkpoint(v, config)] == [4, 8, 12]
    assert [base(v, config) for v in range(10)] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    every = RunConfig(checkpoint_every=1)
    assert all(is_checkpoint(v, every) and base(v, every) == v for v in range(1, 9))
    assert not is_checkpoint(0, every)


def record_of(round: int, config: RunConfig, *, checkpoint: bool) -> RoundRecord:
    draft = RoundRecordDraft(
        round=round, fragment=keys.fragment_of(round, config.fragments),
        version=keys.version_of(round, config.fragments), committed_by="s", participants=(),
        quorum_seconds=0.0, grace_seconds=0.0, cosine=None,
    )  # fmt: skip
    refs = {"theta": REF, "outer": REF} if checkpoint else {}
    return RoundRecord.committed(draft, update=REF, **refs)


def test_a_checkpoint_version_without_its_blobs_is_refused() -> None:
    config = RunConfig(fragments=2, sync_every=4, checkpoint_every=4)
    round = keys.round_of(1, 8, 2)
    assert check_record(record_of(round, config, checkpoint=True), round, config)
    with pytest.raises(RecordError, match=r"checkpoint_every is 4\).*names no θ or no outer-state"):
        check_record(record_of(round, config, checkpoint=False), round, config)
    theta_only = msgspec.structs.replace(record_of(round, config, checkpoint=True), outer=None)
    with pytest.raises(RecordError, match="names no θ or no outer-state"):
        check_record(theta_only, round, config)
    # Without momentum the outer step keeps no state: θ alone is the checkpoint.
    stateless = msgspec.structs.replace(config, outer_momentum=0.0)
    assert check_record(theta_only, round, stateless)
    with pytest.raises(RecordError, match="names no θ"):
        check_record(record_of(round, stateless, checkpoint=False), round, stateless)
    # More checkpoints than the rule asks for (a run created when every record had one).
    assert check_record(record_of(round - 2, config, checkpoint=True), round - 2, config)
    with pytest.raises(RecordError, match="not what round 3 produces"):
        check_record(record_of(round, config, checkpoint=True), 3, config)


def test_a_record_with_an_outer_state_and_no_theta_does_not_decode() -> None:
    good = encode(record_of(0, RunConfig(), checkpoint=True))
    half = good.replace(b'"theta":{', b'"thetax":{')
    with pytest.raises(RecordError, match="outer-state blob only with its θ"):
        decode(half, RoundRecord)
    theta_only = decode(good.replace(b'"outer":{', b'"outerx":{'), RoundRecord)
    assert theta_only.checkpoint
    assert theta_only.outer is None
    assert decode(encode(record_of(0, RunConfig(), checkpoint=False)), RoundRecord).update == REF


@pytest.mark.parametrize("bad", [0, -1])
def test_checkpoint_every_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="checkpoint_every must be a positive integer"):
        RunConfig(checkpoint_every=bad)


def reads(fragment: int, version: int, config: RunConfig) -> tuple[set[int], set[int]]:
    """The rounds whose record blobs and snapshots rebuilding ``version`` of ``fragment``
    with its momentum reads (``RunReader.rebuild`` from the guaranteed checkpoint; no
    snapshot without momentum), and the update of ``version`` a learner one version behind
    reads."""
    count = config.fragments
    start = base(version, config)
    records = {keys.round_of(fragment, v, count) for v in range(max(start, 1), version + 1)}
    snaps = {keys.round_of(fragment, v, count) for v in range(start + 1, version + 1)}
    return records, snaps if config.outer_momentum > 0 else set()


def needed(round: int, config: RunConfig) -> tuple[set[int], set[int]]:
    """What must stay after committing ``round``: the reads of each fragment's newest
    ``keep_versions`` versions, and the snapshots of the newest ``keep_rounds`` rounds."""
    records: set[int] = set()
    snaps = set(range(max(round - config.keep_rounds + 1, 0), round + 1))
    for fragment in range(min(config.fragments, round + 1)):
        newest = keys.version_of(round - (round - fragment) % config.fragments, config.fragments)
        for version in range(max(newest - config.keep_versions + 1, 0), newest + 1):
            more_records, more_snaps = reads(fragment, version, config)
            records |= more_records
            snaps |= more_snaps
    return records, snaps


@settings(max_examples=300, deadline=None)
@given(
    fragments=st.integers(1, 4),
    every=st.integers(1, 6),
    keep_versions=st.integers(1, 4),
    keep_rounds=st.integers(1, 12),
    last=st.integers(0, 60),
    momentum=st.sampled_from([0.0, 0.6]),
)
def test_collection_keeps_exactly_what_replay_reads_and_never_needs_it_back(
    fragments: int, every: int, keep_versions: int, keep_rounds: int, last: int, momentum: float
) -> None:
    """Rounds 0…last committed in turn, each deleting what left ``retained``: nothing a
    replay reads is ever deleted (then or at any later round), and everything else older
    than ``keep_rounds`` is (without momentum, every snapshot older than that)."""
    config = RunConfig(
        fragments=fragments, sync_every=max(fragments, 4), checkpoint_every=every,
        keep_versions=keep_versions, keep_rounds=keep_rounds, outer_momentum=momentum,
    )  # fmt: skip
    deleted_records: set[int] = set()
    deleted_snaps: set[int] = set()
    for round in range(last + 1):
        before, now = retained(round - 1, config), retained(round, config)
        deleted_records |= before.records - now.records
        deleted_snaps |= before.snapshots - now.snapshots
        records, snaps = needed(round, config)
        assert now.records == records, round
        assert now.snapshots == snaps, round
        assert not deleted_records & records, round
        assert not deleted_snaps & snaps, round
    assert deleted_records == set(range(last + 1)) - needed(last, config)[0]
    assert deleted_snaps == set(range(last + 1)) - needed(last, config)[1]


@pytest.mark.parametrize(
    ("every", "records", "snapshots"),
    [
        # F=2, keep_versions=2, keep_rounds=2, after round 9 (versions 5 of both fragments).
        (1, {6, 7, 8, 9}, {8, 9}),
        (4, {6, 7, 8, 9}, {8, 9}),
        (8, set(range(10)), set(range(10))),
        (3, {4, 5, 6, 7, 8, 9}, {6, 7, 8, 9}),
    ],
)
def test_what_collection_keeps_after_round_9(
    every: int, records: set[int], snapshots: set[int]
) -> None:
    config = RunConfig(
        fragments=2, sync_every=4, checkpoint_every=every, keep_versions=2, keep_rounds=2
    )
    kept = retained(9, config)
    assert (set(kept.records), set(kept.snapshots)) == (records, snapshots)
    # Without momentum no snapshot waits for a replay: only the newest keep_rounds rounds'.
    stateless = retained(9, msgspec.structs.replace(config, outer_momentum=0.0))
    assert (set(stateless.records), set(stateless.snapshots)) == (records, {8, 9})


def test_checkpoints_default_to_the_update_encoding() -> None:
    """Unset, ``checkpoint_every`` is ``CHECKPOINT_EVERY`` for dense updates and
    ``TOPK_CHECKPOINT_EVERY`` for ``topk`` ones, also after ``replace`` changes the
    encoding; a value given is kept; the manifest stores it unset."""
    dense = RunConfig()
    topk = msgspec.structs.replace(dense, delta_encoding="topk", update_encoding="topk")
    assert (dense.checkpoint_interval, topk.checkpoint_interval) == (
        CHECKPOINT_EVERY,
        TOPK_CHECKPOINT_EVERY,
    )
    assert is_checkpoint(TOPK_CHECKPOINT_EVERY, topk)
    assert not is_checkpoint(CHECKPOINT_EVERY, topk)
    assert msgspec.structs.replace(topk, checkpoint_every=3).checkpoint_interval == 3
    stored = msgspec.json.decode(msgspec.json.encode(topk), type=RunConfig)
    assert stored == topk
    assert stored.checkpoint_every is None
