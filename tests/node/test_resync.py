"""Runs resynchronize: a learner that fell behind rejoins the others' rounds.

Two learners step at the same pace (``TICK`` of simulated compute a step); for a stretch of
``SLOW_STEPS`` steps one of them takes ``2 × TICK`` a step, which leaves its schedule
``SLOW_STEPS`` steps (``SLOW_STEPS × TICK`` = 0.56 s) behind the other's: more than the
run's grace (0.4 s), and less than a period (``sync_every × TICK`` = 1.28 s) minus the
grace, so its snapshots are neither in time nor early enough for the others' rounds. Without
resynchronization it stays so for good: rounds alternate a, a, b, b, a, a, … (each learner's
snapshots open rounds the other reaches a grace too late). Then they are equal again: within
``N`` rounds of the end of the stretch, every round has both.
"""

import anyio
import msgspec
import pytest
from node_helpers import FAST, Trainer, records, tiny_model

from gradientmail._node import Node
from gradientmail._node import node as open_node
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RunConfig

pytestmark = [pytest.mark.anyio, pytest.mark.timing]

CONFIG = RunConfig(fragments=2, sync_every=32, grace=0.4, keep_versions=1000, keep_rounds=1000)
TICK = 0.04
SLOW_FROM, SLOW_STEPS = 24, 14
N = 4
"""Rounds after the end of the slow stretch within which every round has both learners."""
CHECKED = 4
"""Rounds checked after those ``N``."""


@pytest.mark.parametrize("overlap", [None, 4], ids=["unpaced", "overlap-4"])
async def test_a_learner_that_fell_behind_rejoins_the_others_rounds_within_n_rounds(
    overlap: int | None,
) -> None:
    config = msgspec.structs.replace(CONFIG, overlap=overlap)
    box = MemoryMailbox()
    stop = anyio.Event()
    created = anyio.Event()
    caught_up: list[int] = []
    nodes: dict[str, Node] = {}

    async def learner(name: str, seed: int, slow: bool) -> None:
        model = tiny_model(seed)
        trainer = Trainer(model, seed)
        async with open_node(model, box, learner=name, config=config, options=FAST) as node:
            nodes[name] = node
            created.set()
            step = 0
            while not stop.is_set():
                trainer.step()
                await node.step(tokens=16)
                step += 1
                # The simulated compute of one step (twice as long during the stretch).
                late = slow and SLOW_FROM <= step < SLOW_FROM + SLOW_STEPS
                await anyio.sleep(2 * TICK if late else TICK)
                if slow and step == SLOW_FROM + SLOW_STEPS:
                    caught_up.append(max(n.state.round for n in nodes.values()))
                rounds = min(n.state.round for n in nodes.values())
                if caught_up and rounds >= caught_up[0] + N + CHECKED:
                    stop.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner, "a", 1, False)
            await created.wait()  # "a" created the run: "b" joins it
            tg.start_soon(learner, "b", 2, True)
    history = await records(box)
    first = caught_up[0] + N
    window = history[first : first + CHECKED]
    seen = {r.round: sorted(p.learner for p in r.participants) for r in history}
    assert len(window) == CHECKED
    assert all(seen[r.round] == ["a", "b"] for r in window), (
        f"rounds {first}..{first + CHECKED - 1} after the stretch ended at round "
        f"{caught_up[0]}: {seen}"
    )


RESTART = RunConfig(fragments=4, sync_every=128, grace=0.4, keep_versions=1000, keep_rounds=1000)
"""The adaptive schedule (the default overlap, None); a fragment comes due every 32 steps
(``INTERVAL``: 1.28 s of steps). A period of 64 steps left rounds without one learner
under a loaded machine (two other processes busy on two cores); this one does not."""
INTERVAL = RESTART.sync_every // RESTART.fragments


@pytest.mark.parametrize(
    "restart_at", [2 * INTERVAL + 2, 3 * INTERVAL - 2], ids=["after-a-round", "before-a-round"]
)
async def test_a_restarted_learner_rejoins_the_rounds_in_step(restart_at: int) -> None:
    """``b`` crashes (its node cancelled mid-training, as in ``test_membership``) and
    restarts at once with a fresh model while ``a`` is at step ``restart_at`` of its
    period: two steps after fragment 1's round came due, or two steps before fragment 2's
    does. ``b`` takes the next round at its first step (``fragments.joined_phase``): its
    first snapshot after the restart goes to the round after the newest it joined at, and
    every round from its ``N``-th on has both learners (``CHECKED`` of them are checked)."""
    box = MemoryMailbox()
    period = RESTART.sync_every
    a_ready = anyio.Event()
    crashed = anyio.Event()
    restart = anyio.Event()
    stop = anyio.Event()
    rejoined: list[int] = []

    async def a() -> None:
        model = tiny_model(1)
        trainer = Trainer(model, 1)
        async with open_node(model, box, learner="a", config=RESTART, options=FAST) as node:
            a_ready.set()
            while not stop.is_set():
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(TICK)
                if crashed.is_set() and node.state.steps % period == restart_at:
                    restart.set()
                if rejoined and node.state.round >= rejoined[0] + N + CHECKED:
                    stop.set()

    async def b() -> None:
        model = tiny_model(2)
        trainer = Trainer(model, 2)
        with anyio.CancelScope() as scope:
            async with open_node(model, box, learner="b", options=FAST) as node:
                for _ in range(2 * INTERVAL):
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(TICK)
                scope.cancel()
                await anyio.sleep_forever()
        crashed.set()
        await restart.wait()
        model = tiny_model(3)
        trainer = Trainer(model, 3)
        async with open_node(model, box, learner="b", options=FAST) as node:
            rejoined.append(node.state.round)
            while not stop.is_set():
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(TICK)

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a)
            await a_ready.wait()
            tg.start_soon(b)
    history = await records(box)
    seen = {r.round: sorted(p.learner for p in r.participants) for r in history}
    first = rejoined[0] + N
    window = history[first : first + CHECKED]
    assert len(window) == CHECKED
    assert all(seen[r.round] == ["a", "b"] for r in window), (
        f"rounds {first}..{first + CHECKED - 1} after b rejoined at round {rejoined[0]}: {seen}"
    )
    b_first = min(r.round for r in history if r.round > rejoined[0] and "b" in seen[r.round])
    assert b_first == rejoined[0] + 1, seen
