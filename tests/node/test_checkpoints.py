"""Checkpoints through real nodes on a real directory store: every checkpoint a syncer
writes is, bit for bit, the replay of the whole history from Θ⁰ (θ and the momentum), also
after a syncer was killed between checkpoints and another recovered from the store; a
learner joining between checkpoints holds exactly that θ; a node passing another
``checkpoint_every`` than the run's is refused, naming the field; a record lacking the
checkpoint its version calls for is reported once and not followed."""

from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from node_helpers import (
    CONFIG,
    FAST,
    LEARNER_ONLY,
    Recorder,
    Trainer,
    records,
    tiny_model,
    train,
)

from gradientmail._node import node as open_node
from gradientmail.errors import CorruptBlob, RecordError, RunMismatch
from gradientmail.events import PollFailed
from gradientmail.mailbox import MemoryMailbox
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import mean_of, replayed, stateful
from gradientmail.protocol.codec import decode_fragment, encode_fragment
from gradientmail.protocol.fragments import window
from gradientmail.protocol.records import BlobRef, RoundRecord, RoundRecordDraft, RunConfig
from gradientmail.reader import RunReader
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

EVERY = msgspec.structs.replace(CONFIG, checkpoint_every=3)
TOPK = msgspec.structs.replace(
    EVERY,
    delta_encoding="topk",
    update_encoding="topk",
    topk_chunk=64,
    outer_momentum=0.0,
    outer_lr=2.0,
)
"""Two fragments, a checkpoint every third version, nothing collected."""


def same_bits(a: object, b: object) -> bool:
    assert isinstance(a, list | tuple)
    assert isinstance(b, list | tuple)
    return all(
        torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))
        for x, y in zip(a, b, strict=True)
    )


async def blob(store: Store, ref: BlobRef | None, fragment: int) -> list[torch.Tensor]:
    assert ref is not None
    data = await store.get_blob(ref)
    assert data is not None
    manifest = await store.manifest()
    assert manifest is not None
    return decode_fragment(data, manifest.fragments[fragment])


