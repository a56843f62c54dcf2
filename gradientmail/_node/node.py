"""``gradientmail.node(...)``: one member of a run, as an async context manager.

The user's facade and the supervisor of the node's tasks; the learner's decisions are the
pure ``protocol.learner.Learner``'s, carried out by ``_node.learner_driver.LearnerDriver``.

Entering checks the arguments once (``_node.spec.node_spec``: the ``NodeSpec`` the rest
takes), opens the mailbox (when given a URL), starts the event bus, creates or joins the
run (``_node.run_creation``), then starts the node's tasks in one task group: the lease, for a
learner the receive loop and the publisher, and the syncer unless ``options.syncer`` is
False. The block's body runs in that task group's scope: when a task fails, the body is
cancelled at its next checkpoint and the block raises ``NodeFailed`` (the task's exception
chained), unless the body raised an exception of its own, which propagates as itself. With
``group=`` the ranks of a process group are one learner (``_node.group_member``). ``Node.step`` is
the one place the training meets the node: ``_node.stepping.Steps``, which ``StepHandle``
and ``sync.Node`` step through too.

Leaving normally closes with flush (``Closing``, then ``Closed``; ``GaveUp`` and
``StepsDropped`` once nothing has landed for ``close_timeout``); leaving by an exception or
a cancellation publishes nothing more (``StepsDropped``) and re-raises. Either way the tasks
are cancelled, the lease is deleted (shielded, bounded), the event bus drains and closes,
and a mailbox opened from a URL is closed: no task, thread or connection outlives the block
(docs/node.md, "Lifecycle").

Everything that touches the node's state runs on the event-loop thread that entered the
block: ``Node.step`` is awaited there (or called through ``StepHandle.step`` from a thread
``run_in_thread`` started). Encoding, decoding, hashing and aggregation run in
``anyio.to_thread`` worker threads; no other thread is started.
"""

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
import torch
from anyio.abc import TaskGroup, TaskStatus
from torch import Tensor

from gradientmail._node.entry import Entered, enter
from gradientmail._node.learner_driver import LearnerDriver
from gradientmail._node.lease import LeaseBeats, run_lease
from gradientmail._node.options import NodeOptions
from gradientmail._node.receive import Receiver
from gradientmail._node.runtime import Nudge
from gradientmail._node.sharded import ShardedRank
from gradientmail._node.shared import shared_model
from gradientmail._node.spec import NodeSpec, node_spec
from gradientmail._node.state import NodeState
from gradientmail._node.stepping import Steps
from gradientmail._node.supervision import block_error
from gradientmail._node.syncer_task import run_syncer
from gradientmail._node.ticks import Ticks
from gradientmail.clock import Clock
from gradientmail.errors import GroupFailed, MailboxUnavailable, NodeFailed, RecordError
from gradientmail.events import (
    Closed,
    Closing,
    Event,
    EventBus,
    GaveUp,
    PublishCancelled,
    Sink,
    SyncerStopped,
)
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox import open as open_mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.learner import Learner
from gradientmail.protocol.learner_inputs import DroppedAll, Finalized
from gradientmail.protocol.records import DropReason, Manifest, RunConfig
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

__all__ = ["Node", "StepHandle", "node", "running"]

T = TypeVar("T")


