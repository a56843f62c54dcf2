"""``Events``: a node's events as a blocking iterator, for ``gradientmail.sync.Node.events``."""

import concurrent.futures
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Self

from anyio.from_thread import BlockingPortal

from gradientmail._node import Node as AsyncNode
from gradientmail.events import Event

__all__ = ["Events"]


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
            raise StopIteration from None

    def close(self) -> None:
        """End the subscription; idempotent, and a no-op once the node has closed."""
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
