"""Joining late, restarting with the same id, and a model that does not fit the run."""

import anyio
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
    wait_until,
)
from torch import nn

from gradientmail._node import NodeState
from gradientmail._node import node as open_node
from gradientmail.errors import RunMismatch
from gradientmail.events import Joined, LeaseReleased
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RunConfig
from gradientmail.store import Store

pytestmark = pytest.mark.anyio


async def test_a_node_joining_at_round_10_catches_up_and_takes_part() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    finals: dict[str, tuple[nn.Module, NodeState]] = {}

    async def member(name: str, seed: int, start_at: int) -> None:
        if start_at:

            async def started() -> bool:
                return len(await Store(box).record_rounds()) > start_at

            await wait_until(started)
        model = tiny_model(seed)
        async with open_node(
            model, box, learner=name, config=CONFIG, options=FAST, sinks=[sink]
        ) as node:
            await train(node, model, seed=seed, until_round=24)
        finals[name] = (model, node.state)

    async with anyio.create_task_group() as tg:
        for seed, name in enumerate(("a", "b", "c")):
            tg.start_soon(member, name, seed, 0)
        tg.start_soon(member, "late", 7, 10)

    history = await records(box)
    joined = next(e for e in sink.of(Joined) if e.learner == "late")
    assert joined.round >= 10  # type: ignore[attr-defined]
    late_rounds = [r.round for r in history if any(p.learner == "late" for p in r.participants)]
    assert late_rounds
    assert min(late_rounds) > joined.round  # type: ignore[attr-defined]
    for name, (model, state) in finals.items():
        await assert_holds_committed(box, model, state.versions)
        assert_steps_accounted(name, state.steps, state.tokens, sink.events, history)


async def test_a_node_restarted_with_the_same_id_resumes() -> None:
    box = MemoryMailbox()
    store = Store(box)
    sink = Recorder()
    model = tiny_model(0)
    async with open_node(
        model, box, learner="a", config=CONFIG, options=FAST, sinks=[sink]
    ) as node:
        await train(node, model, seed=0, until_round=5)
    first = node.state
    assert await store.leases() == {}

    # Restarted from scratch (a fresh model), as after a crash: cancelled mid-training.
    model = tiny_model(5)
    with anyio.CancelScope() as scope:
        async with open_node(model, box, learner="a", options=FAST, sinks=[sink]) as node:
            assert node.state.versions == first.versions
            await assert_holds_committed(box, model, first.versions)
            await train(node, model, seed=1, until_round=first.round + 4)
            scope.cancel()
            await anyio.sleep_forever()
    assert await store.leases() == {}

    model = tiny_model(6)
    async with open_node(model, box, learner="a", options=FAST, sinks=[sink]) as node:
        await train(node, model, seed=2, until_round=node.state.round + 4)
    history = await records(box)
    assert len(history) > first.round + 8
    await assert_holds_committed(box, model, node.state.versions)
    assert len([e for e in sink.of(LeaseReleased) if e.learner == "a"]) == 3


async def test_a_different_model_or_config_is_refused_and_the_run_goes_on() -> None:
    box = MemoryMailbox()
    model = tiny_model(0)
    async with open_node(model, box, learner="a", config=CONFIG, options=FAST) as node:
        await train(node, model, seed=0, until_round=2)
        before = sorted(await box.list(""))
        with pytest.raises(RunMismatch, match=r"0\.weight"):
            async with open_node(tiny_model(0, hidden=17), box, learner="b", options=FAST):
                pytest.fail("a mismatched model joined")
        wrong = RunConfig(fragments=CONFIG.fragments, sync_every=8)
        with pytest.raises(RunMismatch, match="sync_every"):
            async with open_node(tiny_model(0), box, learner="b", config=wrong, options=FAST):
                pytest.fail("a mismatched config joined")
        # Nothing of b's reached the store; a keeps training and committing.
        after = await box.list("")
        assert not [key for key in after if "b" in key.split("/")]
        assert set(before) <= set(after) | {k for k in before if k.startswith("leases/")}
        await train(node, model, seed=0, until_round=node.state.round + 3)
    await assert_holds_committed(box, model, node.state.versions)
