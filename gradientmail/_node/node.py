"""``gradientmail.node(...)``: one member of a run, as an async context manager.

Lifecycle: entering opens the mailbox (when given a URL), starts the event bus, creates or
joins the run (``node.creation``), then starts the node's tasks in one task group: the lease
(``node.lease``), the receive loop and the publisher (``node.learner``, learners only), and
the syncer (``node.syncer``, unless ``options.syncer`` is False). The block runs the user's
training; ``Node.step`` is the one place the training meets the node.

Leaving the block normally closes with flush (``Closing``): every fragment with steps since
its last included snapshot is published, and the node waits until those rounds are
committed and applied (``Closed``), or gives up once nothing has landed for
``close_timeout`` seconds (``GaveUp``, ``StepsDropped``). Its syncer keeps closing rounds
meanwhile, so the last node alive closes its own flush rounds. Leaving by an exception or a
cancellation publishes nothing more (``StepsDropped`` for what was not published) and
re-raises. Either way the tasks are cancelled, the lease is deleted (shielded, bounded), the
event bus drains into the sinks and closes, and a mailbox opened from a URL is closed: no
task, thread or connection outlives the block.

Threading: everything that touches the node's state runs on the event-loop thread that
entered the block. ``Node.step`` must be awaited there (or called through
``StepHandle.step`` from a thread ``run_in_thread`` started). Encoding, decoding, hashing
and aggregation run in ``anyio.to_thread`` worker threads; no other thread is started.
"""

import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream
from torch import Tensor

from gradientmail._node.creation import load_newest, open_run
from gradientmail._node.learner import (
    FragmentState,
    Job,
    LearnerState,
    StateCell,
    merge_in_place,
    run_publisher,
    run_receive,
)
from gradientmail._node.lease import run_lease
from gradientmail._node.options import NodeOptions
from gradientmail._node.runtime import Runtime
from gradientmail._node.state import NodeState
from gradientmail._node.syncer import run_syncer
from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import NodeFailed
from gradientmail.events import (
    Closed,
    Closing,
    Event,
    EventBus,
    FragmentAligned,
    GaveUp,
    Joined,
    PublishCancelled,
    RoundCommitted,
    Sink,
    StepsDropped,
    SyncerStopped,
)
from gradientmail.events.kinds import DropReason
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox import open as open_mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.fragments import due
from gradientmail.protocol.merge import Ledger
from gradientmail.protocol.records import Manifest, RunConfig
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

