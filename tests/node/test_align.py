"""Learners that step at different paces publish together: a round that waited
for its last participant tells the earlier ones how long (``Participant.arrived``), and they
move their schedule back (``Learner._held_back``). The rule is the unpaced learner's
(``overlap=None``); a paced one is held back by its wait at the overlap step instead.

Two learners with quorum 1.0: ``a`` takes ``TICK`` of simulated compute a step, ``b`` takes
``1.5 × TICK``, so ``a`` gains 4 steps (0.16 s) on ``b`` in every round (8 of ``b``'s
steps). Without the rule ``a``'s snapshots go out earlier and earlier until they wait most
of a period for ``b``'s; with it, each round ``a`` moves back by what it gained, and the
first and last snapshot of a round stay about one round's gain apart.
"""

import statistics

import anyio
import pytest
from node_helpers import FAST, Trainer, records, tiny_model

from gradientmail._node import node as open_node
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RoundRecord, RunConfig

pytestmark = [pytest.mark.anyio, pytest.mark.timing]

CONFIG = RunConfig(
    fragments=2, sync_every=16, grace=0.4, overlap=None, keep_versions=1000, keep_rounds=1000
)
TICK = 0.04
ROUNDS = 16
WARM = 8
"""Rounds left out of the check while ``a`` first moves back."""
SPREAD = 0.3
"""The most the median first-to-last spread of the checked rounds may be, in seconds: one
round's gain (0.16 s) and two polls' worth of noting (0.04 s); a learner that never moves
back gains past it within four rounds and waits most of a period (0.64 s of ``a``'s
steps) for ``b``'s snapshots."""


def spread(record: RoundRecord) -> float:
    arrived = [p.arrived for p in record.participants if isinstance(p.arrived, float)]
    assert len(arrived) == 2, record
    return max(arrived) - min(arrived)


async def test_learners_at_different_paces_publish_together() -> None:
    box = MemoryMailbox()
    stop = anyio.Event()
    created = anyio.Event()

    async def learner(name: str, seed: int, tick: float) -> None:
        model = tiny_model(seed)
        trainer = Trainer(model, seed)
        async with open_node(model, box, learner=name, config=CONFIG, options=FAST) as node:
            created.set()
            while not stop.is_set():
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(tick)
                if node.state.round >= ROUNDS:
                    stop.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner, "a", 1, TICK)
            await created.wait()  # "a" created the run: "b" joins it
            tg.start_soon(learner, "b", 2, 1.5 * TICK)
    history = [r for r in await records(box) if WARM <= r.round < ROUNDS]
    assert all(sorted(p.learner for p in r.participants) == ["a", "b"] for r in history)
    spreads = [round(spread(r), 3) for r in history]
    assert statistics.median(spreads) < SPREAD, [
        (r.round, [(p.learner, p.arrived, p.steps) for p in r.participants]) for r in history
    ]
