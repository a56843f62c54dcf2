"""``Events``: a node's events as a blocking iterator, for ``gradientmail.sync.Node.events``."""

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Self

from anyio.from_thread import BlockingPortal

from gradientmail._node import Node as AsyncNode
from gradientmail.events import Event

__all__ = ["DRAIN_TIMEOUT", "Events"]

DRAIN_TIMEOUT = 5.0
"""How long a closing node waits, at most, for its open iterators to read the events it
emitted up to its close (``Events.wait_drained``): an iterator whose thread has stopped
reading without ``close()`` holds the close this long."""


class Events(Iterator[Event]):
    """A blocking iterator over a node's events, from the moment ``Node.events`` was called
    until the node has closed (then ``StopIteration``). Iterate it in a thread other than
    the training thread (the node closes when the training thread leaves its block).
    ``close()`` (or leaving ``with node.events() as events:``) ends the subscription early."""

    def __init__(
        self, portal: BlockingPortal, node: AsyncNode, buffer: int, closed: Callable[[], bool]
    ) -> None:
        self._portal = portal
        self._closed = closed
        self._subscription = portal.wrap_async_context_manager(node.events(buffer))
        self._events = self._subscription.__enter__()
        self._open = True
        self._drained = threading.Event()

    def __next__(self) -> Event:
        if not self._open:
            raise StopIteration
        try:
            return self._portal.call(self._events.__anext__)
        except StopAsyncIteration:
            self.close()
            raise StopIteration from None
        except (RuntimeError, concurrent.futures.CancelledError):
            # The portal stops when the node has closed: the same end as the stream's.
            if not self._closed():
                raise
            self._open = False
            self._drained.set()
            raise StopIteration from None

    def wait_drained(self, timeout: float) -> None:
        """Block until this iterator has ended (read to the end of its stream, or closed),
        or ``timeout`` seconds; on the closing node's thread, before its portal stops."""
        self._drained.wait(timeout)

    def close(self) -> None:
        """End the subscription; idempotent, and a no-op once the node has closed."""
        self._drained.set()
        if not self._open:
            return
        self._open = False
        try:
            self._subscription.__exit__(None, None, None)
        except (RuntimeError, concurrent.futures.CancelledError):
            # The node closed and its portal stopped (cancelling what was left) meanwhile.
            if not self._closed():
                raise

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
