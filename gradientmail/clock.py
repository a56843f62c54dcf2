"""Time as a dependency: protocol decisions read an injected clock, never the wall clock.

``Clock.now()`` is a monotonic reading in seconds (meaningful only on this machine);
``Clock.sleep()`` waits in the current task and is a cancellation point. Nothing in the
store carries one machine's clock reading for another to compare against.
"""

import time
from typing import Protocol

import anyio

__all__ = ["Clock", "MonotonicClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock; safe to call from any thread."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` in the calling task; a cancellation point."""
        ...


class MonotonicClock:
    """``time.monotonic`` and ``anyio.sleep``: the clock every node uses unless told otherwise."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    def __repr__(self) -> str:
        return "MonotonicClock()"