class Node:
    """A member of a run, yielded by ``gradientmail.node(...)``; never built directly.

    Read ``state`` and call ``step``/``run_in_thread``/``events`` on the event-loop thread
    that entered the block.
    """

    def __init__(self, entered: Entered, bus: EventBus, sharded: ShardedRank | None) -> None:
        rt = self._rt = entered.rt
        self._bus = bus
        self._driver = None
        # Set once a snapshot of this node's learner is in the store: its receive loop
        # and its syncer look at the round then instead of at their next idle poll.
        self._nudges = (Nudge(), Nudge())
        if entered.start is not None:
            self._driver = LearnerDriver(
                rt, entered.start, entered.params, self._wake, sharded, published=self._published
            )
        self._wakeup = anyio.Event()
        role: keys.Role = "syncer" if self._driver is None else "learner"
        self._beats = LeaseBeats(rt.store, rt.learner, role)
        self._group = group = entered.member
        self._sharded = sharded
        self._steps = Steps(rt.learner, self._driver, group)
        if group is not None and self._driver is not None:
            if sharded is not None:
                log = self._driver.record() if sharded.leader else None
                group.tick_with(Ticks(self._driver, sharded, log))
            else:
                group.attach(self._steps.decided, self._steps.decision)

    # -- what users see ---------------------------------------------------------------------

    @property
    def learner(self) -> str:
        return self._rt.learner

    @property
    def config(self) -> RunConfig:
        """The run's config (the manifest's)."""
        return self._rt.config

    @property
    def manifest(self) -> Manifest:
        return self._rt.manifest

    @property
    def state(self) -> NodeState:
        """What this node has done so far (see ``NodeState``)."""
        stats = self._rt.store.stats
        waited = 0.0
        if self._driver is None:
            round, aligned, steps, tokens, committed = -1, -1, 0, 0, 0
            versions: tuple[int, ...] = ()
        else:
            learner = self._driver.state
            round, steps, tokens = learner.newest_round, learner.step, learner.tokens
            versions, committed = learner.versions, learner.committed
            aligned = learner.aligned_round
            waited = self._driver.waited
        state = NodeState(
            learner=self.learner,
            round=round,
            versions=versions,
            aligned_round=aligned,
            steps=steps,
            tokens=tokens,
            rounds_committed=committed,
            bytes_published=stats.bytes_up,
            bytes_downloaded=stats.bytes_down,
            requests=stats.requests,
            waited_seconds=waited,
        )
        return state if self._group is None else self._group.state(state)

    def events(self, buffer: int = 4096) -> AbstractAsyncContextManager[AsyncIterator[Event]]:
        """``async with node.events() as events: async for event in events: ...``: every event
        of this node from now on, in order (the newest are dropped, with an
        ``EventsDropped`` notice, when the consumer falls more than ``buffer`` behind). The
        iteration ends when the node has closed."""
        return self._bus.subscribe(buffer)

    async def step(self, tokens: int = 0) -> None:
        """Count one local optimizer step of ``tokens`` tokens, apply the committed versions
        that are ready, and snapshot the fragment due after this step.

        Call it between optimizer steps, on the event-loop thread, from the training loop
        only (the model must not be changing while it runs). Its cost is in-place tensor
        operations and the copies of due fragments; all I/O happens in the node's tasks.
        With ``RunConfig.overlap`` it waits, at the step that applies a round's version,
        until that version is ready (``Learner.wait_until``: at most ``2 · grace`` after
        the snapshot); with ``overlap`` 0 the step that snapshots waits for it and applies
        it before returning.
        Raises ``NodeFailed`` (the cause chained) once a task of the node has failed (the
        block's body is cancelled then too), and ``TypeError``/``ValueError`` for bad
        ``tokens`` or a syncer-only node.
        """
        await self._steps.step(tokens)

    async def run_in_thread(self, fn: Callable[["StepHandle"], T]) -> T:
        """Run the synchronous ``fn(handle)`` in a worker thread and return its result;
        ``handle.step(tokens)`` does what ``step`` does, from that thread. A thread cannot
        be interrupted: cancelling the caller (or the failure of a task of the node, which
        cancels the block's body) takes effect at the thread's next ``handle.step``, which
        raises the cancellation out of ``fn``."""
        return await anyio.to_thread.run_sync(fn, StepHandle(self, self._steps))

    async def shared_model(self, into: torch.nn.Module | None = None) -> dict[str, Tensor]:
        """The run's model as committed (the newest version of every fragment), not this
        learner's local weights: ``_node.shared.shared_model`` on this node's store."""
        return await shared_model(self._rt.store, self._rt.manifest, into)

    def __repr__(self) -> str:
        state = self.state
        return (
            f"<Node {self.learner!r} round={state.round} versions={list(state.versions)} "
            f"steps={state.steps} committed={state.rounds_committed}"
            f"{' failed' if self._steps.failure is not None else ''}>"
        )

    # -- inside ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._wakeup.set()

    async def _supervised(self, name: str, fn: Callable[[], Any]) -> None:
        """Run one task of the node. Its failure fails the node: it is raised as
        ``NodeFailed`` into the task group, which cancels the other tasks and the block's
        body; ``step`` raises it from then on."""
        try:
            await fn()
        except Exception as exc:
            raise self._task_failed(name, exc) from exc

    def _task_failed(self, name: str, exc: Exception) -> NodeFailed:
        """Record the failure of task ``name``; the ``NodeFailed`` to raise for it."""
        if name == "syncer":
            self._rt.emit(SyncerStopped(self.learner, exc))
        error = self._steps.fail(exc)
        self._wake()
        return error

    def _published(self) -> None:
        for nudge in self._nudges:
            nudge.set()

    def _drop_unpublished(self, reason: DropReason, detail: str) -> None:
        if self._driver is not None:
            self._driver.feed(DroppedAll(reason, detail))

    async def _start(self, tg: TaskGroup) -> None:
        """Start the node's tasks in ``tg``: the lease first (its first beat lands before
        anything else runs), then receive and publish (learners) and the syncer."""
        rt = self._rt
        driver = self._driver
        if self._group is not None and not self._group.link.leader:
            # A follower of a learner group: its leader is the node the run sees; a sharded
            # follower moves its own rows' bytes.
            if driver is not None and self._sharded is not None:
                receiver = Receiver(rt, driver, self._sharded)
                tg.start_soon(self._supervised, "receive", receiver.run)
                tg.start_soon(self._supervised, "publisher", driver.run_publisher)
            return
        await tg.start(self._lease)
        receiving, syncing = self._nudges
        if driver is not None:
            receiver = Receiver(rt, driver, self._sharded, receiving)
            tg.start_soon(self._supervised, "receive", receiver.run)
            tg.start_soon(self._supervised, "publisher", driver.run_publisher)
        if rt.options.syncer:
            tg.start_soon(self._supervised, "syncer", lambda: run_syncer(rt, syncing))

    async def _lease(self, *, task_status: TaskStatus[None]) -> None:
        """The lease task. A failure before its first beat is the caller's (the node does
        not start); a later one fails the node like any task's."""
        rt = self._rt
        started = False

        class _Started:
            def started(self, value: None = None) -> None:
                nonlocal started
                started = True
                task_status.started()

        try:
            await run_lease(
                self._beats,
                rt.options.lease_every,
                rt.clock,
                rt.emit,
                task_status=_Started(),
            )
        except Exception as exc:
            if not started:
                raise
            raise self._task_failed("lease", exc) from exc

    def _stop(self, tg: TaskGroup) -> None:
        if self._driver is not None:
            self._driver.close_jobs()
        tg.cancel_scope.cancel()

    async def _flush(self) -> None:
        """Close with flush (see the module docstring)."""
        self._steps.raise_failure()
        self._rt.emit(Closing(self.learner, flushing=True))
        driver = self._driver
        if driver is None:
            self._rt.emit(Closed(self.learner, -1))
            return
        clock = self._rt.clock
        marker: tuple[int, int] | None = None
        since = clock.now()
        with contextlib.suppress(MailboxUnavailable, RecordError):
            # Before the flush: the syncers take it for a closer's, ahead of the pace. Not
            # written, the lease says learner and the close goes on.
            await self._beats.renew("closing")
        driver.begin_close()
        while True:
            self._steps.raise_failure()
            driver.flush_once()
            driver.feed(Finalized())
            if self._group is not None and self._group.sharded:
                await self._group.closing_tick()
            state = driver.state
            if state.finished:
                self._rt.emit(Closed(self.learner, state.aligned_round))
                return
            now = clock.now()
            progress = (state.newest_round, sum(state.versions))
            if progress != marker:
                marker, since = progress, now
            elif now - since >= self._rt.options.close_timeout:
                self._give_up(state, now - since)
                return
            with anyio.move_on_after(self._rt.options.poll_interval):
                await self._wakeup.wait()
            self._wakeup = anyio.Event()

    def _give_up(self, state: Learner, waited: float) -> None:
        target = max(
            (slot.published.round for slot in state.slots if slot.published is not None),
            default=state.newest_round + 1,
        )
        self._rt.emit(GaveUp(self.learner, target, waited, state.aligned_round))
        if state.publishing:
            self._rt.emit(PublishCancelled(self.learner, waited))
        self._drop_unpublished("gave-up", "close() stopped waiting for the rounds")


