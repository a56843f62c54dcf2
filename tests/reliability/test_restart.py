"""A learner that restarts with its id before its earlier life's snapshots were closed.

Its new life publishes to a round whose snapshot key its old life already filled: the write
finds the key taken by other bytes, so it is a failed publish (``PublishFailed``) and the
new life's steps go out with the fragment's next round. The round takes the old life's
snapshot. Every step of the new life is then accounted for exactly once.
"""

from dataclasses import replace

import anyio
import msgspec
import pytest
from reliability_helpers import (
    CONFIG,
    FAST,
    Recorder,
    Trainer,
    assert_steps_accounted,
    history,
    tiny_model,
)

import gradientmail
from gradientmail.events import PublishFailed, SnapshotPublished
from gradientmail.mailbox import MemoryMailbox

pytestmark = pytest.mark.anyio

LEARNER_ONLY = replace(FAST, syncer=False)


class Leave(Exception):
    """Leaves the node's block without flushing, like a crash of the training loop."""


async def test_a_restarted_learner_never_claims_its_earlier_lifes_snapshot() -> None:
    box = MemoryMailbox()
    first, second = Recorder(), Recorder()

    async def first_life() -> None:
        model = tiny_model(0)
        async with gradientmail.node(
            model, box, learner="c", config=CONFIG, options=LEARNER_ONLY, sinks=[first]
        ) as node:
            trainer = Trainer(model, 0)
            with anyio.fail_after(30):
                while len(first.of(SnapshotPublished)) < CONFIG.fragments:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)
            raise Leave

    with pytest.raises(Leave):
        await first_life()
    old_rounds = {e.round for e in first.of(SnapshotPublished)}  # type: ignore[attr-defined]

    async def closer() -> None:
        """A syncer that starts once the new life has hit its old life's snapshot."""
        with anyio.fail_after(30):
            while not second.of(PublishFailed):  # noqa: ASYNC110
                await anyio.sleep(0.005)
        async with gradientmail.node(None, box, learner="s", options=FAST):
            await done.wait()

    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(closer)
        model = tiny_model(0)
        async with gradientmail.node(
            model, box, learner="c", options=LEARNER_ONLY, sinks=[second]
        ) as node:
            trainer = Trainer(model, 1)
            with anyio.fail_after(60):
                while node.state.round < 6:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)
        state = node.state
        done.set()

    failed = second.of(PublishFailed)
    assert {e.round for e in failed} <= old_rounds  # type: ignore[attr-defined]
    assert all("already holds another snapshot" in str(e.error) for e in failed)  # type: ignore[attr-defined]
    records = await history(box)
    old_steps = {e.round: e.steps for e in first.of(SnapshotPublished)}  # type: ignore[attr-defined]
    for record in records:
        if record.round in old_steps:
            (entry,) = [p for p in record.participants if p.learner == "c"]
            assert entry.steps == old_steps[record.round]
    # The new life's steps: each in one later round or one drop report, never twice.
    later = [
        msgspec.structs.replace(
            r, participants=tuple(p for p in r.participants if r.round not in old_rounds)
        )
        for r in records
    ]
    assert_steps_accounted("c", state.steps, state.tokens, second.events, later)
