"""``preview``'s costs against what a real run moves and keeps: two learners, one of them
also the syncer that closes every round, on a shared in-memory store whose puts are counted
per node by kind."""

import collections

import anyio
import pytest
import torch
from node_helpers import FAST, LEARNER_ONLY, Recorder, SharedView, records, train, wait_until
from torch import nn

from gradientmail import preview
from gradientmail._node import node as open_node
from gradientmail.events import CreatingRun
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import RunConfig

pytestmark = pytest.mark.anyio

CONFIG = RunConfig(fragments=2, sync_every=4, grace=0.3)


class Counted(SharedView):
    """One node's view of a shared ``MemoryMailbox``, counting what it puts by kind."""

    def __init__(self, shared: MemoryMailbox) -> None:
        super().__init__(shared)
        self.puts: collections.Counter[str] = collections.Counter()

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        written = await super().put_if_absent(key, data)
        if keys.parse_snapshot(key) is not None:
            self.puts["snapshot"] += 1
        elif keys.parse_lease(key) is None:
            self.puts[key.split("/")[0]] += 1
        return written


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 1))


def near(measured: float, predicted: float, within: float) -> bool:
    return abs(measured - predicted) <= within * predicted


async def test_preview_costs_are_what_a_run_moves_and_keeps() -> None:
    shared = MemoryMailbox()
    shown = preview(model().named_parameters(), CONFIG, learners=2)
    run = shown.costs()
    sink = Recorder()
    boxes = {"syncer": Counted(shared), "learner": Counted(shared)}
    states = {}

    async def learner(name: str, seed: int) -> None:
        trained = model()
        options = FAST if name == "syncer" else LEARNER_ONLY
        async with open_node(
            trained, boxes[name], learner=name, config=CONFIG, options=options, sinks=[sink]
        ) as node:
            await train(node, trained, seed=seed, until_round=30)
        states[name] = node.state

    async def created() -> bool:
        return await shared.get(keys.MANIFEST) is not None

    async with anyio.create_task_group() as tg:
        tg.start_soon(learner, "syncer", 1)
        await wait_until(created)
        tg.start_soon(learner, "learner", 2)
    # The creator reports the split it makes, which is preview's.
    (created,) = sink.of(CreatingRun)
    assert created.pattern == "even"
    assert created.sizes == tuple(f.params for f in shown.fragments)
    history = await records(shared)
    rounds = len(history)
    published = {
        name: sum(p.learner == name for r in history for p in r.participants) for name in boxes
    }
    # A learner's puts are its deltas and snapshots, two a round it publishes in (a delta
    # whose round closed before its snapshot was written is not followed by one); closing a
    # round is a claim, the update, its index and the record, and a checkpoint's three more.
    plain = boxes["learner"].puts
    assert plain["snapshot"] >= published["learner"] > rounds // 2, (plain, published, rounds)
    assert near(sum(plain.values()), run.learner_requests["put"] * plain["snapshot"], 0.1), plain
    mine = boxes["syncer"].puts
    closing = sum(mine.values()) - run.learner_requests["put"] * mine["snapshot"]
    assert near(closing, run.syncer_requests["put"] * rounds + CONFIG.fragments, 0.1)
    # Bytes: the learner alone moves its deltas up, the updates and Θ⁰ down.
    alone = states["learner"]
    assert near(alone.bytes_published, plain["snapshot"] * run.learner_up, 0.03)
    assert near(alone.bytes_downloaded, rounds * run.learner_down + run.creation, 0.1)
    both = states["syncer"]
    up = mine["snapshot"] * run.learner_up + rounds * run.syncer_up + run.creation
    assert near(both.bytes_published, up, 0.1), (both.bytes_published, up)
    down = rounds * (run.learner_down + run.syncer_down)
    assert near(both.bytes_downloaded, down, 0.1), (both.bytes_downloaded, down)
    # What the store holds once the run is over: what collection keeps, and every record.
    stored = 0
    for key in await shared.list(""):
        data = await shared.get(key)
        stored += len(data or b"")
    least, most = run.storage
    assert 0.9 * least <= stored <= 1.1 * most + rounds * run.record_bytes, (stored, run.storage)