class StepHandle:
    """What ``Node.run_in_thread`` hands to the training function; used from that worker
    thread only. A step that needs nothing of the event loop (nothing to apply, no fragment
    due: most steps) is counted right there (``Steps.step_quietly``); the others cross to the
    node's event-loop thread through ``anyio.from_thread``."""

    def __init__(self, node: Node, steps: Steps) -> None:
        self._node = node
        self._steps = steps

    @property
    def node(self) -> Node:
        return self._node

    def step(self, tokens: int = 0) -> None:
        """``Node.step`` from the worker thread: blocks it until the step is done. Raises
        ``NodeFailed`` once a task of the node has failed, and the event loop's cancellation
        exception once the task that called ``run_in_thread`` is cancelled otherwise; either
        ends the training loop (let it propagate)."""
        steps = self._steps
        steps.raise_failure()
        try:
            anyio.from_thread.check_cancelled()
            if not steps.step_quietly(tokens):
                anyio.from_thread.run(steps.step, tokens)
        except BaseException:
            # A node's failure cancels the block's body: say so rather than "cancelled".
            steps.raise_failure()
            raise


async def _dispatch(bus: EventBus, *, task_status: TaskStatus[None]) -> None:
    """The bus's dispatcher, shielded: a cancelled node still reports how it closed (the
    drops, the lease release); ``bus.aclose()`` in the node's last cleanup stops it."""
    with anyio.CancelScope(shield=True):
        await bus.run(task_status=task_status)


