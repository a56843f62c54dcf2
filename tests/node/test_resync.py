"""Runs resynchronize (issue 17): a learner that fell behind rejoins the others' rounds.

Two learners step at the same pace (``TICK`` of simulated compute a step); for a stretch of
``SLOW_STEPS`` steps one of them takes ``2 × TICK`` a step, which leaves its schedule
``SLOW_STEPS`` steps (``SLOW_STEPS × TICK`` = 0.56 s) behind the other's: more than the
run's grace (0.4 s), and less than a period (``sync_every × TICK`` = 1.28 s) minus the
grace, so its snapshots are neither in time nor early enough for the others' rounds. On
main it stays so for good: rounds alternate a, a, b, b, a, a, … (each learner's snapshots
open rounds the other reaches a grace too late). Then they are equal again: within ``N``
rounds of the end of the stretch, every round has both.
"""

import anyio
import msgspec
import pytest
from node_helpers import FAST, Trainer, records, tiny_model

from gradientmail._node import Node
from gradientmail._node import node as open_node
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RunConfig

pytestmark = pytest.mark.anyio

CONFIG = RunConfig(fragments=2, sync_every=32, grace=0.4, keep_versions=1000, keep_rounds=1000)
TICK = 0.04
SLOW_FROM, SLOW_STEPS = 40, 14
N = 4
"""Rounds after the end of the slow stretch within which every round has both learners."""
CHECKED = 8
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
