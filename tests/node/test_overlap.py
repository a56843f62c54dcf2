"""Rounds that pace the learners (``RunConfig.overlap``): each learner applies the version of
a round it published to exactly ``overlap`` steps after its snapshot, waiting for it when it
is late, so that what the run computes depends on the steps and not on the timing.

Two learners train the same steps on the same batches twice, each time with its own random
pauses between steps (one run's learner ``b`` several times slower than the other's): the
two runs commit the same rounds with the same participants and bit for bit the same θ.
This holds with the repeatable mode's ``overlap`` (2), with a larger one and with 0 (the
synchronous mode: every version applied before the step after its snapshot). Without overlap
(``overlap=None``) the same two runs apply versions at steps that depend on the timing and
their θ differ (the control that shows the timing does reach the numbers here).
"""

import random

import anyio
import msgspec
import pytest
from node_helpers import FAST, Trainer, records, tiny_model

from gradientmail._node import node as open_node
from gradientmail.events import Closing, Event, FragmentAligned
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RunConfig

pytestmark = pytest.mark.anyio

STEPS = 48
PAUSE = 0.01
"""The longest random pause between two steps of the faster learner."""
CONFIG = RunConfig.repeatable(
    fragments=2, sync_every=8, grace=1.0, keep_versions=1000, keep_rounds=1000
)
"""The repeatable mode (overlap 2)."""


async def run(
    config: RunConfig, pauses: dict[str, float], seed: int
) -> tuple[list[object], list[int | None], dict[str, float]]:
    """Learners ``a`` and ``b`` train ``STEPS`` steps each on one mailbox, ``b`` starting once
    ``a`` created the run and ``a`` stepping once ``b`` joined; between steps each sleeps a
    random time up to ``pauses[name]`` (drawn from ``seed``). Returns what the run
    committed (round, participants, θ), the lags of the versions they applied while
    training and the seconds each waited for them."""
    box = MemoryMailbox()
    created = anyio.Event()
    joined = anyio.Event()
    lags: list[int | None] = []
    waited: dict[str, float] = {}
    draws = random.Random(seed)

    closing: set[str] = set()

    def seen(event: Event) -> None:
        # The closing flush applies what is ready at once: only training steps are paced.
        if isinstance(event, Closing):
            closing.add(event.learner)
        if isinstance(event, FragmentAligned) and event.learner not in closing:
            lags.append(event.lag_steps)

    async def learner(name: str, seed: int) -> None:
        model = tiny_model(seed)
        trainer = Trainer(model, seed)
        async with open_node(
            model, box, learner=name, config=config, options=FAST, sinks=[seen]
        ) as node:
            (joined if name == "b" else created).set()
            await joined.wait()
            for _ in range(STEPS):
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(draws.uniform(0, pauses[name]))
            waited[name] = node.state.waited_seconds

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner, "a", 1)
            await created.wait()
            tg.start_soon(learner, "b", 2)
    committed = [
        (r.round, sorted((p.learner, p.steps) for p in r.participants), r.update.sha256, r.theta)
        for r in await records(box)
    ]
    return committed, lags, waited


@pytest.mark.parametrize(
    "overlap", [CONFIG.overlap, 3, 0], ids=["repeatable", "overlap-3", "synchronous"]
)
async def test_with_overlap_the_run_computes_the_same_whatever_the_timing(
    overlap: int | None,
) -> None:
    config = msgspec.structs.replace(CONFIG, overlap=overlap)
    first, lags, _ = await run(config, {"a": PAUSE, "b": PAUSE}, seed=1)
    again, _, waited = await run(config, {"a": PAUSE, "b": 6 * PAUSE}, seed=2)
    both = [r for r in first if [name for name, _ in r[1]] == ["a", "b"]]
    assert len(both) >= STEPS // 4 - 2, first  # every round of the training has both
    assert {lag for lag in lags if lag is not None} == {overlap}
    assert first == again
    # The faster learner waited for the slower one's rounds, and says so.
    assert waited["a"] > waited["b"] >= 0


async def test_without_overlap_the_same_runs_differ() -> None:
    unpaced = msgspec.structs.replace(CONFIG, overlap=None)
    first, _, _ = await run(unpaced, {"a": PAUSE, "b": PAUSE}, seed=1)
    again, _, waited = await run(unpaced, {"a": PAUSE, "b": 6 * PAUSE}, seed=2)
    # The rounds' members, their steps or their updates differ: the timing decided them.
    assert first != again
    assert waited == {"a": 0.0, "b": 0.0}
