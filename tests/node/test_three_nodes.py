"""Three nodes in one process on a MemoryMailbox train one model for 20+ rounds."""

import anyio
import pytest
from node_helpers import (
    CONFIG,
    FAST,
    Recorder,
    assert_holds_committed,
    assert_steps_accounted,
    commits_by_round,
    records,
    tiny_model,
    train,
)

from gradientmail._node import node as open_node
from gradientmail.events import Closed, Joined, RoundCommitted
from gradientmail.mailbox import MemoryMailbox

pytestmark = pytest.mark.anyio


async def test_three_nodes_train_together_and_a_late_joiner_holds_the_newest() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    finals: dict[str, tuple[object, object]] = {}

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(
            model, box, learner=name, config=CONFIG, options=FAST, sinks=[sink]
        ) as node:
            await train(node, model, seed=seed, until_round=22)
        finals[name] = (model, node.state)

    async with anyio.create_task_group() as tg:
        for seed, name in enumerate(("a", "b", "c")):
            tg.start_soon(member, name, seed)

    history = await records(box)
    assert len(history) >= 23
    # Exactly one commit per round, whoever made it, and every node took part.
    assert commits_by_round(sink.events) == {r.round: 1 for r in history}
    for record in history:
        assert record.version == record.round // CONFIG.fragments + 1
    assert {p.learner for r in history for p in r.participants} == {"a", "b", "c"}
    # The closer noted when it first listed every snapshot, the round's first at 0.
    for record in (r for r in history if r.participants):
        arrived = [p.arrived for p in record.participants]
        assert all(isinstance(a, float) and a >= 0.0 for a in arrived), record
    assert any(0.0 in (p.arrived for p in r.participants) for r in history)
    assert len(sink.of(Closed)) == 3
    for name, (model, state) in finals.items():
        await assert_holds_committed(box, model, state.versions)  # type: ignore[arg-type]
        assert_steps_accounted(name, state.steps, state.tokens, sink.events, history)  # type: ignore[attr-defined]

    # A node joining once everyone has left holds exactly the newest version of everything.
    newest = [max(r.version for r in history if r.fragment == f) for f in range(2)]
    late = tiny_model(seed=9)
    async with open_node(late, box, learner="late", options=FAST, sinks=[sink]) as node:
        assert node.state.versions == tuple(newest)
        await assert_holds_committed(box, late, newest)
    joined = [e for e in sink.of(Joined) if e.learner == "late"]
    assert joined[0].round == history[-1].round  # type: ignore[attr-defined]
    assert not [e for e in sink.of(RoundCommitted) if e.learner == "late"]
