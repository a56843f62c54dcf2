"""``gradientmail.node(...)``: one member of a run, as an async context manager.

The user's facade and the supervisor of the node's tasks; the learner's decisions are the
pure ``protocol.learner.Learner``'s, carried out by ``_node.learner.LearnerDriver``.

Entering opens the mailbox (when given a URL), starts the event bus, creates or joins the
run (``_node.creation``), then starts the node's tasks in one task group: the lease, for a
learner the receive loop and the publisher, and the syncer unless ``options.syncer`` is
False. The block's body runs in that task group's scope: when a task fails, the body is
cancelled at its next checkpoint and the block raises ``NodeFailed`` (the task's exception
chained), unless the body raised an exception of its own, which propagates as itself. With
``group=`` the ranks of a process group are one learner (``_node.group``).

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

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
from anyio.abc import TaskGroup, TaskStatus
from torch import Tensor

from gradientmail._node.entry import enter
from gradientmail._node.group import GroupMember
from gradientmail._node.group_link import GroupLink, link_of
from gradientmail._node.handle import StepHandle
from gradientmail._node.learner import LearnerDriver
from gradientmail._node.lease import run_lease
from gradientmail._node.model import named_parameters, shards
from gradientmail._node.options import NodeOptions
from gradientmail._node.receive import Receiver
from gradientmail._node.runtime import Nudge, Runtime
from gradientmail._node.sharded import Layout, ShardedRank
from gradientmail._node.shared import shared_model
from gradientmail._node.state import NodeState
from gradientmail._node.supervision import block_error
from gradientmail._node.syncer import run_syncer
from gradientmail._node.ticks import Ticks
from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import GroupFailed, NodeFailed
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
from gradientmail.protocol.group import Decision
from gradientmail.protocol.learner import Learner
from gradientmail.protocol.learner_inputs import DroppedAll, Finalized
from gradientmail.protocol.records import DropReason, Manifest, RunConfig
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

__all__ = ["Node", "node"]

T = TypeVar("T")


class Node:
    """A member of a run, yielded by ``gradientmail.node(...)``; never built directly.

    Read ``state`` and call ``step``/``run_in_thread``/``events`` on the event-loop thread
    that entered the block.
    """

    def __init__(
        self,
        rt: Runtime,
        bus: EventBus,
        learner: Learner | None,
        params: tuple[tuple[Tensor, ...], ...],
        group: GroupMember | None = None,
        sharded: ShardedRank | None = None,
    ) -> None:
        self._rt = rt
        self._bus = bus
        self._driver = None
        # Set once a snapshot of this node's learner is in the store: its receive loop
        # and its syncer look at the round then instead of at their next idle poll.
        self._nudges = (Nudge(), Nudge())
        if learner is not None:
            self._driver = LearnerDriver(
                rt, learner, params, self._wake, sharded, published=self._published
            )
        self._failure: BaseException | None = None
        self._wakeup = anyio.Event()
        self._group = group
        self._sharded = sharded
        if group is not None and self._driver is not None:
            if sharded is not None:
                log = self._driver.record() if sharded.leader else None
                group.tick_with(Ticks(self._driver, sharded, log))
            else:
                group.attach(self._decided, self._decision)

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
        the snapshot).
        Raises ``NodeFailed`` (the cause chained) once a task of the node has failed (the
        block's body is cancelled then too), and ``TypeError``/``ValueError`` for bad
        ``tokens`` or a syncer-only node.
        """
        await anyio.lowlevel.checkpoint()
        self._check_step(tokens)
        if self._group is not None:
            await self._group.step(tokens)
        elif self._driver is not None:
            await self._driver.wait_to_step()
            self._raise_failure()
            self._driver.step(tokens)

    async def run_in_thread(self, fn: Callable[["StepHandle"], T]) -> T:
        """Run the synchronous ``fn(handle)`` in a worker thread and return its result;
        ``handle.step(tokens)`` does what ``step`` does, from that thread. A thread cannot
        be interrupted: cancelling the caller (or the failure of a task of the node, which
        cancels the block's body) takes effect at the thread's next ``handle.step``, which
        raises the cancellation out of ``fn``."""
        return await anyio.to_thread.run_sync(fn, StepHandle(self))

    async def shared_model(self, into: torch.nn.Module | None = None) -> dict[str, Tensor]:
        """The run's model as committed (the newest version of every fragment), not this
        learner's local weights: ``_node.shared.shared_model`` on this node's store."""
        return await shared_model(self._rt.store, self._rt.manifest, into)

    def __repr__(self) -> str:
        state = self.state
        return (
            f"<Node {self.learner!r} round={state.round} versions={list(state.versions)} "
            f"steps={state.steps} committed={state.rounds_committed}"
            f"{' failed' if self._failure is not None else ''}>"
        )

    # -- inside ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._wakeup.set()

    async def _decided(self, tokens: int) -> Decision:
        """A group leader's learner step of ``tokens``; its decision."""
        self._raise_failure()
        assert self._driver is not None
        await self._driver.wait_to_step()
        self._driver.step(tokens)
        return self._decision(tokens)

    def _decision(self, tokens: int = 0) -> Decision:
        assert self._driver is not None
        return Decision.of(self._driver.state, tokens)

    def _check_step(self, tokens: int) -> None:
        self._raise_failure()
        if self._driver is None and self._group is None:
            raise TypeError("a syncer-only node (model=None) has no steps to count")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")

    def _step_quietly(self, tokens: int) -> bool:
        """``step`` from a thread other than the event loop's, when the step needs nothing
        of the loop (``LearnerDriver.step_quietly``); True if it was counted, False if the
        caller must run ``step`` on the loop. Raises as ``step`` does."""
        self._check_step(tokens)
        return (
            self._group is None and self._driver is not None and self._driver.step_quietly(tokens)
        )

    def _node_failed(self) -> NodeFailed:
        failure = self._failure
        assert failure is not None
        error = NodeFailed(f"node {self.learner!r} failed: {type(failure).__name__}: {failure}")
        error.__cause__ = failure
        return error

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._node_failed()

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
        if self._failure is None:
            self._failure = exc
        self._wake()
        return self._node_failed()

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
                rt.store,
                rt.learner,
                "syncer" if self._driver is None else "learner",
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
        self._raise_failure()
        self._rt.emit(Closing(self.learner, flushing=True))
        driver = self._driver
        if driver is None:
            self._rt.emit(Closed(self.learner, -1))
            return
        clock = self._rt.clock
        marker: tuple[int, int] | None = None
        since = clock.now()
        driver.begin_close()
        while True:
            self._raise_failure()
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
    and form this one learner (``_node.group``; docs/node.md, "Learner groups").

    Raises ``RunMismatch`` (before anything is written) when the model or config contradict
    the run, ``ValueError``/``TypeError`` for bad arguments, and ``NodeFailed`` (itself, the
    cause chained) when a task of the node failed: the block's body is cancelled at its
    next checkpoint and the block raises it, unless the body raised an exception of its
    own, which then propagates as itself. See the module docstring for the lifecycle.
    """
    keys.check_learner(learner)
    options = options if options is not None else NodeOptions()
    if not isinstance(options, NodeOptions):
        raise TypeError(f"options must be a NodeOptions, got {type(options).__name__}")
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(f"config must be a RunConfig or None, got {type(config).__name__}")
    link = link_of(group, options.group_timeout, model=model is not None)
    named = named_parameters(model, sharded=link is not None)
    if named is None and not options.syncer:
        raise ValueError("a node without a model must be a syncer (options.syncer=True)")
    layout = None
    if link is not None and named is not None:
        found = shards(named, link.rank, link.world)
        if found is not None:
            layout = Layout(
                {name: shard.local for (name, _), shard in zip(named, found, strict=True)},
                {
                    name: (shard.start, shard.end)
                    for (name, _), shard in zip(named, found, strict=True)
                },
            )
    clock = clock if clock is not None else MonotonicClock()
    if run_key is None:
        key = RunKey.from_env()
    else:
        key = run_key if isinstance(run_key, RunKey) else RunKey(run_key)
    if options.learner_key is not None and key is None:
        raise ValueError("a node with options.learner_key needs the run key too (run_key=...)")
    bus = EventBus(sinks, learner=learner)
    async with AsyncExitStack() as stack:
        box: Mailbox
        if isinstance(mailbox, str):
            box = await stack.enter_async_context(open_mailbox(mailbox))
        else:
            box = mailbox
        store = Store(
            box,
            clock=clock,
            max_retry_delay=options.max_retry_delay,
            run_key=key,
            learner_key=options.learner_key,
        )
        async with _running(
            bus, store, learner, named, config, options, clock, link, layout
        ) as node_:
            yield node_


@asynccontextmanager
async def _running(
    bus: EventBus,
    store: Store,
    learner: str,
    named: list[tuple[str, Tensor]] | None,
    config: RunConfig | None,
    options: NodeOptions,
    clock: Clock,
    link: GroupLink | None,
    layout: Layout | None,
) -> AsyncIterator[Node]:
    """The event bus around joining and the node's task group (see ``_supervise``). Every
    failure leaves as one exception, never an ``ExceptionGroup`` of one."""
    error: BaseException | None = None
    async with anyio.create_task_group() as events_tg:
        await events_tg.start(_dispatch, bus)
        try:
            entered = await enter(
                store, learner, named, config, options, clock, bus.emit, link, layout
            )
            sharded = None
            if layout is not None and link is not None:
                rows = layout.fragment_rows(entered.rt.manifest)
                sharded = ShardedRank(link.rank, link.world, rows)
            node_ = Node(entered.rt, bus, entered.start, entered.params, entered.member, sharded)
            try:
                async with anyio.create_task_group() as tg, _supervise(node_, tg) as running:
                    yield running
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
        if node_._failure is not None:
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
