"""The exceptions gradientmail raises, under one root and named by whose fault they are.

- ``MailboxUnavailable``: the store is (for now) out of reach; transient, callers retry.
- ``CorruptBlob``, ``RecordError``: bytes in the store are not what they claim to be; the
  store's content (or whoever wrote it) is at fault, never the caller.
- ``RunMismatch``: this node's model or config contradicts the run in the store; the
  caller must change its model or config. The store is left untouched.
- ``NodeFailed``: a task of a node died; raised from the next ``step()`` with the cause chained.
"""

__all__ = [
    "CorruptBlob",
    "GradientmailError",
    "MailboxUnavailable",
    "NodeFailed",
    "RecordError",
    "RunMismatch",
]


class GradientmailError(Exception):
    """Root of every exception gradientmail defines."""


class MailboxUnavailable(GradientmailError):
    """A transient transport failure (timeout, refused or dropped connection, conflict).

    Only this is retried by ``retrying``; every other store error propagates at once.
    """


class CorruptBlob(GradientmailError):
    """A blob's bytes do not hash to the sha256 its key and its reference name."""


class RecordError(GradientmailError):
    """A record, snapshot, claim or manifest in the store is malformed: not JSON, the wrong
    types, over the size limit, or of a format version this code does not know."""


class RunMismatch(GradientmailError):
    """This node's model or config contradicts the run's manifest.

    The message names the first difference (a parameter's name, shape or dtype, or a config
    field) and what to do about it.
    """


class NodeFailed(GradientmailError):
    """A task of the node failed; the original exception is chained as ``__cause__``."""
