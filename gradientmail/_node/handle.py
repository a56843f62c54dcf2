"""``StepHandle``: what ``Node.run_in_thread`` hands to a synchronous training function.

It is used from that worker thread only. A step that needs nothing of the event loop (nothing
to apply, no fragment due: most steps) is counted right there (``Node._step_quietly``); the
others cross to the node's event-loop thread through ``anyio.from_thread``.
"""

from typing import TYPE_CHECKING

import anyio.from_thread

if TYPE_CHECKING:
    from gradientmail._node.node import Node

__all__ = ["StepHandle"]


class StepHandle:
    """What ``Node.run_in_thread`` hands to the training function."""

    def __init__(self, node: "Node") -> None:
        self._node = node

    @property
    def node(self) -> "Node":
        return self._node

    def step(self, tokens: int = 0) -> None:
        """``Node.step`` from the worker thread: blocks it until the step is done. Raises
        ``NodeFailed`` once a task of the node has failed, and the event loop's cancellation
        exception once the task that called ``run_in_thread`` is cancelled otherwise; either
        ends the training loop (let it propagate)."""
        self._node._raise_failure()
        try:
            anyio.from_thread.check_cancelled()
            if not self._node._step_quietly(tokens):
                anyio.from_thread.run(self._node.step, tokens)
        except BaseException:
            # A node's failure cancels the block's body: say so rather than "cancelled".
            self._node._raise_failure()
            raise
