"""One node alone on a MemoryMailbox: creates the run, commits rounds, closes aligned."""

import msgspec
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
from gradientmail.protocol.records import RunConfig
from gradientmail.protocol.sparse import sent_as

pytestmark = pytest.mark.anyio

TOPK = msgspec.structs.replace(
    CONFIG, delta_encoding="topk", update_encoding="topk", topk_chunk=64, outer_lr=2.0
)


@pytest.mark.parametrize(
    "config",
    [CONFIG, TOPK, msgspec.structs.replace(TOPK, overlap=0)],
    ids=["fp32", "topk", "topk-synchronous"],
)
async def test_one_node_commits_rounds_and_closes_aligned(config: RunConfig) -> None:
    """Under ``topk`` too, where until its final round the learner's weights hold what its
    deltas did not send: the final snapshots and updates, dense, leave it on the run's θ."""
    box = MemoryMailbox()
    sink = Recorder()
    model = tiny_model()
    async with open_node(
        model, box, learner="solo", config=config, options=FAST, sinks=[sink]
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
    last = {r.fragment: r for r in history}
    assert all(p.closing and not p.steps for r in last.values() for p in r.participants)
    encodings = {r.update.encoding for r in history if r is not last[r.fragment]}
    assert encodings == {config.update_encoding}
    assert {r.update.encoding for r in last.values()} == {sent_as(config, "update", final=True)}
    assert_steps_accounted("solo", state.steps, state.tokens, sink.events, history)