__all__ = ["Node", "StepHandle", "node"]

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
        cell: StateCell | None,
        params: tuple[tuple[Tensor, ...], ...],
        jobs: MemoryObjectSendStream[Job] | None,
    ) -> None:
        self._rt = rt
        self._bus = bus
        self._cell = cell
        self._params = params
        self._jobs = jobs
        self._pin = any(p.is_cuda for group in params for p in group)
        self._failure: BaseException | None = None
        self._committed = 0
        self._wakeup = anyio.Event()

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
        versions: tuple[int, ...] = ()
        if self._cell is None:
            round, aligned, steps, tokens = -1, -1, 0, 0
        else:
            learner = self._cell.value
            round, steps, tokens = learner.newest_round, learner.step, learner.tokens
            versions = tuple(f.version for f in learner.fragments)
            aligned = _aligned_round(versions)
        return NodeState(
            learner=self.learner,
            round=round,
            versions=versions,
            aligned_round=aligned,
            steps=steps,
            tokens=tokens,
            rounds_committed=self._committed,
            bytes_published=stats.bytes_up,
            bytes_downloaded=stats.bytes_down,
            requests=stats.requests,
        )

    def events(self, buffer: int = 4096) -> AbstractAsyncContextManager[AsyncIterator[Event]]:
        """``async with node.events() as events: async for event in events: ...``: every event
        of this node from now on, in order (the newest are dropped, with an
        ``EventsDropped`` notice, when the consumer falls more than ``buffer`` behind). The
        iteration ends when the node has closed."""
        return self._bus.subscribe(buffer)

    async def step(self, tokens: int = 0) -> None:
        """Count one local optimizer step of ``tokens`` tokens, apply the committed versions
        that are ready, and snapshot the fragments due after this step.

        Call it between optimizer steps, on the event-loop thread, from the training loop
        only (the model must not be changing while it runs). Its cost is in-place tensor
        operations and the copies of due fragments; all I/O happens in the node's tasks.
        Raises ``NodeFailed`` (the cause chained) once a task of the node has failed, and
        ``TypeError``/``ValueError`` for bad ``tokens`` or a syncer-only node.
        """
        await anyio.lowlevel.checkpoint()
        self._raise_failure()
        if self._cell is None:
            raise TypeError("a syncer-only node (model=None) has no steps to count")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
        self._cell.value = self._cell.value.stepped(tokens)
        self._apply_ready()
        for fragment in due(self._cell.value.step, self.config):
            self._snapshot(fragment)

    async def run_in_thread(self, fn: Callable[["StepHandle"], T]) -> T:
        """Run the synchronous ``fn(handle)`` in a worker thread and return its result;
        ``handle.step(tokens)`` does what ``step`` does, from that thread. A thread cannot
        be interrupted: cancelling the caller takes effect at the thread's next
        ``handle.step``, which raises the cancellation out of ``fn``."""
        return await anyio.to_thread.run_sync(fn, StepHandle(self))

    def __repr__(self) -> str:
        state = self.state
        return (
            f"<Node {self.learner!r} round={state.round} versions={list(state.versions)} "
            f"steps={state.steps} committed={state.rounds_committed}"
            f"{' failed' if self._failure is not None else ''}>"
        )

    # -- inside ---------------------------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        if isinstance(event, RoundCommitted):
            self._committed += 1
        self._bus.emit(event)

    def _wake(self) -> None:
        self._wakeup.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise NodeFailed(
                f"node {self.learner!r} failed: {type(self._failure).__name__}: {self._failure}"
            ) from self._failure

    async def _guard(self, name: str, fn: Callable[[], Any]) -> None:
        """Run a task; a failure of it fails the node (the next ``step`` raises it)."""
        try:
            await fn()
        except Exception as exc:
            if name == "syncer":
                self._emit(SyncerStopped(self.learner, exc))
            self._failed(exc)

    def _apply_ready(self) -> None:
        assert self._cell is not None
        config = self.config
        for fragment, entry in enumerate(self._cell.value.fragments):
            ready = entry.ready
            if ready is None:
                continue
            published = entry.published
            outcome = None
            if published is not None and published.round <= ready.round:
                outcome = published.outcome
            merge_in_place(
                self._params[fragment],
                outcome or "late",
                theta=ready.theta,
                snapshot=published.snapshot if published is not None else None,
                base=entry.base,
                rule=config.merge,
                alpha=config.alpha,
                non_blocking=self._pin,
            )
            step = self._cell.value.step
            lag = step - published.step if outcome == "included" and published else None
            self._cell.value = self._cell.value.aligned(fragment)
            if outcome == "rejected":
                # The ledger dropped the steps up to the record when the receive task folded
                # it; the reset to the global θ just now also wiped the steps taken since.
                self._drop(fragment, "reset", f"round {ready.round} rejected a snapshot")
            self._emit(
                FragmentAligned(self.learner, ready.round, fragment, ready.version, step, lag)
            )

    def _copy_out(self, fragment: int) -> tuple[tuple[Tensor, ...], Any]:
        params = self._params[fragment]
        if not self._pin:
            return tuple(p.detach().to("cpu", copy=True) for p in params), None
        copies = []
        for p in params:
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            host.copy_(p.detach(), non_blocking=True)
            copies.append(host)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return tuple(copies), event

    def _snapshot(self, fragment: int) -> bool:
        """Hand a snapshot of ``fragment`` to the publisher if it has steps to publish and
        none is in flight or pending; whether it did."""
        assert self._cell is not None
        assert self._jobs is not None
        entry = self._cell.value.fragments[fragment]
        if entry.blocked:
            return False
        pending = self._cell.value.ledger[fragment].since_base
        if pending.steps == 0:
            return False
        snapshot, ready = self._copy_out(fragment)
        self._cell.value, round = self._cell.value.published(fragment, snapshot)
        self._jobs.send_nowait(
            Job(
                fragment=fragment,
                round=round,
                base_version=entry.version,
                base=entry.base,
                snapshot=snapshot,
                ready=ready,
                steps=pending.steps,
                tokens=pending.tokens,
            )
        )
        return True

    def _drop_unpublished(self, reason: DropReason, detail: str) -> None:
        if self._cell is None:
            return
        for fragment in range(self.config.fragments):
            self._drop(fragment, reason, detail)

    def _drop(self, fragment: int, reason: DropReason, detail: str) -> None:
        """Give up the steps of ``fragment`` that no round will carry, and report them."""
        assert self._cell is not None
        ledger, dropped = self._cell.value.ledger.dropped(fragment, detail)
        self._cell.value = _with_ledger(self._cell.value, ledger)
        if dropped.steps or dropped.tokens:
            self._emit(
                StepsDropped(self.learner, fragment, dropped.steps, dropped.tokens, reason, detail)
            )

    async def _start(self, tg: TaskGroup) -> None:
        """Start the node's tasks in ``tg``: the lease first (its first beat lands before
        anything else runs), then receive and publish (learners) and the syncer."""
        rt = self._rt
        await tg.start(self._lease)
        cell = self._cell
        if cell is not None:
            send, receive = anyio.create_memory_object_stream[Job](max_buffer_size=math.inf)
            self._jobs = send
            tg.start_soon(
                self._guard, "receive", lambda: run_receive(rt, cell, self._pin, self._wake)
            )
            tg.start_soon(
                self._guard, "publisher", lambda: run_publisher(rt, cell, receive, self._wake)
            )
        if rt.options.syncer:
            tg.start_soon(self._guard, "syncer", lambda: run_syncer(rt))

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
                "syncer" if self._cell is None else "learner",
                rt.options.lease_every,
                rt.clock,
                rt.emit,
                task_status=_Started(),
            )
        except Exception as exc:
            if not started:
                raise
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        if self._failure is None:
            self._failure = exc
        self._wake()

    def _stop(self, tg: TaskGroup) -> None:
        if self._jobs is not None:
            self._jobs.close()
        tg.cancel_scope.cancel()

    async def _flush(self) -> None:
        """Close with flush (see the module docstring)."""
        self._raise_failure()
        self._emit(Closing(self.learner, flushing=True))
        if self._cell is None:
            self._emit(Closed(self.learner, -1))
            return
        clock = self._rt.clock
        marker: tuple[int, int] | None = None
        since = clock.now()
        while True:
            self._raise_failure()
            self._apply_ready()
            for fragment in range(self.config.fragments):
                self._snapshot(fragment)
            state = self._cell.value
            waiting = [
                f
                for f, entry in enumerate(state.fragments)
                if entry.blocked or state.ledger[f].since_base.steps > 0
            ]
            versions = tuple(f.version for f in state.fragments)
            if not waiting:
                self._emit(Closed(self.learner, _aligned_round(versions)))
                return
            now = clock.now()
            progress = (state.newest_round, sum(f.version for f in state.fragments))
            if progress != marker:
                marker, since = progress, now
            elif now - since >= self._rt.options.close_timeout:
                target = max(
                    (
                        entry.published.round
                        for entry in state.fragments
                        if entry.published is not None
                    ),
                    default=state.newest_round + 1,
                )
                self._emit(GaveUp(self.learner, target, now - since, _aligned_round(versions)))
                if any(entry.in_flight for entry in state.fragments):
                    self._emit(PublishCancelled(self.learner, now - since))
                self._drop_unpublished("gave-up", "close() stopped waiting for the rounds")
                return
            with anyio.move_on_after(self._rt.options.poll_interval):
                await self._wakeup.wait()
            self._wakeup = anyio.Event()


