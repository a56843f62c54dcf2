"""What both callbacks share: one blocking node held open across a framework's hooks."""

import atexit
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Protocol

import torch

from gradientmail import sync

__all__ = ["Member", "OpenNode", "missing_extra"]


def missing_extra(module: str, extra: str) -> ImportError:
    """The error raised when an integration's framework is not installed."""
    return ImportError(
        f"gradientmail.integrations.{module} needs the {extra} package: "
        f"pip install 'gradientmail[{extra}]'"
    )


def refuse_processes(world_size: int, framework: str) -> None:
    """Raise when the trainer runs more than one process (see docs/integrations.md)."""
    if world_size > 1:
        raise RuntimeError(
            f"{framework} runs {world_size} processes (DDP), and each would join the run as "
            "the same learner with its own copy of the model; the callbacks do not form "
            "learner groups yet: run one single-process trainer per learner, each with its "
            "own learner id, or write the loop with gradientmail.sync.node(..., group=) "
            "(docs/node.md, 'Learner groups')"
        )


def learner_group(world_size: int, framework: str) -> Any:
    """None for a trainer of one process; else a new gloo group over all of the trainer's
    processes, which then form one learner (``group=``; docs/node.md, "Learner groups").
    Every process must call it (``new_group`` is a collective). Raises ``RuntimeError`` when
    ``torch.distributed`` is not initialized though the trainer runs several processes."""
    if world_size <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{framework} runs {world_size} processes but torch.distributed is not "
            "initialized: launch it with torchrun (or accelerate launch)"
        )
    return dist.new_group(backend="gloo")


class OpenNode(Protocol):
    """How a ``Member`` opens its node: ``gradientmail.sync.node`` with the callback's
    arguments bound (``functools.partial``), given the model and the learner group."""

    def __call__(
        self, model: torch.nn.Module, *, group: Any
    ) -> AbstractContextManager[sync.Node]: ...


class Member:
    """A ``gradientmail.sync.node`` (``open_node``) opened by ``join`` and closed by
    ``close`` (with flush) or ``abandon`` (without). A member still open when the
    interpreter exits (a training that raised past the framework's end hook) is abandoned
    then, which releases its lease. All methods run on the training thread."""

    def __init__(self, open_node: OpenNode) -> None:
        self._open_node = open_node
        self._stack: ExitStack | None = None
        self.node: sync.Node | None = None

    def join(self, model: torch.nn.Module, group: Any = None) -> sync.Node:
        """Join the run with ``model`` (whose weights become the run's newest), as one rank
        of the learner ``group`` when one is given."""
        if self._stack is not None:
            raise RuntimeError("this callback's node is already open: one training at a time")
        stack = ExitStack()
        node = self._open_node(model, group=group)
        self.node = stack.enter_context(node)
        self._stack = stack
        atexit.register(self._at_exit)
        return self.node

    def step(self, tokens: int) -> None:
        if self.node is None:
            raise RuntimeError("the callback's node is not open: training has not begun")
        self.node.step(tokens=tokens)

    def close(self) -> None:
        """Close with flush; raises ``NodeFailed`` when the node failed."""
        stack, self._stack = self._stack, None
        if stack is not None:
            atexit.unregister(self._at_exit)
            stack.close()

    def abandon(self, error: BaseException) -> None:
        """Close without flush, as leaving the block by ``error`` does."""
        stack, self._stack = self._stack, None
        if stack is not None:
            atexit.unregister(self._at_exit)
            stack.__exit__(type(error), error, error.__traceback__)

    def _at_exit(self) -> None:
        self.abandon(SystemExit("the interpreter exited with the node open"))
