"""What every task of one node shares: who it is, the run, the store, the clock, the events.

A ``Runtime`` is built once the node has joined its run and never changes; tasks receive it
instead of reaching into the node. ``backoff`` is the retry schedule the tasks share; a
``Nudge`` is how one task cuts another's pause short.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from gradientmail._node.options import NodeOptions
from gradientmail.clock import Clock
from gradientmail.events import Event
from gradientmail.protocol.records import FragmentSpec, Manifest, RunConfig
from gradientmail.store import Store

__all__ = ["Nudge", "Runtime", "backoff"]


@dataclass(frozen=True, slots=True)
class Runtime:
    learner: str
    store: Store
    manifest: Manifest
    options: NodeOptions
    clock: Clock
    emit: Callable[[Event], None]
    wall: Callable[[], float] = time.time
    """The wall clock stamped on records for people to read (``RoundRecord.closed_at``)."""

    @property
    def config(self) -> RunConfig:
        return self.manifest.config

    @property
    def specs(self) -> tuple[FragmentSpec, ...]:
        return self.manifest.fragments


def backoff(previous: float | None, options: NodeOptions) -> float:
    """The next retry delay after ``previous`` (None: the first failure): from the poll
    interval, doubling, up to ``max_retry_delay``."""
    if previous is None:
        return min(max(options.poll_interval, 0.05), options.max_retry_delay)
    return min(previous * 2, options.max_retry_delay)


class Nudge:
    """Cuts a task's pause short: ``set`` ends the ``pause`` under way, or the next one
    (returning at once), and each pause consumes it. The node's learner sets its receive
    loop's and its syncer's when a snapshot of it is in the store, so that the receive loop
    starts its due pace then and the syncer, waiting at its idle pace for a round's first
    snapshot, looks at the round then, rather than up to a ``poll_interval`` later. Both
    sides run on the node's event-loop thread; ``pause`` is a cancellation point and leaves
    no task behind."""

    def __init__(self) -> None:
        self._pending = False
        self._scope: anyio.CancelScope | None = None

    def set(self) -> None:
        self._pending = True
        if self._scope is not None:
            self._scope.cancel()

    async def pause(self, clock: Clock, seconds: float) -> None:
        """Sleep ``seconds`` on ``clock``, or until ``set``. A pause that runs its time
        starts no task and cancels nothing (it is every idle poll of every node)."""
        if self._pending:
            self._pending = False
            await anyio.lowlevel.checkpoint()
            return
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                await clock.sleep(seconds)
            finally:
                self._scope = None
                self._pending = False
