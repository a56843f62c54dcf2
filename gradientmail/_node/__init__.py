"""A member of a run: ``async with gradientmail.node(model, mailbox, learner=...) as node``.

``node`` (the async context manager), ``Node`` (what it yields), ``NodeOptions`` (one node's
timings and roles), ``NodeState`` (what ``Node.state`` returns) and ``StepHandle`` (what
``Node.run_in_thread`` hands to a synchronous training loop). See ``docs/node.md``.
"""

from gradientmail._node.node import Node, StepHandle, node
from gradientmail._node.options import NodeOptions
from gradientmail._node.state import NodeState

__all__ = ["Node", "NodeOptions", "NodeState", "StepHandle", "node"]
