"""One sink's or subscriber's stream of events and its drop accounting (``EventBus``'s routes).

A route is a bounded memory object stream: the dispatcher offers each event to it without
waiting, a full stream drops the newest events and counts them, and the ``EventsDropped``
notice goes in exactly where the gap is. Event-loop thread only.
"""

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeAlias

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from gradientmail.events.kinds import Event, EventsDropped

__all__ = ["Route", "Sink", "SinkStatistics", "Subscription", "check_buffer", "sink_name"]

Sink: TypeAlias = Callable[[Event], None] | Callable[[Event], Awaitable[None]]
"""A sync or async callable taking one event. It may also have ``aclose()`` (awaited) or
``close()`` (called), which the bus calls once after the last event it delivers."""


@dataclass(frozen=True, slots=True)
class SinkStatistics:
    """One sink or subscriber: events it was handed (``delivered``, including the
    ``EventsDropped`` notices and the calls that raised), calls that raised (``failed``),
    events it lost to a full buffer (``dropped``, whether or not the notice went out yet) and
    events waiting in its stream (``buffered``)."""

    name: str
    delivered: int
    failed: int
    dropped: int
    buffered: int


def sink_name(sink: object) -> str:
    """How logs and ``EventsDropped`` name ``sink``: its ``name`` attribute if it has one,
    else its qualified name (a function's, or an object's class's), less any ``<locals>``
    prefix."""
    name = getattr(sink, "name", None)
    if isinstance(name, str):
        return name
    qualname = getattr(sink, "__qualname__", None)
    if not isinstance(qualname, str):
        qualname = type(sink).__qualname__
    return qualname.rsplit("<locals>.", 1)[-1]


def check_buffer(buffer: int, what: str) -> None:
    if not (isinstance(buffer, int) and buffer >= 1) and buffer != math.inf:
        raise ValueError(f"{what} must be a positive integer (events), got {buffer!r}")


class Route:
    """One sink's or subscriber's stream and its drop accounting. Event-loop thread only."""

    __slots__ = (
        "delivered",
        "dropped",
        "failed",
        "learner",
        "lost",
        "lost_learner",
        "name",
        "receive",
        "send",
        "sink",
    )

    def __init__(self, name: str, sink: Sink | None, buffer: int, learner: str) -> None:
        self.name = name
        self.sink = sink
        self.send: MemoryObjectSendStream[Event]
        self.receive: MemoryObjectReceiveStream[Event]
        self.send, self.receive = anyio.create_memory_object_stream[Event](buffer)
        self.learner = learner
        self.lost = 0
        self.lost_learner = ""
        self.dropped = 0
        self.delivered = 0
        self.failed = 0

    def offer(self, event: Event) -> None:
        """Put ``event`` in the stream, or count it as lost when the stream is full.

        After a loss, the ``EventsDropped`` notice goes in just before the next event that
        fits, so the notice sits exactly where the gap is; that needs room for both, hence
        the wait for two free slots.
        """
        if self.lost:
            stats = self.send.statistics()
            if stats.max_buffer_size - stats.current_buffer_used < 2:
                self.lose(1, event.learner)
                return
            self.send.send_nowait(self.notice())
        try:
            self.send.send_nowait(event)
        except anyio.WouldBlock:
            self.lose(1, event.learner)

    def lose(self, count: int, learner: str) -> None:
        self.lost += count
        self.dropped += count
        self.lost_learner = learner

    def notice(self) -> EventsDropped:
        notice = EventsDropped(self.learner or self.lost_learner, self.name, self.lost)
        self.lost = 0
        return notice

    def lose_at_tail(self, count: int, learner: str) -> None:
        """Count ``count`` events lost after everything already in the stream; when the
        stream has room, the notice goes in at once, so a sink that is already waiting learns
        of the loss without waiting for the next event."""
        self.lose(count, learner)
        stats = self.send.statistics()
        if stats.current_buffer_used < stats.max_buffer_size:
            self.send.send_nowait(self.notice())

    async def next(self) -> Event:
        """The next event in order, or the pending ``EventsDropped`` notice once the stream
        is empty; raises ``anyio.EndOfStream`` once the stream is closed and drained."""
        try:
            return self.receive.receive_nowait()
        except anyio.WouldBlock:
            pass
        except anyio.EndOfStream:
            if not self.lost:
                raise
            return self.notice()
        if self.lost:
            return self.notice()
        # Waiting means the stream is empty, so every send reaches this receiver at once and
        # nothing can be lost until it returns.
        return await self.receive.receive()

    def statistics(self) -> SinkStatistics:
        return SinkStatistics(
            self.name,
            self.delivered,
            self.failed,
            self.dropped,
            self.receive.statistics().current_buffer_used,
        )


class Subscription:
    """The async iterator a subscriber reads: the events of its own route, in order."""

    __slots__ = ("_route",)

    def __init__(self, route: Route) -> None:
        self._route = route

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> Event:
        try:
            event = await self._route.next()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        self._route.delivered += 1
        return event
