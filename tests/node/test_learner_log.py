"""The leader's log (``LearnerDriver.record``), what a sharded group's ranks will replay: once
recording, every input of a real node's learner is logged in the order it was fed (its
steps, the records it saw, each publish's end, the versions prepared, the close), and the
log survives its encoding with the real records in it."""

import pytest
from node_helpers import CONFIG, FAST, tiny_model, train

from gradientmail._node import node as open_node
from gradientmail.events import Event, SnapshotPublished
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.group import decode_log, encode_log
from gradientmail.protocol.learner_inputs import (
    BeganClosing,
    Finalized,
    Flushed,
    PublishEnded,
    RecordSeen,
    Stepped,
    VersionReady,
)

pytestmark = pytest.mark.anyio


async def test_every_input_of_the_learner_is_logged_in_order() -> None:
    published: list[SnapshotPublished] = []

    def sink(event: Event) -> None:
        if isinstance(event, SnapshotPublished):
            published.append(event)

    model = tiny_model()
    mailbox = MemoryMailbox()
    async with open_node(
        model, mailbox, learner="a", config=CONFIG, options=FAST, sinks=[sink]
    ) as node:
        driver = node._driver  # the node's own driver: what a sharded leader records
        assert driver is not None
        log = driver.record()
        await train(node, model, seed=0, until_round=6)
        steps = node.state.steps
    kinds = [type(entry) for entry in log]
    assert kinds.count(Stepped) == steps
    seen = [entry.record.round for entry in log if isinstance(entry, RecordSeen)]
    assert seen == list(range(seen[0], seen[0] + len(seen)))
    assert len(seen) >= 6
    ended = [entry for entry in log if isinstance(entry, PublishEnded)]
    assert [(e.fragment, e.round) for e in ended if e.ok] == [
        (p.fragment, p.round) for p in published
    ]
    ready = [(e.fragment, e.round) for e in log if isinstance(e, VersionReady)]
    assert ready, "no version was logged as prepared"
    assert all(round in seen for _, round in ready)
    assert BeganClosing in kinds
    assert Flushed in kinds
    assert kinds.index(BeganClosing) < kinds.index(Finalized)
    assert all(
        entry.now <= later.now
        for entry, later in zip(
            [e for e in log if isinstance(e, Stepped)],
            [e for e in log if isinstance(e, Stepped)][1:],
            strict=False,
        )
    )
    assert decode_log(encode_log(log)) == log
