"""``Steps``: the one path by which a training loop's step reaches the node's learner, from
``Node.step``, ``StepHandle.step`` and ``sync.Node.step`` alike, and the node's failure,
which every step raises once a task of the node has failed."""

import anyio.lowlevel

from gradientmail._node.group_member import GroupMember
from gradientmail._node.learner_driver import LearnerDriver
from gradientmail.errors import NodeFailed
from gradientmail.protocol.group import Decision

__all__ = ["Steps"]


class Steps:
    """The step path of one node: its learner's driver (None: a syncer-only node or a
    replicated group's follower) and its part in a learner group, if any.

    Threads: ``step``, ``decided`` and ``fail`` run on the node's event-loop thread;
    ``step_quietly`` on a thread other than the loop's (where ``step`` runs instead);
    ``raise_failure`` on any. The failure is set once, on the loop's thread, before any
    other thread can learn of it through a cancellation or a ``NodeFailed``.
    """

    def __init__(
        self, learner: str, driver: LearnerDriver | None, group: GroupMember | None
    ) -> None:
        self._learner = learner
        self._driver = driver
        self._group = group
        self.failure: BaseException | None = None
        """The first failure of a task of the node; None while it runs."""

    def fail(self, exc: BaseException) -> NodeFailed:
        """Record ``exc`` as the node's failure (unless one is recorded already); the
        ``NodeFailed`` to raise for it."""
        if self.failure is None:
            self.failure = exc
        return self._failed()

    def raise_failure(self) -> None:
        """Raise ``NodeFailed`` (the failure chained) once the node has failed."""
        if self.failure is not None:
            raise self._failed()

    def check(self, tokens: int) -> None:
        """Raise what a step of ``tokens`` raises before it counts: ``NodeFailed``, then
        ``TypeError`` for a syncer-only node and ``ValueError`` for bad ``tokens``."""
        self.raise_failure()
        if self._driver is None and self._group is None:
            raise TypeError("a syncer-only node (model=None) has no steps to count")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")

    async def step(self, tokens: int) -> None:
        """``Node.step`` (its docstring states the contract), on the event-loop thread."""
        await anyio.lowlevel.checkpoint()
        self.check(tokens)
        if self._group is not None:
            await self._group.step(tokens)
        elif self._driver is not None:
            await self._counted(tokens)

    def step_quietly(self, tokens: int) -> bool:
        """``step`` from a thread other than the event loop's, when the step needs nothing
        of the loop (``LearnerDriver.step_quietly``); True if it was counted, False if the
        caller must run ``step`` on the loop. Raises as ``check`` does."""
        self.check(tokens)
        return (
            self._group is None and self._driver is not None and self._driver.step_quietly(tokens)
        )

    async def decided(self, tokens: int) -> Decision:
        """A group leader's learner step of ``tokens``; its decision."""
        self.raise_failure()
        await self._counted(tokens)
        return self.decision(tokens)

    async def _counted(self, tokens: int) -> None:
        """Count one step of ``tokens`` once it may be; a synchronous learner
        (``RunConfig.overlap`` 0) then waits for the version of the round it snapshotted
        for and applies it before the next step."""
        driver = self._driver
        assert driver is not None
        await driver.wait_to_step()
        self.raise_failure()
        driver.step(tokens)
        if driver.synchronous:
            await driver.wait_to_step()
            self.raise_failure()
            driver.sync()

    def decision(self, tokens: int = 0) -> Decision:
        """The leader's decision as its learner stands."""
        assert self._driver is not None
        return Decision.of(self._driver.state, tokens)

    def _failed(self) -> NodeFailed:
        failure = self.failure
        assert failure is not None
        error = NodeFailed(f"node {self._learner!r} failed: {type(failure).__name__}: {failure}")
        error.__cause__ = failure
        return error
