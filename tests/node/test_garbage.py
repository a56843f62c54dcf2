"""Garbage collection: old snapshots, claims and unreferenced θ/outer/update blobs go;
round records stay; a node joining afterwards still finds everything it needs."""

import anyio
import msgspec
import pytest
from node_helpers import (
    CONFIG,
    FAST,
    assert_holds_committed,
    records,
    tiny_model,
    train,
    wait_until,
)

from gradientmail._node import node as open_node
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import retained
from gradientmail.protocol.records import Manifest, decode
from gradientmail.reader import RunReader
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

SMALL = msgspec.structs.replace(CONFIG, keep_rounds=4, keep_versions=2, checkpoint_every=3)


async def test_old_objects_are_collected_and_records_kept() -> None:
    """After the run, what ``checkpoint.retained`` leaves out is gone (snapshots, claims and
    blobs no kept object names), and what it keeps rebuilds every fragment's newest version
    with its momentum, and lets a late joiner in."""
    box = MemoryMailbox()

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(model, box, learner=name, config=SMALL, options=FAST) as node:
            await train(node, model, seed=seed, until_round=16)

    async with anyio.create_task_group() as tg:
        tg.start_soon(member, "a", 0)
        tg.start_soon(member, "b", 1)

    history = await records(box)  # contiguous from round 0: no record was deleted
    last = history[-1].round
    kept = retained(last, SMALL)
    present = set(await box.list(""))
    for round in range(last + 1):
        if round not in kept.snapshots:
            assert not [k for k in present if k.startswith(keys.round_prefix(round))], round

    manifest_bytes = await box.get(keys.MANIFEST)
    assert manifest_bytes is not None
    manifest = decode(manifest_bytes, Manifest)
    named: set[str] = {ref.sha256 for ref in manifest.theta0}
    for record in history:
        if record.round in kept.records:
            named |= {ref.sha256 for ref in (record.theta, record.outer, record.update) if ref}
    for record in history:
        if record.round not in kept.records:
            for ref in (record.theta, record.outer, record.update):
                if ref is not None and ref.sha256 not in named:
                    assert keys.blob(ref.sha256) not in present, f"round {record.round}"

    reader = RunReader.of(box)
    for record in history[-SMALL.fragments :]:
        rebuilt = await reader.rebuild(record.fragment, record.version, momentum=True)
        assert rebuilt is not None, record.round
        assert rebuilt.momentum is not None, record.round

    late = tiny_model(5)
    async with open_node(late, box, learner="late", options=FAST) as node:
        await assert_holds_committed(box, late, node.state.versions)


async def test_a_snapshot_landing_in_a_collected_round_goes_with_a_later_collection() -> None:
    """A slow learner's snapshot (here junk at its key) lands in a round after that round's
    keys were collected: a later collection takes it (``garbage.stale``) instead of leaving
    it for good."""
    box = MemoryMailbox()
    late = keys.snapshot(1, "slow")
    planted = anyio.Event()

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(model, box, learner=name, config=SMALL, options=FAST) as node:
            await train(node, model, seed=seed, until_round=24)

    async def collected() -> bool:
        newest = await records(box)
        if not newest or 1 in retained(newest[-1].round, SMALL).snapshots:
            return False
        return not await box.list(keys.round_prefix(1))

    async def plant() -> None:
        await wait_until(collected, limit=60)
        assert await box.put_if_absent(late, b"late")
        planted.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(plant)
        tg.start_soon(member, "a", 0)
        tg.start_soon(member, "b", 1)
    assert planted.is_set()
    assert late not in await box.list(keys.round_prefix(1))


async def test_rounds_that_change_nothing_name_blobs_of_their_own() -> None:
    """Learners whose model does not move (frozen parameters, say) publish zero deltas, and
    their rounds commit zero updates: equal payloads round after round. Each round's blobs
    are still its own (no two rounds' records or snapshots name one blob), so collecting a
    round never deletes a blob a round being committed or published names; the newest
    versions rebuild."""
    box = MemoryMailbox()
    named: dict[str, int] = {}

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(model, box, learner=name, config=SMALL, options=FAST) as node:
            with anyio.fail_after(60):
                while node.state.round < 12:
                    await node.step(tokens=16)
                    await anyio.sleep(0.001)

    async def watch() -> None:
        store = Store(box)
        while True:
            for key in await box.list(keys.ROUNDS):
                parsed = keys.parse_snapshot(key)
                if parsed is None:
                    continue
                for snapshot, _ in await store.snapshots(parsed[0]):
                    for ref in snapshot.blobs:
                        assert named.setdefault(ref.sha256, snapshot.round) == snapshot.round
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        async with anyio.create_task_group() as members:
            members.start_soon(member, "a", 0)
            members.start_soon(member, "b", 1)
        tg.cancel_scope.cancel()

    history = await records(box)
    assert len(named) >= 8, named
    for record in history:
        for ref in (record.theta, record.outer, record.update):
            if ref is not None:
                assert named.setdefault(ref.sha256, record.round) == record.round, record.round
    reader = RunReader.of(box)
    for record in history[-SMALL.fragments :]:
        rebuilt = await reader.rebuild(record.fragment, record.version, momentum=True)
        assert rebuilt is not None, record.round
