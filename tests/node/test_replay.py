"""A sharded group's followers run the leader's learner by replaying its log
(``LearnerDriver.replay``): a second driver, on a second copy of the model trained on the
same batches, fed only the log a real node's learner recorded, ends in the same learner
state and on the very bits of the leader's model, through every merge and the close."""

import pytest
import torch
from node_helpers import CONFIG, FAST, Trainer, tiny_model, train

from gradientmail._node import node as open_node
from gradientmail._node.group_member import fragment_params
from gradientmail._node.learner_driver import LearnerDriver
from gradientmail._node.runtime import Runtime
from gradientmail.clock import MonotonicClock
from gradientmail.events import Event
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.learner import Learner
from gradientmail.protocol.learner_inputs import Input, RecordSeen, Stepped, VersionReady
from gradientmail.reader import RunReader
from gradientmail.store import Store

pytestmark = pytest.mark.anyio


async def test_a_follower_replaying_the_log_ends_on_the_leaders_model() -> None:
    model = tiny_model()
    mailbox = MemoryMailbox()
    async with open_node(model, mailbox, learner="a", config=CONFIG, options=FAST) as node:
        driver = node._driver  # the node's own driver: what a sharded leader records
        assert driver is not None
        log = driver.record()
        await train(node, model, seed=0, until_round=6)
    leader = driver.state  # after the close
    ready = [entry for entry in log if isinstance(entry, VersionReady)]
    assert ready, "no version reached the learner"

    reader = RunReader(Store(mailbox))
    manifest = await reader.manifest()
    versions = {e.record.round: e.record.version for e in log if isinstance(e, RecordSeen)}
    thetas = {}
    for entry in ready:
        rebuilt = await reader.rebuild(entry.fragment, versions[entry.round], manifest=manifest)
        assert rebuilt is not None
        thetas[entry.fragment, entry.round] = rebuilt.theta
    start = await reader.newest(manifest, initial=True)

    twin = tiny_model()
    events: list[Event] = []
    rt = Runtime("a", Store(mailbox), manifest, FAST, MonotonicClock(), events.append)
    named = list(twin.named_parameters())
    follower = LearnerDriver(
        rt,
        Learner.start(CONFIG, "a", start.versions, start.thetas, -1),
        fragment_params(manifest, named),
        lambda: None,
    )
    trainer = Trainer(twin, seed=0)
    batch: list[Input] = []
    for entry in log:
        # The follower trains its own batch between two steps, as a rank does.
        if isinstance(entry, Stepped):
            follower.replay(batch, lambda f, r: thetas[f, r])
            batch = []
            trainer.step()
        batch.append(entry)
    follower.replay(batch, lambda f, r: thetas[f, r])
    follower.close_jobs()
    await follower.run_publisher()  # its snapshots are the leader's: the same bits

    state = follower.state
    assert (state.versions, state.step, state.tokens) == (
        leader.versions,
        leader.step,
        leader.tokens,
    )
    assert (state.newest_round, state.committed, state.finished) == (
        leader.newest_round,
        leader.committed,
        leader.finished,
    )
    for (name, ours), (_, theirs) in zip(named, model.named_parameters(), strict=True):
        assert torch.equal(ours, theirs), f"{name} differs after the replay"
