"""Who closes rounds: takeover of a cancelled claimant, syncer-only nodes, learners that
do not sync."""

import anyio
import msgspec
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
    wait_until,
)

import gradientmail.node as gm_node
from gradientmail.events import (
    FollowingRound,
    RoundClaimed,
    RoundCommitted,
    TookOverRound,
)
from gradientmail.mailbox import MemoryMailbox
from gradientmail.node import NodeOptions
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

LEARNER_ONLY = NodeOptions(
    poll_interval=FAST.poll_interval,
    lease_every=FAST.lease_every,
    lease_timeout=FAST.lease_timeout,
    close_timeout=FAST.close_timeout,
    syncer=False,
)


async def test_a_cancelled_claimant_is_taken_over_and_the_round_commits_once() -> None:
    box = MemoryMailbox()
    store = Store(box)
    sink = Recorder()
    # Every syncer counts only learners, so quorum_fraction=1.0 needs both learners.
    config = msgspec.structs.replace(CONFIG, quorum_fraction=1.0)
    async with gm_node.node(
        tiny_model(), box, learner="creator", config=config, options=LEARNER_ONLY
    ):
        pass

    async with anyio.create_task_group() as tg:
        first = anyio.CancelScope()

        async def syncer(name: str, scope: anyio.CancelScope) -> None:
            with scope:
                async with gm_node.node(None, box, learner=name, options=FAST, sinks=[sink]):
                    await anyio.sleep_forever()

        tg.start_soon(syncer, "s1", first)

        async def claimed() -> bool:
            return await store.round_claims(0) == [(0, "s1")]

        await wait_until(claimed)
        second = anyio.CancelScope()
        tg.start_soon(syncer, "s2", second)

        async def following() -> bool:
            return any(e.learner == "s2" for e in sink.of(FollowingRound))

        await wait_until(following)
        first.cancel()  # s1 is mid-close: it holds round 0 and waits for snapshots

        finals = {}

        async def learner(name: str, seed: int) -> None:
            model = tiny_model(seed)
            async with gm_node.node(
                model, box, learner=name, options=LEARNER_ONLY, sinks=[sink]
            ) as node:
                await train(node, model, seed=seed, until_round=6)
            finals[name] = (model, node.state)

        async with anyio.create_task_group() as learners:
            learners.start_soon(learner, "l1", 1)
            learners.start_soon(learner, "l2", 2)
        second.cancel()

    history = await records(box)
    assert history[0].committed_by == "s2"
    assert await store.round_claims(0) == [(0, "s1"), (1, "s2")]
    takeovers = sink.of(TookOverRound)
    assert [(e.round, e.cause, e.claimants) for e in takeovers][:1] == [(0, "lease_gone", ("s1",))]  # type: ignore[attr-defined]
    assert commits_by_round(sink.events) == {r.round: 1 for r in history}
    # Only syncer-only nodes closed rounds, and both learners took part in every round.
    assert {e.learner for e in sink.of(RoundCommitted)} <= {"s2"}
    assert {e.learner for e in sink.of(RoundClaimed)} <= {"s1", "s2"}
    assert {p.learner for r in history for p in r.participants} == {"l1", "l2"}
    for name, (model, state) in finals.items():
        await assert_holds_committed(box, model, state.versions)
        assert_steps_accounted(name, state.steps, state.tokens, sink.events, history)
