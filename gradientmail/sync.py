"""The blocking facade: a node for synchronous training loops.

``with gradientmail.sync.node(model, url, learner=...) as node:`` then ``node.step(tokens=n)``
after each optimizer step; or ``node = gradientmail.sync.open(...)`` … ``node.close()`` in a
script whose loop is not to be re-indented. It is the same ``gradientmail.node``, run in one
event loop in one background thread (``anyio.from_thread.start_blocking_portal``, asyncio or
trio); every call crosses into that loop through the portal. No other thread is started.

Leaving the block normally closes with flush (``NodeFailed`` raises if a task of the node
failed); by an ``Exception``, without flush, the exception propagating unchanged; by any
other ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``, ``Terminated``), the node is
cancelled (its lease deleted, shielded and bounded) and the exception propagates. A second
interrupt while closing stops the wait, not the lease's release. A node from ``open`` stays
open until ``close()`` (with flush) or the interpreter's exit (with flush, or without after
an uncaught ``Exception``; a second signal while it flushes closes it without flush); no
thread outlives its close.

``handle_signals=True`` makes SIGTERM raise ``Terminated`` (a ``SystemExit``, code 143) and
SIGINT ``KeyboardInterrupt`` in the main thread for the block's duration, so that what Slurm
and Kubernetes send closes the node as Ctrl-C does (docs/integrations.md).

``load`` and ``Barrier`` are ``gradientmail.load`` and ``gradientmail.Barrier`` for
synchronous code (``gradientmail._blocking``).
"""

import concurrent.futures
import concurrent.futures.thread
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from types import FrameType
from typing import Any, Literal, TypeVar, overload

import anyio
import anyio.from_thread
import torch
from anyio.from_thread import BlockingPortal

from gradientmail._blocking import Barrier, load
from gradientmail._node import Node as AsyncNode
from gradientmail._node import NodeOptions, NodeState
from gradientmail._node.node import running
from gradientmail._node.spec import NodeSpec, node_spec
from gradientmail._node.stepping import Steps
from gradientmail._sync_events import DRAIN_TIMEOUT, Events
from gradientmail.clock import Clock
from gradientmail.events import Sink
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox import open as open_mailbox
from gradientmail.patterns.shards import Shard, declare
from gradientmail.protocol.records import Manifest, RunConfig
from gradientmail.protocol.signing import RunKey

__all__ = ["Backend", "Barrier", "Events", "Node", "Terminated", "load", "node", "open"]