def _with_ledger(state: LearnerState, ledger: Ledger) -> LearnerState:
    return replace(state, ledger=ledger)


def _aligned_round(versions: Sequence[int]) -> int:
    fragments = len(versions)
    return max(
        (keys.round_of(f, v, fragments) for f, v in enumerate(versions) if v > 0), default=-1
    )


class StepHandle:
    """What ``Node.run_in_thread`` hands to the training function."""

    def __init__(self, node: Node) -> None:
        self._node = node

    @property
    def node(self) -> Node:
        return self._node

    def step(self, tokens: int = 0) -> None:
        """``Node.step`` from the worker thread: blocks it until the step is done. Raises
        the event loop's cancellation exception once the task that called
        ``run_in_thread`` is cancelled, which ends the training loop (let it propagate)."""
        anyio.from_thread.check_cancelled()
        anyio.from_thread.run(self._node.step, tokens)


async def _dispatch(bus: EventBus, *, task_status: TaskStatus[None]) -> None:
    """The bus's dispatcher, shielded: a cancelled node still reports how it closed (the
    drops, the lease release); ``bus.aclose()`` in the node's last cleanup stops it."""
    with anyio.CancelScope(shield=True):
        await bus.run(task_status=task_status)


def _named(model: torch.nn.Module | None) -> list[tuple[str, Tensor]] | None:
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    named: list[tuple[str, Tensor]] = list(model.named_parameters())
    if not named:
        raise ValueError("model has no parameters to train together")
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(
            f"model's parameters live on {len(devices)} devices ({sorted(map(str, devices))}); "
            "a node trains a model that lives on one device"
        )
    return named


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
    joins only a run signed with its key, or an unsigned run when it has none.

    Raises ``RunMismatch`` (before anything is written) when the model or config contradict
    the run, ``ValueError``/``TypeError`` for bad arguments, and ``NodeFailed`` from the
    flush when a task of the node failed. See the module docstring for the lifecycle.
    """
    keys.check_learner(learner)
    options = options if options is not None else NodeOptions()
    if not isinstance(options, NodeOptions):
        raise TypeError(f"options must be a NodeOptions, got {type(options).__name__}")
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(f"config must be a RunConfig or None, got {type(config).__name__}")
    named = _named(model)
    if named is None and not options.syncer:
        raise ValueError("a node without a model must be a syncer (options.syncer=True)")
    clock = clock if clock is not None else MonotonicClock()
    if run_key is None:
        key = RunKey.from_env()
    else:
        key = run_key if isinstance(run_key, RunKey) else RunKey(run_key)
    bus = EventBus(sinks, learner=learner)
    async with AsyncExitStack() as stack:
        box: Mailbox
        if isinstance(mailbox, str):
            box = await stack.enter_async_context(open_mailbox(mailbox))
        else:
            box = mailbox
        store = Store(box, clock=clock, max_retry_delay=options.max_retry_delay, run_key=key)
        error: Exception | None = None
        async with anyio.create_task_group() as events_tg:
            await events_tg.start(_dispatch, bus)
            try:
                manifest = await open_run(store, learner, named, config, options, clock, bus.emit)
                node_ = await _join(store, manifest, learner, named, options, clock, bus)
                async with anyio.create_task_group() as tg:
                    await node_._start(tg)
                    try:
                        yield node_
                    except Exception as exc:
                        error = exc
                        node_._drop_unpublished("closed-without-flush", "closed by an exception")
                    except BaseException:
                        node_._drop_unpublished("closed-without-flush", "cancelled")
                        raise
                    else:
                        await node_._flush()
                    finally:
                        node_._stop(tg)
            except Exception as exc:
                # Raised outside the task groups, not as a one-member ExceptionGroup.
                error = error or exc
            finally:
                with anyio.CancelScope(shield=True):
                    await bus.aclose()
        if error is not None:
            raise error


async def _join(
    store: Store,
    manifest: Manifest,
    learner: str,
    named: list[tuple[str, Tensor]] | None,
    options: NodeOptions,
    clock: Clock,
    bus: EventBus,
) -> Node:
    node_: Node | None = None

    def emit(event: Event) -> None:
        assert node_ is not None
        node_._emit(event)

    rt = Runtime(
        learner=learner, store=store, manifest=manifest, options=options, clock=clock, emit=emit
    )
    newest = await load_newest(store, manifest, clock, options.poll_interval)
    params: tuple[tuple[Tensor, ...], ...] = ()
    cell = None
    if named is not None:
        by_name = dict(named)
        params = tuple(tuple(by_name[p.name] for p in spec.params) for spec in manifest.fragments)
        with torch.no_grad():
            for group, thetas in zip(params, newest.thetas, strict=True):
                for param, theta in zip(group, thetas, strict=True):
                    param.copy_(theta)
        fragments = tuple(
            FragmentState(version=version, base=theta)
            for version, theta in zip(newest.versions, newest.thetas, strict=True)
        )
        cell = StateCell(
            LearnerState(
                ledger=Ledger.start(manifest.config.fragments),
                step=0,
                tokens=0,
                fragments=fragments,
                newest_round=newest.round,
            )
        )
    node_ = Node(rt, bus, cell, params, None)
    bus.emit(Joined(learner, manifest.created_by, manifest.config.fragments, newest.round))
    return node_
