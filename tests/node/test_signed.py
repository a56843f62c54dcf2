"""Signed runs: everything a keyed node writes is signed, keyless or wrongly keyed nodes
are refused, and a forged snapshot never reaches the model."""

import anyio
import msgspec
import pytest
from node_helpers import (
    CONFIG,
    FAST,
    assert_holds_committed,
    created_manifest,
    forged_snapshot,
    records,
    tiny_model,
    train,
)

from gradientmail._node import node as open_node
from gradientmail.errors import RunMismatch
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import Manifest, decode, encode
from gradientmail.protocol.signing import RunKey

pytestmark = pytest.mark.anyio

SECRET = "correct horse battery staple, twice over"


async def test_a_signed_run_signs_everything_and_rejects_forgeries() -> None:
    box = MemoryMailbox()
    key = RunKey(SECRET)
    finals = {}

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(
            model, box, learner=name, config=CONFIG, options=FAST, run_key=SECRET
        ) as node:
            await train(node, model, seed=seed, until_round=8)
        finals[name] = (model, node.state)

    async def forge() -> None:
        """Mallory can write to the bucket but has no key: a huge delta for every round."""
        manifest = await created_manifest(box)
        for round in range(2, 7):
            forged = await forged_snapshot(box, manifest, round, "mallory")
            await box.put_if_absent(keys.snapshot(round, "mallory"), encode(forged))

    async with anyio.create_task_group() as tg:
        tg.start_soon(member, "a", 0)
        tg.start_soon(member, "b", 1)
        tg.start_soon(forge)

    history = await records(box)
    run_id = decode(await box.get(keys.MANIFEST) or b"", Manifest).run_id
    assert isinstance(run_id, str)
    for record in history:
        assert "mallory" not in {p.learner for p in record.participants}
        data = await box.get(keys.record(record.round))
        assert data is not None
        assert key.check(keys.record(record.round), data, run=run_id) is None
    rejected = {r.round for r in history for x in r.rejected if x.learner == "mallory"}
    assert rejected
    assert all(
        x.reason == "unsigned" for r in history for x in r.rejected if x.learner == "mallory"
    )
    manifest_bytes = await box.get(keys.MANIFEST)
    assert manifest_bytes is not None
    assert decode(manifest_bytes, Manifest).key_id == key.key_id
    for name, (model, state) in finals.items():
        await assert_holds_committed(box, model, state.versions)
        for round in range(len(history)):
            snapshot = await box.get(keys.snapshot(round, name))
            if snapshot is not None:
                assert key.check(keys.snapshot(round, name), snapshot, run=run_id) is None

    with pytest.raises(RunMismatch, match="signed"):
        async with open_node(tiny_model(), box, learner="c", options=FAST):
            pass
    with pytest.raises(RunMismatch, match="another key"):
        async with open_node(tiny_model(), box, learner="c", options=FAST, run_key=SECRET + "!"):
            pass


async def test_a_keyed_node_refuses_an_unsigned_run() -> None:
    box = MemoryMailbox()
    async with open_node(tiny_model(), box, learner="a", config=CONFIG, options=FAST):
        pass
    with pytest.raises(RunMismatch, match="not signed"):
        async with open_node(tiny_model(), box, learner="b", options=FAST, run_key=SECRET):
            pass
    assert msgspec.json.decode(await box.get(keys.MANIFEST) or b"{}").get("key_id") is None