Backend = Literal["asyncio", "trio"]
_Module = TypeVar("_Module", bound=torch.nn.Module)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(SystemExit):
    """Raised in the main thread by a SIGTERM when ``handle_signals=True``. Its ``code`` is
    128 + the signal's number (143), the exit status a shell reports for a process ended by
    that signal; uncaught, Python exits with it and prints nothing."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class Node:
    """What ``gradientmail.sync.node(...)`` yields and ``gradientmail.sync.open(...)``
    returns: the node, seen from synchronous code.

    ``step``, ``state`` and ``events`` may be called from any thread but the node's own
    event-loop thread; ``step`` from the training loop only (the model must not change
    while it runs)."""

    def __init__(self, portal: BlockingPortal, spec: NodeSpec) -> None:
        self._portal = portal
        self._spec = spec
        self._node: AsyncNode | None = None
        self._steps: Steps | None = None
        self._scope: anyio.CancelScope | None = None
        self._leave: anyio.Event | None = None
        self._error: Exception | None = None
        self._aborted = False
        self._final: NodeState | None = None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._served: concurrent.futures.Future[None] | None = None
        self._opened: ExitStack | None = None
        # Held weakly: an iterator nobody can read any more is not waited for.
        self._iterators: weakref.WeakSet[Events] = weakref.WeakSet()

    # -- what users see ---------------------------------------------------------------------

    @property
    def learner(self) -> str:
        return self._joined().learner

    @property
    def config(self) -> RunConfig:
        """The run's config (the manifest's)."""
        return self._joined().config

    @property
    def manifest(self) -> Manifest:
        return self._joined().manifest

    @property
    def state(self) -> NodeState:
        """What this node has done so far (``NodeState``), read on the node's thread; after
        the block, as the node stood when it closed."""
        if self._final is not None:
            return self._final
        node = self._joined()
        try:
            return self._portal.call(lambda: node.state)
        except RuntimeError:
            # The node closed between the check and the call.
            final = self._closed()
            if final is None:
                raise
            return final

    def _closed(self) -> NodeState | None:
        return self._final

    def step(self, tokens: int = 0) -> None:
        """``Node.step`` (count one optimizer step of ``tokens`` tokens, apply what is ready,
        snapshot what is due): counted on the caller's thread when it needs nothing of the
        node's thread (most steps), else run there; blocks the caller until done. Raises
        ``NodeFailed`` once a task of the node has failed, ``ValueError``/``TypeError`` for
        bad ``tokens``, ``RuntimeError`` after the block."""
        if self._final is not None:
            raise RuntimeError(
                f"node {self.learner!r} has closed: step() belongs inside its with block, "
                "or between sync.open() and close()"
            )
        self._joined()
        steps = self._steps
        assert steps is not None
        if not steps.step_quietly(tokens):
            self._portal.call(steps.step, tokens)

    @overload
    def shared_model(self) -> dict[str, torch.Tensor]: ...
    @overload
    def shared_model(self, into: _Module) -> _Module: ...
    def shared_model(self, into: torch.nn.Module | None = None) -> object:
        """The run's model as committed (the newest version of every fragment), not this
        learner's local weights: every parameter by name, on the CPU; or, given ``into`` (a
        module like the trained one, to evaluate or save), copied into it and ``into``
        returned. Read from the store on the node's thread; blocks the caller. Raises
        ``RunMismatch`` when ``into`` is not the run's model. Buffers are not in a run."""
        node = self._joined()
        if self._final is not None:
            raise RuntimeError(f"node {self.learner!r} has closed: use gradientmail.sync.load")
        state = self._portal.call(node.shared_model, into)
        return state if into is None else into

    def close(self) -> None:
        """Close a node from ``open``, with flush, as leaving a ``with`` block does; raises
        ``NodeFailed`` when a task of the node failed. Idempotent. Call it from the thread
        that opened the node; a node from ``sync.node`` closes by leaving its block."""
        if self._opened is None:
            raise RuntimeError("a node from sync.node() closes when its with block is left")
        _OPENED.discard(self)
        self._opened.close()

    def _close_after(self, error: BaseException | None) -> None:
        _OPENED.discard(self)
        assert self._opened is not None
        if error is None:
            self._opened.close()
        else:
            self._opened.__exit__(type(error), error, error.__traceback__)

    def declare_shard(self, shard: Shard, *, name: str = "data") -> Shard:
        """``gradientmail.patterns.declare`` for this node's learner on its run's mailbox:
        record ``shard`` of the data set ``name`` and warn (``ShardOverlap``) when another
        live learner declared the same one. Returns ``shard``."""
        return self._portal.call(self._declare, shard, name)

    async def _declare(self, shard: Shard, name: str) -> Shard:
        mailbox = self._spec.mailbox
        learner = self._joined().learner
        if not isinstance(mailbox, str):
            return await declare(mailbox, learner, shard, name=name)
        async with open_mailbox(mailbox) as opened:
            return await declare(opened, learner, shard, name=name)

    def events(self, buffer: int = 4096) -> Events:
        """Every event of this node from now on, as a blocking iterator (``Events``); the
        newest are dropped, with an ``EventsDropped`` notice, when the consumer falls more
        than ``buffer`` behind."""
        events = Events(self._portal, self._joined(), buffer, lambda: self._final is not None)
        self._iterators.add(events)
        return events

    def __repr__(self) -> str:
        if self._node is None:
            return "<sync.Node joining>"
        state = self.state
        return (
            f"<sync.Node {state.learner!r} round={state.round} steps={state.steps} "
            f"committed={state.rounds_committed}{' closed' if self._final else ''}>"
        )

    # -- the node's own task, on the portal's thread ------------------------------------------

    def _joined(self) -> AsyncNode:
        if self._node is None:
            raise RuntimeError("the node has not joined its run")
        return self._node

    async def _serve(self) -> None:
        """Join, hold the node open until ``_leave`` or ``_abort``, then close it: with
        flush, or by raising ``_error`` into the block, or by cancellation."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            self._leave = anyio.Event()
            if self._aborted:
                scope.cancel()
            try:
                async with running(self._spec) as (node, steps):
                    self._node, self._steps = node, steps
                    self._ready.set_result(None)
                    await self._leave.wait()
                    if self._error is not None:
                        raise self._error
            except Exception as exc:
                if exc is not self._error:
                    raise
            finally:
                if self._node is not None:
                    self._final = self._node.state

    def _request_leave(self, error: Exception | None) -> None:
        assert self._leave is not None
        self._error = error
        self._leave.set()

    def _abort(self) -> None:
        self._aborted = True
        if self._scope is not None:
            self._scope.cancel()

    # -- the caller's side ----------------------------------------------------------------------

    def _enter(self) -> None:
        """Start ``_serve`` and wait until it has joined; raise what joining raised. An
        interrupt while joining cancels the join (nothing of this node is left running)."""
        self._served = self._portal.start_task_soon(self._serve)
        try:
            concurrent.futures.wait(
                [self._ready, self._served], return_when=concurrent.futures.FIRST_COMPLETED
            )
            if not self._ready.done():
                self._served.result()
                raise RuntimeError("the node's task ended before it joined")
        except BaseException:
            self._cancel_and_wait()
            raise

    def _exit(self, error: BaseException | None) -> None:
        """Close the node as the block was left (see the module docstring)."""
        assert self._served is not None
        try:
            if error is None or isinstance(error, Exception):
                self._portal.call(self._request_leave, error)
            else:
                self._portal.call(self._abort)
            self._served.result()
        except (KeyboardInterrupt, SystemExit):
            # An interrupt while closing (the flush can take close_timeout): close without
            # flush instead, and let the interrupt propagate.
            self._cancel_and_wait()
            raise

    def _drain(self) -> None:
        """Wait, ``DRAIN_TIMEOUT`` at most in all, for every events iterator to read to its
        end what the node emitted up to its close."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        for events in list(self._iterators):
            events.wait_drained(max(0.0, deadline - time.monotonic()))

    def _cancel_and_wait(self) -> None:
        assert self._served is not None
        try:
            self._portal.call(self._abort)
        except RuntimeError:
            return
        concurrent.futures.wait([self._served])


