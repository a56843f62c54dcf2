"""A node's syncer looks at the round it holds once its own learner's snapshot is in the
store (``_node.runtime.Nudge``), not at its next idle poll (``poll_interval``)."""

from dataclasses import replace

import anyio
import pytest
from node_helpers import FAST, Trainer, records, tiny_model

from gradientmail._node import node as open_node
from gradientmail._node.runtime import Nudge
from gradientmail.clock import MonotonicClock
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RunConfig

pytestmark = pytest.mark.anyio

CONFIG = RunConfig(fragments=2, sync_every=4, grace=0.2)
IDLE = 30.0
"""The idle poll: a round that waited for it would not close within the test's deadline."""


async def test_a_learner_s_own_syncer_closes_its_round_once_it_published() -> None:
    """One learner that is its own syncer, polling every ``IDLE`` seconds when nothing is
    due: six rounds and the close's within 20 s, each round closed once its snapshot was
    in the store (without the nudge the first round alone waits ``IDLE``)."""
    box = MemoryMailbox()
    model = tiny_model(0)
    trainer = Trainer(model, 0)
    options = replace(FAST, poll_interval=IDLE)
    with anyio.fail_after(20):
        async with open_node(model, box, learner="solo", config=CONFIG, options=options) as node:
            while node.state.round < 6:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.01)
    history = await records(box)
    assert len(history) >= 6
    assert all([p.learner for p in r.participants] == ["solo"] for r in history[:6])


async def test_a_nudge_ends_the_pause_under_way_or_the_next_and_is_consumed() -> None:
    nudge, clock = Nudge(), MonotonicClock()
    nudge.set()
    with anyio.fail_after(5):
        await nudge.pause(clock, IDLE)  # set before the pause: it returns at once
    ended = anyio.Event()

    async def pausing() -> None:
        await nudge.pause(clock, IDLE)
        ended.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pausing)
            await anyio.wait_all_tasks_blocked()
            assert not ended.is_set()
            nudge.set()
    with anyio.move_on_after(0.2) as waited:
        await nudge.pause(clock, IDLE)  # consumed: this one sleeps its time
    assert waited.cancelled_caught
