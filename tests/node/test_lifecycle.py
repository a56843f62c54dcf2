"""The node's lifecycle: a synchronous trainer in a thread, events, cancellation, failure."""

import threading

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from node_helpers import (
    CONFIG,
    FAST,
    Recorder,
    Trainer,
    assert_holds_committed,
    assert_steps_accounted,
    records,
    tiny_model,
    train,
    wait_until,
)

from gradientmail._node import StepHandle
from gradientmail._node import node as open_node
from gradientmail.errors import NodeFailed
from gradientmail.events import (
    Closed,
    Closing,
    FragmentAligned,
    LeaseReleased,
    SnapshotPublished,
    StepsDropped,
)
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import RunConfig
from gradientmail.store import Store

pytestmark = pytest.mark.anyio


async def test_a_synchronous_trainer_runs_in_a_thread_and_events_stream() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    model = tiny_model()
    seen: list[object] = []
    async with (
        open_node(model, box, learner="solo", config=CONFIG, options=FAST, sinks=[sink]) as node,
        anyio.create_task_group() as tg,
    ):

        async def watch() -> None:
            async with node.events() as events:
                async for event in events:
                    seen.append(event)
                    if isinstance(event, FragmentAligned) and event.version >= 3:
                        return

        tg.start_soon(watch)
        await anyio.lowlevel.checkpoint()
        trainer = Trainer(model, seed=1)

        def loop(handle: StepHandle) -> int:
            while handle.node.state.round < 8:
                trainer.step()
                handle.step(16)
            return handle.node.state.steps

        steps = await node.run_in_thread(loop)
    assert steps == node.state.steps > 0
    assert any(isinstance(e, FragmentAligned) and e.version >= 3 for e in seen)
    history = await records(box)
    await assert_holds_committed(box, model, node.state.versions)
    assert_steps_accounted("solo", node.state.steps, node.state.tokens, sink.events, history)


async def test_a_step_with_nothing_due_is_counted_without_the_event_loop() -> None:
    """``handle.step`` counts a step that applies nothing and snapshots nothing on the
    training thread itself: while the event loop's thread is held (blocked, not awaiting),
    the first eleven steps of a run that syncs every 12 steps all return; the twelfth,
    whose fragment is due, waits for the loop, and goes through once the loop runs again."""
    box = MemoryMailbox()
    sink = Recorder()
    model = tiny_model()
    config = RunConfig(fragments=1, sync_every=12, grace=0.3)
    started = anyio.Event()
    holding, quiet, due = threading.Event(), threading.Event(), threading.Event()
    async with (
        open_node(model, box, learner="solo", config=config, options=FAST, sinks=[sink]) as node,
        anyio.create_task_group() as tg,
    ):
        trainer = Trainer(model, seed=1)

        def loop(handle: StepHandle) -> None:
            anyio.from_thread.run_sync(started.set)
            assert holding.wait(timeout=30.0)
            for _ in range(11):
                trainer.step()
                handle.step(16)
            quiet.set()
            trainer.step()
            handle.step(16)
            due.set()

        tg.start_soon(node.run_in_thread, loop)
        with anyio.fail_after(30):
            await started.wait()
        # Hold the loop's thread from here: nothing below awaits until the training thread
        # has had its chance at every step.
        holding.set()
        held_through_quiet = quiet.wait(timeout=10.0)
        due_while_held = due.wait(timeout=0.3)
        assert held_through_quiet, "a step with nothing due waited for the event loop"
        assert not due_while_held, "the step with a fragment due did not go through the loop"
    assert due.is_set()
    assert node.state.steps == 12
    assert [(e.round, e.steps) for e in sink.of(SnapshotPublished)][:1] == [(0, 12)]


async def test_cancelling_mid_training_leaves_nothing_behind() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    tasks_before = len(anyio.get_running_tasks())
    threads_before = {t.ident for t in threading.enumerate()}
    model = tiny_model()
    with anyio.CancelScope() as scope:
        async with open_node(
            model, box, learner="solo", config=CONFIG, options=FAST, sinks=[sink]
        ) as node:
            trainer = Trainer(model, seed=1)

            def loop(handle: StepHandle) -> None:
                while True:
                    trainer.step()
                    handle.step(16)
                    if handle.node.state.round >= 3:
                        anyio.from_thread.run_sync(scope.cancel)

            await node.run_in_thread(loop)
    assert scope.cancelled_caught
    assert len(anyio.get_running_tasks()) == tasks_before
    # Worker threads go back to anyio's pool, idle; none runs node code afterwards.
    for thread in threading.enumerate():
        if thread.ident not in threads_before:
            assert "worker" in thread.name.lower() or thread.name.startswith("Trio thread")
    assert await Store(box).leases() == {}
    assert sink.of(LeaseReleased)
    assert [e.flushing for e in sink.of(Closing)] == [False]
    history = await records(box)
    state = node.state
    assert any(isinstance(e, StepsDropped) for e in sink.events) or state.steps == 0
    # In-flight snapshots may still be committed after the drop report; count only what
    # the node had not handed over.
    assert all(r.round <= state.round + 2 for r in history)


class BreakingMailbox(MemoryMailbox):
    """Lists ``records/`` fine until ``armed``, then raises an error no layer expects."""

    armed = False

    async def list(self, prefix: str, *, after: str = "") -> list[str]:  # type: ignore[override]
        if self.armed and prefix == "records/":
            raise RuntimeError("the store broke in a way nobody expected")
        return list(await super().list(prefix, after=after))