def _check_backend(backend: object) -> Backend:
    if backend == "asyncio":
        return "asyncio"
    if backend == "trio":
        return "trio"
    raise ValueError(f"backend must be 'asyncio' or 'trio', got {backend!r}")


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM raises ``Terminated``, SIGINT ``KeyboardInterrupt``, in the main thread,
    until the block is left; the previous handlers are restored then."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "handle_signals=True needs the main thread (Python runs signal handlers there "
            "only): enter the node from the main thread, or leave handle_signals off"
        )

    def handler(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
    try:
        for number in _SIGNALS:
            previous[number] = signal.signal(number, handler)
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


_OPENED: set[Node] = set()
"""The nodes from ``open`` not closed yet, which ``_close_at_exit`` closes."""


def _close_at_exit() -> None:
    """Close what ``open`` left open: with flush, or without when an uncaught ``Exception``
    ended the script (the interpreter keeps it in ``sys.last_value``). Runs in the main
    thread before the interpreter joins its threads (the node's workers among them)."""
    ended = getattr(sys, "last_value", None)
    error = ended if isinstance(ended, Exception) else None
    for facade in list(_OPENED):
        try:
            facade._close_after(error)
        except (KeyboardInterrupt, SystemExit):
            print(f"gradientmail: {facade.learner!r} closed without flush", file=sys.stderr)
        except Exception as exc:
            if exc is not error:
                print(f"gradientmail: closing {facade.learner!r}: {exc!r}", file=sys.stderr)


# atexit runs after the interpreter waits for non-daemon threads, the node's workers among
# them: too late. threading's exit hooks run before (concurrent.futures, imported first,
# has one that refuses new work: hooks run last registered first, so it comes after this).
threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]