async def from_scratch(
    box: LocalMailbox, history: list[RoundRecord], fragment: int
) -> dict[int, tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
    """θ and the momentum of every version of ``fragment``, replayed by hand from Θ⁰ through
    every round's update and its participants' deltas (the oracle: no checkpoint is read)."""
    store = Store(box)
    manifest = await store.manifest()
    assert manifest is not None
    spec = manifest.fragments[fragment]
    theta = await blob(store, manifest.theta0[fragment], fragment)
    momentum: list[torch.Tensor] | None = None
    out = {}
    for record in history:
        if record.fragment != fragment:
            continue
        found = []
        for snapshot, _ in await store.snapshots(record.round):
            found.append((snapshot, await blob(store, snapshot.delta, fragment)))
        update = await store.get_blob(record.update)
        assert update is not None
        mean = mean_of(record, found, spec, manifest.config)
        theta, momentum = replayed(theta, momentum, update, spec, manifest.config, mean=mean)
        out[record.version] = (theta, momentum)
    return out


async def assert_checkpoints_replay(box: LocalMailbox) -> list[RoundRecord]:
    """Every checkpoint in the store equals the replay from scratch, bit for bit; without
    momentum it names θ alone."""
    history = await records(box)
    store = Store(box)
    manifest = await store.manifest()
    assert manifest is not None
    with_momentum = stateful(manifest.config)
    checked = 0
    for fragment in range(EVERY.fragments):
        replay = await from_scratch(box, history, fragment)
        for record in history:
            if record.fragment == fragment and record.checkpoint:
                theta, momentum = replay[record.version]
                assert same_bits(await blob(store, record.theta, fragment), theta), record.round
                if with_momentum:
                    assert same_bits(await blob(store, record.outer, fragment), momentum), record
                else:
                    assert record.outer is None, record
                checked += 1
            elif record.fragment == fragment:
                assert record.version % EVERY.checkpoint_interval, record.round
    assert checked >= 2
    return history


async def assert_rebuilds_step_by_step(box: LocalMailbox, history: list[RoundRecord]) -> None:
    """``RunReader.rebuild`` of every version with its momentum, from the checkpoint and from
    the version before it (the start a syncer holds when it adopted another's round), is the
    replay from scratch (without momentum: θ, and no momentum)."""
    reader = RunReader.of(box)
    with_momentum = stateful((await reader.manifest()).config)
    for fragment in range(EVERY.fragments):
        replay = await from_scratch(box, history, fragment)
        held = None
        for version in sorted(replay):
            theta, momentum = replay[version]
            alone = await reader.rebuild(fragment, version, momentum=True)
            stepped = await reader.rebuild(fragment, version, momentum=True, start=held)
            for rebuilt in (alone, stepped):
                assert rebuilt is not None
                assert same_bits(rebuilt.theta, theta), (fragment, version)
                if with_momentum:
                    assert same_bits(rebuilt.momentum, momentum), (fragment, version)
                else:
                    assert rebuilt.momentum is None, (fragment, version)
                    assert rebuilt.outer, (fragment, version)
            held = stepped


@pytest.mark.parametrize("config", [EVERY, TOPK], ids=["fp32", "topk"])
async def test_a_syncer_killed_between_checkpoints_is_followed_exactly(
    tmp_path: Path, config: RunConfig
) -> None:
    """``a`` (learner and syncer) is killed after version 4 of both fragments (checkpoint at
    3); ``b`` recovers from the store, rebuilding θ and the momentum from checkpoint 3 and
    the rounds after it, and commits on past checkpoint 6: each checkpoint is the replay, and
    so is every version rebuilt from the checkpoint or from the version before it. Under
    ``topk`` without momentum too (its checkpoints are θ alone)."""
    box = LocalMailbox(tmp_path / "store")
    async with box:
        model = tiny_model(0)
        with anyio.CancelScope() as kill:
            async with open_node(model, box, learner="a", config=config, options=FAST) as node:
                await train(node, model, seed=0, until_round=7)
                kill.cancel()
        assert max(r.round for r in await records(box)) < 10
        model = tiny_model(1)
        async with open_node(model, box, learner="b", options=FAST) as node:
            await train(node, model, seed=1, until_round=14)
        history = await assert_checkpoints_replay(box)
        assert any(r.committed_by == "b" and r.checkpoint for r in history)
        await assert_rebuilds_step_by_step(box, history)


async def test_a_learner_joining_between_checkpoints_holds_the_replayed_theta(
    tmp_path: Path,
) -> None:
    """``late`` joins while the fragments are past checkpoint 3 (one at least before 6): its
    model is θ of the newest versions, bit for bit the replay from scratch."""
    box = LocalMailbox(tmp_path / "store")
    async with box:
        model = tiny_model(0)
        async with open_node(model, box, learner="a", config=EVERY, options=FAST) as node:
            await train(node, model, seed=0, until_round=8)
            with anyio.CancelScope() as leave:
                late = tiny_model(5)
                async with open_node(late, box, learner="late", options=FAST) as joined:
                    versions = joined.state.versions
                    weights = [p.detach().clone() for p in late.parameters()]
                    leave.cancel()
        assert any(v % EVERY.checkpoint_interval for v in versions), versions
        history = await assert_checkpoints_replay(box)
        named = dict(zip([n for n, _ in late.named_parameters()], weights, strict=True))
        manifest = await Store(box).manifest()
        assert manifest is not None
        for fragment, version in enumerate(versions):
            theta, _ = (await from_scratch(box, history, fragment))[version]
            ours = [window(named[p.name], p) for p in manifest.fragments[fragment].params]
            assert same_bits(ours, theta), (fragment, version)


async def test_records_that_all_carry_theta_are_read_from_the_newest() -> None:
    """A run whose records all carry θ and the momentum (a run created before the rule), its older
    blobs collected, then one more record with only its update (a zero one, accepting
    nobody), all read under a ``checkpoint_every`` of 16: the version is rebuilt from the
    newest record that carries a checkpoint, not from Θ⁰ through collected updates."""
    box = MemoryMailbox()
    every = msgspec.structs.replace(EVERY, checkpoint_every=1, keep_versions=1, keep_rounds=2)
    model = tiny_model(0)
    async with open_node(model, box, learner="a", config=every, options=FAST) as node:
        await train(node, model, seed=0, until_round=9)
    last = (await records(box))[-EVERY.fragments]
    store = Store(box)
    manifest = await store.manifest()
    assert manifest is not None
    spec = manifest.fragments[last.fragment]
    zero = encode_fragment([torch.zeros(p.shape) for p in spec.params], spec, "fp32", block_size=1)
    round = keys.round_of(last.fragment, last.version + 1, EVERY.fragments)
    draft = RoundRecordDraft(
        round=round, fragment=last.fragment, version=last.version + 1, committed_by="old",
        participants=(), quorum_seconds=0.0, grace_seconds=0.0, cosine=None,
    )  # fmt: skip
    update = await store.put_blob(zero, "fp32")
    assert (await store.put_record(RoundRecord.committed(draft, update=update)))[1]
    older = msgspec.structs.replace(
        manifest, config=msgspec.structs.replace(manifest.config, checkpoint_every=16)
    )
    assert 1 < last.version + 1 < 16, last.version
    rebuilt = await RunReader.of(box).rebuild(
        last.fragment, last.version + 1, momentum=True, manifest=older
    )
    assert rebuilt is not None
    assert same_bits(rebuilt.theta, await blob(store, last.theta, last.fragment))
    assert same_bits(rebuilt.momentum, await blob(store, last.outer, last.fragment))


async def test_reading_the_newest_fails_as_the_damaged_fragment_does_or_rereads_a_gone_one() -> (
    None
):
    """``newest`` rebuilds fragments concurrently: a damaged blob of one fragment is raised
    as itself (``CorruptBlob``, not a group of errors), whatever the other fragments do; a
    blob gone from under it makes it list again, then say the store lacks it."""
    box = MemoryMailbox()
    model = tiny_model(0)
    async with open_node(model, box, learner="a", config=EVERY, options=FAST) as node:
        await train(node, model, seed=0, until_round=5)
    reader = RunReader.of(box)
    newest = await reader.newest()
    damaged = newest.records[1]
    assert damaged is not None
    assert newest.records[0] is not None
    ref = damaged.theta or damaged.update
    original = box._objects[keys.blob(ref.sha256)]
    box._objects[keys.blob(ref.sha256)] = original[:-1] + bytes([original[-1] ^ 1])
    with pytest.raises(CorruptBlob, match="damaged"):
        await RunReader.of(box).newest()
    del box._objects[keys.blob(ref.sha256)]
    with pytest.raises(CorruptBlob, match="showed no newer record"):
        await RunReader.of(box).newest(poll=0.0)


async def test_a_node_with_another_checkpoint_every_is_refused(tmp_path: Path) -> None:
    box = LocalMailbox(tmp_path / "store")
    async with box:
        async with open_node(tiny_model(0), box, learner="s", config=EVERY, options=FAST):
            pass
        other = msgspec.structs.replace(EVERY, checkpoint_every=5)
        with pytest.raises(RunMismatch, match="'checkpoint_every': the run has 3"):
            async with open_node(tiny_model(0), box, learner="x", config=other, options=FAST):
                pass
        assert await box.get(keys.MANIFEST) is not None


async def test_an_unset_checkpoint_every_matches_the_number_it_stands_for(tmp_path: Path) -> None:
    """A run created with ``checkpoint_every`` unset takes a node passing the number its
    default gives, and the other way round; another number is refused."""
    box = LocalMailbox(tmp_path / "store")
    unset = msgspec.structs.replace(EVERY, checkpoint_every=None)
    number = msgspec.structs.replace(EVERY, checkpoint_every=unset.checkpoint_interval)
    async with box:
        async with open_node(tiny_model(0), box, learner="s", config=unset, options=FAST):
            pass
        async with open_node(tiny_model(0), box, learner="x", config=number, options=FAST):
            pass
        other = msgspec.structs.replace(EVERY, checkpoint_every=unset.checkpoint_interval + 1)
        with pytest.raises(RunMismatch, match="'checkpoint_every': the run has 2, this node"):
            async with open_node(tiny_model(0), box, learner="y", config=other, options=FAST):
                pass


async def test_a_record_without_its_checkpoint_is_reported_and_not_followed() -> None:
    """Round 0 of a run with ``checkpoint_every`` 1 is committed (by a forger) with only its
    update: the learner reports one ``PollFailed`` naming the rule and stays at version 0,
    training on."""
    box = MemoryMailbox()
    model = tiny_model(1)
    sink = Recorder()
    every = msgspec.structs.replace(EVERY, checkpoint_every=1)
    trainer = Trainer(model, 1)
    with anyio.CancelScope() as leave:  # left by cancelling: no round can commit here
        async with open_node(
            model, box, learner="l", config=every, options=LEARNER_ONLY, sinks=[sink]
        ) as node:
            draft = RoundRecordDraft(
                round=0, fragment=0, version=1, committed_by="forger", participants=(),
                quorum_seconds=0.0, grace_seconds=0.0, cosine=None,
            )  # fmt: skip
            store = Store(box)
            update = await store.put_blob(b"not even a blob", "int8")
            assert (await store.put_record(RoundRecord.committed(draft, update=update)))[1]
            with anyio.fail_after(30):
                while not sink.of(PollFailed):
                    trainer.step()
                    await node.step(16)
                    await anyio.sleep(FAST.poll_interval)
                for _ in range(10):
                    trainer.step()
                    await node.step(16)
                    await anyio.sleep(FAST.poll_interval)
            assert node.state.versions == (0, 0)
            leave.cancel()
    reports = sink.of(PollFailed)
    assert len(reports) == 1
    error = reports[0].error  # type: ignore[attr-defined]
    assert isinstance(error, RecordError)
    assert "checkpoint_every is 1" in str(error)
    assert "names no θ or no outer-state blob" in str(error)