EVALUATION = 30.0
"""How long the body below "evaluates" without stepping: the block must end long before."""


async def test_a_failed_task_is_raised_by_the_next_step() -> None:
    box = BreakingMailbox()
    model = tiny_model()

    async def run() -> None:
        async with open_node(model, box, learner="solo", config=CONFIG, options=FAST) as node:
            await train(node, model, seed=1, until_round=1)
            box.armed = True

            async def never() -> bool:
                await node.step(16)
                return False

            await wait_until(never, limit=10)

    with pytest.raises(NodeFailed) as failed:
        await run()
    assert isinstance(failed.value.__cause__, RuntimeError)


async def test_a_task_failing_while_the_body_waits_raises_node_failed_from_the_block() -> None:
    """The body stops stepping to "evaluate" for 30 s; the receive task fails meanwhile.
    The body is cancelled at its await and the block raises ``NodeFailed`` itself (not an
    ``ExceptionGroup``), within a few poll intervals rather than 30 s."""
    box = BreakingMailbox()
    model = tiny_model()
    sink = Recorder()
    evaluated = False

    async def run() -> None:
        nonlocal evaluated
        async with open_node(
            model, box, learner="solo", config=CONFIG, options=FAST, sinks=[sink]
        ) as node:
            await train(node, model, seed=1, until_round=1)
            box.armed = True
            await anyio.sleep(EVALUATION)  # the evaluation: the body waits, steps nothing
            evaluated = True

    with anyio.fail_after(EVALUATION / 3), pytest.raises(NodeFailed) as failed:
        await run()
    assert type(failed.value) is NodeFailed
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert not evaluated
    assert [e.flushing for e in sink.of(Closing)] == [False]
    assert all(e.detail == "the node failed" for e in sink.of(StepsDropped))
    assert all(e.reason == "closed-without-flush" for e in sink.of(StepsDropped))


async def test_a_thread_training_in_run_in_thread_is_stopped_when_the_node_fails() -> None:
    """A thread stepping through ``run_in_thread``: its next ``handle.step`` after the
    failure raises ``NodeFailed`` out of it, and so does the block."""
    box = BreakingMailbox()
    model = tiny_model()
    seen: list[BaseException] = []

    async def run() -> None:
        async with open_node(model, box, learner="solo", config=CONFIG, options=FAST) as node:
            trainer = Trainer(model, seed=1)

            def loop(handle: StepHandle) -> None:
                try:
                    while True:
                        trainer.step()
                        handle.step(16)
                        if handle.node.state.round >= 1:
                            box.armed = True
                except BaseException as exc:
                    seen.append(exc)
                    raise

            await node.run_in_thread(loop)

    with anyio.fail_after(EVALUATION):
        with pytest.raises(NodeFailed) as failed:
            await run()
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert len(seen) == 1
    assert type(seen[0]) is NodeFailed


async def test_the_bodys_own_exception_wins_over_a_node_failure() -> None:
    box = BreakingMailbox()
    model = tiny_model()

    async def run() -> None:
        async with open_node(model, box, learner="solo", config=CONFIG, options=FAST) as node:
            await train(node, model, seed=1, until_round=1)
            box.armed = True
            try:
                await anyio.sleep(EVALUATION)
            finally:
                raise KeyError("the user's own")

    with anyio.fail_after(EVALUATION / 3), pytest.raises(KeyError, match="the user's own"):
        await run()


async def test_a_node_with_nothing_to_flush_closes_at_once() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    async with open_node(
        tiny_model(), box, learner="idle", config=CONFIG, options=FAST, sinks=[sink]
    ):
        pass
    assert [e.round for e in sink.of(Closed)] == [-1]  # type: ignore[attr-defined]


class LeasesAtSnapshots(MemoryMailbox):
    """A mailbox that notes, as each snapshot is written, the roles of its writer's lease."""

    def __init__(self) -> None:
        super().__init__()
        self.roles: list[tuple[int, set[str]]] = []

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        parsed = keys.parse_snapshot(key)
        if parsed is not None:
            beats = await self.list(keys.lease_prefix(parsed[1]))
            self.roles.append((parsed[0], {b.rpartition(".")[2] for b in beats}))
        return await super().put_if_absent(key, data)


async def test_a_closing_learners_lease_says_closing_before_its_flush_goes_out() -> None:
    """The syncers take a flush for a closer's, ahead of the rounds' pace, by its lease:
    every snapshot written while the body runs is under a ``learner`` lease; once the lease
    says ``closing`` it says nothing else, and the flush goes out under it; the lease is gone
    once the node is. A publish already under way when the body ends may land while the
    lease turns (its beat written, the one before not yet deleted), so it may see both."""
    box, model = LeasesAtSnapshots(), tiny_model()
    async with open_node(model, box, learner="a", config=CONFIG, options=FAST) as node:
        await train(node, model, seed=0, until_round=2)
        before = len(box.roles)
    assert before > 0
    roles = [seen for _, seen in box.roles]
    assert all(seen == {"learner"} for seen in roles[:before]), box.roles
    closing = roles.index({"closing"}, before)
    assert all("learner" in seen for seen in roles[before:closing]), box.roles
    assert all(seen == {"closing"} for seen in roles[closing:]), box.roles
    assert await box.list(keys.lease_prefix("a")) == []