@asynccontextmanager
async def node(
    model: torch.nn.Module | None,
    mailbox: Mailbox | str,
    *,
    learner: str,
    config: RunConfig | None = None,
    options: NodeOptions | None = None,
    sinks: Sequence[Sink] = (),
    clock: Clock | None = None,
    run_key: RunKey | str | bytes | None = None,
    group: object = None,
) -> AsyncIterator[Node]:
    """Join (or create) the run in ``mailbox`` as ``learner`` and yield the ``Node``.

    ``model``: the ``torch.nn.Module`` to train (its weights are replaced by the run's
    newest committed ones on entry), or None for a syncer-only node. ``mailbox``: a
    ``Mailbox`` (the caller keeps it open) or a URL for ``gradientmail.mailbox.open`` (the
    node opens and closes it). ``config``: the run's config when creating it (default
    ``RunConfig()``); when joining, None takes the manifest's and anything else must equal it.
    ``options``: this node's timings and roles. ``sinks``: where its events go. ``clock``:
    the time source for every protocol decision (default: monotonic). ``run_key``: the
    secret of a signed run (a ``RunKey`` or the secret itself; default: the
    ``GRADIENTMAIL_RUN_KEY`` environment variable, else none): a node with a key creates a
    signed run, signs everything it writes and ignores objects that do not verify; a node
    joins only a run signed with its key, or an unsigned run when it has none. ``group``: a
    gloo ``torch.distributed`` process group whose ranks all enter with the same arguments
    and form this one learner (``_node.group_member``; docs/node.md, "Learner groups").

    Raises ``RunMismatch`` (before anything is written) when the model or config contradict
    the run, ``ValueError``/``TypeError`` for bad arguments, and ``NodeFailed`` (itself, the
    cause chained) when a task of the node failed: the block's body is cancelled at its
    next checkpoint and the block raises it, unless the body raised an exception of its
    own, which then propagates as itself. See the module docstring for the lifecycle.
    """
    spec = node_spec(
        model,
        mailbox,
        learner=learner,
        config=config,
        options=options,
        sinks=sinks,
        clock=clock,
        run_key=run_key,
        group=group,
    )
    async with running(spec) as (node_, _):
        yield node_


@asynccontextmanager
async def running(spec: NodeSpec) -> AsyncIterator[tuple[Node, Steps]]:
    """``gradientmail.node`` for a checked ``spec``: the node and its step path (``Steps``,
    which ``sync.Node`` steps through). Opens the mailbox when ``spec`` names a URL and
    closes it after the node."""
    bus = EventBus(spec.sinks, learner=spec.learner)
    async with AsyncExitStack() as stack:
        box: Mailbox
        if isinstance(spec.mailbox, str):
            box = await stack.enter_async_context(open_mailbox(spec.mailbox))
        else:
            box = spec.mailbox
        async with _entered(spec, bus, spec.store(box)) as node_:
            yield node_, node_._steps


@asynccontextmanager
async def _entered(spec: NodeSpec, bus: EventBus, store: Store) -> AsyncIterator[Node]:
    """The event bus around entering the run and the node's task group (see
    ``_supervise``). Every failure leaves as one exception, never an ``ExceptionGroup`` of
    one."""
    error: BaseException | None = None
    async with anyio.create_task_group() as events_tg:
        await events_tg.start(_dispatch, bus)
        try:
            entered = await enter(spec, store, bus.emit)
            sharded = None
            if spec.layout is not None and spec.link is not None:
                rows = spec.layout.fragment_rows(entered.rt.manifest)
                sharded = ShardedRank(spec.link.rank, spec.link.world, rows)
            node_ = Node(entered, bus, sharded)
            try:
                async with anyio.create_task_group() as tg, _supervise(node_, tg) as supervised:
                    yield supervised
            except ExceptionGroup as group:
                error = block_error(group)
        except Exception as exc:
            error = exc
        finally:
            with anyio.CancelScope(shield=True):
                await bus.aclose()
    if error is not None:
        raise error


@asynccontextmanager
async def _supervise(node_: Node, tg: TaskGroup) -> AsyncIterator[Node]:
    """Start the node's tasks in ``tg`` and yield the node to the block, whose body runs in
    ``tg``'s scope: a failing task cancels it. Then close: with flush when the body ended
    normally, else dropping what was not published (``Closing(flushing=False)``)."""
    await node_._start(tg)
    try:
        yield node_
    except BaseException as exc:
        node_._rt.emit(Closing(node_.learner, flushing=False))
        if node_._steps.failure is not None:
            detail = "the node failed"
        elif isinstance(exc, Exception):
            detail = "closed by an exception"
        else:
            detail = "cancelled"
        node_._drop_unpublished("closed-without-flush", detail)
        if node_._group is not None:
            await node_._group.abort()
        raise
    else:
        if node_._group is None:
            await node_._flush()
        else:
            try:
                await node_._group.close(node_._flush)
            except GroupFailed:
                # Another rank left by an exception, or died, while this one was closing.
                node_._drop_unpublished("closed-without-flush", "the learner group failed")
                raise
    finally:
        node_._stop(tg)
