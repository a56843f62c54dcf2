"""gradientmail: train one PyTorch model on many machines that share nothing but a bucket.

The names that need torch (the node, ``sync``, the patterns, ``load``, ``preview``) and
``events`` are imported on first use, so that the command line's read and identity commands
start without them.
"""

import importlib
from typing import TYPE_CHECKING, Any

from gradientmail.errors import (
    CorruptBlob,
    GradientmailError,
    GroupFailed,
    MailboxUnavailable,
    NodeFailed,
    NoRun,
    RecordError,
    RunMismatch,
    StoreAccessError,
    StoreTampered,
)
from gradientmail.protocol.identities import AdmissionKey, LearnerKey
from gradientmail.protocol.records import RunConfig

if TYPE_CHECKING:
    from gradientmail import events, sync
    from gradientmail._node import Node, NodeOptions, NodeState, StepHandle
    from gradientmail._node.node import node
    from gradientmail.admission import admit, revoke
    from gradientmail.patterns import Barrier, shared_queue
    from gradientmail.protocol.fragments import preview
    from gradientmail.reader import load

__all__ = [
    "AdmissionKey",
    "Barrier",
    "CorruptBlob",
    "GradientmailError",
    "GroupFailed",
    "LearnerKey",
    "MailboxUnavailable",
    "NoRun",
    "Node",
    "NodeFailed",
    "NodeOptions",
    "NodeState",
    "RecordError",
    "RunConfig",
    "RunMismatch",
    "StepHandle",
    "StoreAccessError",
    "StoreTampered",
    "admit",
    "events",
    "load",
    "node",
    "preview",
    "revoke",
    "shared_queue",
    "sync",
]

_LAZY = {
    "Barrier": "gradientmail.patterns",
    "Node": "gradientmail._node",
    "NodeOptions": "gradientmail._node",
    "NodeState": "gradientmail._node",
    "StepHandle": "gradientmail._node",
    "admit": "gradientmail.admission",
    "load": "gradientmail.reader",
    "node": "gradientmail._node",
    "preview": "gradientmail.protocol.fragments",
    "revoke": "gradientmail.admission",
    "shared_queue": "gradientmail.patterns",
}
"""Each name imported on first use, by the module it comes from (``_SUBMODULES`` are
imported as they are)."""
_SUBMODULES = frozenset({"events", "sync"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"gradientmail.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'gradientmail' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
