"""Helpers for the blocking facade's tests: the one-learner node's arguments, a store that
breaks on demand, store checks run from synchronous code, and a deadline-bounded wait."""

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypedDict

import anyio
from node_helpers import CONFIG, FAST, assert_holds_committed, records
from torch import nn

from gradientmail._node import NodeOptions
from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol.records import RoundRecord, RunConfig
from gradientmail.store import Store


class Solo(TypedDict):
    learner: str
    config: RunConfig
    options: NodeOptions


SOLO = Solo(learner="solo", config=CONFIG, options=FAST)
"""The node most tests here open, one learner alone: ``node(model, where, **SOLO, ...)``."""


class BreakingMailbox(LocalMailbox):
    """A ``LocalMailbox`` whose listing of round records fails once ``broken`` is set, as a
    store that lost its disk would: the node's receive task fails on a real call."""

    broken = False

    async def list(self, prefix: str, *, after: str = "") -> list[str]:  # type: ignore[override]
        if self.broken and prefix == "records/":
            raise OSError(f"{self.directory} is gone")
        return list(await super().list(prefix, after=after))


def leases(directory: Path, backend: str = "asyncio") -> dict[str, tuple[int, str]]:
    """The live leases in the run at ``directory``, by learner."""

    async def read() -> dict[str, tuple[int, str]]:
        return dict(await Store(LocalMailbox(directory)).leases())

    return anyio.run(read, backend=backend)


def committed(directory: Path, backend: str = "asyncio") -> list[RoundRecord]:
    """Every committed round record of the run at ``directory``."""
    return anyio.run(records, LocalMailbox(directory), backend=backend)


def check_holds_committed(
    directory: Path, model: nn.Module, versions: Sequence[int], backend: str = "asyncio"
) -> None:
    """``model`` holds, fragment by fragment, the committed θ of ``versions``."""
    anyio.run(assert_holds_committed, LocalMailbox(directory), model, versions, backend=backend)


def wait_for(condition: Callable[[], bool], limit: float = 30.0) -> None:
    """Poll ``condition`` every 10 ms until it holds; fail after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"condition did not hold within {limit} s"
        time.sleep(0.01)
