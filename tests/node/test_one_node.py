"""One node alone on a MemoryMailbox: creates the run, commits rounds, closes aligned."""

import pytest
from node_helpers import (
    CONFIG,
    FAST,
    Recorder,
    assert_holds_committed,
    assert_steps_accounted,
    records,
    tiny_model,
    train,
)

from gradientmail._node import node as open_node
from gradientmail.events import Closed, Joined, RoundCommitted
from gradientmail.mailbox import MemoryMailbox

pytestmark = pytest.mark.anyio


async def test_one_node_commits_rounds_and_closes_aligned() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    model = tiny_model()
    async with open_node(
        model, box, learner="solo", config=CONFIG, options=FAST, sinks=[sink]
    ) as node:
        await train(node, model, seed=1, until_round=6)
    state = node.state
    history = await records(box)
    assert len(history) >= 7
    assert all(r.committed_by == "solo" for r in history)
    assert len(sink.of(RoundCommitted)) == len(history)
    assert sink.of(Joined)[0].round == -1
    assert sink.of(Closed)
    await assert_holds_committed(box, model, state.versions)
    assert_steps_accounted("solo", state.steps, state.tokens, sink.events, history)
