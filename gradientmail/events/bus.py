"""The event bus: events from any task or thread, in order, to every sink on its own stream.

Shape of the flow::

    emit() ──► intake (a list under a lock) ──► dispatcher task ──► one bounded memory object
    (any thread)                                 (run())             stream per sink and per
                                                                     subscriber ──► its own
                                                                     delivery task ──► sink

``emit`` takes a lock for a few hundred nanoseconds and appends; it never awaits, never
blocks on a sink and never raises. The dispatcher moves each batch into every sink's stream
with ``send_nowait``, so a slow sink fills only its own stream. A full stream drops the
*newest* events for that sink and counts them (each stream and its accounting is a route,
``events._routes``); see ``EventBus`` for why, and for the ``EventsDropped`` notice that
tells the sink exactly how many it lost.

Waking the dispatcher from another thread must not block that thread (the training thread
calls ``emit`` between optimizer steps). ``anyio.from_thread.run_sync`` waits for the loop, so
the bus instead uses the loop's own non-blocking hand-off (``loop.call_soon_threadsafe`` on
asyncio, ``TrioToken.run_sync_soon`` on trio), and only when the dispatcher is asleep: under
load a wakeup is already pending and ``emit`` makes no system call at all.
"""

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from gradientmail.events._routes import (
    Route,
    Sink,
    SinkStatistics,
    Subscription,
    check_buffer,
    sink_name,
)
from gradientmail.events.kinds import Event, kind_name

__all__ = ["BusStatistics", "EventBus"]

log = logging.getLogger("gradientmail.events")

_FAIR_EVERY = 64
"""Events a delivery task or the dispatcher handles between two checkpoints, so that a
backlog of fast sync calls cannot starve the rest of the event loop."""

_CLOSE_TIMEOUT = 5.0
"""Seconds allowed to each sink's ``close``/``aclose``, shielded from cancellation."""


@dataclass(frozen=True, slots=True)
class BusStatistics:
    """The bus as a whole: events emitted before closing began (``emitted``, those the full
    intake dropped included), events waiting for the dispatcher (``pending``), events
    refused because the bus was closing (``refused``), and each sink and subscriber."""

    emitted: int
    pending: int
    refused: int
    sinks: tuple[SinkStatistics, ...]


