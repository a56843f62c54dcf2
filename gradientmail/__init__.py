"""gradientmail: train one PyTorch model on many machines that share nothing but a bucket."""

from gradientmail import events, sync
from gradientmail._node import Node, NodeOptions, NodeState, StepHandle, node
from gradientmail.admission import admit, revoke
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
from gradientmail.patterns import Barrier, shared_queue
from gradientmail.protocol.fragments import preview
from gradientmail.protocol.identities import LearnerKey
from gradientmail.protocol.records import RunConfig
from gradientmail.reader import load

__all__ = [
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