def open(
    model: torch.nn.Module | None,
    mailbox: Mailbox | str,
    *,
    learner: str,
    config: RunConfig | None = None,
    options: NodeOptions | None = None,
    sinks: Sequence[Sink] = (),
    clock: Clock | None = None,
    run_key: RunKey | str | bytes | None = None,
    backend: Backend = "asyncio",
    handle_signals: bool = False,
    group: object = None,
) -> Node:
    """``node``'s join without the ``with`` block: the joined ``Node``, open until its
    ``close()`` or the interpreter's exit (see the module docstring), for a script whose
    loop is not inside a block. Arguments and errors are ``node``'s; ``handle_signals``
    keeps its handlers until the node is closed."""
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
    stack = ExitStack()
    facade = stack.enter_context(_served(spec, backend, handle_signals))
    facade._opened = stack
    _OPENED.add(facade)
    return facade


@contextmanager
def node(
    model: torch.nn.Module | None,
    mailbox: Mailbox | str,
    *,
    learner: str,
    config: RunConfig | None = None,
    options: NodeOptions | None = None,
    sinks: Sequence[Sink] = (),
    clock: Clock | None = None,
    run_key: RunKey | str | bytes | None = None,
    backend: Backend = "asyncio",
    handle_signals: bool = False,
    group: object = None,
) -> Iterator[Node]:
    """Join (or create) the run in ``mailbox`` as ``learner`` and yield a ``Node`` whose
    ``step`` a synchronous training loop calls after each optimizer step.

    Arguments are ``gradientmail.node``'s, plus ``backend`` (the event loop the node runs
    in, in one background thread) and ``handle_signals`` (see the module docstring; off by
    default, as a library should not take the process's signals unasked); ``group`` is
    ``gradientmail.node``'s (a learner group: ``step`` runs its collectives in the node's
    worker threads; docs/node.md, "Learner groups"). A ``Mailbox``
    passed in must be usable from that event loop (open it inside it, or pass a URL). Raises
    what ``gradientmail.node`` raises: ``RunMismatch``, ``ValueError``/``TypeError`` on
    entry, ``NodeFailed`` from ``step`` and from leaving the block.
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
    with _served(spec, backend, handle_signals) as facade:
        yield facade


@contextmanager
def _served(spec: NodeSpec, backend: Backend, handle_signals: bool) -> Iterator[Node]:
    """The node of ``spec`` in a blocking portal's event loop, closed as the block is left
    (see the module docstring)."""
    chosen = _check_backend(backend)
    if not isinstance(handle_signals, bool):
        raise TypeError(f"handle_signals must be a bool, got {handle_signals!r}")
    with ExitStack() as stack:
        if handle_signals:
            stack.enter_context(_signals_raise())
        portal = stack.enter_context(anyio.from_thread.start_blocking_portal(chosen))
        facade = Node(portal, spec)
        facade._enter()
        try:
            yield facade
        except BaseException as exc:
            facade._exit(exc)
            raise
        else:
            facade._exit(None)
        finally:
            # Only event subscriptions can be left (their streams have ended): let their
            # readers take what is still buffered, then end them.
            facade._drain()
            with suppress(RuntimeError):
                portal.call(portal.stop, True)
