"""A fleet of unequal machines (the adaptive schedule, ``RunConfig.overlap`` None): the fast
learners do not wait for a slow one, and the slow one's steps still reach the rounds.

Three learners on one mailbox, each step a ``TICK`` of simulated compute (a sleep), the
third four times as long. With the default, the fast learners wait on rounds for at most
``MAX_WAITING`` of their time, the slow learner takes part in the rounds with the steps it
has (its schedule runs four positions a step), and none of its steps is dropped. The same
fleet in the repeatable mode is the control: there every learner runs at the pace of the
slowest, and the fast ones spend most of their time waiting.
"""

import anyio
import pytest
from node_helpers import FAST, Trainer, records, tiny_model

from gradientmail._node import node as open_node
from gradientmail.events import Event, StepsDropped
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RunConfig

pytestmark = pytest.mark.anyio

TICK = 0.02
SPEEDS = {"a": 1, "b": 1, "c": 4}
TRAIN = 4.0
"""Seconds each learner trains."""
MAX_WAITING = 0.05
CONFIG = RunConfig(fragments=2, sync_every=16, grace=0.3)


async def fleet(config: RunConfig) -> tuple[dict[str, float], dict[str, int], list[object]]:
    """Every learner trains ``TRAIN`` seconds at its speed, then closes. Returns each one's
    share of its training time spent waiting, the steps each dropped, and the records."""
    box = MemoryMailbox()
    created = anyio.Event()
    joined: set[str] = set()
    everyone = anyio.Event()
    waiting: dict[str, float] = {}
    dropped = dict.fromkeys(SPEEDS, 0)

    def seen(event: Event) -> None:
        if isinstance(event, StepsDropped):
            dropped[event.learner] += event.steps

    async def learner(name: str, seed: int) -> None:
        model = tiny_model(seed)
        trainer = Trainer(model, seed)
        async with open_node(
            model, box, learner=name, config=config, options=FAST, sinks=[seen]
        ) as node:
            created.set()
            joined.add(name)
            if joined == set(SPEEDS):
                everyone.set()
            await everyone.wait()
            began = anyio.current_time()
            while anyio.current_time() - began < TRAIN:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(SPEEDS[name] * TICK)
            waiting[name] = node.state.waited_seconds / (anyio.current_time() - began)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner, "a", 1)
            await created.wait()
            tg.start_soon(learner, "b", 2)
            tg.start_soon(learner, "c", 3)
    return waiting, dropped, await records(box)


async def test_the_fast_learners_of_an_unequal_fleet_do_not_wait_for_the_slow_one() -> None:
    waiting, dropped, history = await fleet(CONFIG)
    assert waiting["a"] <= MAX_WAITING
    assert waiting["b"] <= MAX_WAITING
    assert dropped == dict.fromkeys(SPEEDS, 0)
    with_c = [r for r in history if "c" in {p.learner for p in r.participants}]
    # Four times slower, c covers a period in a quarter of the steps: it is in most rounds.
    assert len(with_c) >= len(history) // 2, [
        sorted(p.learner for p in r.participants) for r in history
    ]
    steps = {p.learner: p.steps for r in with_c[2:-2] for p in r.participants}
    assert steps["c"] < steps["a"]


async def test_the_repeatable_mode_paces_every_learner_at_the_slowest() -> None:
    waiting, dropped, _ = await fleet(RunConfig.repeatable(fragments=2, sync_every=16, grace=0.3))
    assert waiting["a"] > 0.3
    assert dropped == dict.fromkeys(SPEEDS, 0)