class EventBus:
    """Carries events from producers on any task or thread to sinks on the event loop.

    Owned by one task group: start the dispatcher with ``await tg.start(bus.run)`` and stop
    it with ``await bus.aclose()``, which delivers everything emitted before it, closes the
    sinks and returns once ``run()`` has returned.

    Each sink gets a stream of ``buffer`` events and a delivery task of its own, which calls
    it once per event, in emission order, on the event-loop thread. A sync sink therefore
    runs on the loop and must be quick (writing a line to a file or a pipe is; a network call
    is not; make such a sink async). A sink that raises is logged on the
    ``gradientmail.events`` logger with its traceback, and keeps receiving later events: an
    observer never changes the run.

    **Dropping.** When a sink's stream is full the bus drops the *newest* events for that
    sink, never the oldest: a memory object stream hands out what it holds in order, so
    dropping at the tail needs no reach into the buffer and no lock shared with the delivery
    task, and what the sink sees is an unbroken prefix, one ``EventsDropped(count=N)`` with
    the exact number lost, then every event from where it caught up. It catches up when its
    stream has room for the notice and the next event, or, if no event comes, as soon as it
    empties the stream. The intake in front of the dispatcher holds ``buffer`` events as
    well; what ``emit`` cannot queue there (the loop was starved while producers on other
    threads kept going) counts as dropped for every sink, at that point in the order.

    ``learner`` names the node in the ``EventsDropped`` notices; when empty, the notice
    carries the learner of the last event it accounts for.
    ``drain_timeout`` bounds how long ``aclose`` waits for slow sinks to take what is
    buffered; what they have not taken by then is dropped and logged, and they are still
    closed.
    """

    def __init__(
        self,
        sinks: Sequence[Sink] = (),
        *,
        buffer: int = 4096,
        learner: str = "",
        drain_timeout: float = 30.0,
    ) -> None:
        check_buffer(buffer, "EventBus(buffer=...)")
        for sink in sinks:
            if not callable(sink):
                raise TypeError(f"EventBus sinks must be callables taking one event, got {sink!r}")
        if not drain_timeout > 0:
            raise ValueError(
                f"EventBus(drain_timeout=...) must be positive seconds, got {drain_timeout!r}"
            )
        self._sinks = tuple(sinks)
        self._buffer = buffer
        self._learner = learner
        self._drain_timeout = drain_timeout
        self._lock = threading.Lock()
        # Everything from here to the blank line is guarded by _lock.
        self._intake: list[Event] = []
        self._intake_lost = 0
        self._intake_lost_learner = ""
        self._emitted = 0
        self._refused = 0
        self._closing = False
        self._sleeping = False
        self._wakeup: anyio.Event | None = None

        self._routes: tuple[Route, ...] = ()
        self._subscribers = 0
        self._started = False
        self._done = False
        self._finished: anyio.Event | None = None
        self._loop_thread = 0
        self._call_soon: Callable[[Callable[[], object]], object] | None = None
        self._loop_gone: tuple[type[BaseException], ...] = ()

    def __repr__(self) -> str:
        state = "done" if self._done else "closing" if self._closing else "running"
        if not self._started:
            state = "not started"
        stats = self.statistics()
        dropped = sum(sink.dropped for sink in stats.sinks)
        return (
            f"<EventBus learner={self._learner!r} {state} emitted={stats.emitted} "
            f"pending={stats.pending} routes={len(stats.sinks)} dropped={dropped}>"
        )

    def statistics(self) -> BusStatistics:
        """A snapshot of the counters. Exact when called on the event-loop thread."""
        with self._lock:
            emitted, pending, refused = self._emitted, len(self._intake), self._refused
        return BusStatistics(
            emitted, pending, refused, tuple(route.statistics() for route in self._routes)
        )

    def emit(self, event: Event) -> None:
        """Queue ``event`` for every sink. Safe from any task and any thread; never blocks,
        never awaits, never raises.

        Events one thread emits reach every sink in that order. Once ``aclose()`` has begun
        the event is refused (counted in ``statistics().refused``); when the intake is full
        it is dropped and counted for every sink (see the class docstring).
        """
        with self._lock:
            if self._closing:
                self._refused += 1
                return
            self._emitted += 1
            if len(self._intake) >= self._buffer:
                self._intake_lost += 1
                self._intake_lost_learner = event.learner
                return
            self._intake.append(event)
            if not self._sleeping:
                return
            self._sleeping = False
            wakeup = self._wakeup
        self._wake(wakeup)

    def _wake(self, wakeup: anyio.Event | None) -> None:
        if wakeup is None:
            return
        if threading.get_ident() == self._loop_thread:
            wakeup.set()
            return
        assert self._call_soon is not None
        # A finished loop has no dispatcher left to wake.
        with contextlib.suppress(*self._loop_gone):
            self._call_soon(wakeup.set)

    def _bind_loop(self) -> None:
        self._loop_thread = threading.get_ident()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            import trio

            self._call_soon = trio.lowlevel.current_trio_token().run_sync_soon
            self._loop_gone = (trio.RunFinishedError,)
        else:
            self._call_soon = loop.call_soon_threadsafe
            self._loop_gone = (RuntimeError,)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The dispatcher: moves events from the intake into every sink's stream, runs one
        delivery task per sink, and returns once ``aclose()`` has drained them and closed
        the sinks. Start it once, with ``await tg.start(bus.run)``; it reports started once
        the delivery tasks exist. Raises ``RuntimeError`` if started a second time.

        Cancelled: buffered events are discarded, subscribers' iterators end, and every sink
        is still closed (shielded, at most 5 s each); then the cancellation propagates.
        """
        if self._started:
            raise RuntimeError("EventBus.run() was already started; a bus runs once")
        self._started = True
        self._finished = anyio.Event()
        self._bind_loop()
        sink_routes = tuple(
            Route(sink_name(sink), sink, self._buffer, self._learner) for sink in self._sinks
        )
        self._routes = (*sink_routes, *self._routes)
        try:
            with anyio.CancelScope() as drain_scope:
                async with anyio.create_task_group() as tg:
                    for route in sink_routes:
                        tg.start_soon(self._deliver, route, name=f"event sink {route.name}")
                    task_status.started()
                    await self._pump()
                    for route in self._routes:
                        route.send.close()
                    drain_scope.deadline = anyio.current_time() + self._drain_timeout
            if drain_scope.cancelled_caught:
                for route in sink_routes:
                    left = route.receive.statistics().current_buffer_used + route.lost
                    if left:
                        log.warning(
                            "event sink %s took no more events for %.1f s while closing; "
                            "dropping the %d it had not taken",
                            route.name,
                            self._drain_timeout,
                            left,
                        )
        finally:
            with self._lock:
                self._closing = True
                self._intake = []
            self._done = True
            for route in self._routes:
                route.send.close()
            for route in sink_routes:
                route.receive.close()
                await _close_sink(route)
            self._finished.set()

    async def _pump(self) -> None:
        while True:
            with self._lock:
                batch, lost = self._intake, self._intake_lost
                lost_learner = self._intake_lost_learner
                if batch or lost:
                    self._intake, self._intake_lost = [], 0
                elif self._closing:
                    return
                else:
                    wakeup = self._wakeup = anyio.Event()
                    self._sleeping = True
            if not batch and not lost:
                await wakeup.wait()
                continue
            for index, event in enumerate(batch, 1):
                for route in self._routes:
                    route.offer(event)
                if index % _FAIR_EVERY == 0:
                    await anyio.lowlevel.checkpoint()
            if lost:
                for route in self._routes:
                    route.lose_at_tail(lost, lost_learner)
            await anyio.lowlevel.checkpoint()

    async def _deliver(self, route: Route) -> None:
        sink = route.sink
        assert sink is not None
        calls = 0
        while True:
            try:
                event = await route.next()
            except anyio.EndOfStream:
                return
            route.delivered += 1
            try:
                result = sink(event)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                route.failed += 1
                log.exception(
                    "%s: event sink %s failed on %s; it keeps receiving later events",
                    event.learner,
                    route.name,
                    kind_name(event),
                )
            calls += 1
            if calls % _FAIR_EVERY == 0:
                await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """Stop accepting events, deliver every event emitted before this call to every sink
        (waiting at most ``drain_timeout`` for slow ones), close the sinks, and return once
        ``run()`` has returned. Idempotent; call it on the event-loop thread.

        If ``run()`` was never started, this runs it in place to deliver what was emitted.
        Cancelled: stops waiting; the dispatcher keeps draining in its own task.
        """
        with self._lock:
            self._closing = True
            wakeup = self._wakeup if self._sleeping else None
            self._sleeping = False
        if wakeup is not None:
            wakeup.set()
        if not self._started:
            await self.run()
            return
        assert self._finished is not None
        await self._finished.wait()

    def subscribe(self, buffer: int = 4096) -> AbstractAsyncContextManager[AsyncIterator[Event]]:
        """An async iterator of every event dispatched while the context is open, with the
        same ordering and the same drop-newest rule and ``EventsDropped`` notice as a sink
        (named ``subscriber-N``). The iteration ends once the bus has closed and the
        subscriber has read everything. Enter it on the event-loop thread. Events emitted
        after entering are all seen (dropping aside); some emitted just before may be too.
        """
        check_buffer(buffer, "EventBus.subscribe(buffer=...)")
        return self._subscription(buffer)

    @asynccontextmanager
    async def _subscription(self, buffer: int) -> AsyncIterator[AsyncIterator[Event]]:
        self._subscribers += 1
        route = Route(f"subscriber-{self._subscribers}", None, buffer, self._learner)
        if self._done:
            route.send.close()
        else:
            self._routes = (*self._routes, route)
        try:
            yield Subscription(route)
        finally:
            self._routes = tuple(other for other in self._routes if other is not route)
            route.send.close()
            route.receive.close()


async def _close_sink(route: Route) -> None:
    sink = route.sink
    aclose = getattr(sink, "aclose", None)
    close = getattr(sink, "close", None)
    if aclose is None and close is None:
        return
    with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True) as scope:
        try:
            if callable(aclose):
                await aclose()
            elif callable(close):
                close()
        except Exception:
            log.exception("event sink %s failed to close", route.name)
    if scope.cancelled_caught:
        log.warning("event sink %s did not close within %.0f s", route.name, _CLOSE_TIMEOUT)
