"""gradientmail: train one PyTorch model on many machines that share nothing but a bucket."""

from gradientmail import events
from gradientmail.errors import (
    CorruptBlob,
    GradientmailError,
    MailboxUnavailable,
    NodeFailed,
    RecordError,
    RunMismatch,
)
from gradientmail.protocol.records import RunConfig

__all__ = [
    "CorruptBlob",
    "GradientmailError",
    "MailboxUnavailable",
    "NodeFailed",
    "RecordError",
    "RunConfig",
    "RunMismatch",
    "events",
]
